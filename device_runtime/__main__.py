"""`python -m device_runtime` (`device-runtime`): a device's side of the system from the command line.

- `import`: a per-device examples table (CSV, TSV or Parquet: a device id, a timestamp and one
  column per feature of the model) checked against an exported model and written as one example
  store per device;
- `recommend`: a ranking model's top-k for one device, in a context (`--context hour=21`) for a
  model that takes one;
- `predict`: a classification or regression model's output for one example (`--input NAME=VALUE`).

`recommend` and `predict` read the device's own example store and an exported model directory
(`model.tflite`, `manifest.json`, and the global parameters: the export's initial ones, or a file
downloaded from the orchestrator's `/models/{version}/global`), with the user's local parameters
reconstructed from the store (FedRecon) or kept by training (FURL). Bad input is one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from contracts.command_line import CommandParser, quiet_on_closed_pipe
from contracts.features import Examples, FeatureSpec
from contracts.manifest import INITIAL_GLOBAL_FILE, ManifestError, load_manifest
from contracts.params import Params, ParamsError, decode_params
from contracts.task_config import TaskConfig
from device_runtime.example_store import ExampleStore, ExampleStoreError
from device_runtime.examples_table import (
    DEVICE_COLUMN,
    TIME_COLUMN,
    IfExists,
    TableError,
    parse_value,
    read_examples_table,
    summary,
    write_example_stores,
)
from device_runtime.local_state import LocalStateStore
from device_runtime.recommender import Predictor, Recommender
from model_runtime.tflite_model import ModelLoadError, TFLiteModel

RECONSTRUCTED, KEPT = "reconstructed", "kept"
PROG = "device-runtime"


class CommandError(RuntimeError):
    """Input the user can fix; printed as one line."""


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown where there is one worth showing (not None, off, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, [], "") or action.default is argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action) or ""


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog=PROG,
        description="A device's side of on-device personalization: import a per-device examples table "
        "into example stores, and serve a model's recommendations or predictions from one device's "
        "store (no TensorFlow needed).",
        epilog=f"`{PROG} COMMAND --help` for each command's options.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{import,recommend,predict}")
    formatter = _Help
    imports = sub.add_parser(
        "import",
        help="write a per-device examples table into one example store per device",
        description="Check every row of a per-device examples table (one row per example: a device id, "
        "a timestamp and one column per feature of the model) against an exported model's features, "
        "then write one example store per device, DEVICE.sqlite in --out. A bad row is one line "
        "(file, row, column, value, what was expected) and nothing is written.",
        formatter_class=formatter,
    )
    imports.add_argument(
        "--model-dir",
        type=Path,
        required=True,
        metavar="DIR",
        help="an export: its manifest.json declares the features",
    )
    imports.add_argument(
        "--examples", type=Path, required=True, metavar="TABLE", help="the table: .csv, .tsv or .parquet"
    )
    imports.add_argument(
        "--out", type=Path, required=True, metavar="DIR", help="the directory of the example stores"
    )
    imports.add_argument("--device-column", default=DEVICE_COLUMN, help="the column of device ids")
    imports.add_argument(
        "--time-column", default=TIME_COLUMN, help="the column of times (epoch seconds or ISO 8601)"
    )
    existing = imports.add_mutually_exclusive_group()
    existing.add_argument(
        "--append", action="store_true", help="add to stores that already hold examples (else refused)"
    )
    existing.add_argument(
        "--replace", action="store_true", help="replace the examples of stores that already hold some"
    )

    recommend = sub.add_parser(
        "recommend",
        help="a ranking model's top-k items for one device",
        description="Rank a ranking model's whole catalog for the device whose example store is given "
        "(in --context for a model with context features) and print the top k.",
        formatter_class=formatter,
    )
    _personal_arguments(recommend)
    recommend.add_argument(
        "--context",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a context feature's value for this ranking (e.g. hour=21); one per context feature",
    )
    recommend.add_argument("-k", "--top-k", type=int, default=10, metavar="K", help="how many items")
    recommend.add_argument(
        "--exclude", default="", metavar="IDS", help="comma-separated item ids to leave out"
    )
    recommend.add_argument(
        "--include-used", action="store_true", help="also recommend items the user already has examples for"
    )
    recommend.add_argument("--json", action="store_true", help="print JSON instead of a table")

    predict = sub.add_parser(
        "predict",
        help="a classification or regression model's output for one example",
        description="The output of a classification model (its top classes) or a regression model (its "
        "prediction) for one example given by its input features, with the local parameters of the "
        "device whose example store is given.",
        formatter_class=formatter,
    )
    _personal_arguments(predict)
    predict.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an input feature's value (e.g. movie=12); one per input feature of the model",
    )
    predict.add_argument("--json", action="store_true", help="print JSON instead of text")
    return parser


def _personal_arguments(parser: argparse.ArgumentParser) -> None:
    """What `recommend` and `predict` share: the device's store, the model, whose locals."""
    parser.add_argument(
        "--store", type=Path, required=True, metavar="FILE", help="the device's example store (SQLite)"
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        required=True,
        metavar="DIR",
        help="an export: model.tflite and manifest.json",
    )
    parser.add_argument(
        "--globals",
        type=Path,
        metavar="FILE",
        help=f"global parameters (safetensors); default: the export's {INITIAL_GLOBAL_FILE}",
    )
    parser.add_argument(
        "--locals",
        choices=(RECONSTRUCTED, KEPT),
        default=RECONSTRUCTED,
        help="reconstruct the user's parameters from the store, or use those kept by training (FURL)",
    )
    parser.add_argument("--population", metavar="NAME", help="whose kept parameters (with --locals kept)")
    parser.add_argument(
        "--task-config",
        type=Path,
        metavar="FILE",
        help="the population's task config (JSON, as GET /v1/populations/NAME/task-config answers): "
        "reconstruct as its training does; default: the export's training defaults",
    )


