"""Scale-out benchmark: the fast simulation on Ray, idle devices' memory, a projection to 10 million.

    ./dev bench-scale        (or: python benchmarks/bench_scale.py [--rounds N] [--repeats N])

Prints:
1. The fast simulation (`simulate`), MovieLens 100K, the protocol's FedRecon (1,682 x 50),
   `--rounds` rounds of 100 clients: today's threads backend (2 threads), and the Ray
   backend with 1 and 2 local worker processes, alternating in one session (medians over
   `--repeats`). The rounds' wall time (validation included, Ray's start excluded), client tasks
   per second, and 2 Ray workers over 1 (target >= 1.7x) and over the threads. The held-out RMSE
   of every run is printed too: the backends train the same model.
   A CPU probe beside it: the same pure-Python loop in 1 and then 2 processes at once, which
   says how much of a second core the machine gave (the cores are shared with other jobs).
   The Ray round trip (a round of one client per worker) is measured too, for the projection.
2. The server's commit alone (the orchestrator's weighted mean and optimizer over a round's 100
   reports), which stays in the driver: what bounds a round however many workers there are.
3. Memory per idle device in the HTTP fleet: a fleet of `--idle-devices` devices that are not
   in a round (RSS and traced Python memory per device; target <= 20 KB).
4. The HTTP fleet (`run`, the benchmark phones of bench_fleet.py: always eligible, no delays):
   client tasks/s in one process and sharded over 2 Ray actors (`--shards 2`), against the
   device's own task rate on the same model, one core, times the cores (target >= 50%).
5. A projection for 10 million devices on a Ray cluster, from the measured per-worker rate.
The machine's load average is printed before and after: the cores are shared.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import pickle
import resource
import statistics
import sys
import tempfile
import time
import tracemalloc
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from android_sim.bench.federated import Rounds, Server  # noqa: E402
from android_sim.bench.models import ModelCache  # noqa: E402
from android_sim.bench.protocol import split_users  # noqa: E402
from android_sim.bench.quality import FAITHFUL, Dataset, load_dataset, protocol_model  # noqa: E402
from android_sim.datasets import DatasetError, folder_of  # noqa: E402
from android_sim.fleet import TRAINING, DeviceSpec, Fleet, FleetOptions  # noqa: E402
from android_sim.network import Connector  # noqa: E402
from android_sim.profiles import DEFAULT_MIX, SimClock, draw_profiles  # noqa: E402
from android_sim.simulation import SimulationOptions, simulate, simulation_clients  # noqa: E402
from device_runtime.task_runner import TaskRunner  # noqa: E402
from model_runtime.tflite_model import TFLiteModel  # noqa: E402

CLIENTS = 100
BACKENDS: tuple[tuple[Literal["threads", "ray"], int], ...] = (("threads", 2), ("ray", 1), ("ray", 2))
TEN_MILLION = 10_000_000


def load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _spin(n: int) -> float:
    t0 = time.perf_counter()
    x = 0
    for i in range(n):
        x ^= i
    return time.perf_counter() - t0


def cpu_probe(n: int = 20_000_000) -> float:
    """How many cores' worth of work 2 processes got, running the same loop as 1 did alone."""
    import multiprocessing

    alone = _spin(n)
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        pool.map(_spin, [1000, 1000])  # started
        t0 = time.perf_counter()
        pool.map(_spin, [n, n])
        together = time.perf_counter() - t0
    return 2 * alone / together


def round_trip(data: Dataset, model_dir: Path, options: SimulationOptions, repeats: int = 50) -> float:
    """A round of one client per worker on 2 Ray workers less one task in this process: what a
    round costs beyond its tasks."""
    split = split_users(len(data.examples))
    pool = simulation_clients(model_dir, data.examples, replace(options, backend="ray", workers=2))
    local = simulation_clients(model_dir, data.examples, replace(options, backend="threads", workers=1))
    try:
        params = TFLiteModel(model_dir).get_global()
        users = [u for u in split.train if u % 2 == 0][:1] + [u for u in split.train if u % 2 == 1][:1]
        timings: dict[str, list[float]] = {"ray": [], "one task": []}
        for _ in range(repeats):
            for name, clients, chosen in (("ray", pool, users), ("one task", local, users[:1])):
                t0 = time.perf_counter()
                clients.set_global(params)
                clients.map("train", chosen)
                timings[name].append(time.perf_counter() - t0)
    finally:
        pool.close()
        local.close()
    return max(0.0, statistics.median(timings["ray"]) - statistics.median(timings["one task"]))


