"""The conformance kit: the Python device passes it, the committed vectors are what the generator
writes, and each deliberately broken port fails it where its fault is."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.__main__ import main
from conformance.generate import generate
from conformance.port import Port
from conformance.python_port import PythonPort
from conformance.runner import failures, run_kit
from conformance.vectors import VECTORS
from tests.conformance.broken_ports import (
    MissingField,
    ShareForWrongNeighbour,
    StaleLearningRate,
    UnsortedSparseRows,
    WrongMaskSign,
)


def test_the_python_device_passes_every_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    outcomes = run_kit(PythonPort())
    assert len(outcomes) > 90 and not failures(outcomes)
    assert capsys.readouterr().out.endswith(f"{len(outcomes)} of {len(outcomes)} checks passed\n")


def test_the_committed_vectors_are_what_the_generator_writes(tmp_path: Path) -> None:
    generate(tmp_path)

    def files(root: Path) -> list[Path]:
        return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())

    written = files(tmp_path)
    exported = [Path("task", "model", p) for p in files(VECTORS / "task" / "model")]  # export_model.py's
    assert sorted([*written, *exported]) == files(VECTORS)
    # The task's outputs come from a TFLite interpreter: the kit compares them within its tolerance
    # (the Python device's run of the kit), not byte for byte.
    written = [p for p in written if p.parts[0] != "task"]
    changed = [str(p) for p in written if (tmp_path / p).read_bytes() != (VECTORS / p).read_bytes()]
    assert not changed, f"regenerate with python -m conformance.generate: {changed}"


@pytest.mark.parametrize(
    ("port", "caught"),
    [
        (WrongMaskSign(), {"round/1/masked_input", "round/tampered_share_masks_without_it"}),
        (ShareForWrongNeighbour(), {"round/1/share_keys", "round/5/share_keys"}),
        (UnsortedSparseRows(), {"sparse_delta/encode_rows"}),
        (MissingField(), {"round/1/advertise", "round/3/advertise"}),
        (StaleLearningRate(), {"task/delta"}),
    ],
    ids=[
        "wrong mask sign",
        "share for the wrong neighbour",
        "unsorted sparse rows",
        "missing field",
        "stale rate",
    ],
)
def test_a_broken_port_fails_the_kit_where_its_fault_is(port: Port, caught: set[str]) -> None:
    failed = {o.name: o.problem for o in failures(run_kit(port))}

    assert caught <= set(failed), failed
    # Only the checks its fault touches fail: the rest of the kit still passes.
    assert all(name.startswith(("round/", "refuse/", "sparse_delta/", "task/")) for name in failed), failed


def test_a_port_that_cannot_be_loaded_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="--port nowhere:Port: cannot load it"):
        main(["--port", "nowhere:Port"])
    with pytest.raises(SystemExit, match=r"--vectors .*: no conformance vectors there"):
        main(["--vectors", "/nonexistent"])
