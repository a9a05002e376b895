"""Any model through the simulators: a user's export and examples table, not one of our data sets.

The model is the tests' own (`tests.model_export.genre_rating`: a regression through a hidden
layer with a local user vector); the table has users whose ratings follow a taste for genres,
so that federated training has something to learn.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console
from safetensors.numpy import load
from sqlalchemy import select
from sqlalchemy.orm import Session

from android_sim.__main__ import build_parser, main
from android_sim.run import run
from android_sim.run_config import RunConfig
from android_sim.simulation.command import main as simulate_main
from contracts.manifest import INITIAL_GLOBAL_FILE, load_manifest
from contracts.params import encode_params
from orchestrator.db import ModelVersion, make_engine
from tests.android_sim.test_run import ALWAYS_ON


def write_table(path: Path, model_dir: Path, devices: int, per_device: int = 16, seed: int = 3) -> Path:
    """A per-device CSV for genre_rating: each user likes some genres; ratings in [1, 5]. The
    catalog sizes come from the export's manifest: importing the builder would load TensorFlow
    into this process, where tflite_runtime then cannot load a model."""
    rows = {spec.name: spec.shape[0] for spec in load_manifest(model_dir).global_params}
    num_movies, num_genres = rows["movie_embeddings"], rows["genre_embeddings"]
    rng = np.random.default_rng(seed)
    genre_of = rng.integers(num_genres, size=num_movies)
    quality = rng.normal(0, 0.5, num_movies)
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["device_id", "timestamp", "movie", "genre", "rating"])
        for user in range(devices):
            taste = rng.normal(0, 1.0, num_genres)
            for k, movie in enumerate(rng.choice(num_movies, size=per_device, replace=False)):
                rating = np.clip(3.5 + taste[genre_of[movie]] + quality[movie] + rng.normal(0, 0.2), 1, 5)
                out.writerow(
                    [f"phone-{user:03d}", 1_700_000_000 + 3600 * k, movie, genre_of[movie], f"{rating:.2f}"]
                )
    return path


def test_simulate_trains_a_users_model_on_its_table(genre_rating_model: Path, tmp_path: Path) -> None:
    table = write_table(tmp_path / "ratings.csv", genre_rating_model, devices=60)
    args = build_parser().parse_args(
        [
            "simulate",
            "--model-dir",
            str(genre_rating_model),
            "--examples",
            str(table),
            "--rounds",
            "30",
            "--clients-per-round",
            "10",
            "--evaluate-every",
            "10",
            "--workers",
            "2",
            "--out",
            str(tmp_path / "out"),
        ]
    )

    report = simulate_main(args, Console(file=(tmp_path / "log.txt").open("w")))

    written = json.loads((tmp_path / "out" / "simulation.json").read_text())
    curve = written["learning_curve"]
    assert written == json.loads(json.dumps(report))
    assert written["model"]["task"] == {"kind": "regression"}
    assert written["devices"] == {"training": 48, "validation": 6, "held_out": 6}
    assert [p["round"] for p in curve] == [0, 10, 20, 30]
    assert curve[-1]["rmse"] < 0.8 * curve[0]["rmse"]  # the rounds learned the users' tastes
    held = written["held_out"]
    assert held["devices"] == 6 and np.isfinite(held["rmse"])
    # Each figure with its interval over the held-out devices, printed beside it
    assert held["rmse_low"] <= held["rmse"] <= held["rmse_high"] and held["rmse_low"] < held["rmse_high"]
    printed = " ".join((tmp_path / "log.txt").read_text().split())
    assert f"rmse {held['rmse']:.4f} [{held['rmse_low']:.4f}, {held['rmse_high']:.4f}]" in printed
    assert written["seen"] is None  # FedRecon: no kept locals to evaluate
    assert (tmp_path / "out" / "learning_curve.png").stat().st_size > 0
    # Beside the same model without locals (no reconstruction), paired over the same devices.
    rmse = written["without_locals"]["rmse"]
    assert rmse["model"] == pytest.approx(held["rmse"], rel=1e-5)
    assert rmse["difference"] == pytest.approx(rmse["model"] - rmse["without_locals"])
    assert rmse["difference_low"] <= rmse["difference"] <= rmse["difference_high"]
    assert rmse["without_locals"] > rmse["model"]  # the users' tastes are in their locals
    assert "ReconEval against the model without locals" in printed
    # And beside the label baselines on the same query examples: the global and each user's mean.
    baselines = written["label_baselines"]
    assert set(baselines) == {"global mean", "per-user mean"}
    for name, found in baselines.items():
        assert set(found) == {"rmse"} and found["rmse"]["model"] == pytest.approx(held["rmse"], rel=1e-5)
        assert (
            found["rmse"]["difference_low"] <= found["rmse"]["difference"] <= found["rmse"]["difference_high"]
        )
        assert f"{found['rmse']['without_locals']:.4f}" in printed and name in printed
    # The users' tastes are per genre: a user's own mean beats the global one, and the model beats both.
    assert (
        baselines["per-user mean"]["rmse"]["without_locals"]
        < baselines["global mean"]["rmse"]["without_locals"]
    )
    assert baselines["global mean"]["rmse"]["difference_high"] < 0


def test_simulate_with_kept_locals_evaluates_seen_devices_too(
    genre_rating_model: Path, tmp_path: Path
) -> None:
    table = write_table(tmp_path / "ratings.csv", genre_rating_model, devices=30)
    args = build_parser().parse_args(
        [
            "simulate",
            "--model-dir",
            str(genre_rating_model),
            "--examples",
            str(table),
            "--rounds",
            "10",
            "--clients-per-round",
            "8",
            "--local-state",
            "keep",
            "--out",
            str(tmp_path / "out"),
        ]
    )

    report = simulate_main(args, Console(file=(tmp_path / "log.txt").open("w")))

    assert report["options"]["task_config"]["local_state"] == "keep"
    assert report["seen"]["devices"] == 24 and np.isfinite(report["seen"]["rmse"])
    assert report["seen"]["rmse_low"] <= report["seen"]["rmse"] <= report["seen"]["rmse_high"]
    assert np.isfinite(report["held_out"]["rmse"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--examples", "t.csv"], "--examples needs the model they are for"),
        (["--model-dir", "m"], "a model of your own needs its per-device examples: --examples TABLE"),
        (["--model-dir", "m", "--model", "a:b", "--examples", "t.csv"], "not both"),
        (["--model", "nocolon", "--examples", "t.csv"], "--model takes MODULE:FUNCTION"),
        (
            ["--model-dir", "m", "--examples", "t.csv", "--data", "movielens"],
            "--data movielens is a built-in",
        ),
        (["--model-dir", "m", "--examples", "t.csv", "--mixing", "parallel_training"], "mixing draws"),
        (
            ["--model-dir", "m", "--examples", "t.csv", "--devices", "50"],
            "your table's devices are its device ids",
        ),
    ],
)
def test_a_users_model_options_that_do_not_fit_are_one_line(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["run", "--work-dir", str(tmp_path / "run"), *args])

    err = capsys.readouterr().err
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_a_bad_table_is_one_line_before_anything_starts(
    genre_rating_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = write_table(tmp_path / "ratings.csv", genre_rating_model, devices=30)
    lines = table.read_text().splitlines()
    lines[5] = lines[5].rsplit(",", 1)[0] + ",7.5"  # a rating outside [1, 5]
    table.write_text("\n".join(lines) + "\n")

    code = main(
        [
            "run",
            "--model-dir",
            str(genre_rating_model),
            "--examples",
            str(table),
            "--work-dir",
            str(tmp_path / "run"),
        ]
    )

    err = capsys.readouterr().err
    assert code == 2
    assert f"{table}, row 5, column 'rating': got 7.5; expected" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run" / "orchestrator.sqlite").exists()


def test_the_fleet_trains_a_users_model_over_http_and_reports_its_metrics(
    genre_rating_model: Path, tmp_path: Path
) -> None:
    table = write_table(tmp_path / "ratings.csv", genre_rating_model, devices=40)
    # The population starts from given globals (as from simulate's global_params.safetensors).
    exported = load((genre_rating_model / INITIAL_GLOBAL_FILE).read_bytes())
    start = {name: value + 0.125 for name, value in exported.items()}
    (tmp_path / "start.safetensors").write_bytes(encode_params(start))
    config = RunConfig(
        work_dir=tmp_path / "run",
        model_dir=genre_rating_model,
        examples=table,
        initial_globals=tmp_path / "start.safetensors",
        rounds=3,
        target_reports=6,
        oversampling=1.5,
        min_examples=2,
        round_seconds=8.0,
        evaluation_every=2,
        device_mix=ALWAYS_ON,
        held_out_fraction=0.25,
        workers=2,
        stall_seconds=60.0,
    )

    result = run(config, Console(file=(tmp_path / "log.txt").open("w")))

    body = result.summary
    assert result.rounds_committed >= 3
    assert body["data"]["devices"] == 40 and body["data"]["examples"] == 40 * 16
    assert body["model"]["task"] == {"kind": "regression"}
    assert body["population"]["name"].startswith(f"{genre_rating_model.name}-")
    assert np.isfinite(result.final_evaluation["rmse"]) and result.final_evaluation["weight_sum"] > 0
    assert result.hit_rates is None and body["recommendations"] == []  # no catalog to rank
    # Every report a committed round counted, the devices counted too (a round may commit at its
    # deadline with fewer than its target: once in CI, 17 reports in three rounds of 6)
    committed = [r for r in body["rounds"] if r["kind"] == "training" and r["status"] == "committed"]
    assert len(committed) >= 3 and all(r["counters"]["reported"] >= r["min_reports"] for r in committed)
    counted = sum(r["counters"]["reported"] for r in committed)
    assert body["fleet"]["device_side_outcomes"]["training/reported"] >= counted
    assert all(p.stat().st_size > 0 for p in result.plots)
    with Session(make_engine(f"sqlite:///{tmp_path / 'run' / 'orchestrator.sqlite'}")) as session:
        first = load(session.scalars(select(ModelVersion).where(ModelVersion.version == 0)).one().params)
    assert all(np.array_equal(first[name], value) for name, value in start.items())


def test_initial_globals_that_do_not_fit_the_export_are_one_line(
    genre_rating_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = write_table(tmp_path / "ratings.csv", genre_rating_model, devices=20)
    exported = load((genre_rating_model / INITIAL_GLOBAL_FILE).read_bytes())
    name = sorted(exported)[0]
    (tmp_path / "g.safetensors").write_bytes(encode_params({name: exported[name]}))

    code = main(
        [
            "run",
            "--model-dir",
            str(genre_rating_model),
            "--examples",
            str(table),
            "--initial-globals",
            str(tmp_path / "g.safetensors"),
            "--target-reports",
            "4",
            "--work-dir",
            str(tmp_path / "run"),
        ]
    )

    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"error: --initial-globals {tmp_path / 'g.safetensors'}: expected tensors" in err
    assert "missing" in err and "simulate's global_params.safetensors" in err
    assert not (tmp_path / "run" / "orchestrator.sqlite").exists()


def test_simulate_holds_out_the_devices_a_column_marks(genre_rating_model: Path, tmp_path: Path) -> None:
    table = write_table(tmp_path / "ratings.csv", genre_rating_model, devices=30)
    lines = table.read_text().splitlines()
    marked = {"phone-003", "phone-017", "phone-021"}
    rows = [lines[0] + ",held_out"] + [f"{line},{int(line.split(',')[0] in marked)}" for line in lines[1:]]
    table.write_text("\n".join(rows) + "\n")
    args = build_parser().parse_args(
        [
            "simulate",
            "--model-dir",
            str(genre_rating_model),
            "--examples",
            str(table),
            "--held-out-column",
            "held_out",
            "--rounds",
            "2",
            "--workers",
            "1",
            "--out",
            str(tmp_path / "out"),
        ]
    )

    report = simulate_main(args, Console(file=(tmp_path / "log.txt").open("w")))

    assert report["devices"] == {"training": 24, "validation": 3, "held_out": 3}
    assert report["held_out"]["devices"] == 3


def test_a_held_out_column_that_changes_within_a_device_is_one_line(
    genre_rating_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = write_table(tmp_path / "ratings.csv", genre_rating_model, devices=12)
    lines = table.read_text().splitlines()
    rows = [lines[0] + ",held_out"] + [f"{line},{i % 2}" for i, line in enumerate(lines[1:])]
    table.write_text("\n".join(rows) + "\n")

    code = main(
        [
            "simulate",
            "--model-dir",
            str(genre_rating_model),
            "--examples",
            str(table),
            "--held-out-column",
            "held_out",
            "--out",
            str(tmp_path / "out"),
        ]
    )

    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "column 'held_out' is both 0 and 1 on device 'phone-000'" in err
