"""The fleet simulator end to end: real devices, a real orchestrator process, real HTTP on loopback."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from android_sim.__main__ import build_parser, main
from android_sim.builtin_data import load_data, model_config
from android_sim.fleet import FleetStats
from android_sim.options import algorithm
from android_sim.profiles import DeviceClass
from android_sim.run import run, run_async
from android_sim.run_config import RunConfig, RunResult
from android_sim.session import progress_line
from contracts.manifest import load_manifest
from contracts.mixing import max_gradient_bytes
from device_runtime.example_store import ExampleStore
from device_runtime.local_state import LocalStateStore
from model_export.config import ModelConfig
from model_runtime.tflite_model import TFLiteModel
from orchestrator.aggregation.buffered_privacy import buffered_epsilon
from orchestrator.aggregation.differential_privacy import DPConfig, epsilon, target_delta_for
from orchestrator.local import LocalOrchestrator

# Always charging on wifi, never picked up: every device is eligible, so small tests run fast.
# One in five tasks drops out mid-task (half of those vanish, half abort).
ALWAYS_ON = (DeviceClass("test phone", 1.0, 1.5, 200.0, 2.0, 0.2, 0.5, 24.0, 1.0, 0.0),)


def small(work: Path, **overrides: object) -> RunConfig:
    values: dict[str, object] = dict(
        work_dir=work,
        devices=60,
        expressions=120,
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
        show_devices=2,
    )
    values.update(overrides)
    return RunConfig(**values)  # type: ignore[arg-type]


@pytest.fixture
def work(tmp_path: Path, export: Callable[[ModelConfig], Path]) -> Path:
    """A work directory that already holds this data's export (the run reuses an identical one)."""
    config = small(tmp_path)
    shutil.copytree(export(model_config(load_data(config))), tmp_path / "model")
    return tmp_path


def reconcile(result: RunResult, server_killed: bool = False) -> None:
    """Server-side counters agree with what the devices saw. A server killed mid-run may have
    counted an abort whose answer it never sent; the device's retry is answered as the first
    (aborts are idempotent) unless its retries ran out while the server was down: it then counts
    itself vanished, so only those can make the server's count larger."""
    rounds = result.summary["rounds"]
    device_side = result.summary["fleet"]["device_side_outcomes"]
    reported = sum(n for k, n in device_side.items() if k.endswith("/reported"))
    aborted = sum(n for k, n in device_side.items() if k.endswith("/aborted"))
    vanished = sum(n for k, n in device_side.items() if k.endswith("/vanished"))
    assert sum(r["counters"]["reported"] for r in rounds) == reported
    server_aborted = sum(r["counters"]["aborted"] for r in rounds)
    if server_killed:
        assert aborted <= server_aborted <= aborted + vanished
    else:
        assert server_aborted == aborted


def test_a_fleet_trains_under_secure_aggregation_with_dropouts_at_its_phases(work: Path) -> None:
    # Prepare: one device in ten leaves before each phase of the protocol (and mid-task)
    phone = replace(ALWAYS_ON[0], dropout_probability=0.1)
    config = small(work, aggregation="secure", rounds=2, device_mix=(phone,), secure_phase_seconds=2.0)

    # Execute
    result = run(config, Console(width=120, record=True))

    # Assert: rounds commit from masked inputs alone: no per-device training metrics reach the server
    report = json.loads(result.report_path.read_text())
    training = [r for r in report["rounds"] if r["kind"] == "training" and r["status"] == "committed"]
    assert result.rounds_committed >= 2 and len(training) >= 2
    assert all(r["counters"]["reported"] >= 3 and "query_loss" not in r["metrics"] for r in training)
    assert report["fleet"]["device_side_outcomes"].get("training/reported", 0) >= 2 * 3