def simulation(data: Dataset, model_dir: Path, rounds: int, repeats: int) -> dict[str, Any]:
    """Each backend `repeats` times, alternating; the rounds' seconds and held-out RMSE of each run."""
    import ray

    options = SimulationOptions(
        Rounds(rounds, CLIENTS, evaluate_every=rounds), FAITHFUL.task, FAITHFUL.server, FAITHFUL.aggregation
    )
    started = time.perf_counter()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        _system_config={"worker_niceness": 0},
    )
    ray_start = time.perf_counter() - started
    seconds: dict[str, list[float]] = {f"{b} {w}": [] for b, w in BACKENDS}
    rmse: dict[str, list[float]] = {f"{b} {w}": [] for b, w in BACKENDS}
    try:
        for _ in range(repeats):
            for backend, workers in BACKENDS:
                run = simulate(model_dir, data.examples, replace(options, backend=backend, workers=workers))
                seconds[f"{backend} {workers}"].append(run.seconds)
                rmse[f"{backend} {workers}"].append(run.held_out["rmse"])
                print(
                    f"  {backend} x{workers}: {run.seconds:.1f} s, RMSE {run.held_out['rmse']:.5f}",
                    flush=True,
                )
        trip = round_trip(data, model_dir, options)
    finally:
        ray.shutdown()
    median = {k: statistics.median(v) for k, v in seconds.items()}
    return {
        "rounds": rounds,
        "clients_per_round": CLIENTS,
        "ray_start_seconds": ray_start,
        "round_trip_seconds": trip,
        "seconds": seconds,
        "median_seconds": median,
        "tasks_per_second": {k: rounds * CLIENTS / v for k, v in median.items()},
        "held_out_rmse": rmse,
    }


def commit_seconds(data: Dataset, model_dir: Path, repeats: int = 20) -> float:
    """The server's commit of one round of `CLIENTS` reports (the driver's share of a round)."""
    split = split_users(len(data.examples))
    options = SimulationOptions(Rounds(1, CLIENTS), FAITHFUL.task, FAITHFUL.server, workers=2)
    pool = simulation_clients(model_dir, data.examples, options)
    try:
        initial = TFLiteModel(model_dir).get_global()
        users = np.random.default_rng(0).choice(split.train, CLIENTS, replace=False).tolist()
        pool.set_global(initial)
        reports = pool.map("train", users)
    finally:
        pool.close()
    times = []
    for _ in range(repeats):
        server = Server(initial, FAITHFUL.server, FAITHFUL.aggregation)
        t0 = time.perf_counter()
        server.commit(reports)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def packed_bytes_per_device(data: Dataset) -> float:
    """What a worker receives per device: its examples, pickled (it packs its batches itself)."""
    return len(pickle.dumps(data.examples, protocol=5)) / len(data.examples)


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


def fleet_rates(work: Path, devices: int, rounds: int) -> dict[str, Any]:
    """Client tasks/s of the HTTP fleet in one process and over 2 Ray shards, and the device's own
    task rate on one core on the same model and stores."""
    from bench_fleet import BENCH_PHONE, tasks_per_second
    from rich.console import Console

    from android_sim.builtin_data import export, model_config
    from android_sim.device_data import expression_fleet
    from android_sim.expressions import SyntheticConfig
    from android_sim.run import run_async
    from android_sim.run_config import RunConfig

    data = expression_fleet(SyntheticConfig(num_expressions=1000, num_users=devices, seed=0))
    model_dir = export(model_config(data), work / "model")
    rates: dict[str, float] = {}
    for shards in (1, 2):
        label = f"shards-{shards}"
        (work / label).mkdir(parents=True)
        (work / label / "model").symlink_to(model_dir, target_is_directory=True)
        config = RunConfig(
            work_dir=work / label,
            devices=devices,
            rounds=rounds,
            target_reports=40,
            min_examples=2,
            round_seconds=10.0,
            cooldown_hours=0.25,  # as bench_fleet.py: the devices stay busy
            evaluation_every=0,
            device_mix=BENCH_PHONE,
            held_out_fraction=0.05,
            show_devices=0,
            workers=2,
            shards=shards,
        )
        result = asyncio.run(run_async(config, Console(quiet=True)))
        rates[label] = tasks_per_second(result.summary["rounds"])
        print(f"  fleet, {shards} shard(s): {rates[label]:.1f} client tasks/s", flush=True)
    rates["device_one_core"] = device_task_rate(model_dir, sorted((work / "shards-1" / "devices").iterdir()))
    return rates


def device_task_rate(model_dir: Path, stores: list[Path], count: int = 200) -> float:
    """Tasks/s of the device runtime's training task on one core, over the fleet's own stores."""
    from contracts.manifest import INITIAL_GLOBAL_FILE
    from contracts.params import decode_params
    from contracts.task_config import TaskConfig
    from device_runtime.client_task import run_training_task
    from device_runtime.example_store import ExampleStore

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
            run_training_task(model, store, params, config, seed=i)
            busy += time.perf_counter() - t0
    return len(chosen) / busy


