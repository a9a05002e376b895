"""Speed baseline: the fast simulation against plain single-threaded numpy doing the same maths.

    python -m benchmarks.speed_baseline [--rounds 500] [--clients-per-round 100] [--repeats 3]

MovieLens 100K, the protocol's FedRecon (MF 1,682 x 50, `FAITHFUL`): `--rounds` rounds of
`--clients-per-round` clients, each reconstructing its user vector and updating its items' rows,
the server's weighted mean and SGD step; ReconEval on the validation devices before the first
round and after the last. Both sides take the same packed batches and draw the same clients.
- ours: `android_sim.simulation.simulate` (the exported `.tflite` model's signatures through
  the TFLite interpreter, `--workers` interpreter threads, the orchestrator's aggregation);
- numpy: `benchmarks.numpy_fedrecon` (one thread: BLAS is held to one thread too).
Runs alternate (numpy, ours, numpy, ours, ...) in one process; the medians and their ratio are
printed with the machine's load average before and after, and both sides' validation RMSE
(they train the same model, so they must agree to a few 1e-3).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from android_sim.datasets import DatasetError, cached_file
from android_sim.simulation.protocol import PROTOCOL_SEED, pack_support_query, split_users
from android_sim.simulation.rounds import Rounds
from android_sim.simulation.simulate import SimulationOptions, simulate
from benchmarks import numpy_fedrecon
from benchmarks.model_cache import ModelCache
from benchmarks.quality_methods import FAITHFUL, load_dataset, protocol_model
from model_runtime.tflite_model import TFLiteModel

# One BLAS thread for numpy: the baseline is single-threaded.
BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def one_blas_thread() -> None:
    """Run this command again with one BLAS thread unless it has one: numpy reads the setting only
    when it loads, before any of this module runs."""
    unset = [name for name in BLAS_THREADS if name not in os.environ]
    if unset:
        command = [sys.executable, "-m", "benchmarks.speed_baseline", *sys.argv[1:]]
        os.execve(sys.executable, command, {**os.environ, **dict.fromkeys(unset, "1")})


def load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.speed_baseline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--clients-per-round", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side, alternating")
    parser.add_argument("--workers", type=int, default=2, help="our interpreter threads")
    parser.add_argument("--json", type=Path, help="write the timings here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.clients_per_round < 1 or args.repeats < 1 or args.workers < 1:
        print("error: --rounds, --clients-per-round, --repeats and --workers must be >= 1", file=sys.stderr)
        return 2
    try:
        ratings = cached_file("movielens-100k")
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    data = load_dataset(ratings)
    model_dir = ModelCache(Path(tempfile.gettempdir()) / "bench-scale-models").get(
        protocol_model(data.num_items)
    )
    rounds = Rounds(args.rounds, args.clients_per_round, evaluate_every=args.rounds)
    options = SimulationOptions(rounds, FAITHFUL.task, FAITHFUL.server, workers=args.workers)
    model = TFLiteModel(model_dir)
    clients = pack_support_query(data.examples, model.manifest, FAITHFUL.task)
    split = split_users(len(data.examples), PROTOCOL_SEED)
    items = model.get_global()["item_embeddings"]
    load_before = load_average()
    print(
        f"MovieLens 100K ({len(data.examples)} devices), FedRecon MF {items.shape[0]} x {items.shape[1]}, "
        f"{args.rounds} rounds x {args.clients_per_round} clients; load average before {load_before} "
        f"({os.cpu_count()} cores)",
        flush=True,
    )
    seconds: dict[str, list[float]] = {"numpy": [], "ours": []}
    rmse: dict[str, list[float]] = {"numpy": [], "ours": []}
    for _ in range(args.repeats):
        baseline = numpy_fedrecon.train(
            items,
            clients,
            split.train,
            split.validation,
            FAITHFUL.task,
            args.rounds,
            args.clients_per_round,
            rounds.sampling_seed,
            FAITHFUL.server.learning_rate,
        )
        seconds["numpy"].append(baseline.seconds)
        rmse["numpy"].append(baseline.rmse)
        print(f"  numpy, 1 thread: {baseline.seconds:.1f} s, validation RMSE {baseline.rmse:.4f}", flush=True)
        run = simulate(model_dir, data.examples, replace(options))
        seconds["ours"].append(run.seconds)
        rmse["ours"].append(run.curve[-1]["rmse"])
        print(
            f"  ours, {args.workers} threads: {run.seconds:.1f} s, validation RMSE {rmse['ours'][-1]:.4f}",
            flush=True,
        )
    median = {k: statistics.median(v) for k, v in seconds.items()}
    ratio = median["ours"] / median["numpy"]
    load_after = load_average()
    print(
        f"median: numpy {median['numpy']:.1f} s, ours {median['ours']:.1f} s: ours / numpy = {ratio:.2f} "
        f"(target <= 1.00); load average after {load_after}"
    )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "rounds": args.rounds,
                    "clients_per_round": args.clients_per_round,
                    "workers": args.workers,
                    "seconds": seconds,
                    "median_seconds": median,
                    "ours_over_numpy": ratio,
                    "validation_rmse": rmse,
                    "load_average": {"before": load_before, "after": load_after},
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    one_blas_thread()
    raise SystemExit(main())
