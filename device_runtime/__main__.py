"""`python -m device_runtime`: a device's side of the system from the command line.

- `import`: a per-device examples table (CSV, TSV or Parquet: a device id, a timestamp and one
  column per feature of the model) checked against an exported model and written as one example
  store per device;
- `recommend`: a device's top-k, served on the device: the device's own example store and an
  exported model directory (`model.tflite`, `manifest.json`, and the global parameters: the
  export's initial ones, or a file downloaded from the orchestrator's `/models/{version}/global`),
  ranked with local parameters reconstructed from the store (FedRecon) or kept by training (FURL).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from contracts.features import FeatureSpec
from contracts.manifest import INITIAL_GLOBAL_FILE, ManifestError, load_manifest
from contracts.params import ParamsError, decode_params
from device_runtime.example_store import ExampleStore, ExampleStoreError
from device_runtime.examples_table import (
    DEVICE_COLUMN,
    TIME_COLUMN,
    IfExists,
    TableError,
    read_examples_table,
    summary,
    write_example_stores,
)
from device_runtime.local_state import LocalStateStore
from device_runtime.recommender import Recommender
from model_runtime.tflite_model import ModelLoadError, TFLiteModel

RECONSTRUCTED, KEPT = "reconstructed", "kept"


class CommandError(RuntimeError):
    """Input the user can fix; printed as one line."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m device_runtime", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    imports = sub.add_parser(
        "import",
        help="write a per-device examples table into one example store per device",
        description="Check every row of a per-device examples table (one row per example: a device id, "
        "a timestamp and one column per feature of the model) against an exported model's features, "
        "then write one example store per device, DEVICE.sqlite in --out. A bad row is one line "
        "(file, row, column, value, what was expected) and nothing is written.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    imports.add_argument(
        "--model-dir", type=Path, required=True, help="an export: its manifest.json declares the features"
    )
    imports.add_argument("--examples", type=Path, required=True, help="the table: .csv, .tsv or .parquet")
    imports.add_argument("--out", type=Path, required=True, help="the directory of the example stores")
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
        help="top-k items for the device whose example store is given",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    recommend.add_argument("--store", type=Path, required=True, help="the device's example store (SQLite)")
    recommend.add_argument(
        "--model-dir", type=Path, required=True, help="an export: model.tflite and manifest.json"
    )
    recommend.add_argument(
        "--globals",
        type=Path,
        help=f"global parameters (safetensors); default: the export's {INITIAL_GLOBAL_FILE}",
    )
    recommend.add_argument(
        "--locals",
        choices=(RECONSTRUCTED, KEPT),
        default=RECONSTRUCTED,
        help="reconstruct the user's parameters from the store, or use those kept by training (FURL)",
    )
    recommend.add_argument("--population", help="whose kept parameters (needed with --locals kept)")
    recommend.add_argument("-k", "--top-k", type=int, default=10)
    recommend.add_argument("--exclude", default="", help="comma-separated item ids to leave out")
    recommend.add_argument(
        "--include-used", action="store_true", help="also recommend items the user already has examples for"
    )
    recommend.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


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


def _exclusions(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise CommandError(f"--exclude takes comma-separated item ids, got {text!r}") from None


def import_table(args: argparse.Namespace) -> dict[str, object]:
    """`import`: the table checked whole, then one store per device; a summary."""
    if not args.model_dir.is_dir():
        raise CommandError(
            f"no model directory at {args.model_dir}: expected the output of `python -m model_export`"
        )
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


def recommend(args: argparse.Namespace) -> dict[str, object]:
    if args.locals == KEPT and not args.population:
        raise CommandError("--locals kept needs --population: kept parameters are per population")
    if not args.model_dir.is_dir():
        raise CommandError(
            f"no model directory at {args.model_dir}: expected the output of `python -m model_export`"
        )
    try:
        model = TFLiteModel(args.model_dir)
    except (ManifestError, ModelLoadError) as e:
        raise CommandError(str(e)) from None
    globals_path = args.globals or args.model_dir / INITIAL_GLOBAL_FILE
    try:
        params = decode_params(globals_path.read_bytes(), model.manifest.global_params, str(globals_path))
    except OSError as e:
        raise CommandError(f"cannot read global parameters {globals_path}: {e}") from None
    except ParamsError as e:
        raise CommandError(str(e)) from None
    store = _open_store(args.store, model.manifest.features)
    migrated = (
        f"{args.store} was migrated from example store schema {store.migrated_from} to the model's features"
        if store.migrated_from is not None
        else ""
    )
    try:
        kept = None
        if args.locals == KEPT:
            kept = LocalStateStore(store, args.population)
            loaded = kept.load(model)
            if not loaded.trained:
                raise CommandError(
                    f"{args.store} has no kept local parameters for population {args.population!r} "
                    f"({loaded.note}); try --locals reconstructed"
                )
        recommender = Recommender(model, store, params, kept=kept)
        try:
            found = recommender.recommend(
                args.top_k, exclude=_exclusions(args.exclude), exclude_used=not args.include_used
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
        "globals": str(globals_path),
        "source": found.source,
        "local_params": found.local_params,
        "message": "; ".join(m for m in (migrated, found.message) if m),
        "items": [int(i) for i in found.items],
        "scores": [float(s) for s in np.asarray(found.scores, np.float64)],
    }


def _print_table(result: dict[str, object]) -> None:
    how = str(result["source"])
    if result["local_params"]:
        how += f", {result['local_params']} local parameters"
    sha = str(result["model_sha256"])[:12]
    print(f"{result['store']}: {result['examples']} examples; model {sha}... ({how})")
    if result["message"]:
        print(result["message"])
    print(f"{'rank':>4}  {'item':>6}  score")
    items, scores = result["items"], result["scores"]
    assert isinstance(items, list) and isinstance(scores, list)
    for rank, (item, score) in enumerate(zip(items, scores, strict=True), 1):
        print(f"{rank:>4}  {item:>6}  {score:.4f}")


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
        result = recommend(args)
    except CommandError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        _print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