def test_a_fleet_trains_evaluates_and_writes_its_report(work: Path) -> None:
    console = Console(width=120, record=True)
    result = run(small(work), console)

    assert result.rounds_committed >= 3
    report = json.loads(result.report_path.read_text())
    # Without mixing no item is central-only: the devices may draw every catalog row as a negative.
    assert report["algorithm"]["task_config"]["central_only_items"] == []
    training = [r for r in report["rounds"] if r["kind"] == "training" and r["status"] == "committed"]
    assert all(r["counters"]["reported"] >= 1 for r in training)
    assert all("query_loss" in r["metrics"] for r in training)
    assert any(r["kind"] == "evaluation" and r["counters"]["reported"] for r in report["rounds"])
    assert "loss" in result.final_evaluation and "accuracy" in result.final_evaluation
    final, printed = result.final_evaluation, " ".join(console.export_text(clear=False).split())
    if "accuracy_low" in final:  # the server's interval, from two groups of its floor or more
        assert final["accuracy_low"] <= final["accuracy"] <= final["accuracy_high"]
        assert f"accuracy {final['accuracy']:.4f} [{final['accuracy_low']:.4f}," in printed
    else:
        assert "no interval: too few devices for two groups" in printed
    outcomes = report["fleet"]["device_side_outcomes"]
    # Every report a committed round counted was a device's accepted report (a round may commit at
    # its deadline with min_reports on a busy machine, so not 6 a round).
    assert outcomes.get("training/reported", 0) >= sum(r["counters"]["reported"] for r in training) >= 3
    # Why participations ended short of a report: counted by reason, numbers out, no rejections.
    left = report["fleet"]["left_because"]
    short = sum(n for k, n in outcomes.items() if not k.endswith(("/reported", "/rejected")))
    assert sum(e["count"] for e in left) <= short and (short == 0 or left)
    assert all(
        e["status"] not in ("reported", "rejected") and not re.search(r"\d", e["reason"]) for e in left
    )
    assert ("ended short of a report" in console.export_text()) == bool(left)
    # Devices with one example are filtered at check-in (min_examples 2).
    assert sum(r["counters"]["rejected_min_examples"] for r in report["rounds"]) > 0
    reconcile(result)
    for plot in result.plots:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result.hit_rates is not None and result.hit_rates.devices > 0
    assert report["recommendations"] and len(report["recommendations"][0]["personalized"]) == 10
    # Every held-out device is scored, each with its top-10 of every method kept in the report;
    # the synthetic data's ground truth gives every method an expected hit rate and the ceilings.
    held_out = report["hit_rates"]["scored_devices"]
    assert len(held_out) == result.hit_rates.devices
    methods = {"personalized", "global", "most_shared", "topic_rule", "central_mf", "bayes", "oracle"}
    assert all(set(d["top10"]) == methods and len(d["top10"]["oracle"]) == 10 for d in held_out)
    figures = report["hit_rates"]["methods"]
    assert all(figures[m]["expected"]["low"] <= figures[m]["expected"]["value"] for m in methods)
    assert figures["oracle"]["expected"]["value"] >= figures["personalized"]["expected"]["value"]


def test_the_fleet_waits_for_an_orchestrator_that_restarts(work: Path) -> None:
    server = LocalOrchestrator(f"sqlite:///{work / 'server.sqlite'}").start()
    restarted = threading.Event()

    def restart_after_first_commit() -> None:
        import httpx

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                status = httpx.get(
                    f"{server.url}/v1/admin/populations",
                    headers={"Authorization": f"Bearer {server.admin_token}"},
                    timeout=2,
                ).json()
            except httpx.TransportError:
                status = []
            if status and status[0]["training_rounds_committed"] >= 1:
                server.kill()  # SIGKILL mid-run
                time.sleep(3)
                server.start()  # same port, same database
                restarted.set()
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=restart_after_first_commit)
    watcher.start()
    try:
        config = small(work, orchestrator_url=server.url, admin_token=server.admin_token, rounds=4)
        result = asyncio.run(run_async(config, Console(width=120)))
        watcher.join()
        # A second run against the same orchestrator reuses the population and goes on from there.
        again = asyncio.run(run_async(replace(config, rounds=1), Console(width=120)))
    finally:
        watcher.join()
        server.stop()

    assert restarted.is_set()
    assert result.rounds_committed >= 4
    reconcile(result, server_killed=True)
    assert again.summary["population"]["name"] == result.summary["population"]["name"]
    assert again.summary["population"]["current_version"] > result.summary["population"]["current_version"]


def test_the_in_process_transport_runs_the_same_device_code(work: Path) -> None:
    result = run(small(work, in_process=True, rounds=2), Console(width=120))

    assert result.rounds_committed >= 2
    reconcile(result)


