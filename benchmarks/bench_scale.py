"""Scale-out benchmark: the fast simulation on Ray, the HTTP fleet's rate, idle devices' memory,
a projection to 10 million.

    ./dev bench-scale        (or: python benchmarks/bench_scale.py [--rounds N] [--repeats N])
    ./dev bench-scale --only-population --population 100000      (the large HTTP run alone; long)
    ./dev bench-scale --only-fleet --fleet-runs 2x40               (one HTTP fleet run alone)

Prints:
1. The fast simulation (`simulate`), MovieLens 100K, the protocol's FedRecon (1,682 x 50),
   `--rounds` rounds of 100 clients: today's threads backend (2 threads), and the Ray
   backend with 1 and 2 local worker processes, alternating in one session (medians over
   `--repeats`). The rounds' wall time (validation included, Ray's start excluded), client tasks
   per second, and 2 Ray workers over 1 (target >= 1.7x) and over the threads. Beside each, the
   cores it actually got (driver and workers' CPU seconds over the wall time) and its tasks per
   worker CPU second: the cores are shared with other jobs, so the CPU a run got says whether
   it scaled. A CPU probe too: the same pure-Python loop in 1 and then 2 processes at once.
   The Ray round trip (a round of one client per worker) is measured too, for the projection.
   The held-out RMSE of every run is printed: the backends train the same model.
2. The server's commit alone (the orchestrator's weighted mean and optimizer over a round's 100
   reports), which stays in the driver: what bounds a round however many workers there are.
3. The HTTP fleet (`run`, the benchmark phones of bench_fleet.py: always eligible, no delays),
   each run against an orchestrator of its own: in one process, over 2 Ray actors
   (`--shards 2`), and over 2 actors with rounds of 200: client tasks/s against the device's own
   task rate on the same model, one core, times the cores (target >= 50%); where the time goes:
   the orchestrator's and the fleet's CPU per report, the server's own time per check-in against
   the devices' wait for it, how late the fleet's event loops wake.
4. Memory per idle device in the HTTP fleet: a fleet of `--idle-devices` devices that are not
   in a round (RSS and traced Python memory per device; target <= 20 KB).
5. A projection for 10 million devices on a Ray cluster, from the measured per-worker rate, with
   the orchestrator's measured CPU per report beside it.
6. With `--population N`: an HTTP fleet of N enrolled devices (the default device mix) over
   2 shards, rounds of `--population-round`, `--population-rounds` rounds: wall time, the
   fleet's memory per device, check-in p50/p99.
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
import threading
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


class CpuMeter:
    """CPU seconds and wall time of this process and of the processes whose command line names
    `worker` (Ray sets an actor's to `ray::ClassName`), sampled every 0.2 s: what share of the
    cores a configuration actually got, on a machine shared with other jobs. A worker's CPU is
    counted from when it is first seen as that actor (its process start is not)."""

    def __init__(self, worker: str = "") -> None:
        self.worker = worker
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self.rss_kb: dict[int, float] = {}  # each worker's resident memory when last seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while not self._stop.wait(0.2):
            for pid in _pids(self.worker) if self.worker else []:
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue  # gone meanwhile
                cpu = (int(fields[11]) + int(fields[12])) / tick
                self._first.setdefault(pid, cpu)
                self._last[pid] = cpu
                self.rss_kb[pid] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE") / 1024

    def __enter__(self) -> CpuMeter:
        self._wall, self._own = time.perf_counter(), time.process_time()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.wall = time.perf_counter() - self._wall
        self.own = time.process_time() - self._own
        self.workers = sum(self._last[p] - self._first[p] for p in self._last)

    def figures(self) -> dict[str, float]:
        return {
            "wall_seconds": self.wall,
            "driver_cpu_seconds": self.own,
            "worker_cpu_seconds": self.workers,
            "cores_used": (self.own + self.workers) / self.wall,
        }


def _pids(name: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if name.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


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
    cpu: dict[str, list[dict[str, float]]] = {f"{b} {w}": [] for b, w in BACKENDS}
    try:
        for _ in range(repeats):
            for backend, workers in BACKENDS:
                with CpuMeter("ray::ShardWorker") as meter:
                    run = simulate(
                        model_dir, data.examples, replace(options, backend=backend, workers=workers)
                    )
                key = f"{backend} {workers}"
                seconds[key].append(run.seconds)
                rmse[key].append(run.held_out["rmse"])
                cpu[key].append(meter.figures())
                print(
                    f"  {backend} x{workers}: {run.seconds:.1f} s, RMSE {run.held_out['rmse']:.5f}, "
                    f"{meter.figures()['cores_used']:.2f} cores used",
                    flush=True,
                )
        trip = round_trip(data, model_dir, options)
    finally:
        ray.shutdown()
    median = {k: statistics.median(v) for k, v in seconds.items()}
    cpu_median = {k: {f: statistics.median(r[f] for r in runs) for f in runs[0]} for k, runs in cpu.items()}
    return {
        "cpu": cpu_median,
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
    from bench_fleet import bench_config, tasks_per_second

    from android_sim.builtin_data import export, model_config
    from android_sim.device_data import expression_fleet
    from android_sim.expressions import SyntheticConfig

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
        server_cpu = _process_cpu(server.process.pid)
        with CpuMeter("ray::FleetShard") as meter:
            result = asyncio.run(run_async(config, Console(quiet=True)))
        server_cpu = _process_cpu(server.process.pid) - server_cpu
        latency = _server_latency(server.url, server.admin_token)
    rounds = [r for r in result.summary["rounds"] if r["kind"] == "training" and r["status"] == "committed"]
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
        "shards_rss_kb": sum(meter.rss_kb.values()),
        "fleet_loop_lag_p50_ms": fleet["event_loop_lag_p50_ms"],
        "fleet_loop_lag_p99_ms": fleet["event_loop_lag_p99_ms"],
    }


def population_run(work: Path, devices: int, target: int, rounds: int) -> dict[str, Any]:
    """A population of `devices` enrolled phones of the default mix (eligible at night, 2 simulated
    hours' rest after taking part) over 2 Ray shards, rounds of `target`: the run's wall time, the
    fleet's memory per device (the shards' whole RSS: imports, interpreters and the devices in a
    round included), and how long check-ins took."""
    from bench_fleet import bench_config, tasks_per_second

    from android_sim.run_config import RunConfig

    config = bench_config(
        work,
        devices,
        rounds,
        target_reports=target,
        round_seconds=60.0,
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


def _process_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


def projection(
    sim: dict[str, Any], commit: float, bytes_per_device: float, fleet: dict[str, Any]
) -> dict[str, Any]:
    """10 million devices on a cluster of `workers` Ray workers (a core each): a round costs the
    round trip, the largest worker's share of the clients at one worker's rate on a core of its
    own (the 1-worker run's tasks over its worker's CPU seconds), and the driver's commit, which
    takes each round alone. Not counted: the driver's cost of one call per worker, which grows
    with the workers. Beside it, the HTTP orchestrator's bound: a core's worth of its CPU per
    report (measured in the fleet runs, check-ins and downloads included)."""
    rounds = sim["rounds"]
    trip = sim["round_trip_seconds"]
    per_worker = rounds * CLIENTS / sim["cpu"]["ray 1"]["worker_cpu_seconds"]
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
    cheapest = min(r["orchestrator_cpu_ms_per_report"] for r in fleet["runs"].values())
    return {
        "per_worker_tasks_per_second": per_worker,
        "data_gb": TEN_MILLION * bytes_per_device / 1e9,
        "rows": rows,
        "orchestrator_reports_per_core_second": 1e3 / cheapest,
        "orchestrator_core_hours_per_ten_million": TEN_MILLION * cheapest / 1e3 / 3600,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=500, help="simulation rounds of 100 clients")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each backend, alternating")
    parser.add_argument("--idle-devices", type=int, default=100_000)
    parser.add_argument(
        "--fleet-devices-per-report",
        type=float,
        default=None,
        help="the HTTP fleet's devices per report a round (default 7.5: 300 devices for rounds of 40)",
    )
    parser.add_argument("--fleet-rounds", type=int, default=20, help="the HTTP fleet's rounds")
    parser.add_argument(
        "--fleet-runs",
        type=fleet_runs,
        default=FLEET_RUNS,
        help="which HTTP fleet runs, SHARDSxREPORTS comma-separated (default 1x40,2x40,2x200)",
    )
    parser.add_argument(
        "--population",
        type=int,
        default=0,
        help="also run an HTTP fleet of this many enrolled devices over 2 shards (e.g. 100000; long)",
    )
    parser.add_argument("--population-round", type=int, default=1_000, help="its rounds' reports")
    parser.add_argument("--population-rounds", type=int, default=10, help="its committed rounds")
    parser.add_argument("--only-population", action="store_true", help="run only the population")
    parser.add_argument(
        "--only-fleet", action="store_true", help="run only the HTTP fleet (part 3; no data set needed)"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.only_population:
        if not args.population:
            print("error: --only-population needs --population N", file=sys.stderr)
            return 2
        return print_population(args, load_average())
    if args.only_fleet:
        return only_fleet(args)
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
    print(f"HTTP fleet, {args.fleet_rounds} rounds a run:")
    fleet = fleet_rates(
        Path(tempfile.mkdtemp(prefix="bench-scale-")),
        args.fleet_devices_per_report,
        args.fleet_rounds,
        args.fleet_runs,
    )
    project = projection(sim, commit, bytes_per_device, fleet)
    load_after = load_average()
    print_simulation(sim, commit)
    print_fleet(fleet)
    print(
        f"idle devices: {idle['devices']:,} not in a round: {idle['rss_kb_per_device']:.2f} KB RSS, "
        f"{idle['traced_kb_per_device']:.2f} KB traced each   target <= 20 KB"
    )
    print_projection(project, sim, bytes_per_device)
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
    return print_population(args, load_after) if args.population else 0


def only_fleet(args: argparse.Namespace) -> int:
    """Part 3 alone: the HTTP fleet's runs, with the load before and after."""
    load_before = load_average()
    print(f"load average before: {load_before} (2 cores)")
    print(f"HTTP fleet, {args.fleet_rounds} rounds a run:")
    fleet = fleet_rates(
        Path(tempfile.mkdtemp(prefix="bench-scale-")),
        args.fleet_devices_per_report,
        args.fleet_rounds,
        args.fleet_runs,
    )
    load_after = load_average()
    print_fleet(fleet)
    print(f"load average after: {load_after}")
    if args.json:
        args.json.write_text(json.dumps({"fleet": fleet, "load": [load_before, load_after]}, indent=2))
    return 0


def print_simulation(sim: dict[str, Any], commit: float) -> None:
    m, rate, cpu = sim["median_seconds"], sim["tasks_per_second"], sim["cpu"]
    tasks = sim["rounds"] * CLIENTS
    print(f"  Ray started in {sim['ray_start_seconds']:.1f} s (not counted)")
    for key in m:
        worker_cpu = cpu[key]["worker_cpu_seconds"] or cpu[key]["driver_cpu_seconds"]
        print(
            f"  {key:>10}: {m[key]:7.1f} s  {rate[key]:8.0f} client tasks/s; cores used "
            f"{cpu[key]['cores_used']:.2f} (driver {cpu[key]['driver_cpu_seconds']:.1f} s CPU, "
            f"workers {cpu[key]['worker_cpu_seconds']:.1f} s); {tasks / worker_cpu:.0f} tasks per "
            f"{'worker' if cpu[key]['worker_cpu_seconds'] else 'process'} CPU second"
        )
    print(f"  2 Ray workers / 1: {m['ray 1'] / m['ray 2']:.2f}x   target >= 1.7x")
    print(
        f"  the cores they got: 2 workers {cpu['ray 2']['cores_used']:.2f} / 1 worker "
        f"{cpu['ray 1']['cores_used']:.2f} = {cpu['ray 2']['cores_used'] / cpu['ray 1']['cores_used']:.2f}x"
    )
    print(f"  2 Ray workers / 2 threads: {m['threads 2'] / m['ray 2']:.2f}x")
    print(f"  Ray round trip per round, beyond the tasks: {sim['round_trip_seconds'] * 1e3:.1f} ms")
    print(f"server commit of a round of {CLIENTS} reports (in the driver): {commit * 1e3:.1f} ms")


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


def print_projection(project: dict[str, Any], sim: dict[str, Any], bytes_per_device: float) -> None:
    print(
        f"projection, 10 million devices ({project['data_gb']:.0f} GB of examples across the workers, "
        f"{bytes_per_device / 1e3:.1f} KB a device), {project['per_worker_tasks_per_second']:.0f} tasks/s "
        f"a worker on a core of its own, {sim['round_trip_seconds'] * 1e3:.1f} ms a round trip:"
    )
    for row in project["rows"]:
        print(
            f"  {row['workers']:>5} workers, rounds of {row['clients_per_round']:>6,}: "
            f"{row['round_seconds']:6.2f} s a round, {row['tasks_per_second']:8.0f} tasks/s, "
            f"10 million tasks in {row['minutes_per_ten_million_tasks']:.0f} min"
        )
    print(
        f"  the HTTP orchestrator beside it (measured above, one process, SQLite): "
        f"{project['orchestrator_reports_per_core_second']:.0f} reports per core-second: 10 million "
        f"tasks take {project['orchestrator_core_hours_per_ten_million']:.1f} orchestrator core-hours"
    )


def print_population(args: argparse.Namespace, load: str) -> int:
    print(
        f"HTTP population: {args.population:,} devices over 2 shards, rounds of {args.population_round:,}, "
        f"{args.population_rounds} rounds (load average {load}):",
        flush=True,
    )
    work = Path(tempfile.mkdtemp(prefix="bench-scale-population-"))
    run = population_run(work, args.population, args.population_round, args.population_rounds)
    print(
        f"  {run['total_seconds']:.0f} s in all, {run['wall_seconds']:.0f} s of it the run (stores written, "
        f"devices enrolled, rounds); {run['tasks_per_second']:.0f} client tasks/s in the rounds, "
        f"a round {run['round_seconds_median']:.1f} s"
    )
    print(
        f"  fleet memory: {run['rss_kb_per_device']:.1f} KB RSS per device (the 2 shards' whole RSS, "
        f"{run['shards_rss_kb'] / 1024:.0f} MB)   target <= 20 KB"
    )
    print(
        f"  check-in: devices' p50 {run['device_checkin_p50_ms']:.0f} ms, "
        f"p99 {run['device_checkin_p99_ms']:.0f} ms; "
        f"server's mean {run['server_checkin_mean_ms']:.0f} ms; orchestrator cores used "
        f"{run['orchestrator_cores_used']:.2f}; the fleet's event loops late by "
        f"{run['fleet_loop_lag_p50_ms']:.1f} ms p50, {run['fleet_loop_lag_p99_ms']:.0f} ms p99"
    )
    print(f"load average after: {load_average()}")
    if args.json:
        path = args.json.with_name(args.json.stem + "-population.json")
        path.write_text(json.dumps(run, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
