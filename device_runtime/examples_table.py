"""A per-device examples table: the user's own data, read and checked against a model's features.

One row per example: a device id column, a timestamp column and one column per feature of the
model's manifest (CSV, TSV or Parquet). Every value is checked against its `FeatureSpec` (type,
shape, range, whole values, finite) before anything is written; the first bad value is one
`TableError` line naming the file, the row, the column, the value and what was expected. Rows
count from 1 at the first row after a CSV's header (Parquet: the first row). A vector feature
(shape `[8]`) is a Parquet list column, or in CSV a cell of numbers separated by spaces or commas
(`"3 1 4"`, `"[3, 1, 4]"`).

`read_examples_table` gives each device's examples column-wise (`DeviceExamples`), for a
simulation to use as they are; `write_example_stores` writes one `ExampleStore` per device, all
stores checked before any is written, each new store created whole under a temporary name and
renamed, each existing one changed in one transaction.

Reading needs pyarrow (the `tables` extra), imported only here: the device runtime itself never
reads tables.
"""

from __future__ import annotations

import enum
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from contracts.features import Examples, FeatureSpec
from contracts.manifest import Manifest
from device_runtime.example_store import ExampleStore, ExampleStoreError

DEVICE_COLUMN, TIME_COLUMN = "device_id", "timestamp"
FORMATS = {".csv": "csv", ".tsv": "tsv", ".parquet": "parquet", ".pq": "parquet"}
# A device id names its store file: letters, digits, '.', '_', '-', not starting with '.'.
DEVICE_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
STORE_SUFFIX = ".sqlite"


class TableError(ValueError):
    """The table cannot be read for this model; one line that says where and what was expected."""


class IfExists(enum.StrEnum):
    """What `write_example_stores` does with a device whose store already holds examples."""

    REFUSE = "refuse"  # stop before writing anything
    APPEND = "append"  # add the table's examples to the store's
    REPLACE = "replace"  # the store's examples become the table's (its kept local state stays)


@dataclass(frozen=True)
class DeviceExamples:
    """One device's rows of the table: its examples (validated, in the model's dtypes, table order)
    and their timestamps (seconds since the epoch, float64)."""

    device_id: str
    examples: Examples
    timestamps: np.ndarray


@dataclass(frozen=True)
class ExamplesTable:
    path: Path
    features: tuple[FeatureSpec, ...]
    devices: dict[str, DeviceExamples]  # by device id, in order of first appearance
    num_rows: int
    marked: frozenset[str] = frozenset()  # the devices whose `marker_column` is 1 (e.g. held out)


@dataclass(frozen=True)
class WrittenStore:
    device_id: str
    path: Path
    added: int  # examples written
    status: str  # "created" | "appended" | "replaced"


def store_path(out_dir: Path, device_id: str) -> Path:
    """The example store of `device_id` in `out_dir` (as `write_example_stores` names it)."""
    return Path(out_dir) / f"{device_id}{STORE_SUFFIX}"


def table_format(path: Path) -> str:
    """'csv', 'tsv' or 'parquet', from the file's suffix."""
    found = FORMATS.get(Path(path).suffix.lower())
    if found is None:
        raise TableError(
            f"{path}: unknown table format {Path(path).suffix!r}; expected one of {sorted(FORMATS)}"
        )
    return found


def _implicit_label(manifest: Manifest) -> str | None:
    """The label that defaults to 1 (a share) when its column is absent: implicit feedback only."""
    if manifest.task.kind == "ranking" and manifest.task.negative_sampling:
        return manifest.label_features[0].name
    return None


def read_examples_table(
    path: Path,
    manifest: Manifest,
    *,
    device_column: str = DEVICE_COLUMN,
    time_column: str = TIME_COLUMN,
    marker_column: str | None = None,
) -> ExamplesTable:
    """Every row of the table checked against the manifest's features, grouped by device.

    A `TableError` for the first bad value (or a missing, unexpected or unreadable column)."""
    return read_table(
        path,
        manifest.features,
        implicit_label=_implicit_label(manifest),
        device_column=device_column,
        time_column=time_column,
        marker_column=marker_column,
    )