def test_a_dp_fleet_reports_epsilon_and_stops_at_its_budget(work: Path) -> None:
    # 45 training devices, 6 reports a round: a budget that allows exactly two rounds.
    budget = epsilon(1.0, 6 / 45, 2, 1e-5)
    config = small(work, rounds=10, clip_norm=0.5, noise_multiplier=1.0, epsilon_budget=budget)

    result = run(config, Console(width=120))

    assert result.rounds_committed == 2
    privacy = result.summary["privacy"]
    assert privacy["budget_spent"] and privacy["epsilon"] == pytest.approx(budget)
    assert "privacy budget spent" in privacy["message"]
    training = [r for r in result.summary["rounds"] if r["kind"] == "training"]
    epsilons = [r["metrics"]["dp_epsilon"] for r in training if r["status"] == "committed"]
    assert epsilons == sorted(epsilons) and epsilons[-1] == pytest.approx(budget)
    # The progress line shows the epsilon spent so far (the DP tutorial says so).
    last = [r for r in training if r["status"] == "committed"][-1]
    assert progress_line(FleetStats(), last).endswith(f"| epsilon {budget:.2f}")
    # No round of any kind after the budget: an evaluation's sums are not noised, so there is no
    # final evaluation, and no evaluation round opened once the last training round committed.
    assert not result.final_evaluation
    spent_at = max(r["closed_at"] for r in training if r["status"] == "committed")
    evaluations = [r for r in result.summary["rounds"] if r["kind"] == "evaluation"]
    assert all(r["opened_at"] < spent_at for r in evaluations), evaluations


def test_a_fleet_with_adaptive_clipping_moves_its_clip_norm(work: Path) -> None:
    config = small(work, rounds=3, clip_norm=0.001, noise_multiplier=0.0, target_unclipped_quantile=0.5)

    result = run(config, Console(width=120))

    training = [r for r in result.summary["rounds"] if r["kind"] == "training" and r["status"] == "committed"]
    clip_norms = [r["metrics"]["dp_clip_norm"] for r in training]
    # Far below every device's delta norm: nobody is left unclipped, so the clip norm grows each round.
    assert clip_norms[0] == 0.001 and all(b > a for a, b in itertools.pairwise(clip_norms))
    # The share is noised (count noise 6 / 20 = 0.3 over 6 reports: a standard deviation of 0.05).
    assert all(abs(r["metrics"]["dp_unclipped_share"]) < 0.3 for r in training)
    assert all(r["counters"]["invalid"] == 0 for r in training)  # devices clipped to each round's norm


def test_the_local_orchestrator_takes_the_given_admin_token(work: Path) -> None:
    # So that an operator can read a running job's /metrics and admin routes.
    import httpx

    from android_sim.session import orchestrator

    token = "a-token-of-my-own-that-is-long-enough"

    async def ask() -> tuple[int, int]:
        async with orchestrator(small(work, admin_token=token), work, Console(width=120)) as (url, given, _):
            assert given == token
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                mine = await client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
                other = await client.get("/metrics", headers={"Authorization": f"Bearer {token}x"})
                return mine.status_code, other.status_code

    assert asyncio.run(ask()) == (200, 403)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--data", "movielens", "--ratings", "/nonexistent/u.data"], "ratings file not found"),
        (["--orchestrator-url", "http://127.0.0.1:9"], "needs its admin token"),
        (["--orchestrator-url", "http://127.0.0.1:9", "--admin-token", "x"], "no orchestrator answers"),
        (["--admin-token", "admin"], "the admin token is well known or shorter than 32 characters"),
        (["--stall-seconds", "0"], "--stall-seconds must be a number of seconds > 0, got 0.0"),
        (["--admin-token-file", "/nonexistent/token"], "cannot read --admin-token-file"),
        (["--rounds", "0"], "rounds must be >= 1"),
        (["--noise-multiplier", "1"], "need --clip-norm"),
        (["--target-unclipped-quantile", "0.5"], "need --clip-norm"),
        (["--clip-norm", "1"], "--clip-norm needs --noise-multiplier"),
        (
            ["--clip-norm", "1", "--noise-multiplier", "1", "--population-size", "5"],
            "population_size (5) must be >= target_reports (40)",
        ),
    ],
)
def test_user_errors_are_one_clear_line(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], work: Path
) -> None:
    code = main(["run", "--work-dir", str(work), "--devices", "60", "--expressions", "120", *args])

    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize("source", ["environment", "file"])
