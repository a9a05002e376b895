"""The Python device passes the conformance kit, the kit catches broken devices, and the committed
vectors are what the generator writes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from conformance import generate_http
from conformance.__main__ import main
from conformance.generate import generate
from conformance.port import CommandPort
from conformance.python_port import PythonPort
from conformance.runner import VECTORS, differences, resolve, run
from conformance.task_ops import run_task
from tests.conformance import broken_ports


def test_the_python_device_passes_every_case() -> None:
    outcomes = run(PythonPort())
    assert len(outcomes) > 40
    assert [o for o in outcomes if o.problem] == []


def test_the_command_line_reports_each_case(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--section", "wire"]) == 0
    assert capsys.readouterr().out.strip().endswith("cases passed")


def test_a_port_run_as_a_command_speaks_json_lines() -> None:
    port = CommandPort([sys.executable, "-m", "conformance.python_port"])
    try:
        outcomes = run(port, ("wire",))
    finally:
        port.close()
    assert outcomes and [o for o in outcomes if o.problem] == []


@pytest.mark.parametrize(
    ("op", "fault", "failing"),
    [
        ("request.report_training", broken_ports.unsorted_rows, ["report: a training delta, row-sparse"]),
        ("request.checkin", broken_ports.without_task_field, ["check-in:"]),
        (
            "http.flow",
            broken_ports.without_authorization,
            ["http: check in", "http: download", "http: report", "http: abort", "http: secure round"],
        ),
        ("http.flow", broken_ports.masked_input_before_shares, ["http: secure round"]),
        ("http.flow", broken_ports.unsigned_partner_statement, ["http: secure round"]),
    ],
)
def test_a_broken_device_fails(op: str, fault: object, failing: list[str]) -> None:
    assert_fails(broken_ports.broken(op, fault), failing)


def test_a_device_with_the_wrong_mask_sign_fails() -> None:
    assert_fails(broken_ports.wrong_mask_sign(), [f"round: device {i}'s masked input" for i in (1, 2, 3)])


def test_a_device_that_sends_shares_for_the_wrong_neighbour_fails() -> None:
    port = broken_ports.broken("secure.share_keys", broken_ports.shares_for_the_wrong_neighbour)
    assert_fails(port, [f"round: device {i}'s shares" for i in (1, 2, 3, 4)])


def test_a_device_that_signs_the_wrong_task_inputs_fails() -> None:
    assert_fails(broken_ports.signs_the_model_not_the_globals(), ["http: secure round"])


def assert_fails(port: PythonPort, failing: list[str]) -> None:
    """The kit fails `port` in every case named (by prefix) in `failing`, and only in such cases."""
    failed = [o for o in run(port) if o.problem]
    assert failed, "the kit passed a broken device"
    for prefix in failing:
        assert any(o.case.startswith(prefix) for o in failed), f"no failing case {prefix!r}"
    assert all(any(o.case.startswith(f) for f in failing) for o in failed), [o.case for o in failed]


def test_the_committed_vectors_are_what_the_generator_writes(tmp_path: Path) -> None:
    generate(tmp_path, http=False)
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert written
    for relative in written:
        if relative == Path("task/cases.json"):
            continue  # the interpreter's floats: compared within the case's tolerance below
        assert (VECTORS / relative).read_bytes() == (tmp_path / relative).read_bytes(), relative
    [committed_task] = json.loads((VECTORS / "task" / "cases.json").read_text())
    [generated_task] = json.loads((tmp_path / "task" / "cases.json").read_text())
    assert committed_task["args"] == generated_task["args"]
    assert (
        differences(committed_task["expect"], generated_task["expect"], committed_task["tolerance"]) is None
    )
    committed = {p.relative_to(VECTORS) for p in VECTORS.rglob("*") if p.is_file()}
    generated_sections = {r.parts[0] for r in written}
    exported = {c for c in committed if c.parts[:2] == ("task", "model")}  # conformance.export_model's
    stale = {c for c in committed if c.parts[0] in generated_sections} - set(written) - exported
    assert not stale, f"committed vectors the generator no longer writes: {sorted(map(str, stale))}"


def test_a_fresh_recording_from_the_orchestrator_still_passes(tmp_path: Path) -> None:
    """The HTTP exchanges recorded now (new ids, tokens, times) ask of a device what the committed
    ones do: the Python device passes them, flow by flow."""
    generate_http.generate(tmp_path / "http")
    outcomes = run(PythonPort(), ("http",), vectors=tmp_path)
    assert [o.case for o in outcomes] == [
        f"http: {f}" for f in ("enrol", "check in", "download", "report", "abort", "secure round")
    ]
    assert [o for o in outcomes if o.problem] == []
    # What the secure round's device knows beforehand (its draws, identity, update, files) is
    # fixed from labels: only the token the server issued differs.
    fresh, committed = (secure_round_case(folder / "http") for folder in (tmp_path, VECTORS))
    assert {**fresh["args"]["inputs"], "token": None} == {**committed["args"]["inputs"], "token": None}
    for blob in ("secure-round-globals.bin", "secure-round-manifest.json"):
        assert (tmp_path / "http/blobs" / blob).read_bytes() == (VECTORS / "http/blobs" / blob).read_bytes()


def secure_round_case(folder: Path) -> dict[str, Any]:
    cases: list[dict[str, Any]] = json.loads((folder / "cases.json").read_text())
    [case] = [c for c in cases if c["name"] == "http: secure round"]
    return case


def test_both_interpreters_make_the_task_s_calls_exactly(backend: str) -> None:
    [case] = json.loads((VECTORS / "task" / "cases.json").read_text())
    answer = run_task(resolve(case["args"], VECTORS / "task"), backend=backend)
    assert differences(case["expect"], answer, 0.0) is None
