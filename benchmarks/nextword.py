"""`python -m benchmarks.nextword`: the FedRecon paper's Table 2, next-word prediction on
Shakespeare with the OOV rows global or local (docs/benchmarks.md).

FedAvg with a shared OOV bucket against FedRecon with local OOV buckets, through the exported
next-word model's TFLite signatures and the orchestrator's aggregation; prints held-out roles'
accuracy without and with OOV and the bytes a device moves per round."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from android_sim.movielens import DataFormatError
from android_sim.next_word import SERVER as NEXTWORD_SERVER
from contracts.command_line import CommandParser


def _parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="python -m benchmarks.nextword",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--models-dir", type=Path, default=Path("runs/models"), help="exported models, reused"
    )
    parser.add_argument("--vocab-sizes", default="1000,5000", help="comma-separated vocabulary sizes")
    parser.add_argument("--many-buckets", type=int, default=100, help="local OOV buckets of the last methods")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--clients-per-round", type=int, default=10)
    parser.add_argument("--no-fine-tuning", action="store_true", help="leave out FedRecon + fine-tuning")
    parser.add_argument("--learning-rate", type=float, default=0.3, help="client update (and FedAvg's) rate")
    parser.add_argument("--reconstruction-learning-rate", type=float, default=0.5)
    parser.add_argument(
        "--update-epochs", type=int, default=1, help="client passes over its windows per task (FedAvg's too)"
    )
    parser.add_argument(
        "--reconstruction-epochs",
        type=int,
        default=2,
        help="passes over the support to fit the locals",
    )
    parser.add_argument(
        "--embedding-dim", type=int, help="embedding and projection width (default: the builder's, 32)"
    )
    parser.add_argument("--lstm-units", type=int, help="LSTM width (default: the builder's, 64)")
    parser.add_argument("--batch-size", type=int, help="windows per batch (default: 8)")
    parser.add_argument(
        "--max-batches", type=int, help="batches per task, support and query each (default: 8)"
    )
    parser.add_argument("--sampling-seed", type=int, default=0, help="which clients each round samples")
    parser.add_argument(
        "--server-optimizer", default=NEXTWORD_SERVER.name, help="sgd, adam, yogi, ... (orchestrator's)"
    )
    parser.add_argument("--server-learning-rate", type=float, default=NEXTWORD_SERVER.learning_rate)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="interpreter threads")
    parser.add_argument(
        "--no-ceiling", action="store_true", help="leave out the centrally trained network (the ceiling)"
    )
    parser.add_argument(
        "--central-epochs", type=int, default=12, help="the ceiling: passes over the training roles' windows"
    )
    parser.add_argument("--central-learning-rate", type=float, default=1.0, help="the ceiling's SGD rate")
    parser.add_argument(
        "--out", type=Path, help="write the rows as JSON here (each figure with its 95%% interval)"
    )
    return parser


def _nextword(args: argparse.Namespace) -> int:
    from android_sim.next_word import MAX_BATCHES
    from android_sim.simulation.rounds import Rounds
    from benchmarks.nextword_study import ModelShape, rows_json, run, table, task_config
    from orchestrator.aggregation.server_optimizer import ServerOptimizerConfig

    vocab_sizes = [int(v) for v in args.vocab_sizes.split(",") if v.strip()]
    rounds = Rounds(
        args.rounds, args.clients_per_round, evaluate_every=args.rounds, sampling_seed=args.sampling_seed
    )
    shape = ModelShape(args.embedding_dim, args.lstm_units, args.batch_size, args.max_batches)
    print(
        f"next-word prediction, Shakespeare roles as devices: {rounds.rounds} rounds of "
        f"{rounds.clients_per_round} clients; held-out roles: reconstruct on the older half, score the newer"
    )
    task = task_config(
        args.learning_rate,
        args.reconstruction_learning_rate,
        args.update_epochs,
        args.reconstruction_epochs,
        args.max_batches or MAX_BATCHES,
    )
    server = ServerOptimizerConfig(args.server_optimizer, args.server_learning_rate)
    print(
        f"client learning rates: update {task.update_learning_rate}, reconstruction "
        f"{task.reconstruction_learning_rate}; epochs: update {task.update_max_epochs}, reconstruction "
        f"{task.reconstruction_max_epochs}; server: {server.name} {server.learning_rate}; model: "
        + (", ".join(f"{k} {v}" for k, v in shape.builder_args().items()) or "default sizes")
    )
    rows = run(
        args.models_dir,
        vocab_sizes,
        args.many_buckets,
        rounds,
        args.workers,
        not args.no_fine_tuning,
        task,
        server,
        shape=shape,
        ceiling=not args.no_ceiling,
        central_epochs=args.central_epochs,
        central_learning_rate=args.central_learning_rate,
    )
    print(table(rows))
    if args.out is not None:
        import json

        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows_json(rows), indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        return _nextword(args)
    except (DataFormatError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