def test_the_admin_token_comes_from_the_environment_or_a_file(
    source: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    work: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    token = "t" * 40
    given: list[str] = []
    if source == "environment":
        monkeypatch.setenv("ORCHESTRATOR_ADMIN_TOKEN", token)
    else:
        (tmp_path / "token").write_text(token + "\n")
        given = ["--admin-token-file", str(tmp_path / "token")]
    args = ["run", "--work-dir", str(work), "--devices", "60", "--orchestrator-url", "http://127.0.0.1:9"]

    code = main([*args, *given])

    # Past the token check (without one: "needs its admin token"), to the unreachable server.
    assert code == 2 and "no orchestrator answers" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--devices", "0"], "devices must be >= 2 (one to train, one held out), got 0"),
        (["--devices", "-5"], "devices must be >= 2 (one to train, one held out), got -5"),
        (
            ["--devices", "20", "--aggregation", "secure"],
            "a training round needs 20 reports (half of --target-reports 40) from distinct devices, "
            "but the fleet has 17 training devices",
        ),
        (["--devices", "4", "--target-reports", "8"], "the fleet has 3 training devices"),
    ],
)
def test_impossible_fleet_sizes_are_one_line_before_anything_starts(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    code = main(["run", "--work-dir", str(tmp_path / "run"), "--expressions", "120", *args])

    err = capsys.readouterr().err
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run" / "orchestrator.sqlite").exists()  # no orchestrator started
    assert time.monotonic() - started < 30  # not a stalled run


def test_an_unknown_ratings_format_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ratings = tmp_path / "ratings.csv"
    ratings.write_text("user,item,rating,time\n1,2,3,4\n")

    code = main(["run", "--data", "movielens", "--ratings", str(ratings), "--work-dir", str(tmp_path)])

    assert code == 2
    assert "unknown ratings format" in capsys.readouterr().err


def test_movielens_users_are_devices_with_explicit_ratings(
    tmp_path: Path, export: Callable[[ModelConfig], Path], movielens_100k: Path
) -> None:
    config = small(tmp_path, data="movielens", ratings=movielens_100k, devices=80, min_examples=5)
    shutil.copytree(export(model_config(load_data(config))), tmp_path / "model")

    result = run(config, Console(width=120))

    assert result.rounds_committed >= 3
    assert result.hit_rates is None  # explicit ratings: ReconEval RMSE instead
    assert 0.5 < result.final_evaluation["rmse"] < 2.0
    reconcile(result)


def test_a_stateful_fleet_keeps_locals_and_evaluates_on_seen_devices(work: Path) -> None:
    config = small(work, task={"local_state": "keep"}, server_optimizer={"learning_rate": 5.0})

    result = run(config, Console(width=120, record=True))

    assert result.rounds_committed >= 3
    assert result.rounds_committed == config.rounds  # the server stops at --rounds (issue 49)
    report = json.loads(result.report_path.read_text())
    algorithm = report["algorithm"]
    assert algorithm["local_state"] == "keep" and algorithm["evaluation"].startswith("StandardEval")
    # Without its own rate, a kept local trains at the reconstruction rate; the server rate as given.
    assert (
        algorithm["task_config"]["local_learning_rate"]
        == algorithm["task_config"]["reconstruction_learning_rate"]
    )
    assert algorithm["server_optimizer"]["learning_rate"] == 5.0
    outcomes = report["fleet"]["device_side_outcomes"]
    assert not any(key.startswith("held-out") for key in outcomes)  # no device is held out
    assert outcomes.get("training (evaluation)/reported", 0) >= 1  # seen devices evaluate
    assert "loss" in result.final_evaluation and result.final_evaluation["weight_sum"] >= 1
    reconcile(result)
    assert report["recommendations"] and report["recommendations"][0]["local_params"] == "kept"
    # The kept locals are in the devices' own store files, trained by as many tasks as they reported.
    model = TFLiteModel(work / "model")
    name = report["population"]["name"]
    trained = 0
    for store_path in sorted((work / "devices").glob("device-*.sqlite")):
        with ExampleStore(store_path) as store:
            trained += LocalStateStore(store, name).load(model).tasks
    assert trained >= outcomes["training/reported"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--local-state", "remember"], "local_state must be one of ['reconstruct', 'keep']"),
        (["--split", "diagonal"], "split must be one of ['alternate', 'reuse']"),
        (["--local-state", "keep", "--local-learning-rate", "0"], "needs local_learning_rate > 0"),
        (["--reconstruction-steps", "-1"], "reconstruction_max_steps must be in [0, 10000], got -1"),
        (["--server-optimizer", "adagrad"], "unknown server optimizer 'adagrad'"),
        (["--server-learning-rate", "0"], "learning_rate must be a finite number in (0, 1e+06]"),
        (["--algorithm-settings", "/nonexistent.json"], "cannot read algorithm settings"),
    ],
)
def test_algorithm_errors_are_one_clear_line(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["run", "--work-dir", str(tmp_path / "run"), *args])

    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # nothing started


