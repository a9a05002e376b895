"""benchmarks.scale's HTTP fleet: its client tasks/s in one process and over Ray shards against the
device's own task rate, where the time goes, idle devices' memory, and a large population."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import time
import tracemalloc
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from android_sim.fleet import TRAINING, DeviceSpec, Fleet, FleetOptions
from android_sim.network import Connector
from android_sim.profiles import DEFAULT_MIX, SimClock, draw_profiles
from benchmarks.scale_cores import CpuMeter, process_cpu
from device_runtime.task_runner import TaskRunner
from model_runtime.tflite_model import TFLiteModel


def idle_memory(devices: int) -> dict[str, float]:
    """A fleet of `devices` that are not in a round: RSS and traced memory per device."""
    profiles = draw_profiles(devices, DEFAULT_MIX, np.random.default_rng(0))
    specs = [DeviceSpec(TRAINING, profiles[i], Path(f"devices/{i}.sqlite"), 100) for i in range(devices)]

    def rss_kb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024

    async def measure() -> dict[str, float]:
        with TaskRunner(1) as runner:
            gc.collect()
            rss_before = rss_kb()
            tracemalloc.start()
            traced_before = tracemalloc.get_traced_memory()[0]
            fleet = Fleet(
                "http://127.0.0.1:9",
                Connector(),
                specs,
                Path("cache"),
                runner,
                SimClock(60.0),
                FleetOptions("p"),
            )
            for i, device in enumerate(fleet.devices):  # enrolled: an id and a token each
                device.device_id, device.token = f"{i:032x}", f"{i:043x}"
            gc.collect()
            traced = (tracemalloc.get_traced_memory()[0] - traced_before) / devices / 1024
            tracemalloc.stop()
            rss = (rss_kb() - rss_before) / devices
            await fleet.aclose()
            return {"devices": devices, "rss_kb_per_device": rss, "traced_kb_per_device": traced}

    return asyncio.run(measure())


FLEET_RUNS = (  # (shards, reports a round, devices per report a round)
    (1, 40, 7.5),
    (2, 40, 7.5),
    (2, 200, 7.5),  # a larger round: what the round's rhythm costs
)


def fleet_runs(spec: str) -> tuple[tuple[int, int, float], ...]:
    """`--fleet-runs`: SHARDSxREPORTS, comma-separated (e.g. "1x40,2x40"), of FLEET_RUNS."""
    known = {f"{s}x{t}": (s, t, per) for s, t, per in FLEET_RUNS}
    chosen = [known.get(name.strip()) for name in spec.split(",")]
    if not spec or None in chosen:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(known)}, got {spec!r}")
    return tuple(c for c in chosen if c is not None)


def fleet_rates(
    work: Path, devices_per_report: float | None, rounds: int, runs_of: tuple[tuple[int, int, float], ...]
) -> dict[str, Any]:
    """The HTTP fleet in one process and over 2 Ray shards, and with a larger round: client tasks/s,
    where the time goes (the orchestrator's CPU per report, the fleet's CPU per task, the server's
    and the devices' view of a check-in, the fleet's event loop lag), and the device's own task
    rate on one core on the same model and stores."""
    from android_sim.builtin_data import export, model_config
    from android_sim.device_data import expression_fleet
    from android_sim.expressions import SyntheticConfig
    from benchmarks.fleet import bench_config, tasks_per_second

    largest = max(round(target * (devices_per_report or per)) for _, target, per in runs_of)
    data = expression_fleet(SyntheticConfig(num_expressions=1000, num_users=largest, seed=0))
    model_dir = export(model_config(data), work / "model")
    runs: dict[str, dict[str, Any]] = {}
    for shards, target, per in runs_of:
        devices = round(target * (devices_per_report or per))
        label = f"{shards} shard(s), rounds of {target}, {devices} devices"
        folder = work / f"run-{len(runs)}"
        folder.mkdir(parents=True)
        (folder / "model").symlink_to(model_dir, target_is_directory=True)
        config = bench_config(folder, devices, rounds, target_reports=target, workers=2, shards=shards)
        # A deadline that a loaded machine meets: a round still closes at its target reports.
        config = replace(config, round_seconds=60.0)
        runs[label] = fleet_run(config, tasks_per_second)
        print(f"  {label}: {json.dumps(runs[label])}", flush=True)
    stores = sorted((work / "run-0" / "devices").iterdir())
    return {"runs": runs, "device_one_core": device_task_rate(model_dir, stores)}


def fleet_run(config: Any, rate: Any) -> dict[str, Any]:
    """One fleet run against an orchestrator of its own (one process, SQLite), with its figures."""
    from rich.console import Console

    from android_sim.run import run_async
    from android_sim.session import SIMULATED_FLEET_LIMITS
    from orchestrator.local import LocalOrchestrator

    work = config.work_dir
    with LocalOrchestrator(
        f"sqlite:///{work.resolve() / 'orchestrator.sqlite'}",
        log_path=work / "orchestrator.log",
        settings=SIMULATED_FLEET_LIMITS,
    ) as server:
        assert server.process is not None
        config = replace(config, orchestrator_url=server.url, admin_token=server.admin_token)
        server_cpu = process_cpu(server.process.pid)
        with CpuMeter("ray::FleetShard") as meter:
            result = asyncio.run(run_async(config, Console(quiet=True)))
        server_cpu = process_cpu(server.process.pid) - server_cpu
        latency = _server_latency(server.url, server.admin_token)
    training = [r for r in result.summary["rounds"] if r["kind"] == "training"]
    rounds = [r for r in training if r["status"] == "committed"]
    reported = sum(r["counters"]["reported"] for r in rounds)
    fleet = result.summary["fleet"]
    return {
        "tasks_per_second": rate(result.summary["rounds"]),
        "round_seconds_median": statistics.median(
            r["closed_at"] - r["opened_at"] for r in rounds[1:] or rounds
        ),
        "orchestrator_cpu_ms_per_report": server_cpu / reported * 1e3,
        "fleet_cpu_ms_per_report": (meter.own + meter.workers) / reported * 1e3,
        "cores_used_by_fleet": (meter.own + meter.workers) / meter.wall,
        "orchestrator_cores_used": server_cpu / meter.wall,
        "server_checkin_mean_ms": latency.get("checkin", 0.0),
        "server_report_mean_ms": latency.get("report", 0.0),
        "device_checkin_p50_ms": fleet["checkin_p50_ms"],
        "device_checkin_p99_ms": fleet["checkin_p99_ms"],
        "wall_seconds": meter.wall,
        # From the first round's opening to the last commit: the rest of the run is its setup.
        "rounds_seconds": rounds[-1]["closed_at"] - training[0]["opened_at"],
        "rounds_committed": len(rounds),
        "rounds_abandoned": sum(r["status"] == "abandoned" for r in training),
        "shards_rss_kb": sum(meter.rss_kb.values()),
        "fleet_loop_lag_p50_ms": fleet["event_loop_lag_p50_ms"],
        "fleet_loop_lag_p99_ms": fleet["event_loop_lag_p99_ms"],
    }


def population_run(
    work: Path, devices: int, target: int, rounds: int, round_seconds: float = 300.0
) -> dict[str, Any]:
    """A population of `devices` enrolled phones of the default mix (eligible at night, 2 simulated
    hours' rest after taking part) over 2 Ray shards, rounds of `target`: the run's wall time, the
    fleet's memory per device (the shards' whole RSS: imports, interpreters and the devices in a
    round included), and how long check-ins took. `round_seconds`: the rounds' deadline, which
    must fit `target` reports at the fleet's rate (5-15 tasks/s on this machine: a round of 1,000
    with 60 s got 237 reports by its deadline and was abandoned)."""
    from android_sim.run_config import RunConfig
    from benchmarks.fleet import bench_config, tasks_per_second

    config = bench_config(
        work,
        devices,
        rounds,
        target_reports=target,
        round_seconds=round_seconds,
        stall_seconds=2 * round_seconds,  # a round may take up to its deadline
        cooldown_hours=RunConfig.cooldown_hours,
        device_mix=RunConfig.device_mix,
        workers=2,
        shards=2,
    )
    started = time.perf_counter()
    figures = fleet_run(config, tasks_per_second)
    return {
        **figures,
        "devices": devices,
        "target_reports": target,
        "rounds": rounds,
        "total_seconds": time.perf_counter() - started,  # stores and enrollment included
        "rss_kb_per_device": figures["shards_rss_kb"] / devices,
    }


def _server_latency(url: str, token: str) -> dict[str, float]:
    """The orchestrator's own mean time per check-in and per training report (its /metrics)."""
    import re

    import httpx

    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}).text
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(
            r'orchestrator_http_request_duration_seconds_(sum|count)\{method="POST",route="([^"]+)"\} (\S+)',
            line,
        )
        if m:
            kind = "checkin" if m[2].endswith("/checkin") else "report" if m[2].endswith("/report") else ""
            if kind:
                target = sums if m[1] == "sum" else counts
                target[kind] = target.get(kind, 0.0) + float(m[3])
    return {k: sums[k] / counts[k] * 1e3 for k in sums if counts.get(k)}


