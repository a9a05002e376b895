"""`simulate` judges a ranking model by what it is for, on the generated sticker table
(`android_sim.stickers`) with the user-style context-aware model (`model_export.models.stickers`):
held-out devices' hit rate@10 and NDCG@10 beside most-shared, the model without locals and the
table's ceilings, with paired intervals; the trained globals; the user's held-out devices; and
`--tune`'s settings file, found on validation devices only."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from android_sim.__main__ import build_parser
from android_sim.__main__ import main as cli
from android_sim.simulation.command import main as simulate_main
from android_sim.stickers import StickerConfig, write
from contracts.manifest import load_manifest
from contracts.params import decode_params


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stickers")
    write(StickerConfig(), out)  # full size: 800 users, 160 held out
    return out


@pytest.fixture(scope="module")
def small_table(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("few-stickers")
    write(StickerConfig(users=120, held_out=20), out)
    return out


def simulate(model: Path, table: Path, out: Path, *extra: str) -> dict:
    args = build_parser().parse_args(
        [
            "simulate",
            "--model-dir",
            str(model),
            "--examples",
            str(table / "shares.csv"),
            "--held-out",
            str(table / "held_out.txt"),
            "--item-groups",
            str(table / "catalog.csv"),
            "--clients-per-round",
            "20",
            "--evaluate-every",
            "1000",
            "--workers",
            "2",
            "--out",
            str(out),
            *extra,
        ]
    )
    with (out.parent / f"{out.name}.log").open("w") as log:
        return simulate_main(args, Console(file=log, width=160))


def test_a_plain_simulate_shows_fedrecon_above_most_shared_and_global(
    sticker_model: Path, table: Path, tmp_path: Path
) -> None:
    report = simulate(sticker_model, table, tmp_path / "out", "--rounds", "100")

    ranking = report["ranking"]
    assert ranking["devices"] == 160 and report["devices"]["held_out"] == 160
    assert ranking["labels"]["personalized"] == "FedRecon"
    assert set(ranking["methods"]) == {
        "personalized", "global", "most_shared", "cooccurrence", "group_rule", "central_mf"
    }  # fmt: skip
    for baseline in ("most_shared", "global"):
        paired = ranking["model_minus"][baseline]["hit_rate_at_10"]
        assert paired["low"] > 0, (baseline, paired)  # FedRecon above it, the paired interval too
    for method in ranking["methods"].values():
        for figure in method.values():
            assert figure["low"] <= figure["value"] <= figure["high"]
    printed = " ".join((tmp_path / "out.log").read_text().split())
    mine = ranking["methods"]["personalized"]["hit_rate_at_10"]
    assert f"FedRecon {100 * mine['value']:.1f} [{100 * mine['low']:.1f},{100 * mine['high']:.1f}]" in printed
    # The trained globals, as the fleet and `device_runtime recommend --globals` take them.
    manifest = load_manifest(sticker_model)
    blob = (tmp_path / "out" / "global_params.safetensors").read_bytes()
    assert set(decode_params(blob, manifest.global_params, "globals")) == {
        p.name for p in manifest.global_params
    }


def test_tune_searches_on_validation_devices_and_writes_settings_the_commands_take(
    sticker_model: Path, small_table: Path, tmp_path: Path
) -> None:
    table = small_table
    report = simulate(sticker_model, table, tmp_path / "out", "--rounds", "5", "--tune", "--tune-trials", "2")

    trials = json.loads((tmp_path / "out" / "tuning" / "trials.json").read_text())
    assert len(trials) == 2 and all(0 <= t["hit_rate"] <= 1 for t in trials)
    # The tuning served only validation devices, never a held-out one.
    held = set((table / "held_out.txt").read_text().split())
    scored = {p.stem for p in (tmp_path / "out" / "tuning" / "stores").glob("*.sqlite")}
    assert scored and not scored & held and len(scored) == report["devices"]["validation"]
    settings = json.loads((tmp_path / "out" / "tuned_settings.json").read_text())
    # Both trials trained again with a second seed; the other is kept only if it beats the plain one.
    assert all(t["confirmed"] is not None and len(t["per_device"]) > 0 for t in trials)
    best = next(
        t for t in trials if settings == {"task": t["task"], "server_optimizer": t["server_optimizer"]}
    )
    assert best["number"] == 0 or best["confirmed"] > trials[0]["confirmed"]
    assert settings == {"task": best["task"], "server_optimizer": best["server_optimizer"]}
    assert report["options"]["task_config"]["update_learning_rate"] == best["task"]["update_learning_rate"]
    population = json.loads((tmp_path / "out" / "tuned_population.json").read_text())
    assert population["server_optimizer"] == best["server_optimizer"]
    # simulate takes the file back
    again = simulate(
        sticker_model,
        table,
        tmp_path / "again",
        "--rounds",
        "2",
        "--algorithm-settings",
        str(tmp_path / "out" / "tuned_settings.json"),
    )
    assert again["options"]["task_config"] == report["options"]["task_config"]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ("user-0001\nnobody\n", "1 device ids not in the examples (with enough examples), e.g. 'nobody'"),
        ("\n", "names no device; expected one device id a line"),
    ],
)
def test_a_bad_held_out_file_is_one_line(
    sticker_model: Path,
    table: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    lines: str,
    message: str,
) -> None:
    held = tmp_path / "held.txt"
    held.write_text(lines)
    argv = ["simulate", "--model-dir", str(sticker_model), "--examples", str(table / "shares.csv")]
    assert cli([*argv, "--held-out", str(held), "--rounds", "1", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_bad_item_groups_are_one_line(
    sticker_model: Path, table: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    groups = tmp_path / "groups.csv"
    groups.write_text("sticker,pack\n0,1\n1,x\n")
    argv = ["simulate", "--model-dir", str(sticker_model), "--examples", str(table / "shares.csv")]
    assert cli([*argv, "--item-groups", str(groups), "--rounds", "1", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: --item-groups {groups}, line 3: expected two integers (catalog row, group), got ['1', 'x']\n"
    )


def test_the_fleet_holds_out_the_named_devices(
    sticker_model: Path, small_table: Path, tmp_path: Path
) -> None:
    from android_sim.run import prepare_devices, user_workload
    from android_sim.run_config import RunConfig, RunError

    config = RunConfig(
        work_dir=tmp_path,
        model_dir=sticker_model,
        examples=small_table / "shares.csv",
        held_out=small_table / "held_out.txt",
    )
    workload = user_workload(config, Console(file=(tmp_path / "log.txt").open("w")))
    devices = prepare_devices(config, workload, tmp_path / "devices")
    held = {workload.devices[i].device_id for i, spec in enumerate(devices.specs) if spec.role == "held-out"}
    assert held == set((small_table / "held_out.txt").read_text().split())
    # The same settings a plain simulate starts from: the defaults of a ranking model on shares.
    assert workload.task["split"] == "reuse" and workload.server_optimizer["learning_rate"] == 10.0
    (tmp_path / "bad.txt").write_text("nobody\n")
    with pytest.raises(RunError, match="1 device ids not in the examples"):
        user_workload(
            replace(config, held_out=tmp_path / "bad.txt"), Console(file=(tmp_path / "log.txt").open("w"))
        )


def test_bad_tuning_options_are_one_line_before_any_work(
    sticker_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", "--model-dir", str(sticker_model), "--examples", str(tmp_path / "none.csv")]
    assert cli([*argv, "--tune", "--tune-trials", "0", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == "error: --tune-seconds must be > 0 and --tune-trials >= 1, got 600.0 and 0\n"
