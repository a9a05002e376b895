"""`python -m android_sim.bench quality|nextword|mixing`: the quality, next-word and mixing
benchmarks (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from android_sim.movielens import DataFormatError
from android_sim.run_config import DEFAULT_RATINGS
from contracts.command_line import CommandParser


def _parser() -> argparse.ArgumentParser:
    from android_sim.bench.federated import Rounds
    from android_sim.bench.mixing import (
        CENTRAL_LEARNING_RATE,
        CENTRAL_STEPS,
        EXAMPLES_PER_ASSIGNMENT,
        GRADIENT_WEIGHTS,
        PARALLEL_WEIGHTS,
        STRATEGIES,
    )
    from android_sim.bench.quality import (
        DP_CLIP_NORM,
        DP_NOISE_MULTIPLIERS,
        METHODS,
        SECURE_BITS,
        SPLIT_SEEDS,
    )
    from android_sim.bench.staleness import StalenessOptions
    from android_sim.next_word import SERVER as NEXTWORD_SERVER

    d = Rounds()
    parser = CommandParser(prog="python -m android_sim.bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    quality = sub.add_parser(
        "quality",
        help="FedRecon and the paper's baselines on MovieLens through the exported TFLite model",
        description="Train and evaluate every method with the exported model's signatures doing the "
        "device maths and the orchestrator's aggregation; print the test figures and write "
        "quality.json and learning_curves.png to --out.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    quality.add_argument(
        "--ratings", type=Path, default=DEFAULT_RATINGS, help="MovieLens u.data or ratings.dat (.gz ok)"
    )
    quality.add_argument("--out", type=Path, help="output directory (default: runs/quality-<time>)")
    quality.add_argument(
        "--models-dir", type=Path, default=Path("runs/models"), help="exported models, reused"
    )
    quality.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated subset of: {', '.join(METHODS)}"
    )
    quality.add_argument("--rounds", type=int, default=d.rounds)
    quality.add_argument("--clients-per-round", type=int, default=d.clients_per_round)
    quality.add_argument("--evaluate-every", type=int, default=d.evaluate_every, help="validation cadence")
    quality.add_argument("--sampling-seed", type=int, default=d.sampling_seed, help="client sampling")
    quality.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="interpreter threads")
    quality.add_argument(
        "--split-seeds", default=",".join(map(str, SPLIT_SEEDS)), help="user-split seeds for better_seeds"
    )
    quality.add_argument("--centralized-epochs", type=int, default=30)
    quality.add_argument("--better-settings", type=Path, help="JSON file: FedRecon settings for 'better'")
    quality.add_argument(
        "--staleness-participations",
        type=int,
        default=StalenessOptions().participations,
        help="staleness: client tasks per run (the same at 100, 20 and 5 clients per round)",
    )
    quality.add_argument(
        "--staleness-scale-server-rate",
        action="store_true",
        help="staleness: scale the server learning rate by clients-per-round / 100",
    )
    quality.add_argument(
        "--dp-clip-norm", type=float, default=DP_CLIP_NORM, help="dp_fedrecon, secure_fedrecon clip norm"
    )
    quality.add_argument(
        "--dp-noise-multipliers",
        default=",".join(map(str, DP_NOISE_MULTIPLIERS)),
        help="dp_fedrecon's noise multipliers (0: clipping only)",
    )
    quality.add_argument(
        "--secure-bits", type=int, default=SECURE_BITS, help="secure_fedrecon's modulus 2^bits"
    )
    nextword = sub.add_parser(
        "nextword",
        help="the FedRecon paper's Table 2: next-word prediction on Shakespeare, OOV rows global or local",
        description="FedAvg with a shared OOV bucket against FedRecon with local OOV buckets, through "
        "the exported next-word model's TFLite signatures and the orchestrator's aggregation; prints "
        "held-out roles' accuracy without and with OOV and the bytes a device moves per round.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    nextword.add_argument(
        "--models-dir", type=Path, default=Path("runs/models"), help="exported models, reused"
    )
    nextword.add_argument("--vocab-sizes", default="1000,5000", help="comma-separated vocabulary sizes")
    nextword.add_argument(
        "--many-buckets", type=int, default=100, help="local OOV buckets of the last methods"
    )
    nextword.add_argument("--rounds", type=int, default=40)
    nextword.add_argument("--clients-per-round", type=int, default=10)
    nextword.add_argument("--no-fine-tuning", action="store_true", help="leave out FedRecon + fine-tuning")
    nextword.add_argument(
        "--learning-rate", type=float, default=0.3, help="client update (and FedAvg's) rate"
    )
    nextword.add_argument("--reconstruction-learning-rate", type=float, default=0.5)
    nextword.add_argument(
        "--update-epochs", type=int, default=1, help="client passes over its windows per task (FedAvg's too)"
    )
    nextword.add_argument(
        "--reconstruction-epochs",
        type=int,
        default=2,
        help="passes over the support to fit the locals",
    )
    nextword.add_argument(
        "--embedding-dim", type=int, help="embedding and projection width (default: the builder's, 32)"
    )
    nextword.add_argument("--lstm-units", type=int, help="LSTM width (default: the builder's, 64)")
    nextword.add_argument("--batch-size", type=int, help="windows per batch (default: 8)")
    nextword.add_argument(
        "--max-batches", type=int, help="batches per task, support and query each (default: 8)"
    )
    nextword.add_argument("--sampling-seed", type=int, default=0, help="which clients each round samples")
    nextword.add_argument(
        "--server-optimizer", default=NEXTWORD_SERVER.name, help="sgd, adam, yogi, ... (orchestrator's)"
    )
    nextword.add_argument("--server-learning-rate", type=float, default=NEXTWORD_SERVER.learning_rate)
    nextword.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="interpreter threads")
    nextword.add_argument(
        "--no-ceiling", action="store_true", help="leave out the centrally trained network (the ceiling)"
    )
    nextword.add_argument(
        "--central-epochs", type=int, default=12, help="the ceiling: passes over the training roles' windows"
    )
    nextword.add_argument("--central-learning-rate", type=float, default=1.0, help="the ceiling's SGD rate")
    nextword.add_argument(
        "--out", type=Path, help="write the rows as JSON here (each figure with its 95%% interval)"
    )
    mixing = sub.add_parser(
        "mixing",
        help="mixing centralized data (Augenstein et al.): the skewed setup, new items no device holds",
        description="Federated training without mixing, on all data (the upper bound) and with each "
        "mixing strategy on synthetic expressions and MovieLens with held-back items; prints hit "
        "rate@10 / NDCG@10 on the new items, overall hit rate@10 and the bytes mixing adds per assignment.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    mixing.add_argument("--data", default="expressions,movielens", help="expressions, movielens or both")
    mixing.add_argument("--ratings", type=Path, default=DEFAULT_RATINGS, help="MovieLens u.data")
    mixing.add_argument(
        "--models-dir", type=Path, default=Path("runs/models"), help="exported models, reused"
    )
    mixing.add_argument("--expressions", type=int, default=1000, help="synthetic catalog size")
    mixing.add_argument("--users", type=int, default=2000, help="synthetic users")
    mixing.add_argument("--rounds", type=int, default=150)
    mixing.add_argument("--clients-per-round", type=int, default=40)
    mixing.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help="which rows to run",
    )
    mixing.add_argument(
        "--alphas", default=_listed(PARALLEL_WEIGHTS), help="parallel training's alpha (MERGEOPT)"
    )
    mixing.add_argument(
        "--central-steps", type=int, default=CENTRAL_STEPS, help="parallel training's J per round"
    )
    mixing.add_argument(
        "--central-learning-rate",
        type=float,
        default=CENTRAL_LEARNING_RATE,
        help="parallel training's SGD rate",
    )
    mixing.add_argument(
        "--examples-per-pseudo-user",
        type=int,
        help="parallel and gradient transfer, with --without-account-ids: the server's pseudo-users' size "
        "(default: as many as fit one call with their negatives)",
    )
    mixing.add_argument(
        "--without-account-ids",
        action="store_true",
        help="attach the public accounts' shares without their account ids (pseudo-users: consecutive runs)",
    )
    mixing.add_argument(
        "--examples-per-assignment",
        default=_listed(EXAMPLES_PER_ASSIGNMENT),
        help="example transfer: centralized examples sent",
    )
    mixing.add_argument("--weights", default=_listed(GRADIENT_WEIGHTS), help="gradient transfer weights")
    mixing.add_argument(
        "--negative-popularity",
        type=float,
        default=0.0,
        help="the task's negative_popularity: negatives drawn by exp(p x item bias), ranking corrected",
    )
    mixing.add_argument(
        "--undeclared-new-items",
        action="store_true",
        help="the mixing strategies' task leaves central_only_items empty: devices draw the new items "
        "as negatives like any row",
    )
    mixing.add_argument("--out", type=Path, help="write the rows as JSON here")
    mixing.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="interpreter threads")
    return parser


def _mixing(args: argparse.Namespace) -> int:
    import json

    from android_sim.bench.federated import Rounds
    from android_sim.bench.mixing import (
        STRATEGIES,
        TABLE_HEADER,
        describe,
        expressions_setup,
        movielens_setup,
        run_mixing,
    )
    from android_sim.bench.models import ModelCache
    from android_sim.expressions import SyntheticConfig

    wanted = _names(args.data)
    unknown = sorted(set(wanted) - {"expressions", "movielens"})
    if unknown:
        raise ValueError(f"unknown data {unknown}; expected expressions, movielens")
    if args.examples_per_pseudo_user is not None and not args.without_account_ids:
        raise ValueError(
            "--examples-per-pseudo-user sizes pseudo-users of a dataset without group ids; with the "
            "accounts' ids the pseudo-users are the accounts: add --without-account-ids"
        )
    strategies = _names(args.strategies)
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; expected some of {list(STRATEGIES)}")
    weights = {
        "parallel_training": _numbers(args.alphas),
        "example_transfer": _numbers(args.examples_per_assignment),
        "gradient_transfer": _numbers(args.weights),
    }
    runs: list[tuple[str, float | None]] = []
    for strategy in strategies:
        runs.extend([(strategy, w) for w in weights[strategy]] if strategy in weights else [(strategy, None)])
    setups = []
    if "expressions" in wanted:
        setups.append(
            expressions_setup(SyntheticConfig(num_expressions=args.expressions, num_users=args.users))
        )
    if "movielens" in wanted:
        setups.append(movielens_setup(args.ratings))
    for setup in setups:
        print(describe(setup))
    rounds = Rounds(args.rounds, args.clients_per_round, evaluate_every=args.rounds)
    print(
        f"{rounds.rounds} rounds of {rounds.clients_per_round} clients; "
        "the fleet main job's implicit model and task; parallel training: "
        f"J = {args.central_steps} steps at rate {args.central_learning_rate:g} per round; pseudo-users: "
        + (
            f"runs of {args.examples_per_pseudo_user or 'as many as fit one call of the'} examples"
            if args.without_account_ids
            else "the public accounts (split to fit one call)"
        )
    )
    print(TABLE_HEADER, flush=True)
    rows = run_mixing(
        setups,
        ModelCache(args.models_dir),
        rounds,
        args.workers,
        runs,
        central_steps=args.central_steps,
        central_learning_rate=args.central_learning_rate,
        examples_per_pseudo_user=args.examples_per_pseudo_user,
        account_ids=not args.without_account_ids,
        negative_popularity=args.negative_popularity,
        declare_new_items=not args.undeclared_new_items,
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def _listed(values: tuple[float, ...]) -> str:
    return ",".join(f"{v:g}" for v in values)


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _numbers(text: str) -> list[float]:
    return [float(part) for part in _names(text)]


def _nextword(args: argparse.Namespace) -> int:
    from android_sim.bench.federated import Rounds
    from android_sim.bench.nextword import ModelShape, rows_json, run, table, task_config
    from android_sim.next_word import MAX_BATCHES
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
    if args.command == "mixing":
        try:
            return _mixing(args)
        except (DataFormatError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.command == "nextword":
        try:
            return _nextword(args)
        except (DataFormatError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    try:
        import json

        from android_sim.bench.federated import Rounds
        from android_sim.bench.quality import QualityOptions, run_quality
        from android_sim.bench.quality_methods import BETTER, FedReconSettings
        from android_sim.bench.staleness import StalenessOptions

        better = BETTER
        if args.better_settings is not None:
            try:
                better = FedReconSettings.from_json(json.loads(args.better_settings.read_text()))
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"cannot read settings {args.better_settings}: {e}") from None
        options = QualityOptions(
            ratings=args.ratings,
            out=args.out or Path("runs") / time.strftime("quality-%Y%m%d-%H%M%S"),
            models_dir=args.models_dir,
            methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
            rounds=Rounds(args.rounds, args.clients_per_round, args.evaluate_every, args.sampling_seed),
            workers=args.workers,
            better=better,
            split_seeds=tuple(int(s) for s in args.split_seeds.split(",") if s.strip()),
            centralized_epochs=args.centralized_epochs,
            staleness=StalenessOptions(
                participations=args.staleness_participations,
                scale_server_learning_rate=args.staleness_scale_server_rate,
            ),
            dp_clip_norm=args.dp_clip_norm,
            dp_noise_multipliers=tuple(float(z) for z in args.dp_noise_multipliers.split(",") if z.strip()),
            secure_bits=args.secure_bits,
        )
        report = run_quality(options)
        print(f"wrote {options.out / 'quality.json'} and {options.out / 'learning_curves.png'}")
        if "staleness" in report:
            print(f"wrote {options.out / 'staleness.png'}")
        if report["targets"].get("applies") is False:
            print(f"targets: set on {report['targets']['set_on']}, not on this data: none checked")
        for name, target in report["targets"].items():
            if isinstance(target, dict):
                verdict = "met" if target["met"] else "NOT met"
                print(f"target {name}: {target['measured']:.4g} ({target['target']}) {verdict}")
        return 0
    except (DataFormatError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