def projection(sim: dict[str, Any], commit: float, bytes_per_device: float) -> dict[str, Any]:
    """10 million devices on a cluster of `workers` Ray workers (a core each): a round costs the
    round trip, the largest worker's share of the clients at one worker's own rate (the 1-worker
    run's, its round trips taken out), and the driver's commit, which takes each round alone.
    Not counted: the driver's cost of one call per worker, which grows with the workers."""
    rounds = sim["rounds"]
    trip = sim["round_trip_seconds"]
    per_worker = rounds * CLIENTS / (sim["median_seconds"]["ray 1"] - rounds * trip)
    rows = []
    for workers in (64, 256, 1024):
        for clients in (1_000, 10_000, 100_000):
            round_seconds = trip + math.ceil(clients / workers) / per_worker + commit * clients / CLIENTS
            rows.append(
                {
                    "workers": workers,
                    "clients_per_round": clients,
                    "round_seconds": round_seconds,
                    "tasks_per_second": clients / round_seconds,
                    "minutes_per_ten_million_tasks": TEN_MILLION / (clients / round_seconds) / 60,
                }
            )
    return {
        "per_worker_tasks_per_second": per_worker,
        "data_gb": TEN_MILLION * bytes_per_device / 1e9,
        "rows": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=500, help="simulation rounds of 100 clients")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each backend, alternating")
    parser.add_argument("--idle-devices", type=int, default=100_000)
    parser.add_argument("--fleet-devices", type=int, default=300, help="the HTTP fleet's devices")
    parser.add_argument("--fleet-rounds", type=int, default=20, help="the HTTP fleet's rounds of 40")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    try:
        ratings = folder_of("movielens-100k") / "u.data"
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not ratings.is_file():
        print(
            "error: MovieLens 100K is missing: python -m android_sim.datasets fetch movielens-100k",
            file=sys.stderr,
        )
        return 2
    load_before = load_average()
    data = load_dataset(ratings)
    model_dir = ModelCache(Path(tempfile.gettempdir()) / "bench-scale-models").get(
        protocol_model(data.num_items)
    )
    print(f"load average before: {load_before} (2 cores)")
    probe = cpu_probe()
    print(f"CPU probe: 2 processes at once got {probe:.2f} cores' worth of work (2.00 on idle cores)")
    print(
        f"fast simulation, MovieLens 100K ({len(data.examples)} devices), {args.rounds} rounds x {CLIENTS}:"
    )
    sim = simulation(data, model_dir, args.rounds, args.repeats)
    commit = commit_seconds(data, model_dir)
    bytes_per_device = packed_bytes_per_device(data)
    idle = idle_memory(args.idle_devices)
    print(f"HTTP fleet, {args.fleet_devices} devices, {args.fleet_rounds} rounds of 40:")
    fleet = fleet_rates(Path(tempfile.mkdtemp(prefix="bench-scale-")), args.fleet_devices, args.fleet_rounds)
    project = projection(sim, commit, bytes_per_device)
    load_after = load_average()
    m, rate = sim["median_seconds"], sim["tasks_per_second"]
    print(f"  Ray started in {sim['ray_start_seconds']:.1f} s (not counted)")
    for key in m:
        print(f"  {key:>10}: {m[key]:7.1f} s  {rate[key]:8.0f} client tasks/s")
    print(f"  2 Ray workers / 1: {m['ray 1'] / m['ray 2']:.2f}x   target >= 1.7x")
    print(f"  2 Ray workers / 2 threads: {m['threads 2'] / m['ray 2']:.2f}x")
    cores = os.cpu_count() or 1
    device_rate = fleet["device_one_core"] * cores
    print(
        f"  device task on one core: {fleet['device_one_core']:.0f} tasks/s; "
        f"x {cores} cores: {device_rate:.0f}"
    )
    for shards in (1, 2):
        rate_f = fleet[f"shards-{shards}"]
        print(
            f"  fleet, {shards} shard(s): {rate_f:.1f} tasks/s = {rate_f / device_rate:.1%} of it"
            "   target >= 50%"
        )
    print(f"server commit of a round of {CLIENTS} reports (in the driver): {commit * 1e3:.1f} ms")
    print(
        f"idle devices: {idle['devices']:,} not in a round: {idle['rss_kb_per_device']:.2f} KB RSS, "
        f"{idle['traced_kb_per_device']:.2f} KB traced each   target <= 20 KB"
    )
    print(
        f"projection, 10 million devices ({project['data_gb']:.0f} GB of examples across the workers, "
        f"{bytes_per_device / 1e3:.1f} KB a device), {project['per_worker_tasks_per_second']:.0f} tasks/s "
        f"a worker, {sim['round_trip_seconds'] * 1e3:.1f} ms a round trip:"
    )
    for row in project["rows"]:
        print(
            f"  {row['workers']:>5} workers, rounds of {row['clients_per_round']:>6,}: "
            f"{row['round_seconds']:6.2f} s a round, {row['tasks_per_second']:8.0f} tasks/s, "
            f"10 million tasks in {row['minutes_per_ten_million_tasks']:.0f} min"
        )
    print(
        "  the HTTP fleet's bound beside it: the orchestrator's 445 reports/s (one process, SQLite; "
        f"docs/benchmarks.md): 10 million tasks in {TEN_MILLION / 445 / 3600:.1f} h"
    )
    print(f"load average after: {load_after}")
    print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
    if args.json:
        results = {
            "cpu_probe": probe,
            "simulation": sim,
            "commit_seconds": commit,
            "idle": idle,
            "fleet": fleet,
            "projection": project,
        }
        args.json.write_text(json.dumps({**results, "load": [load_before, load_after]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