def read_table(
    path: Path,
    features: Sequence[FeatureSpec],
    *,
    implicit_label: str | None = None,
    device_column: str = DEVICE_COLUMN,
    time_column: str = TIME_COLUMN,
    marker_column: str | None = None,
) -> ExamplesTable:
    """`read_examples_table` for a list of features; `implicit_label`: a label whose column may be
    left out, every row then a share (1); `marker_column`: a column of 0 and 1, the same on all
    of a device's rows, that marks devices (`ExamplesTable.marked`), e.g. the ones to hold out."""
    path = Path(path)
    features = tuple(features)
    if device_column == time_column:
        raise TableError(f"the device and timestamp columns must differ, both are {device_column!r}")
    if marker_column in (device_column, time_column, *(f.name for f in features)):
        raise TableError(
            f"the marker column {marker_column!r} is the device, timestamp or a feature column; "
            "expected a column of its own"
        )
    marker = None if marker_column is None else FeatureSpec(marker_column, "int32", value_range=(0, 1))
    # CSV: an int32 feature's cells read as text, so that "3.0" is refused at its row rather than
    # the whole column inferred as floats.
    ints = [f.name for f in (*features, *([marker] if marker else [])) if f.dtype == "int32"]
    table = _read_arrow(path, device_column, ints)
    names = list(table.column_names)
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise TableError(f"{path}: the columns {repeated} appear more than once")
    wanted = [
        device_column,
        time_column,
        *(f.name for f in features),
        *([marker_column] if marker_column else []),
    ]
    missing = [c for c in wanted if c not in names and c != implicit_label]
    unexpected = [c for c in names if c not in wanted]
    if missing or unexpected:
        problems = [f"no column {', '.join(map(repr, missing))}"] if missing else []
        problems += [f"unexpected column {', '.join(map(repr, unexpected))}"] if unexpected else []
        raise TableError(
            f"{path}: {'; '.join(problems)}; a table for this model has the columns {wanted}"
            + (
                f" ({implicit_label!r} may be left out: every row is then a share, 1)"
                if implicit_label
                else ""
            )
        )
    n = table.num_rows
    if n == 0:
        raise TableError(f"{path}: the table has no rows; expected one row per example")
    where = _Where(path)
    ids = _device_ids(table.column(device_column), device_column, where)
    times = _timestamps(table.column(time_column), time_column, where)
    columns: dict[str, np.ndarray] = {}
    for feature in features:
        if feature.name not in names:
            columns[feature.name] = np.ones(n, np.float32)  # the implicit label: every row a share
        else:
            columns[feature.name] = _feature_column(table.column(feature.name), feature, where)
    examples = Examples(columns).validated(features)  # the checks above are the same, row by row
    devices = _by_device(ids, times, examples)
    marked: frozenset[str] = frozenset()
    if marker is not None:
        marks = _feature_column(table.column(marker.name), marker, where)
        marked = _marked(devices, _by_device(ids, times, Examples({marker.name: marks})), marker.name, path)
    return ExamplesTable(path, features, devices, n, marked)


def _marked(
    devices: Mapping[str, DeviceExamples], marks: Mapping[str, DeviceExamples], column: str, path: Path
) -> frozenset[str]:
    """The devices whose rows are all 1 in `column`; a device with both 0 and 1 is refused."""
    found = set()
    for name in devices:
        values = np.unique(marks[name].examples[column])
        if len(values) > 1:
            raise TableError(
                f"{path}: column {column!r} is both 0 and 1 on device {name!r}'s rows; expected one "
                "value a device (1: marked, e.g. held out)"
            )
        if values[0] == 1:
            found.add(name)
    return frozenset(found)


def _by_device(ids: Any, times: np.ndarray, examples: Examples) -> dict[str, DeviceExamples]:
    """Rows grouped by device id, devices in order of first appearance, rows in table order."""
    encoded = ids.dictionary_encode()
    codes = np.asarray(encoded.indices.to_numpy(zero_copy_only=False), np.int64)
    names = encoded.dictionary.to_pylist()
    order = np.argsort(codes, kind="stable")
    bounds = np.searchsorted(codes[order], np.arange(len(names) + 1))
    devices = {}
    for code, name in enumerate(names):
        rows = order[bounds[code] : bounds[code + 1]]
        devices[name] = DeviceExamples(name, examples.select(rows), times[rows])
    return devices


# ---- reading and converting columns ---------------------------------------------------------


def _pyarrow() -> Any:
    try:
        import pyarrow
    except ImportError:
        raise TableError(
            "reading an examples table needs pyarrow: pip install 'fedrecon-ondevice[tables]'"
        ) from None
    return pyarrow


