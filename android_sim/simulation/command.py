"""`python -m android_sim simulate`: any model on per-device examples, rounds in one process.

The same workload as `run` (your export or builder and examples table, or a built-in data set),
trained by `simulate.simulate`: no HTTP, no orchestrator process, the devices' maths through the
export's `.tflite` signatures and the orchestrator's aggregation. Writes simulation.json
(held-out ReconEval, StandardEval on kept locals, the learning curve) and learning_curve.png.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from android_sim import report
from android_sim.algorithm import algorithm_task, optimizer_over
from android_sim.intervals import INTERVAL
from android_sim.options import algorithm_arguments, model_arguments, shared_run_config
from android_sim.run import FINAL_GLOBALS, load_workload
from android_sim.run_config import DEFAULT_RATINGS
from android_sim.run_report import model_summary, primary_metric, shown_metrics, with_interval
from android_sim.simulation.buffered import Buffering
from android_sim.simulation.predictions import judge, prediction_table
from android_sim.simulation.protocol import PROTOCOL_SEED, UserSplit
from android_sim.simulation.ranking import (
    keep_future,
    ranking_split,
    ranking_table,
    read_held_out,
    read_item_groups,
    score,
    summary,
)
from android_sim.simulation.rounds import Rounds
from android_sim.simulation.simulate import SimulationOptions, simulate
from android_sim.simulation.tune import tune, write_settings
from android_sim.workload import Workload, newest_first
from contracts.params import encode_params
from contracts.task_config import SplitPolicy, TaskConfig
from device_runtime.examples_table import DeviceExamples
from orchestrator.aggregation.server_optimizer import ServerOptimizerConfig
from orchestrator.aggregation.staleness import STALENESS_WEIGHTINGS

MIN_DEVICES = 10  # 80/10/10: at least one device to validate on and one to hold out


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = Rounds()
    parser = sub.add_parser(
        "simulate",
        help="train any model on per-device examples in one process (no HTTP): learning curve, ReconEval",
        description="Federated rounds in one process with your export's .tflite signatures and the "
        "orchestrator's aggregation: devices split 80/10/10 into training, validation (the learning "
        "curve) and held-out (ReconEval; StandardEval too for --local-state keep). Writes "
        "simulation.json and learning_curve.png to --out.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    model_arguments(parser)
    builtin = parser.add_argument_group("or a built-in data set with its model")
    builtin.add_argument("--data", choices=("expressions", "movielens"), help="default: expressions")
    builtin.add_argument("--ratings", type=Path, default=DEFAULT_RATINGS, help="MovieLens file")
    builtin.add_argument(
        "--devices", type=int, help="expressions: users (1000); movielens: at most this many"
    )
    builtin.add_argument("--expressions", type=int, default=1000, help="synthetic catalog size")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--clients-per-round", type=int, default=20)
    parser.add_argument(
        "--rounds-mode",
        choices=("synchronous", "buffered"),
        default="synchronous",
        help="buffered (FedBuff): --concurrency devices train at once, and every --clients-per-round "
        "reports (the buffer) commit a version, stale ones weighted down; --rounds versions in all",
    )
    parser.add_argument(
        "--concurrency", type=int, help="buffered: devices training at once (default: ceil(1.3 x the buffer))"
    )
    parser.add_argument("--max-staleness", type=int, default=10, help="buffered: refused past this")
    parser.add_argument(
        "--staleness-weighting",
        choices=tuple(STALENESS_WEIGHTINGS),
        default="inverse_sqrt",
        help="buffered: a report's weight factor, 1/sqrt(1+s), 1/(1+s) or 1",
    )
    parser.add_argument("--evaluate-every", type=int, default=10, help="learning curve cadence (rounds)")
    parser.add_argument("--sampling-seed", type=int, default=d.sampling_seed, help="client sampling")
    parser.add_argument("--split-seed", type=int, default=PROTOCOL_SEED, help="which devices are held out")
    parser.add_argument("--min-examples", type=int, default=1, help="devices with fewer examples sit out")
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="interpreter threads (--backend threads) or Ray worker processes (--backend ray)",
    )
    parser.add_argument(
        "--backend",
        choices=("threads", "ray"),
        default="threads",
        help="ray: each round's clients sharded over Ray worker processes, each holding its devices' "
        "data (needs the ray extra)",
    )
    parser.add_argument(
        "--address",
        help="--backend ray: an existing Ray cluster (ray://host:10001 or host:6379); default: "
        "worker processes on this machine",
    )
    parser.add_argument(
        "--held-out",
        type=Path,
        metavar="FILE",
        help="the devices to hold out, one device id a line (default: 10%% drawn by --split-seed)",
    )
    parser.add_argument(
        "--held-out-column",
        metavar="NAME",
        help="or a column of the examples table: 1 on a held-out device's rows, 0 on the others'",
    )
    parser.add_argument(
        "--item-groups",
        type=Path,
        metavar="CSV",
        help="a ranking model's catalog grouping (catalog row, group; a header line): adds the group "
        "rule ceiling",
    )
    parser.add_argument(
        "--tune",
        action="store_true",
        help="first search the training settings on the validation devices (Optuna), then simulate "
        "with the best; writes tuned_settings.json (--algorithm-settings) and tuned_population.json",
    )
    parser.add_argument(
        "--tune-seconds", type=float, default=600.0, help="--tune: no trial starts after this"
    )
    parser.add_argument("--tune-trials", type=int, default=100, help="--tune: at most this many trials")
    parser.add_argument("--seed", type=int, default=0, help="the synthetic data's seed")
    parser.add_argument("--out", type=Path, help="output directory (default: runs/simulate-<time>)")
    algorithm_arguments(parser)


def simulation_task(workload: Workload, overrides: dict[str, Any], min_examples: int) -> TaskConfig:
    """The devices' task: the model's training defaults, the data's, then the options'."""
    base = {
        **workload.manifest.training_defaults,
        "split": SplitPolicy.ALTERNATE.value,
        **workload.task,
        "min_examples": min_examples,
    }
    return algorithm_task(base, overrides)


def tuned(
    args: argparse.Namespace,
    workload: Workload,
    devices: list[DeviceExamples],
    split: UserSplit,
    task: TaskConfig,
    options: SimulationOptions,
    out: Path,
    console: Console,
) -> tuple[TaskConfig, SimulationOptions]:
    """The best settings `tune` finds on the validation devices, written to `out`."""
    if not workload.ranks_shares:
        raise ValueError("--tune searches a ranking model's settings (its validation hit rate@10)")
    console.print(
        f"tuning on {len(split.validation)} validation devices (the {len(split.test)} held-out ones take "
        f"no part): at most {args.tune_trials} trials started within {args.tune_seconds:.0f} s"
    )
    best, trials = tune(
        workload,
        devices,
        split,
        task,
        options,
        args.tune_seconds,
        args.tune_trials,
        out / "tuning",
        console.print,
    )
    chosen = TaskConfig.from_json({**task.to_json(), **best.task})
    settings, population = write_settings(best, chosen, out)
    (out / "tuning" / "trials.json").write_text(json.dumps([asdict(t) for t in trials], indent=2) + "\n")
    console.print(
        f"kept of {len(trials)} trials: #{best.number}, validation hit rate@10 over two seeds "
        f"{best.confirmed:.1%} (the plain settings: {trials[0].confirmed:.1%}); settings: {settings} "
        "(--algorithm-settings), "
        f"{population} (orchestrator create-population --settings @FILE)"
    )
    return chosen, replace(
        options, task=chosen, server=ServerOptimizerConfig.from_json(best.server_optimizer)
    )


def require_ray(option: str = "--backend ray") -> None:
    """Ray is an optional extra: say how to get it, before any work."""
    if importlib.util.find_spec("ray") is None:
        raise ValueError(
            f"{option} needs Ray: pip install 'fedrecon-ondevice[ray]' (./dev setup installs it)"
        )


def main(args: argparse.Namespace, console: Console | None = None) -> dict[str, Any]:
    """Run the simulation the options describe; returns the report (also in `--out`)."""
    console = console or Console()
    out = args.out or Path("runs") / time.strftime("simulate-%Y%m%d-%H%M%S")
    if args.held_out is not None and args.held_out_column is not None:
        raise ValueError("give the held-out devices once: --held-out FILE or --held-out-column NAME")
    config = shared_run_config(args, out, held_out_column=args.held_out_column)
    task_overrides, server_overrides = config.task, config.server_optimizer
    rounds = Rounds(args.rounds, args.clients_per_round, args.evaluate_every, args.sampling_seed)
    if args.workers < 1:
        raise ValueError(f"workers must be >= 1, got {args.workers}")
    if args.tune and (args.tune_seconds <= 0 or args.tune_trials < 1):
        raise ValueError(
            "--tune-seconds must be > 0 and --tune-trials >= 1, "
            f"got {args.tune_seconds} and {args.tune_trials}"
        )
    if args.address and args.backend != "ray":
        raise ValueError("--address is a Ray cluster's: give it with --backend ray")
    if args.backend == "ray":
        require_ray()
    buffering = (
        Buffering(
            args.clients_per_round,
            args.concurrency or math.ceil(1.3 * args.clients_per_round),
            args.staleness_weighting,
            args.max_staleness,
        )
        if args.rounds_mode == "buffered"
        else None
    )
    out.mkdir(parents=True, exist_ok=True)

    def enough(count: int) -> None:
        if count < MIN_DEVICES:
            raise ValueError(f"a simulation needs at least {MIN_DEVICES} devices (80/10/10), got {count}")

    workload = load_workload(config, console, enough)
    task = simulation_task(workload, task_overrides, args.min_examples)
    server = ServerOptimizerConfig.from_json(optimizer_over(workload.server_optimizer, server_overrides))
    options = SimulationOptions(
        rounds,
        task,
        server,
        workers=args.workers,
        split_seed=args.split_seed,
        backend=args.backend,
        ray_address=args.address,
        buffering=buffering,
    )
    # A device with fewer examples than the task needs sits out, as it would at check-in.
    taking = [d for d in workload.devices if d.examples.num_examples >= task.min_examples]
    enough(len(taking))
    held_out = None if args.held_out is None else read_held_out(args.held_out, [d.device_id for d in taking])
    if workload.held_out is not None:  # --held-out-column: the table's own
        marked = {workload.devices[i].device_id for i in workload.held_out}
        held_out = {i for i, d in enumerate(taking) if d.device_id in marked}
        if not held_out:
            raise ValueError(
                f"--held-out-column {args.held_out_column}: every marked device has fewer than "
                f"{task.min_examples} examples"
            )
    groups = None if args.item_groups is None else read_item_groups(args.item_groups, workload.manifest)
    split = ranking_split(len(taking), held_out, args.split_seed)
    # A ranking model on shares: each held-out device keeps its newest fifth aside to be scored on.
    past, future = keep_future(taking, split.test) if workload.ranks_shares else (taking, {})
    kept = [newest_first(d) for d in past]
    console.print(
        f"simulating {rounds.rounds} rounds x {rounds.clients_per_round} clients over {len(kept)} devices "
        f"({len(workload.devices) - len(kept)} with fewer than {task.min_examples} examples sit out; "
        f"{len(split.test)} held out)"
    )
    if args.tune:
        task, options = tuned(args, workload, past, split, task, options, out, console)
    result = simulate(workload.model_dir, kept, options, split=split)
    (out / FINAL_GLOBALS).write_bytes(encode_params(result.params))
    hit_rates = (
        score(workload, past, split, future, result.params, task, out / "held_out_stores", groups)
        if workload.ranks_shares
        else None
    )
    # A classification or regression model with locals: beside the same model without them.
    predictions, baselines = (
        judge(workload.model_dir, kept, options, result.params, split)
        if workload.manifest.task.kind != "ranking"
        and workload.manifest.local_params
        and not options.stateful
        else (None, None)
    )
    metric = primary_metric(workload.manifest)
    body = {
        "model": model_summary(workload.manifest),
        "data": {
            "source": workload.source,
            "devices": len(kept),
            "examples": sum(e.num_examples for e in kept),
        },
        "options": {
            "rounds": rounds.rounds,
            "clients_per_round": rounds.clients_per_round,
            "rounds_mode": args.rounds_mode,
            "buffering": None if buffering is None else asdict(buffering),
            "evaluate_every": rounds.evaluate_every,
            "sampling_seed": rounds.sampling_seed,
            "split_seed": args.split_seed,
            "workers": args.workers,
            "backend": args.backend,
            "task_config": task.to_json(),
            "server_optimizer": server.to_json(),
        },
        **result.to_json(),
        "ranking": None if hit_rates is None else summary(hit_rates, workload.manifest, task),
        "without_locals": predictions,
        # each: {metric: {model, without_locals (the baseline's figure), difference, its interval}}
        "label_baselines": baselines,
    }
    (out / "simulation.json").write_text(json.dumps(body, indent=2) + "\n")
    report.plot_learning_curve(out / "learning_curve.png", result.curve, metric, "validation devices")
    names = shown_metrics(workload.manifest)
    held = ", ".join(with_interval(result.held_out, k) for k in names if k in result.held_out)
    console.print(
        f"{result.seconds:.1f} s; held-out devices ({result.held_out['devices']}), ReconEval: {held} "
        f"[{INTERVAL}]"
    )
    if result.seen is not None:
        seen = ", ".join(with_interval(result.seen, k) for k in names if k in result.seen)
        console.print(f"seen devices' newest 10%, StandardEval with their kept locals: {seen}")
    if hit_rates is not None:
        console.print(ranking_table(hit_rates, workload.manifest, task), width=max(console.width, 120))
    if predictions:
        table = prediction_table(predictions, len(split.test), baselines or {})
        console.print(table, width=max(console.width, 120))
    console.print(f"report: {out / 'simulation.json'}; curve: {out / 'learning_curve.png'}")
    console.print(f"trained global parameters: {out / FINAL_GLOBALS}")
    return body