# ---- import -------------------------------------------------------------------------------


def import_table(args: argparse.Namespace) -> dict[str, object]:
    """`import`: the table checked whole, then one store per device; a summary."""
    _check_model_dir(args.model_dir)
    try:
        manifest = load_manifest(args.model_dir)
        table = read_examples_table(
            args.examples, manifest, device_column=args.device_column, time_column=args.time_column
        )
        if_exists = IfExists.APPEND if args.append else IfExists.REPLACE if args.replace else IfExists.REFUSE
        written = write_example_stores(table, args.out, if_exists=if_exists)
    except (ManifestError, TableError) as e:
        raise CommandError(str(e)) from None
    return {"out": str(args.out), **summary(written, table)}


# ---- recommend and predict ----------------------------------------------------------------


def _check_model_dir(model_dir: Path) -> None:
    if not model_dir.is_dir():
        raise CommandError(
            f"no model directory at {model_dir}: expected the output of `python -m model_export`"
        )


def _open_store(path: Path, features: Sequence[FeatureSpec]) -> ExampleStore:
    """The device's store, opened with the model's features: one of another layout is refused, and
    one of the first schema (item, label) is migrated to them, as the device's trainer does."""
    # ExampleStore creates a missing file; a typo must not become an empty device.
    if not path.is_file():
        raise CommandError(f"no example store at {path}: expected a device's SQLite example store file")
    try:
        return ExampleStore(path, features)
    except ExampleStoreError as e:
        raise CommandError(str(e)) from None


