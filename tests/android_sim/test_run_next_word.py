"""`android_sim run --data shakespeare`: next-word prediction through the fleet, end to end: the
exported LSTM on every phone, a real orchestrator process, real HTTP on loopback."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from android_sim.__main__ import main
from android_sim.run import run
from android_sim.run_config import RunConfig
from android_sim.shakespeare import PAD, next_word_data, read_roles
from contracts.manifest import load_manifest
from tests.android_sim.test_run import ALWAYS_ON, reconcile
from tests.conftest import dataset_folder

# The tiny sizes of `tests.conftest.NEXT_WORD_SIZES`: 47 words + PAD, BOS, EOS, 4 OOV buckets.
VOCAB, BUCKETS, SEQ_LEN = 47, 4, 8
TINY = {"embedding_dim": "8", "lstm_units": "8", "batch_size": "4", "max_batches": "3"}


def tiny(work: Path, shakespeare: Path, **overrides: object) -> RunConfig:
    values: dict[str, object] = dict(
        work_dir=work,
        data="shakespeare",
        shakespeare=shakespeare,
        vocab_size=VOCAB,
        oov_buckets=BUCKETS,
        seq_len=SEQ_LEN,
        model_args=TINY,
        rounds=3,
        target_reports=6,
        oversampling=1.5,
        min_examples=2,
        round_seconds=8.0,
        evaluation_every=2,
        device_mix=ALWAYS_ON,
        workers=2,
        stall_seconds=60.0,
        show_devices=2,
    )
    values.update(overrides)
    return RunConfig(**values)  # type: ignore[arg-type]


def test_a_fleet_of_roles_learns_next_words_and_reports_table_two(
    tmp_path: Path, tiny_shakespeare: Path
) -> None:
    # Prepare: the roles as the run splits them
    data = next_word_data(read_roles(tiny_shakespeare), VOCAB, BUCKETS, SEQ_LEN)
    held_out_targets = sum(int((role["targets"] != PAD).sum()) for role in data.test)

    # Execute
    result = run(tiny(tmp_path, tiny_shakespeare), Console(width=120, record=True))

    # Assert: rounds committed from training roles only; held-out roles evaluated, never trained
    report = json.loads(result.report_path.read_text())
    assert result.rounds_committed >= 3
    reconcile(result)
    outcomes = report["fleet"]["device_side_outcomes"]
    assert outcomes.get("training/reported", 0) >= 3 * 6
    assert outcomes.get("held-out/reported", 0) >= 1
    training_rounds = [r for r in report["rounds"] if r["kind"] == "training"]
    assert sum(r["counters"]["reported"] for r in training_rounds) == outcomes["training/reported"]
    assert report["data"]["training_roles"] == len(data.train)
    assert report["data"]["held_out_roles"] == len(data.test)
    # The OOV rows stayed on the devices: they are the model's locals, and no round carries them
    manifest = load_manifest(tmp_path / "model")
    assert (
        {p.name for p in manifest.local_params}
        == set(report["model"]["local_params"])
        == {
            "embedding_oov_embeddings",
            "oov_output_kernel",
            "oov_output_bias",
        }
    )
    nwp = report["next_word"]
    # Every held-out role evaluated the final model on its device, on part of its windows
    on_device = nwp["held_out_on_device"]
    assert on_device["devices"] == len(data.test)
    assert 0 < on_device["in_vocab_tokens"] < on_device["tokens"] <= held_out_targets
    for accuracy, (low, high) in (
        (on_device["accuracy_without_oov"], on_device["interval_without_oov"]),
        (on_device["accuracy_with_oov"], on_device["interval_with_oov"]),
    ):
        assert 0.0 <= low <= accuracy <= high <= 1.0  # over the devices
    final = nwp["final_evaluation_round"]
    assert final["reported"] >= 1 and 0.0 <= final["accuracy_with_oov"] <= 1.0
    assert final["accuracy_with_oov"] == pytest.approx(
        result.final_evaluation["correct_tokens_sum"] / result.final_evaluation["tokens_sum"]
    )
    # Per round: training devices' query accuracy in every committed training round
    training = [a for a in nwp["accuracy_by_round"] if a["kind"] == "training"]
    assert len(training) == result.rounds_committed
    # Bytes: the globals down and their delta up, float32; the links carried at least that
    sizes = nwp["bytes_per_round_per_device"]
    assert sizes["parameters"] == 2 * 4 * sum(math.prod(p.shape) for p in manifest.global_params)
    assert sizes["link"]["per_report"] > sizes["parameters"]
    assert nwp["predictions"] and all(len(p["predicted"]) == 3 for p in nwp["predictions"])
    for plot in result.plots:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fedavg_in_the_fleet_shares_the_oov_rows(tmp_path: Path, tiny_shakespeare: Path) -> None:
    # Execute: the same model with its OOV rows global (no local variables at all)
    result = run(
        tiny(tmp_path, tiny_shakespeare, rounds=2, model_args={**TINY, "oov_local": "false"}),
        Console(width=120),
    )

    # Assert: trained and evaluated; every row is shared, so each round moves the OOV rows too
    manifest = load_manifest(tmp_path / "model")
    nwp = result.summary["next_word"]
    assert result.rounds_committed >= 2
    assert manifest.local_params == () and result.summary["model"]["local_params"] == []
    assert "embedding_oov_embeddings" in {p.name for p in manifest.global_params}
    assert nwp["bytes_per_round_per_device"]["parameters"] == 2 * 4 * sum(
        math.prod(p.shape) for p in manifest.global_params
    )
    assert nwp["held_out_on_device"]["devices"] >= 1
    assert nwp["predictions"]  # served with the globals alone


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--model-arg", "num_oov_buckets=3"],
            "--model-arg num_oov_buckets is set by the run: use --oov-buckets",
        ),
        (["--local-state", "keep"], "--local-state keep is not available with --data shakespeare"),
        (["--vocab-size", "0"], "vocab_size must be >= 1, got 0"),
        (
            ["--data", "expressions", "--model-arg", "seed=1"],
            "--model-arg is for --model or --data shakespeare",
        ),
        # Found once the data is read (the builder's arguments follow from its vocabulary).
        (["--model-arg", "lstm_unit=8"], "takes no argument 'lstm_unit'; it takes: num_global_tokens"),
    ],
)
def test_next_word_user_errors_are_one_clear_line(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = ["--shakespeare", str(dataset_folder("tinyshakespeare"))] if "lstm_unit=8" in args else []
    code = main(["run", "--data", "shakespeare", "--work-dir", str(tmp_path), *data, *args])

    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert "Traceback" not in err
