"""benchmarks.scale's fast simulation: the threads and Ray backends on MovieLens 100K, alternating,
with the cores each run got; the Ray round trip and the server's commit, for the projection."""

from __future__ import annotations

import pickle
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from android_sim.simulation.protocol import split_users
from android_sim.simulation.rounds import Rounds, Server, summed
from android_sim.simulation.simulate import SimulationOptions, simulate, simulation_clients
from benchmarks.quality_methods import FAITHFUL, Dataset
from benchmarks.scale_cores import CpuMeter
from model_runtime.tflite_model import TFLiteModel

CLIENTS = 100
BACKENDS: tuple[tuple[Literal["threads", "ray"], int], ...] = (("threads", 2), ("ray", 1), ("ray", 2))


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


def commit_seconds(data: Dataset, model_dir: Path, repeats: int = 20) -> dict[str, float]:
    """The server's commit (the driver's share of a round), the two ways it is handed a round:
    `CLIENTS` reports one by one (`reports`: clipping, robust means and DP need each), and
    the workers' partial sums (the plain weighted mean on Ray): a base (`partials_base`: the
    optimizer and the mean) plus `per_partial` for each worker's partial."""
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
    shapes = {k: tuple(v.shape) for k, v in initial.items()}
    part = summed(reports, shapes)[0]
    assert part is not None

    def median_commit(commit: Callable[[Server], object]) -> float:
        times = []
        for _ in range(repeats):
            server = Server(initial, FAITHFUL.server, FAITHFUL.aggregation)
            t0 = time.perf_counter()
            commit(server)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    one = median_commit(lambda server: server.commit_partials([part], 0))
    eight = median_commit(lambda server: server.commit_partials([part] * 8, 0))
    per_partial = max(0.0, (eight - one) / 7)
    return {
        "reports": median_commit(lambda server: server.commit(reports)),
        "partials_base": max(0.0, one - per_partial),
        "per_partial": per_partial,
        "partial_bytes": float(part.nbytes),
    }


def packed_bytes_per_device(data: Dataset) -> float:
    """What a worker receives per device: its examples, pickled (it packs its batches itself)."""
    return len(pickle.dumps(data.examples, protocol=5)) / len(data.examples)


def print_simulation(sim: dict[str, Any], commit: dict[str, float]) -> None:
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
    print(
        f"server commit of a round of {CLIENTS} reports (in the driver): "
        f"one by one {commit['reports'] * 1e3:.1f} ms; "
        f"as the workers' partial sums {commit['partials_base'] * 1e3:.1f} ms + "
        f"{commit['per_partial'] * 1e3:.2f} ms a worker"
    )
