"""Scale-out benchmark: the fast simulation on Ray, the HTTP fleet's rate, idle devices' memory,
a projection to 10 million.

    ./dev bench-scale        (or: python -m benchmarks.scale [--rounds N] [--repeats N])
    ./dev bench-scale --only-population --population 100000      (the large HTTP run alone; long)
    ./dev bench-scale --only-fleet --fleet-runs 2x40               (one HTTP fleet run alone)
    ./dev bench-scale --only-simulation --repeats 3                (the fast simulation alone)

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
3. The HTTP fleet (`run`, the benchmark phones of benchmarks.fleet: always eligible, no delays),
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
import json
import resource
import sys
import tempfile
from pathlib import Path

from android_sim.datasets import DatasetError, cached_file
from android_sim.run_config import RunError
from benchmarks.model_cache import ModelCache
from benchmarks.quality_methods import load_dataset, protocol_model
from benchmarks.scale_cores import cpu_probe, load_average
from benchmarks.scale_fleet import (
    FLEET_RUNS,
    fleet_rates,
    fleet_runs,
    idle_memory,
    population_run,
    print_fleet,
)
from benchmarks.scale_projection import print_projection, projection
from benchmarks.scale_simulation import (
    CLIENTS,
    commit_seconds,
    packed_bytes_per_device,
    print_simulation,
    simulation,
)


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.scale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    parser.add_argument("--population-round-seconds", type=float, default=300.0, help="its rounds' deadline")
    parser.add_argument("--only-population", action="store_true", help="run only the population")
    parser.add_argument(
        "--only-fleet", action="store_true", help="run only the HTTP fleet (part 3; no data set needed)"
    )
    parser.add_argument(
        "--only-simulation", action="store_true", help="run only the fast simulation (parts 1 and 2)"
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
        ratings = cached_file("movielens-100k")
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
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
    if args.only_simulation:
        print_simulation(sim, commit)
        print(f"load average after: {load_average()}")
        if args.json:
            args.json.write_text(
                json.dumps({"cpu_probe": probe, "simulation": sim, "commit_seconds": commit}, indent=2)
            )
        return 0
    bytes_per_device = packed_bytes_per_device(data)
    idle = idle_memory(args.idle_devices)
    print(f"HTTP fleet, {args.fleet_rounds} rounds a run:")
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as scratch:
        fleet = fleet_rates(Path(scratch), args.fleet_devices_per_report, args.fleet_rounds, args.fleet_runs)
    project = projection(sim, commit, bytes_per_device, fleet)
    load_after = load_average()
    print_simulation(sim, commit)
    print_fleet(fleet)
    print(
        f"idle devices: {idle['devices']:,} not in a round: {idle['rss_kb_per_device']:.2f} KB RSS, "
        f"{idle['traced_kb_per_device']:.2f} KB traced each   target <= 20 KB"
    )
    print_projection(project, sim, commit, bytes_per_device)
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
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as scratch:
        fleet = fleet_rates(Path(scratch), args.fleet_devices_per_report, args.fleet_rounds, args.fleet_runs)
    load_after = load_average()
    print_fleet(fleet)
    print(f"load average after: {load_after}")
    if args.json:
        args.json.write_text(json.dumps({"fleet": fleet, "load": [load_before, load_after]}, indent=2))
    return 0


def print_population(args: argparse.Namespace, load: str) -> int:
    print(
        f"HTTP population: {args.population:,} devices over 2 shards, rounds of {args.population_round:,}, "
        f"{args.population_rounds} rounds (load average {load}):",
        flush=True,
    )
    # Its 100,000 stores take gigabytes: deleted once the run is measured.
    with tempfile.TemporaryDirectory(prefix="bench-scale-population-") as work:
        try:
            run = population_run(
                Path(work),
                args.population,
                args.population_round,
                args.population_rounds,
                args.population_round_seconds,
            )
        except RunError as e:  # e.g. no round committed: the run's own one-line reason
            print(f"error: the population run stopped: {e} (load average {load_average()})", file=sys.stderr)
            return 1
    print(
        f"  {run['total_seconds']:.0f} s in all (data, model export, stores written, devices enrolled, "
        f"rounds), {run['rounds_seconds']:.0f} s of it the rounds: {run['rounds_committed']} committed, "
        f"{run['rounds_abandoned']} abandoned; {run['tasks_per_second']:.1f} client tasks/s in the rounds, "
        f"a round {run['round_seconds_median']:.1f} s"
    )
    idle = run["idle"] = idle_memory(args.population)
    print(
        f"  fleet memory: {run['rss_kb_per_device']:.1f} KB RSS per device (the 2 shards' whole RSS, "
        f"{run['shards_rss_kb'] / 1024:.0f} MB); {args.population:,} devices not in a round: "
        f"{idle['rss_kb_per_device']:.2f} KB RSS, {idle['traced_kb_per_device']:.2f} KB traced each   "
        "target <= 20 KB"
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