def _read_arrow(path: Path, device_column: str, text_columns: Sequence[str] = ()) -> Any:
    kind = table_format(path)
    pa = _pyarrow()
    if not path.is_file():
        raise TableError(f"no examples table at {path}: expected a {kind.upper()} file")
    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path)
        import pyarrow.csv as pcsv

        return pcsv.read_csv(
            path,
            parse_options=pcsv.ParseOptions(delimiter="\t" if kind == "tsv" else ","),
            # Device ids stay text ("007" is not 7); only empty cells are missing ("nan" is a
            # number, reported as not finite).
            convert_options=pcsv.ConvertOptions(
                # (bytes, not string: a cell that is not UTF-8 is then named at its row, by _text)
                column_types={device_column: pa.string(), **{name: pa.binary() for name in text_columns}},
                null_values=[""],
                strings_can_be_null=True,
            ),
        )
    except (pa.ArrowException, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TableError(f"{path}: not a readable {kind.upper()} table: {first}") from None


class _Where:
    """Formats a bad value as one line: file, row (from 1), column, value, what was expected."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def error(self, row: int, column: str, value: Any, expected: str) -> TableError:
        shown = "an empty cell" if value is None else repr(value)
        return TableError(f"{self.path}, row {row + 1}, column {column!r}: got {shown}; expected {expected}")


def _text(column: Any, name: str, where: _Where) -> Any:
    """The column with bytes that are not UTF-8 (CSV cells pyarrow could not decode) named at their
    row, rather than misread as the feature's values; text columns as text."""
    pa = _pyarrow()
    column = column.combine_chunks()
    if not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
        return column
    for row, value in enumerate(column.to_pylist()):
        try:
            None if value is None else value.decode("utf-8")
        except UnicodeDecodeError:
            raise where.error(row, name, value, "UTF-8 text (save the table as UTF-8)") from None
    return column.cast(pa.string())


def _first_null(column: Any) -> int | None:
    if column.null_count == 0:
        return None
    valid = np.asarray(column.is_valid().to_numpy(zero_copy_only=False), bool)
    return int(np.flatnonzero(~valid)[0])


def _device_ids(column: Any, name: str, where: _Where) -> Any:
    pa = _pyarrow()
    import pyarrow.compute as pc

    expected = "a device id: 1 to 128 letters, digits, '.', '_' or '-', not starting with '.'"
    column = _text(column, name, where)
    null = _first_null(column)
    if null is not None:
        raise where.error(null, name, None, expected)
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    if pa.types.is_integer(column.type):
        column = pc.cast(column, pa.string())
    elif not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise where.error(0, name, column[0].as_py(), expected + f" (the column holds {column.type})")
    good = pc.match_substring_regex(column, f"^(?:{DEVICE_ID.pattern})$")
    bad = np.flatnonzero(~np.asarray(good.to_numpy(zero_copy_only=False), bool))
    if bad.size:
        raise where.error(int(bad[0]), name, column[int(bad[0])].as_py(), expected)
    return column


def _timestamps(column: Any, name: str, where: _Where) -> np.ndarray:
    """Seconds since the epoch: numbers, Arrow timestamps, or ISO 8601 text (no zone: UTC)."""
    pa = _pyarrow()
    import pyarrow.compute as pc

    expected = "seconds since the epoch or an ISO 8601 time such as 2026-11-25T21:00:00Z"
    column = _text(column, name, where)
    null = _first_null(column)
    if null is not None:
        raise where.error(null, name, None, expected)
    if pa.types.is_timestamp(column.type):
        micros = pc.cast(pc.cast(column, pa.timestamp("us", column.type.tz)), pa.int64())
        seconds = np.asarray(micros.to_numpy(), np.float64) / 1e6
    elif pa.types.is_integer(column.type) or pa.types.is_floating(column.type):
        seconds = np.asarray(column.to_numpy(zero_copy_only=False), np.float64)
    elif pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        seconds = _parse_each(column.to_pylist(), _parse_time, name, expected, where)
    else:
        raise where.error(0, name, column[0].as_py(), expected + f" (the column holds {column.type})")
    bad = np.flatnonzero(~np.isfinite(seconds))
    if bad.size:
        raise where.error(int(bad[0]), name, column[int(bad[0])].as_py(), expected + ", finite")
    return seconds


def _parse_time(text: str) -> float:
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        moment = datetime.fromisoformat(text)
        return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def _parse_each(
    values: list[Any], parse: Callable[[str], Any], name: str, expected: str, where: _Where
) -> np.ndarray:
    out = []
    for row, value in enumerate(values):
        try:
            out.append(parse(value))
        except (ValueError, TypeError, OverflowError):
            raise where.error(row, name, value, expected) from None
    return np.asarray(out, np.float64)


def _expected(feature: FeatureSpec) -> str:
    """What one value of `feature` must be, in words."""
    number = "an integer" if feature.dtype == "int32" else "a finite number"
    if feature.discrete and feature.dtype != "int32":
        number = "a whole number"
    if feature.value_range is not None:
        low, high = (_number(x) for x in feature.value_range)
        number += f" in [{low}, {high}]"
        if feature.tables:
            number += f" (the rows of {', '.join(map(repr, feature.tables))})"
    size = math.prod(feature.shape)
    if feature.shape:
        plural = "integers" if feature.dtype == "int32" else "numbers"
        return f"{size} {plural} (shape {list(feature.shape)}), each {number}"
    return number


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


_INTEGER_TEXT = re.compile(r"[+-]?[0-9]+")


def _parse_number(feature: FeatureSpec) -> Callable[[Any], float]:
    def parse(value: Any) -> float:
        if isinstance(value, bool) or value is None:
            raise ValueError("not a number")
        if feature.dtype == "int32":
            # Integers only: "3.0" and 3.0 are a float's spelling (a float column, a computed
            # value), which a whole-number check would let through whatever it rounded from.
            if isinstance(value, str) and _INTEGER_TEXT.fullmatch(value.strip()):
                return float(int(value))
            if isinstance(value, int | np.integer):
                return float(value)
            raise ValueError("not an integer")
        return float(value)

    return parse


def _parse_vector(feature: FeatureSpec) -> Callable[[Any], list[float]]:
    size, number = math.prod(feature.shape), _parse_number(feature)

    def parse(value: Any) -> list[float]:
        if isinstance(value, str):
            parts = [p for p in re.split(r"[\s,]+", value.strip().strip("[]")) if p]
        elif isinstance(value, list):
            parts = list(np.asarray(value, dtype=object).reshape(-1)) if value else []
        else:
            raise ValueError("not a list")
        if len(parts) != size:
            raise ValueError(f"{len(parts)} values")
        return [number(p) for p in parts]

    return parse


def _feature_column(column: Any, feature: FeatureSpec, where: _Where) -> np.ndarray:
    """A table column as the feature's values, [rows, *shape]; the first bad value is a TableError."""
    pa = _pyarrow()
    column = _text(column, feature.name, where)
    name, expected = feature.name, _expected(feature)
    null = _first_null(column)
    if null is not None:
        raise where.error(null, name, None, expected)
    kind = column.type
    if pa.types.is_dictionary(kind):
        column, kind = column.dictionary_decode(), kind.value_type
    if feature.shape:
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or _is_list(pa, kind)):
            raise where.error(0, name, column[0].as_py(), expected + f" (the column holds {kind})")
        flat = _parse_each(column.to_pylist(), _parse_vector(feature), name, expected, where)
        values = flat.reshape(len(column), *feature.shape)
    elif pa.types.is_floating(kind) and feature.dtype == "int32":
        raise where.error(
            0, name, column[0].as_py(), expected + f" (the column holds {kind}: an integer column)"
        )
    elif pa.types.is_integer(kind) or pa.types.is_floating(kind):
        values = np.asarray(column.to_numpy(zero_copy_only=False))
    elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
        values = _parse_each(column.to_pylist(), _parse_number(feature), name, expected, where)
    else:
        raise where.error(0, name, column[0].as_py(), expected + f" (the column holds {kind})")
    _check_values(values, column, feature, expected, where)
    return values.astype(np.int64 if feature.dtype == "int32" else np.float64, copy=False)


