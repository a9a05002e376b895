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

from model_export.config import Feedback, ModelConfig, TrainingDefaults

if TYPE_CHECKING:
    from model_export.export import ExportResult


def build_parser() -> argparse.ArgumentParser:
    d, t = ModelConfig(), TrainingDefaults()
    p = argparse.ArgumentParser(
        prog="python -m model_export",
        description="Export a model to TFLite with training signatures (reconstruct, update, "
        "evaluate, infer, get/set global and local parameters): your own (--model) or the FedRecon "
        "matrix-factorization model the options below describe.",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="MODULE:FUNCTION",
        help="a function returning a model_export.spec.ExportSpec, e.g. my_pkg.my_model:build",
    )
    p.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --model: a keyword argument of the function (repeat for several), converted to "
        "the type its parameter declares, e.g. --model-arg num_oov_buckets=100",
    )
    p.add_argument(
        "--output-dir",
        "--out",
        type=Path,
        required=True,
        help="directory to write model.tflite, manifest.json and global_params.safetensors into",
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="a JSON model config (as in a manifest's 'config'); replaces the options below",
    )
    p.add_argument("--num-items", type=int, default=d.num_items, help="catalog size (default: %(default)s)")
    p.add_argument("--embedding-dim", type=int, default=d.embedding_dim, help="default: %(default)s")
    p.add_argument(
        "--batch-size", type=int, default=d.batch_size, help="static batch size (default: %(default)s)"
    )
    p.add_argument(
        "--max-batches",
        type=int,
        default=d.max_batches,
        help="batches per signature call; bounds the examples a task sees (default: %(default)s)",
    )
    p.add_argument(
        "--top-k", type=int, default=d.top_k, help="length of infer's ranked output (default: %(default)s)"
    )
    p.add_argument(
        "--feedback",
        choices=[f.value for f in Feedback],
        default=d.feedback.value,
        help="explicit ratings (squared error) or implicit shares (logistic loss); default: %(default)s",
    )
    p.add_argument(
        "--item-bias", action=argparse.BooleanOptionalAction, default=d.item_bias, help="global per-item bias"
    )
    p.add_argument(
        "--user-bias", action=argparse.BooleanOptionalAction, default=d.user_bias, help="local per-user bias"
    )
    p.add_argument(
        "--global-mean",
        action=argparse.BooleanOptionalAction,
        default=d.global_mean,
        help="global trainable offset",
    )
    p.add_argument(
        "--global-mean-init",
        type=float,
        default=d.global_mean_init,
        help="initial global mean (e.g. the mean rating)",
    )
    p.add_argument(
        "--rating-min", type=float, default=d.rating_min, help="explicit feedback: lowest valid rating"
    )
    p.add_argument(
        "--rating-max", type=float, default=d.rating_max, help="explicit feedback: highest valid rating"
    )
    p.add_argument(
        "--huber-delta",
        type=float,
        default=d.huber_delta,
        help="explicit feedback: 0 trains squared error, > 0 a Huber loss with this delta "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--init-stddev",
        type=float,
        default=d.init_stddev,
        help="item embedding init N(0, s) (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="initialization seed (default: %(default)s)")
    p.add_argument("--reconstruction-learning-rate", type=float, default=t.reconstruction_learning_rate)
    p.add_argument("--reconstruction-max-epochs", type=int, default=t.reconstruction_max_epochs)
    p.add_argument("--reconstruction-max-steps", type=int, default=t.reconstruction_max_steps)
    p.add_argument("--update-learning-rate", type=float, default=t.update_learning_rate)
    p.add_argument("--update-max-epochs", type=int, default=t.update_max_epochs)
    p.add_argument("--update-max-steps", type=int, default=t.update_max_steps)
    p.add_argument("--l2-global", type=float, default=t.l2_global, help="L2 on the item rows a batch touches")
    p.add_argument("--l2-local", type=float, default=t.l2_local, help="L2 on the local parameters")
    return p


def config_from_args(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        num_items=args.num_items,
        embedding_dim=args.embedding_dim,
        batch_size=args.batch_size,
        max_batches=args.max_batches,
        top_k=min(args.top_k, args.num_items),
        feedback=Feedback(args.feedback),
        item_bias=args.item_bias,
        user_bias=args.user_bias,
        global_mean=args.global_mean,
        global_mean_init=args.global_mean_init,
        rating_min=args.rating_min,
        rating_max=args.rating_max,
        huber_delta=args.huber_delta,
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.model is not None:
        return _export_user_model(args.model, args.model_arg, args.output_dir)
    if args.model_arg:
        print("error: --model-arg needs --model (the function that takes the arguments)", file=sys.stderr)
        return 2
    try:
        if args.config is not None:
            config = ModelConfig.from_json(json.loads(args.config.read_text()))
        else:
            config = config_from_args(args)
    except (ValueError, TypeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # TensorFlow loads only when exporting.
    from model_export.export import export_spec
    from model_export.matrix_factorization import build_spec

    _report(export_spec(build_spec(config), args.output_dir))
    return 0


def _export_user_model(target: str, model_args: list[str], output_dir: Path) -> int:
    from model_export.export import export_spec
    from model_export.model_args import ModelArgError, parse_model_args
    from model_export.spec import ExportError, ExportSpec

    module_name, _, function_name = target.partition(":")
    if not module_name or not function_name:
        print(
            f"error: --model takes MODULE:FUNCTION, e.g. my_pkg.my_model:build; got {target!r}",
            file=sys.stderr,
        )
        return 2
    try:
        build = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as e:
        print(f"error: cannot load {target!r}: {e}", file=sys.stderr)
        return 2
    try:
        spec = build(**parse_model_args(build, model_args))
    except (ModelArgError, ValueError) as e:
        # The builder's own checks (e.g. a size below 1) are the user's arguments being wrong too.
        print(f"error: {target}: {e}", file=sys.stderr)
        return 2
    if not isinstance(spec, ExportSpec):
        print(
            f"error: {target} returned {type(spec).__name__}, expected a model_export.spec.ExportSpec",
            file=sys.stderr,
        )
        return 2
    try:
        result = export_spec(spec, output_dir)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _report(result)
    return 0


def _report(result: ExportResult) -> None:
    print(
        f"exported {result.model_dir / 'model.tflite'}: {result.tflite_bytes:,} bytes "
        f"({result.tflite_bytes / result.parameter_bytes:.2f}x the {result.parameter_bytes:,} "
        f"bytes of parameters); signatures: {', '.join(sorted(result.manifest.signatures))}"
    )


if __name__ == "__main__":
    sys.exit(main())
