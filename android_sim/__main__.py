"""`python -m android_sim`: a fleet of simulated Android devices running the device runtime."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, cast

from android_sim.builtin_next_word import TARGET_REPORTS as NEXT_WORD_TARGET_REPORTS
from android_sim.movielens import DataFormatError, require_file
from android_sim.options import algorithm_arguments, model_arguments, shared_run_config
from android_sim.run_config import DEFAULT_RATINGS, RunConfig, RunError
from android_sim.simulation import command as simulate_command
from contracts.command_line import CommandParser, quiet_on_closed_pipe
from contracts.mixing import STRATEGIES


def _run_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = RunConfig(work_dir=Path("."))
    run = sub.add_parser(
        "run",
        help="export, start (or use) an orchestrator, run a fleet for some rounds, evaluate, report",
        description="Run a simulated fleet against the orchestrator's HTTP API and write a run report "
        "(report.json, metrics.png, funnel.png) into the work directory: your model (--model-dir or "
        "--model) on your per-device examples table (--examples), or a built-in data set (--data).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    model_arguments(run)
    run.add_argument(
        "--data",
        choices=("expressions", "movielens", "shakespeare"),
        help="a built-in data set with its model (default: expressions); shakespeare: next-word "
        "prediction, each speaking role a device",
    )
    run.add_argument(
        "--ratings", type=Path, default=DEFAULT_RATINGS, help="MovieLens file for --data movielens"
    )
    run.add_argument(
        "--devices",
        type=int,
        help="devices (default: expressions 1000; MovieLens: every user, or at most this many)",
    )
    run.add_argument("--expressions", type=int, default=d.expressions, help="synthetic catalog size")
    run.add_argument("--held-out-fraction", type=float, default=d.held_out_fraction)
    run.add_argument(
        "--held-out",
        type=Path,
        metavar="FILE",
        help="your table's devices to hold out, one device id a line (default: --held-out-fraction drawn)",
    )
    run.add_argument(
        "--held-out-column",
        metavar="NAME",
        help="or a column of your table: 1 on a held-out device's rows, 0 on the others'",
    )
    run.add_argument(
        "--initial-globals",
        type=Path,
        metavar="FILE",
        help="the population starts from these global parameters (safetensors, e.g. simulate's "
        "global_params.safetensors) instead of the export's",
    )
    run.add_argument("--rounds", type=int, default=d.rounds, help="training rounds to commit")
    run.add_argument(
        "--target-reports",
        type=int,
        help=f"reports per round (default: {d.target_reports}; shakespeare: {NEXT_WORD_TARGET_REPORTS})",
    )
    run.add_argument("--oversampling", type=float, default=d.oversampling)
    run.add_argument("--min-examples", type=int, default=d.min_examples)
    run.add_argument("--round-seconds", type=float, default=d.round_seconds, help="round deadline")
    run.add_argument(
        "--aggregation",
        choices=("plaintext", "secure"),
        default=d.aggregation,
        help="secure: secure aggregation, the server learns only each round's sum",
    )
    rounds = run.add_argument_group(
        "buffered rounds", "FedBuff: no round's target, a version every --buffer-size reports"
    )
    rounds.add_argument(
        "--rounds-mode",
        choices=("synchronous", "buffered"),
        default=d.rounds_mode,
        help="buffered: devices check in while fewer than --concurrency train, and every --buffer-size "
        "reports commit a version (stale ones weighted down); --rounds versions in all; with "
        "--aggregation secure, in cohorts of ceil(--target-reports x --oversampling) devices",
    )
    rounds.add_argument("--buffer-size", type=int, help="K: reports per version (default: --target-reports)")
    rounds.add_argument(
        "--concurrency",
        type=int,
        help="devices training at once (default: ceil(--target-reports x --oversampling))",
    )
    rounds.add_argument(
        "--max-staleness",
        type=int,
        default=d.max_staleness,
        help="versions behind past which a report is refused",
    )
    rounds.add_argument(
        "--staleness-weighting",
        choices=("inverse_sqrt", "inverse", "constant"),
        default=d.staleness_weighting,
        help="a report's weight factor: 1/sqrt(1+s), 1/(1+s) or 1",
    )
    run.add_argument(
        "--secure-clip-norm", type=float, default=d.secure_clip_norm, help="L2 bound of a device's delta"
    )
    run.add_argument("--evaluation-every", type=int, default=d.evaluation_every)
    run.add_argument(
        "--day-seconds", type=float, default=d.day_seconds, help="wall seconds per simulated day"
    )
    run.add_argument("--device-mix", type=Path, help="JSON list of device classes (default: built-in mix)")
    run.add_argument("--orchestrator-url", help="use this orchestrator instead of starting one")
    run.add_argument(
        "--admin-token",
        help="the orchestrator's admin token: needed with --orchestrator-url; else the local "
        "orchestrator's (default: --admin-token-file, $ORCHESTRATOR_ADMIN_TOKEN, or a random one), "
        "e.g. to read its /metrics during the run; on the command line it shows in process lists, "
        "so prefer the file or the variable",
    )
    run.add_argument(
        "--admin-token-file", type=Path, help="a file holding the admin token (instead of --admin-token)"
    )
    run.add_argument(
        "--stall-seconds",
        type=float,
        default=d.stall_seconds,
        help="give up when no training round commits for this long (default %(default)s)",
    )
    run.add_argument("--population", help="population name (default: <data>-<model sha>)")
    run.add_argument(
        "--work-dir", type=Path, help="model, device stores, database, report (default: runs/run-<time>)"
    )
    run.add_argument("--workers", type=int, default=d.workers, help="interpreter threads (default: cores)")
    run.add_argument(
        "--shards",
        type=int,
        default=d.shards,
        help="2 or more: the devices sharded over this many Ray actors, each its own process and event "
        "loop (needs the ray extra; --workers threads shared among them)",
    )
    run.add_argument(
        "--address", help="--shards: an existing Ray cluster (default: processes of this machine)"
    )
    run.add_argument("--seed", type=int, default=d.seed)
    algorithm_arguments(run)
    _mixing_arguments(run)
    _next_word_arguments(run, d)
    dp = run.add_argument_group(
        "differential privacy (DP-FedAvg)",
        "devices clip their whole delta to --clip-norm; the server adds Gaussian noise "
        "N(0, (noise multiplier x clip norm)^2) to the round's sum and tracks epsilon",
    )
    dp.add_argument("--clip-norm", type=float, help="L2 bound on a device's delta (turns DP on)")
    dp.add_argument(
        "--noise-multiplier", type=float, help="noise stddev over the clip norm; 0: clipping only"
    )
    dp.add_argument(
        "--population-size", type=int, help="devices that could take part (default: the training devices)"
    )
    dp.add_argument("--epsilon-budget", type=float, help="stop training rounds before epsilon exceeds it")
    dp.add_argument(
        "--max-participations",
        type=int,
        help="--rounds-mode buffered: the most buffers one device may report into, which bounds its "
        "epsilon (default: --rounds)",
    )
    dp.add_argument(
        "--target-delta",
        type=float,
        help="the delta of the (epsilon, delta) guarantee, < 1 / population size "
        "(default: min(1e-5, population size^-1.1))",
    )
    dp.add_argument(
        "--target-unclipped-quantile",
        type=float,
        help="adaptive clipping: the share of devices to leave unclipped (--clip-norm is the first round's)",
    )


def _mixing_arguments(run: argparse.ArgumentParser) -> None:
    group = run.add_argument_group(
        "mixing centralized data",
        "a centralized dataset of public shares (android_sim/central_data.py) mixed into training",
    )
    group.add_argument(
        "--mixing",
        choices=list(STRATEGIES),
        default="none",
        help="parallel_training, example_transfer or gradient_transfer (contracts/mixing.py)",
    )
    group.add_argument(
        "--mixing-weight", type=float, help="alpha (parallel training) or the gradient's weight"
    )
    group.add_argument("--central-steps", type=int, help="parallel training: J server steps per round")
    group.add_argument("--central-learning-rate", type=float, help="parallel training: server SGD rate")
    group.add_argument("--examples-per-assignment", type=int, help="example transfer: examples sent per task")
    group.add_argument(
        "--central-examples", type=int, default=2000, help="public shares in the centralized dataset"
    )


def mixing(args: argparse.Namespace) -> dict[str, Any]:
    """The MixingConfig fields the flags set ({} without --mixing)."""
    if args.mixing == "none":
        return {}
    flags = {
        "weight": args.mixing_weight,
        "central_steps": args.central_steps,
        "central_learning_rate": args.central_learning_rate,
        "examples_per_assignment": args.examples_per_assignment,
    }
    return {"strategy": args.mixing, **{k: v for k, v in flags.items() if v is not None}}


def _next_word_arguments(run: argparse.ArgumentParser, d: RunConfig) -> None:
    group = run.add_argument_group(
        "next-word prediction (--data shakespeare)",
        "the model is model_export.models.next_word:build; its OOV rows are local unless "
        "--model-arg oov_local=false",
    )
    group.add_argument("--shakespeare", type=Path, default=d.shakespeare, help="Tiny Shakespeare's folder")
    group.add_argument("--vocab-size", type=int, default=d.vocab_size, help="words in the global vocabulary")
    group.add_argument("--oov-buckets", type=int, default=d.oov_buckets, help="OOV hash buckets")
    group.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per example window")


def next_word_options(args: argparse.Namespace) -> dict[str, Any]:
    """The RunConfig fields of the next-word options."""
    return {
        "shakespeare": args.shakespeare,
        "vocab_size": args.vocab_size,
        "oov_buckets": args.oov_buckets,
        "seq_len": args.seq_len,
    }


def admin_token(args: argparse.Namespace) -> str | None:
    """--admin-token, else the file --admin-token-file names, else $ORCHESTRATOR_ADMIN_TOKEN."""
    if args.admin_token is not None and args.admin_token_file is not None:
        raise ValueError("--admin-token and --admin-token-file: give one")
    if args.admin_token_file is not None:
        try:
            token = args.admin_token_file.read_text().strip()
        except OSError as e:
            raise ValueError(f"cannot read --admin-token-file: {e}") from None
        if not token:
            raise ValueError(f"--admin-token-file {args.admin_token_file} is empty")
        return str(token)
    if args.admin_token is not None:
        return str(args.admin_token)
    return os.environ.get("ORCHESTRATOR_ADMIN_TOKEN") or None


def target_reports(args: argparse.Namespace) -> int:
    if args.target_reports is not None:
        return int(args.target_reports)
    return NEXT_WORD_TARGET_REPORTS if args.data == "shakespeare" else RunConfig.target_reports


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="python -m android_sim", description=__doc__)
    # Its subcommands' parsers are CommandParsers; their builders take any ArgumentParser's.
    sub = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]",
        parser.add_subparsers(dest="command", required=True),
    )
    _run_parser(sub)
    simulate_command.add_parser(sub)
    demo = sub.add_parser(
        "demo", help="export a model, fill one device from MovieLens, run a client task, show a top-10"
    )
    demo.add_argument(
        "--ratings",
        type=Path,
        default=DEFAULT_RATINGS,
        help="MovieLens u.data or ratings.dat (default: %(default)s)",
    )
    demo.add_argument(
        "--work-dir", type=Path, default=None, help="where to write the model and the device store"
    )
    demo.add_argument("--user", type=int, default=0, help="which MovieLens user is the device (dense index)")
    return parser


@quiet_on_closed_pipe
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        if args.command == "simulate":
            simulate_command.main(args)
            return 0
        if args.command == "demo":
            require_file(args.ratings)  # before TensorFlow loads (and logs)
            from android_sim.demo import run_demo

            return run_demo(args.ratings, args.work_dir, args.user)
        from android_sim.profiles import DEFAULT_MIX, load_mix
        from android_sim.run import run

        if args.shards > 1:
            simulate_command.require_ray("--shards")
        config = shared_run_config(
            args,
            args.work_dir or Path("runs") / time.strftime("run-%Y%m%d-%H%M%S"),
            held_out_fraction=args.held_out_fraction,
            held_out=args.held_out,
            held_out_column=args.held_out_column,
            initial_globals=args.initial_globals,
            rounds=args.rounds,
            target_reports=target_reports(args),
            oversampling=args.oversampling,
            min_examples=args.min_examples,
            round_seconds=args.round_seconds,
            aggregation=args.aggregation,
            rounds_mode=args.rounds_mode,
            buffer_size=args.buffer_size,
            concurrency=args.concurrency,
            max_staleness=args.max_staleness,
            staleness_weighting=args.staleness_weighting,
            secure_clip_norm=args.secure_clip_norm,
            evaluation_every=args.evaluation_every,
            day_seconds=args.day_seconds,
            device_mix=load_mix(args.device_mix) if args.device_mix else DEFAULT_MIX,
            orchestrator_url=args.orchestrator_url,
            admin_token=admin_token(args),
            stall_seconds=args.stall_seconds,
            population=args.population,
            workers=args.workers,
            shards=args.shards,
            ray_address=args.address,
            clip_norm=args.clip_norm,
            noise_multiplier=args.noise_multiplier,
            population_size=args.population_size,
            epsilon_budget=args.epsilon_budget,
            max_participations=args.max_participations,
            target_delta=args.target_delta,
            target_unclipped_quantile=args.target_unclipped_quantile,
            mixing=mixing(args),
            central_examples=args.central_examples,
            **next_word_options(args),
        )
        run(config)
        return 0
    except (DataFormatError, RunError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