def test_an_algorithm_settings_file_with_flags_over_it(tmp_path: Path) -> None:
    settings = tmp_path / "algorithm.json"
    settings.write_text(
        json.dumps(
            {
                "task": {"split": "reuse", "update_learning_rate": 0.3},
                "server_optimizer": {"name": "adam", "learning_rate": 0.01},
            }
        )
    )
    args = build_parser().parse_args(
        ["run", "--algorithm-settings", str(settings), "--update-learning-rate", "0.2"]
    )

    task, server = algorithm(args)

    assert task == {"split": "reuse", "update_learning_rate": 0.2}
    assert server == {"name": "adam", "learning_rate": 0.01}
    (tmp_path / "bad.json").write_text(json.dumps({"task": {}, "optimizer": {}}))
    bad = build_parser().parse_args(["run", "--algorithm-settings", str(tmp_path / "bad.json")])
    with pytest.raises(ValueError, match=r"keys from \['task', 'server_optimizer'\]"):
        algorithm(bad)


@pytest.mark.parametrize("strategy", ["parallel_training", "example_transfer", "gradient_transfer"])
def test_a_fleet_mixes_centralized_data_and_counts_its_bytes(work: Path, strategy: str) -> None:
    mixing = {"strategy": strategy, "weight": 0.2, "central_steps": 4, "examples_per_assignment": 8}
    config = small(work, rounds=2, evaluation_every=0, mixing=mixing, central_examples=200)

    result = run(config, Console(width=120, record=True))

    report = json.loads(result.report_path.read_text())
    mixed = report["mixing"]
    assert result.rounds_committed >= 2 and mixed["mixing"]["strategy"] == strategy
    assert mixed["num_examples"] >= 200  # the public shares, and the new expressions' shares
    # The items only the centralized data holds are declared central-only, as the mixing
    # benchmark declares its held-back items: no device draws them as negatives.
    declared = report["algorithm"]["task_config"]["central_only_items"]
    assert len(declared) == mixed["new_items"] > 0 and declared == sorted(set(declared))
    training = [r for r in report["rounds"] if r["kind"] == "training" and r["status"] == "committed"]
    if strategy == "parallel_training":
        assert all(r["metrics"]["central_steps"] == 4 for r in training)
        assert mixed["assignments_with_central_download"] == 0
    elif strategy == "gradient_transfer":
        reported = report["fleet"]["device_side_outcomes"].get("training/reported", 0)
        assert mixed["assignments_with_central_download"] >= reported > 0
        # The gradient's rows: at most every row of every global (max_gradient_bytes), and more
        # than a few hundred bytes (the centralized data touches many item rows).
        manifest = load_manifest(work / "model")
        assert 1000 < mixed["central_bytes_per_assignment"] <= max_gradient_bytes(manifest)
    else:
        reported = report["fleet"]["device_side_outcomes"].get("training/reported", 0)
        assert mixed["assignments_with_central_download"] >= reported > 0
        # 8 examples of two features (int32 item, float32 label) and a safetensors header.
        assert 8 * 8 < mixed["central_bytes_per_assignment"] < 8 * 8 + 400
    reconcile(result)


# The README's DP example (issue 26): a population of 100,000 needs a delta below 1e-5.
DOCUMENTED_DP = ["--clip-norm", "0.5", "--noise-multiplier", "1.0", "--population-size", "100000"]


@pytest.mark.parametrize("population", ["100000", "200000"])
def test_the_documented_dp_command_is_accepted_and_trains(work: Path, population: str) -> None:
    argv = ["run", *DOCUMENTED_DP[:-1], population, "--epsilon-budget", "8"]
    args = build_parser().parse_args(argv)
    config = small(
        work,
        rounds=1,
        clip_norm=args.clip_norm,
        noise_multiplier=args.noise_multiplier,
        population_size=args.population_size,
        epsilon_budget=args.epsilon_budget,
        target_delta=args.target_delta,
    )

    result = run(config, Console(width=120))

    assert result.rounds_committed >= 1  # the fleet stops after one; another may commit meanwhile
    privacy = result.summary["privacy"]
    assert 0 < privacy["epsilon"] < 8 and not privacy["budget_spent"]


