"""`python -m benchmarks.mixing`: mixing centralized data (Augenstein et al.), the skewed setup
with new items no device holds (docs/benchmarks.md).

Federated training without mixing, on all data (the upper bound) and with each mixing strategy on
synthetic expressions and MovieLens with held-back items; prints hit rate@10 / NDCG@10 on the new
items, overall hit rate@10 and the bytes mixing adds per assignment."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from android_sim.movielens import DataFormatError
from android_sim.run_config import DEFAULT_RATINGS
from contracts.command_line import CommandParser


def _parser() -> argparse.ArgumentParser:
    # The study loads TensorFlow's interpreter: imported here, `--help` stays quick.
    from benchmarks.mixing_study import (
        CENTRAL_LEARNING_RATE,
        CENTRAL_STEPS,
        EXAMPLES_PER_ASSIGNMENT,
        GRADIENT_WEIGHTS,
        PARALLEL_WEIGHTS,
        STRATEGIES,
    )

    parser = CommandParser(
        prog="python -m benchmarks.mixing",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--data", default="expressions,movielens", help="expressions, movielens or both")
    parser.add_argument("--ratings", type=Path, default=DEFAULT_RATINGS, help="MovieLens u.data")
    parser.add_argument(
        "--models-dir", type=Path, default=Path("runs/models"), help="exported models, reused"
    )
    parser.add_argument("--expressions", type=int, default=1000, help="synthetic catalog size")
    parser.add_argument("--users", type=int, default=2000, help="synthetic users")
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--clients-per-round", type=int, default=40)
    parser.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help="which rows to run",
    )
    parser.add_argument(
        "--alphas", default=_listed(PARALLEL_WEIGHTS), help="parallel training's alpha (MERGEOPT)"
    )
    parser.add_argument(
        "--central-steps", type=int, default=CENTRAL_STEPS, help="parallel training's J per round"
    )
    parser.add_argument(
        "--central-learning-rate",
        type=float,
        default=CENTRAL_LEARNING_RATE,
        help="parallel training's SGD rate",
    )
    parser.add_argument(
        "--examples-per-pseudo-user",
        type=int,
        help="parallel and gradient transfer, with --without-account-ids: the server's pseudo-users' size "
        "(default: as many as fit one call with their negatives)",
    )
    parser.add_argument(
        "--without-account-ids",
        action="store_true",
        help="attach the public accounts' shares without their account ids (pseudo-users: consecutive runs)",
    )
    parser.add_argument(
        "--examples-per-assignment",
        default=_listed(EXAMPLES_PER_ASSIGNMENT),
        help="example transfer: centralized examples sent",
    )
    parser.add_argument("--weights", default=_listed(GRADIENT_WEIGHTS), help="gradient transfer weights")
    parser.add_argument(
        "--negative-popularity",
        type=float,
        default=0.0,
        help="the task's negative_popularity: negatives drawn by exp(p x item bias), ranking corrected",
    )
    parser.add_argument(
        "--undeclared-new-items",
        action="store_true",
        help="the mixing strategies' task leaves central_only_items empty: devices draw the new items "
        "as negatives like any row",
    )
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="interpreter threads")
    return parser


def _mixing(args: argparse.Namespace) -> int:
    import json

    from android_sim.expressions import SyntheticConfig
    from android_sim.simulation.rounds import Rounds
    from benchmarks.mixing_study import (
        STRATEGIES,
        TABLE_HEADER,
        describe,
        expressions_setup,
        movielens_setup,
        run_mixing,
    )
    from benchmarks.model_cache import ModelCache

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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        return _mixing(args)
    except (DataFormatError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
