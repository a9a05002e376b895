"""Command-line options that `run` and `simulate` share: your model and data, and the algorithm,
and the `RunConfig` both build from them (`shared_run_config`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from android_sim.run_config import RunConfig


def model_arguments(parser: argparse.ArgumentParser) -> None:
    """Your model and your data: an export or a builder to export, and a per-device examples table."""
    group = parser.add_argument_group("your model and data")
    group.add_argument(
        "--model-dir", type=Path, help="an export (python -m model_export ... --output-dir DIR)"
    )
    group.add_argument(
        "--model",
        metavar="MODULE:FUNCTION",
        help="a function returning an ExportSpec, exported into the work dir",
    )
    group.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a keyword argument of the model's builder (--model, --data shakespeare), repeat for several",
    )
    group.add_argument(
        "--examples",
        type=Path,
        help="per-device examples: CSV/TSV/Parquet with device_id, timestamp and one column per feature",
    )


def parse_model_args(pairs: list[str]) -> dict[str, str]:
    """`--model-arg KEY=VALUE`s as a dict; the builder converts and checks the values."""
    model_args: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--model-arg takes KEY=VALUE, e.g. lstm_units=128; got {pair!r}")
        model_args[key.strip()] = value
    return model_args


# Flags that set a task config field: (flag, field, type, help).
_TASK_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--split", "split", str, "support/query split policy: alternate or reuse"),
    ("--reuse-below", "reuse_below", int, "devices with fewer examples reuse them for support and query"),
    ("--reconstruction-steps", "reconstruction_max_steps", int, "at most this many reconstruction steps"),
    ("--reconstruction-learning-rate", "reconstruction_learning_rate", float, "reconstruction SGD rate"),
    ("--update-steps", "update_max_steps", int, "at most this many update steps"),
    ("--update-learning-rate", "update_learning_rate", float, "client SGD rate of the update"),
    (
        "--local-state",
        "local_state",
        str,
        "reconstruct: FedRecon (locals fitted afresh each task); keep: FURL (locals kept on the "
        "device and trained jointly; evaluation on seen devices' newest 10%%, no held-out devices)",
    ),
    (
        "--local-learning-rate",
        "local_learning_rate",
        float,
        "rate of the locals during the update (keep: default the reconstruction rate)",
    ),
)
_ALGORITHM_KEYS = ("task", "server_optimizer")


def algorithm_arguments(run: argparse.ArgumentParser) -> None:
    group = run.add_argument_group(
        "algorithm", "over the data's defaults; a settings file first, then these flags over it"
    )
    group.add_argument(
        "--algorithm-settings",
        type=Path,
        help='JSON file: {"task": {task config fields}, "server_optimizer": {"name": ..., ...}}',
    )
    for flag, _, kind, text in _TASK_FLAGS:
        group.add_argument(flag, type=kind, help=text)
    group.add_argument("--server-optimizer", help="sgd, momentum, adam or yogi")
    group.add_argument("--server-learning-rate", type=float, help="the server optimizer's learning rate")


def algorithm(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """(task config overrides, server optimizer overrides) from the settings file and the flags."""
    task: dict[str, Any] = {}
    server: dict[str, Any] = {}
    if args.algorithm_settings is not None:
        path = args.algorithm_settings
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read algorithm settings {path}: {e}") from None
        if not isinstance(data, dict) or set(data) - set(_ALGORITHM_KEYS):
            raise ValueError(
                f"algorithm settings {path} must be a JSON object with keys from {list(_ALGORITHM_KEYS)}"
            )
        for key, target in (("task", task), ("server_optimizer", server)):
            if not isinstance(data.get(key, {}), dict):
                raise ValueError(f"algorithm settings {path}: {key!r} must be a JSON object")
            target.update(data.get(key, {}))
    for flag, name, _, _ in _TASK_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            task[name] = value
    if args.server_optimizer is not None:
        server["name"] = args.server_optimizer
    if args.server_learning_rate is not None:
        server["learning_rate"] = args.server_learning_rate
    return task, server


def shared_run_config(args: argparse.Namespace, work_dir: Path, **only_run: Any) -> RunConfig:
    """The run's config from the options `run` and `simulate` share (model and data, the data's
    seed, the algorithm); `only_run` sets what only `run` has (rounds, fleet, server, DP, ...)."""
    if args.data and (args.model_dir or args.model):
        raise ValueError(
            f"--data {args.data} is a built-in data set with its own model; not with --model-dir/--model"
        )
    task, server = algorithm(args)
    return RunConfig(
        work_dir=work_dir,
        model_dir=args.model_dir,
        model=args.model,
        model_args=parse_model_args(args.model_arg),
        examples=args.examples,
        data=args.data or RunConfig.data,
        ratings=args.ratings,
        devices=args.devices,
        expressions=args.expressions,
        seed=args.seed,
        task=task,
        server_optimizer=server,
        **only_run,
    )