def device_task_rate(model_dir: Path, stores: list[Path], count: int = 200) -> float:
    """Tasks/s of the device runtime's training task on one core, over the fleet's own stores."""
    from contracts.manifest import INITIAL_GLOBAL_FILE
    from contracts.params import decode_params
    from contracts.task_config import TaskConfig
    from device_runtime.client_task import Task, run_training_task
    from device_runtime.example_store import ExampleStore
    from device_runtime.task_environment import Environment

    model = TFLiteModel(model_dir)
    params = decode_params(
        (model_dir / INITIAL_GLOBAL_FILE).read_bytes(), model.manifest.global_params, "globals"
    )
    config = TaskConfig.from_manifest(model.manifest)
    chosen = [p for p in stores if p.suffix == ".sqlite"][:count]
    busy = 0.0
    for i, path in enumerate(chosen):
        with ExampleStore(path) as store:
            t0 = time.perf_counter()
            run_training_task(model, Environment.of(store), params, Task(config, seed=i))
            busy += time.perf_counter() - t0
    return len(chosen) / busy


def print_fleet(fleet: dict[str, Any]) -> None:
    cores = os.cpu_count() or 1
    device_rate = fleet["device_one_core"] * cores
    print(
        f"  device task on one core: {fleet['device_one_core']:.0f} tasks/s; "
        f"x {cores} cores: {device_rate:.0f}"
    )
    for label, run in fleet["runs"].items():
        print(
            f"  {label}: {run['tasks_per_second']:.1f} tasks/s = {run['tasks_per_second'] / device_rate:.1%}"
            f" of it (target >= 50%); a round {run['round_seconds_median']:.2f} s"
        )
        print(
            f"    CPU per report: orchestrator {run['orchestrator_cpu_ms_per_report']:.1f} ms, fleet "
            f"{run['fleet_cpu_ms_per_report']:.1f} ms; cores used: orchestrator "
            f"{run['orchestrator_cores_used']:.2f}, fleet {run['cores_used_by_fleet']:.2f}"
        )
        print(
            f"    check-in: server's mean {run['server_checkin_mean_ms']:.0f} ms, devices' p50/p99 "
            f"{run['device_checkin_p50_ms']:.0f}/{run['device_checkin_p99_ms']:.0f} ms; report: "
            f"server's mean {run['server_report_mean_ms']:.0f} ms; the fleet's event loop late by "
            f"{run['fleet_loop_lag_p50_ms']:.1f} ms p50, {run['fleet_loop_lag_p99_ms']:.0f} ms p99"
        )