def _is_list(pa: Any, kind: Any) -> bool:
    return bool(pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind))


def parse_value(feature: FeatureSpec, text: str) -> np.ndarray:
    """One value of `feature` from text (`"21"`, `"3 1 4"` for shape [3]), checked against its spec
    and cast to its dtype; a ValueError says what was expected (no pyarrow needed)."""
    try:
        if feature.shape:
            value = np.asarray(_parse_vector(feature)(text), np.float64).reshape(feature.shape)
        else:
            value = np.asarray(_parse_number(feature)(text), np.float64)
    except (ValueError, TypeError, OverflowError):
        raise ValueError(f"got {text!r}; expected {_expected(feature)}") from None
    if _bad_rows(value.reshape(1, -1), feature).size:
        raise ValueError(f"got {text!r}; expected {_expected(feature)}")
    return value.astype(feature.dtype)


def _bad_rows(flat: np.ndarray, feature: FeatureSpec) -> np.ndarray:
    """Rows of `flat` ([rows, values]) that are not finite, not whole where integers are expected,
    outside int32 or outside the feature's range."""
    bad = ~np.all(np.isfinite(flat), axis=1)
    if feature.dtype == "int32" or feature.discrete:
        bad |= ~np.all(flat == np.round(flat), axis=1)
    if feature.dtype == "int32":
        bad |= np.any((flat < -(2**31)) | (flat >= 2**31), axis=1)
    if feature.value_range is not None:
        low, high = feature.value_range
        bad |= np.any((flat < low) | (flat > high), axis=1)
    return np.flatnonzero(bad)


