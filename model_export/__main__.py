"""`python -m model_export`: export a model with its training signatures.

`--model my_pkg.my_model:build` exports the `ExportSpec` that `build()` returns (see
`model_export.spec`); without it, the FedRecon matrix-factorization model that the options
describe.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from contracts.command_line import CommandParser, quiet_on_closed_pipe
from contracts.task_config import TrainingDefaults
from model_export.config import Feedback, ModelConfig

if TYPE_CHECKING:
    from model_export.export import ExportResult


def build_parser() -> argparse.ArgumentParser:
    d, t = ModelConfig(), TrainingDefaults()
    p = CommandParser(
        prog="model-export",
        usage="%(prog)s --model MODULE:FUNCTION [--model-arg KEY=VALUE ...] --output-dir DIR\n"
        "       %(prog)s [--config FILE | matrix-factorization options] --output-dir DIR",
        # Wide enough for the longest option to keep its help on its line: one screen.
        formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=36),
        description="Export a Keras model to TFLite with the training signatures a device runs "
        "(reconstruct, update, evaluate, infer, get/set global and local parameters), builtin ops "
        "only: your own model (--model) or the FedRecon matrix-factorization model that the options "
        "below describe. Also `python -m model_export`; needs TensorFlow (the `export` extra).",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="MODULE:FUNCTION",
        help="a function returning an ExportSpec, e.g. my_pkg.my_model:build",
    )
    p.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --model: a keyword argument of the function (repeatable), of the type its "
        "parameter declares, e.g. num_oov_buckets=100",
    )
    p.add_argument(
        "--output-dir",
        "--out",
        type=Path,
        required=True,
        metavar="DIR",
        help="where to write model.tflite, manifest.json and global_params.safetensors",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="also print TensorFlow's log lines",
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="a JSON matrix-factorization config (a manifest's 'config'); replaces the options below",
    )
    mf = p.add_argument_group("the matrix-factorization model (without --model; defaults in brackets)")
    mf.add_argument(
        "--num-items", type=int, default=d.num_items, metavar="N", help="catalog size [%(default)s]"
    )
    mf.add_argument("--embedding-dim", type=int, default=d.embedding_dim, metavar="N", help="[%(default)s]")
    mf.add_argument(
        "--batch-size", type=int, default=d.batch_size, metavar="N", help="static batch size [%(default)s]"
    )
    mf.add_argument(
        "--max-batches", type=int, default=d.max_batches, metavar="N", help="batches per call [%(default)s]"
    )
    mf.add_argument(
        "--top-k", type=int, default=d.top_k, metavar="N", help="infer's ranked length [%(default)s]"
    )
    mf.add_argument(
        "--feedback",
        choices=[f.value for f in Feedback],
        default=d.feedback.value,
        help="ratings (squared error) or shares (logistic loss) [%(default)s]",
    )
    mf.add_argument("--item-bias", action=argparse.BooleanOptionalAction, default=d.item_bias, help="global")
    mf.add_argument("--user-bias", action=argparse.BooleanOptionalAction, default=d.user_bias, help="local")
    mf.add_argument(
        "--global-mean", action=argparse.BooleanOptionalAction, default=d.global_mean, help="a global offset"
    )
    mf.add_argument(
        "--global-mean-init",
        type=float,
        default=d.global_mean_init,
        metavar="X",
        help="its start [%(default)s]",
    )
    mf.add_argument("--rating-min", type=float, default=d.rating_min, metavar="X", help="[%(default)s]")
    mf.add_argument("--rating-max", type=float, default=d.rating_max, metavar="X", help="[%(default)s]")
    mf.add_argument(
        "--huber-delta", type=float, default=d.huber_delta, metavar="X", help="0: squared error [%(default)s]"
    )
    mf.add_argument(
        "--clip-predictions",
        action=argparse.BooleanOptionalAction,
        default=d.clip_predictions,
        help="evaluate ratings clipped to [rating-min, rating-max]",
    )
    mf.add_argument(
        "--init-stddev",
        type=float,
        default=d.init_stddev,
        metavar="X",
        help="item rows N(0, X) [%(default)s]",
    )
    mf.add_argument("--seed", type=int, default=d.seed, metavar="N", help="[%(default)s]")
    hyper = p.add_argument_group("its training defaults, recorded in the manifest")
    for name, kind in (
        ("reconstruction_learning_rate", float),
        ("reconstruction_max_epochs", int),
        ("reconstruction_max_steps", int),
        ("update_learning_rate", float),
        ("update_max_epochs", int),
        ("update_max_steps", int),
        ("l2_global", float),
        ("l2_local", float),
    ):
        flag = "--" + name.replace("_", "-")
        hyper.add_argument(flag, type=kind, default=getattr(t, name), metavar="X", help="[%(default)s]")
    return p


def config_from_args(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        num_items=args.num_items,
        embedding_dim=args.embedding_dim,
        batch_size=args.batch_size,
        max_batches=args.max_batches,
        # A small catalog's top-k is the catalog; a catalog below 1 is refused as such.
        top_k=min(args.top_k, args.num_items) if args.num_items >= 1 else args.top_k,
        feedback=Feedback(args.feedback),
        item_bias=args.item_bias,
        user_bias=args.user_bias,
        global_mean=args.global_mean,
        global_mean_init=args.global_mean_init,
        rating_min=args.rating_min,
        rating_max=args.rating_max,
        huber_delta=args.huber_delta,
        clip_predictions=args.clip_predictions,
        init_stddev=args.init_stddev,
        seed=args.seed,
        training=TrainingDefaults(
            reconstruction_learning_rate=args.reconstruction_learning_rate,
            reconstruction_max_epochs=args.reconstruction_max_epochs,
            reconstruction_max_steps=args.reconstruction_max_steps,
            update_learning_rate=args.update_learning_rate,
            update_max_epochs=args.update_max_epochs,
            update_max_steps=args.update_max_steps,
            l2_global=args.l2_global,
            l2_local=args.l2_local,
        ),
    )


@quiet_on_closed_pipe
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    unwritable = _unwritable(args.output_dir)
    if unwritable:
        print(f"error: --output-dir {args.output_dir}: {unwritable}", file=sys.stderr)
        return 2
    if args.model is not None:
        return _export_user_model(args.model, args.model_arg, args.output_dir, args.verbose)
    if args.model_arg:
        print("error: --model-arg needs --model (the function that takes the arguments)", file=sys.stderr)
        return 2
    try:
        if args.config is not None:
            config = ModelConfig.from_json(json.loads(args.config.read_text()))
        else:
            config = config_from_args(args)
    except OSError as e:
        print(f"error: cannot read --config {args.config}: {e.strerror}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # TensorFlow loads only when exporting.
    from model_export.held_output import native_stderr_held

    problem = ""
    with native_stderr_held(args.verbose):  # TensorFlow's import logs too
        from model_export.export import export_spec
        from model_export.matrix_factorization import build_spec
        from model_export.spec import ExportError

        try:
            result = export_spec(build_spec(config), args.output_dir)
        except ExportError as e:  # e.g. a model that does not run alike on every backend
            problem = str(e)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    _report(result)
    return 0


def _export_user_model(target: str, model_args: list[str], output_dir: Path, verbose: bool) -> int:
    from model_export.held_output import native_stderr_held

    module_name, _, function_name = target.partition(":")
    if not module_name or not function_name:
        print(
            f"error: --model takes MODULE:FUNCTION, e.g. my_pkg.my_model:build; got {target!r}",
            file=sys.stderr,
        )
        return 2
    # As `python -m` does: the user's modules in the current directory import (the console script
    # `model-export` does not put it on the path by itself).
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    problem, result = "", None
    # TensorFlow logs as it loads and as it converts: held back, so that an error is its message.
    with native_stderr_held(verbose):
        from model_export.export import export_spec
        from model_export.model_args import ModelArgError, parse_model_args
        from model_export.spec import ExportError, ExportSpec

        try:
            build = getattr(importlib.import_module(module_name), function_name)
            spec = build(**parse_model_args(build, model_args))
            if isinstance(spec, ExportSpec):
                result = export_spec(spec, output_dir)
            else:
                problem = f"{target} returned {type(spec).__name__}, expected a model_export.spec.ExportSpec"
        except (ImportError, AttributeError) as e:
            problem = f"cannot load {target!r}: {e}"
        except ExportError as e:
            problem = str(e)
        except (ModelArgError, ValueError) as e:
            # The builder's own checks (e.g. a size below 1) are the user's arguments being wrong too.
            problem = f"{target}: {e}"
    if problem or result is None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    _report(result)
    return 0


def _unwritable(output_dir: Path) -> str:
    """Why the export could not be written to `output_dir` (checked before a minute of exporting),
    or ''."""
    if output_dir.exists() and not output_dir.is_dir():
        return "exists and is not a directory"
    existing = output_dir
    while not existing.exists():
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot write in {existing}"
    return ""


def _report(result: ExportResult) -> None:
    print(
        f"exported {result.model_dir / 'model.tflite'}: {result.tflite_bytes:,} bytes "
        f"({result.tflite_bytes / result.parameter_bytes:.2f}x the {result.parameter_bytes:,} "
        f"bytes of parameters); signatures: {', '.join(sorted(result.manifest.signatures))}"
    )
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