def _load_model(args: argparse.Namespace, ranking: bool) -> tuple[TFLiteModel, Params]:
    """The model and its globals, checked before the store is touched; a model of the wrong task
    (a ranking model asked to predict, or another asked to recommend) is refused here."""
    if args.locals == KEPT and not args.population:
        raise CommandError("--locals kept needs --population: kept parameters are per population")
    _check_model_dir(args.model_dir)
    try:
        model = TFLiteModel(args.model_dir)
    except (ManifestError, ModelLoadError) as e:
        raise CommandError(str(e)) from None
    kind = model.manifest.task.kind
    if ranking and kind != "ranking":
        raise CommandError(
            f"{args.model_dir} is a {kind} model: `recommend` ranks a ranking model's catalog; "
            f"use `{PROG} predict` for its predictions"
        )
    if not ranking and kind == "ranking":
        raise CommandError(
            f"{args.model_dir} is a ranking model: `predict` is for classification and regression "
            f"models; use `{PROG} recommend` for its top-k items"
        )
    globals_path = args.globals or args.model_dir / INITIAL_GLOBAL_FILE
    try:
        params = decode_params(globals_path.read_bytes(), model.manifest.global_params, str(globals_path))
    except OSError as e:
        raise CommandError(f"cannot read global parameters {globals_path}: {e}") from None
    except ParamsError as e:
        raise CommandError(str(e)) from None
    return model, params


def _task_config(args: argparse.Namespace, model: TFLiteModel) -> TaskConfig | None:
    """The population's task config from `--task-config`, checked against the model; None without."""
    if args.task_config is None:
        return None
    try:
        document = json.loads(args.task_config.read_text())
    except OSError as e:
        raise CommandError(f"cannot read --task-config {args.task_config}: {e}") from None
    except ValueError as e:
        raise CommandError(f"--task-config {args.task_config} is not JSON: {e}") from None
    if not isinstance(document, dict):
        raise CommandError(f"--task-config {args.task_config}: expected a JSON object of task settings")
    try:
        return TaskConfig.from_manifest(model.manifest, **document)
    except (TypeError, ValueError) as e:
        raise CommandError(f"--task-config {args.task_config}: {e}") from None


def _named_values(pairs: list[str], features: Sequence[FeatureSpec], flag: str, what: str) -> dict[str, Any]:
    """`NAME=VALUE` pairs as one checked value per feature of `features` (all of them, no other)."""
    by_name = {f.name: f for f in features}
    values: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        name = name.strip()
        if not sep or name not in by_name or name in values:
            problem = (
                "expected NAME=VALUE"
                if not sep
                else f"{name!r} is given twice"
                if name in values
                else f"the model has no {what} {name!r}"
            )
            raise CommandError(f"{flag} {pair!r}: {problem}; the model's {what}s are {sorted(by_name)}")
        try:
            values[name] = parse_value(by_name[name], text)
        except ValueError as e:
            raise CommandError(f"{flag} {name}: {e}") from None
    missing = sorted(set(by_name) - set(values))
    if missing:
        hint = " ".join(f"{flag} {n}=VALUE" for n in missing)
        raise CommandError(f"this model needs a value of each {what} {missing}: give {hint}")
    return values


def _locals(args: argparse.Namespace, store: ExampleStore, model: TFLiteModel) -> LocalStateStore | None:
    if args.locals != KEPT:
        return None
    kept = LocalStateStore(store, args.population)
    loaded = kept.load(model)
    if not loaded.trained:
        raise CommandError(
            f"{args.store} has no kept local parameters for population {args.population!r} "
            f"({loaded.note}); try --locals reconstructed"
        )
    return kept


def _migrated(args: argparse.Namespace, store: ExampleStore) -> str:
    if store.migrated_from is None:
        return ""
    return (
        f"{args.store} was migrated from example store schema {store.migrated_from} to the model's features"
    )