def _check_values(
    values: np.ndarray, column: Any, feature: FeatureSpec, expected: str, where: _Where
) -> None:
    """Finite, whole where integers are expected, within int32 and within the feature's range."""
    rows = _bad_rows(values.reshape(len(values), -1).astype(np.float64), feature)
    if rows.size:
        row = int(rows[0])
        more = f" ({rows.size} rows are wrong)" if rows.size > 1 else ""
        shown = column[row].as_py()
        if isinstance(shown, str) and _INTEGER_TEXT.fullmatch(shown.strip()):
            shown = int(shown)  # an integer out of range, read as text (CSV): shown as the number
        raise where.error(row, feature.name, shown, expected + more)


# ---- writing example stores ------------------------------------------------------------------


def write_example_stores(
    table: ExamplesTable, out_dir: Path, *, if_exists: IfExists = IfExists.REFUSE
) -> list[WrittenStore]:
    """One example store per device of `table` in `out_dir` (`store_path`).

    Every existing store is opened and checked first (the model's feature layout; with
    `IfExists.REFUSE`, that it holds no examples): a `TableError` then, and nothing is written.
    A new store is written whole under a temporary name, then renamed; an existing one changes
    in one transaction. So a store is never half-written, even if the import stops midway."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise TableError(f"{out_dir} is not a directory; expected where to write the example stores")
    existing: dict[str, int] = {}
    for device in table.devices:
        path = store_path(out_dir, device)
        if path.exists():
            existing[device] = _existing_count(path, table.features)
    full = sorted(d for d, count in existing.items() if count)
    if full and if_exists is IfExists.REFUSE:
        shown = ", ".join(str(store_path(out_dir, d)) for d in full[:3]) + (" ..." if len(full) > 3 else "")
        raise TableError(
            f"{len(full)} example store(s) already hold examples ({shown}): pass --append to add the "
            "table's examples to them or --replace to replace theirs; nothing was written"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for device, rows in table.devices.items():
        path = store_path(out_dir, device)
        if device in existing:
            replace = if_exists is IfExists.REPLACE
            with ExampleStore(path, table.features) as store:
                added = store.add_examples(rows.examples, rows.timestamps, replace=replace)
            written.append(WrittenStore(device, path, added, "replaced" if replace else "appended"))
        else:
            added = _create_store(path, table.features, rows)
            written.append(WrittenStore(device, path, added, "created"))
    return written


def _existing_count(path: Path, features: tuple[FeatureSpec, ...]) -> int:
    try:
        with ExampleStore(path, features) as store:
            return store.count()
    except ExampleStoreError as e:
        raise TableError(f"{e}; nothing was written") from None


def _create_store(path: Path, features: tuple[FeatureSpec, ...], rows: DeviceExamples) -> int:
    """A new store written under a temporary name in the same directory, then renamed into place."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with ExampleStore(temporary, features) as store:
            added = store.add_examples(rows.examples, rows.timestamps)
        # The last connection's close checkpoints the WAL into the file and removes it.
        os.replace(temporary, path)
    finally:
        for leftover in (temporary, Path(f"{temporary}-wal"), Path(f"{temporary}-shm")):
            leftover.unlink(missing_ok=True)
    return added


def summary(written: list[WrittenStore], table: ExamplesTable) -> Mapping[str, int]:
    """Counts for a one-line report: stores by status and examples written."""
    counts = {
        status: sum(1 for w in written if w.status == status)
        for status in ("created", "appended", "replaced")
    }
    return {
        "stores": len(written),
        "examples": sum(w.added for w in written),
        "rows": table.num_rows,
        **counts,
    }