def test_an_invalid_dp_combination_stops_before_anything_is_exported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    work = tmp_path / "run"
    started = time.monotonic()
    # 1e-5 is not below 1 / 100,000: the server would refuse it, so the fleet must, at once.
    code = main(["run", "--work-dir", str(work), *DOCUMENTED_DP, "--target-delta", "1e-5"])
    seconds = time.monotonic() - started

    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "target_delta (1e-05) must be < 1 / population_size" in err
    assert not work.exists()  # no export, no server, no device store
    assert seconds < 1.0


def test_the_target_delta_follows_the_population() -> None:
    assert target_delta_for(45) == 1e-5  # small fleets keep the usual 1e-5
    for size in (100_000, 200_000, 10**7):
        assert target_delta_for(size) < 1 / size
    assert DPConfig.from_json(
        {"clip_norm": 1.0, "noise_multiplier": 1.0, "population_size": 100_000}
    ).target_delta == pytest.approx(100_000**-1.1)


def test_a_fleet_trains_in_buffered_rounds(work: Path) -> None:
    # A version every 4 reports, 6 devices training at once: reports of devices that trained on
    # an older version go into the next buffer instead of being refused as late.
    config = small(work, rounds_mode="buffered", buffer_size=4, concurrency=6, rounds=4)

    result = run(config, Console(width=120, record=True))

    report = json.loads(result.report_path.read_text())
    training = [r for r in report["rounds"] if r["kind"] == "training" and r["status"] == "committed"]
    assert result.rounds_committed == 4 and len(training) == 4
    assert all(r["counters"]["reported"] == 4 and r["capacity"] == 6 for r in training)
    assert all("staleness_mean" in r["metrics"] for r in training)
    assert report["config"]["rounds_mode"] == "buffered"
    reconcile(result)


def test_a_fleet_trains_in_buffered_rounds_under_differential_privacy(work: Path) -> None:
    # Each buffer noised; a device in at most 2 buffers, so epsilon is 2 Gaussian releases' once
    # 2 buffers have committed, whatever the number of buffers after.
    config = small(
        work,
        rounds_mode="buffered",
        buffer_size=4,
        concurrency=6,
        rounds=3,
        clip_norm=0.5,
        noise_multiplier=1.0,
        max_participations=2,
    )

    result = run(config, Console(width=120))

    assert result.rounds_committed == 3
    privacy = result.summary["privacy"]
    assert privacy["sampling_rate"] == 1.0
    assert privacy["epsilon"] == pytest.approx(buffered_epsilon(1.0, 2, privacy["delta"]))
    buffers = [r for r in result.summary["rounds"] if r["kind"] == "training" and r["status"] == "committed"]
    assert len(buffers) == 3
    assert all(
        r["metrics"]["dp_noise_stddev"] == pytest.approx(0.5 / r["counters"]["reported"]) for r in buffers
    )
    reconcile(result)


def test_a_fleet_trains_in_buffered_rounds_under_secure_aggregation(work: Path) -> None:
    # Cohorts of ceil(6 x 1.5) = 9 devices, up to two training at once, a version every 6 devices'
    # worth: each buffer holds the unmasked sums of whole cohorts, never a device's update.
    config = small(
        work, rounds_mode="buffered", aggregation="secure", buffer_size=6, concurrency=18, rounds=3
    )

    result = run(config, Console(width=120, record=True))

    report = json.loads(result.report_path.read_text())
    buffers = [r for r in report["rounds"] if r["kind"] == "training" and r["status"] == "committed"]
    cohorts = [r for r in report["rounds"] if r["kind"] == "cohort" and r["status"] == "committed"]
    assert result.rounds_committed == 3 and len(buffers) == 3
    # Each buffer's count is its cohorts' survivors, and at least its size; no training metrics.
    for buffer in buffers:
        into = [c for c in cohorts if c["metrics"].get("buffer_id") == buffer["id"]]
        assert into and buffer["counters"]["reported"] == sum(c["counters"]["reported"] for c in into)
        assert buffer["counters"]["reported"] >= 6 and "query_loss" not in buffer["metrics"]
    assert all(3 <= c["counters"]["reported"] <= 9 for c in cohorts)
    assert report["fleet"]["device_side_outcomes"].get("training/reported", 0) >= 3 * 6