def _exclusions(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise CommandError(f"--exclude takes comma-separated item ids, got {text!r}") from None


def recommend(args: argparse.Namespace) -> dict[str, object]:
    model, params = _load_model(args, ranking=True)
    task = _task_config(args, model)
    context = _named_values(args.context, model.manifest.context_features, "--context", "context feature")
    exclude = _exclusions(args.exclude)
    store = _open_store(args.store, model.manifest.features)
    try:
        recommender = Recommender(model, store, params, task, kept=_locals(args, store, model))
        try:
            found = recommender.recommend(
                args.top_k, exclude=exclude, exclude_used=not args.include_used, context=context
            )
        except ValueError as e:
            raise CommandError(str(e)) from None
        examples = store.count()
    except ExampleStoreError as e:
        raise CommandError(str(e)) from None
    finally:
        store.close()
    return {
        "store": str(args.store),
        "examples": examples,
        "model_sha256": model.manifest.model_sha256,
        "globals": str(args.globals or args.model_dir / INITIAL_GLOBAL_FILE),
        "context": {k: np.asarray(v).tolist() for k, v in context.items()},
        "source": found.source,
        "local_params": found.local_params,
        "message": "; ".join(m for m in (_migrated(args, store), found.message) if m),
        "items": [int(i) for i in found.items],
        "scores": [float(s) for s in np.asarray(found.scores, np.float64)],
    }


def predict(args: argparse.Namespace) -> dict[str, object]:
    model, params = _load_model(args, ranking=False)
    task = _task_config(args, model)
    inputs = _named_values(args.input, model.manifest.input_features, "--input", "input feature")
    store = _open_store(args.store, model.manifest.features)
    try:
        predictor = Predictor(model, store, params, task, kept=_locals(args, store, model))
        example = Examples({name: np.asarray(value)[None] for name, value in inputs.items()})
        try:
            found = predictor.predict(example)
        except ValueError as e:
            raise CommandError(str(e)) from None
        examples = store.count()
    except ExampleStoreError as e:
        raise CommandError(str(e)) from None
    finally:
        store.close()
    return {
        "store": str(args.store),
        "examples": examples,
        "model_sha256": model.manifest.model_sha256,
        "task": model.manifest.task.kind,
        "inputs": {k: np.asarray(v).tolist() for k, v in inputs.items()},
        "local_params": found.local_params,
        "message": _migrated(args, store),
        **{k: np.asarray(v[0]).tolist() for k, v in found.outputs.items()},
    }


# ---- output -------------------------------------------------------------------------------


def _header(result: dict[str, object], how: str) -> None:
    sha = str(result["model_sha256"])[:12]
    print(f"{result['store']}: {result['examples']} examples; model {sha}... ({how})")
    if result["message"]:
        print(result["message"])


def _print_ranking(result: dict[str, object]) -> None:
    how = str(result["source"])
    if result["local_params"]:
        how += f", {result['local_params']} local parameters"
    context = result["context"]
    assert isinstance(context, dict)
    if context:
        how += ", context " + ", ".join(f"{k}={v}" for k, v in context.items())
    _header(result, how)
    print(f"{'rank':>4}  {'item':>6}  score")
    items, scores = result["items"], result["scores"]
    assert isinstance(items, list) and isinstance(scores, list)
    for rank, (item, score) in enumerate(zip(items, scores, strict=True), 1):
        print(f"{rank:>4}  {item:>6}  {score:.4f}")


def _print_prediction(result: dict[str, object]) -> None:
    _header(result, f"{result['task']}, {result['local_params']} local parameters")
    if result["task"] == "regression":
        print(f"prediction: {float(result['predictions']):.4f}")  # type: ignore[arg-type]
        return
    classes, scores = result["top_classes"], result["top_scores"]
    assert isinstance(classes, list) and isinstance(scores, list)
    print(f"{'rank':>4}  {'class':>6}  score")
    for rank, (label, score) in enumerate(zip(classes, scores, strict=True), 1):
        print(f"{rank:>4}  {label:>6}  {score:.4f}")


@quiet_on_closed_pipe
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "import":
            imported = import_table(args)
            print(
                f"{imported['out']}: {imported['examples']} examples of {imported['rows']} rows in "
                f"{imported['stores']} example stores ({imported['created']} created, "
                f"{imported['appended']} appended, {imported['replaced']} replaced)"
            )
            return 0
        result = recommend(args) if args.command == "recommend" else predict(args)
    except CommandError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    elif args.command == "recommend":
        _print_ranking(result)
    else:
        _print_prediction(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
