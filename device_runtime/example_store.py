"""The device's local examples in a SQLite file. Examples never leave the device.

The app writes events (an example's named features, per the model's feature spec: an
expression share, a rating, a sentence) as the user does things; the trainer and the
recommender read them. Each example is one row: its features packed as one little-endian
record (a numpy structured dtype of the spec), its time and context; the store records
the spec's layout and refuses to be opened with another. SQLite in WAL mode lets one writer
and many readers work at once, across threads and processes; each thread has its own
connection. Every write is one transaction, validated before it starts, so a bad event or
a crash never leaves half a batch behind.
"""

from __future__ import annotations

import json
import math
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from contracts.features import Examples, FeatureSpec, FeatureSpecError, InvalidExamples
from device_runtime.task_environment import Selection

_SCHEMA = """
CREATE TABLE IF NOT EXISTS examples (
    id INTEGER PRIMARY KEY,
    features BLOB NOT NULL,
    timestamp REAL NOT NULL,
    context TEXT
);
CREATE INDEX IF NOT EXISTS examples_by_time ON examples (timestamp);
CREATE TABLE IF NOT EXISTS store_meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO store_meta (key, value) VALUES ('revision', 0);
CREATE TRIGGER IF NOT EXISTS examples_insert AFTER INSERT ON examples
    BEGIN UPDATE store_meta SET value = value + 1 WHERE key = 'revision'; END;
CREATE TRIGGER IF NOT EXISTS examples_delete AFTER DELETE ON examples
    BEGIN UPDATE store_meta SET value = value + 1 WHERE key = 'revision'; END;
CREATE TRIGGER IF NOT EXISTS examples_update AFTER UPDATE ON examples
    BEGIN UPDATE store_meta SET value = value + 1 WHERE key = 'revision'; END;
CREATE TABLE IF NOT EXISTS local_state (key TEXT PRIMARY KEY, value BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS store_features (id INTEGER PRIMARY KEY CHECK (id = 1), spec TEXT NOT NULL);
"""


def _create_schema(conn: sqlite3.Connection) -> None:
    """The schema, statement by statement inside the caller's transaction (`executescript` would
    commit it first)."""
    statement = ""
    for line in _SCHEMA.strip().splitlines(keepends=True):
        statement += line
        if sqlite3.complete_statement(statement):
            conn.execute(statement)
            statement = ""


# 1: (item_id, label) columns, before models declared their features; 2: features per the spec.
_SCHEMA_VERSION = 2


class ExampleStoreError(RuntimeError):
    """The store file cannot be opened or read as an example store."""


@dataclass(frozen=True)
class Event:
    """One example at `timestamp`: its `features` by name (e.g. `{"item": 17, "label": 4.0}`)."""

    features: Mapping[str, Any]
    timestamp: float
    context: str | None = None


EVERY_EXAMPLE = Selection()  # newest first, no window, no cap


def _sql(selection: Selection) -> tuple[str, list[object]]:
    """The WHERE, ORDER BY and LIMIT clauses of `selection`, with their arguments."""
    where: list[str] = []
    args: list[object] = []
    if selection.since is not None:
        where.append("timestamp >= ?")
        args.append(selection.since)
    if selection.until is not None:
        where.append("timestamp < ?")
        args.append(selection.until)
    if selection.context is not None:
        where.append("context = ?")
        args.append(selection.context)
    clause = (" WHERE " + " AND ".join(where)) if where else ""
    order = " ORDER BY timestamp DESC, id DESC" if selection.newest_first else " ORDER BY timestamp, id"
    limit = ""
    if selection.limit is not None:
        limit = " LIMIT ?"
        args.append(max(int(selection.limit), 0))
    return clause + order + limit, args


def record_dtype(features: Sequence[FeatureSpec]) -> np.dtype:
    """One example's features as one packed little-endian record."""
    return np.dtype([(f.name, "<i4" if f.dtype == "int32" else "<f4", f.shape) for f in features])


def _layout(features: Sequence[FeatureSpec]) -> list[dict[str, Any]]:
    """What the stored records depend on: names, dtypes, shapes and roles (not value ranges)."""
    return [
        {k: v for k, v in f.to_json().items() if k in ("name", "dtype", "shape", "role")} for f in features
    ]


class ExampleStore:
    """A device's examples, with the features of `features` (the model's spec), enforced on write.

    A new store needs `features`; an existing one remembers its own, and opening it with
    features of another layout is an `ExampleStoreError`. A store of the first schema
    (item, label) is migrated when opened with a spec of one integer input and one label.
    """

    def __init__(
        self, path: Path, features: Sequence[FeatureSpec] | None = None, *, durable: bool = True
    ) -> None:
        """`durable=False`: writes do not wait for the disk (SQLite's `synchronous = OFF`), for a
        store that is written in one go and can be written again (a simulation's fleet, whose
        thousands of stores waited 35 ms each for the disk); a crash may lose such a store."""
        self.path = Path(path)
        self._synchronous = "NORMAL" if durable else "OFF"
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self.migrated_from: int | None = None  # the schema this open migrated the store from, if any
        try:
            self._open(features)
        except BaseException:
            self.close()  # a store that cannot be opened leaves no connection (nor WAL files) behind
            raise

    def _open(self, features: Sequence[FeatureSpec] | None) -> None:
        try:
            conn = self._connection()
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version == 1:
                self._migrate_from_v1(conn, features)
                self.migrated_from = 1
            elif version != _SCHEMA_VERSION:
                if features is None:
                    raise ExampleStoreError(f"{self.path} is a new example store: give the model's features")
                with conn:
                    conn.execute("BEGIN IMMEDIATE")
                    _create_schema(conn)
                    conn.execute(
                        "INSERT OR IGNORE INTO store_features (id, spec) VALUES (1, ?)",
                        (json.dumps([f.to_json() for f in features]),),
                    )
                    conn.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
            stored = [FeatureSpec.from_json(f) for f in json.loads(self._stored_spec(conn))]
        except (sqlite3.DatabaseError, FeatureSpecError, json.JSONDecodeError) as e:
            raise ExampleStoreError(f"{self.path} is not a usable example store: {e}") from None
        if features is not None and _layout(features) != _layout(stored):
            raise ExampleStoreError(
                f"{self.path} holds examples with the features {_layout(stored)}; the model's are "
                f"{_layout(features)}: use a store per model layout (or export the model with these features)"
            )
        self.features: tuple[FeatureSpec, ...] = tuple(features if features is not None else stored)
        self._record = record_dtype(self.features)

    def mismatch(self, features: Sequence[FeatureSpec]) -> str | None:
        """Why this store's examples cannot feed a model of `features` (another layout: names,
        dtypes, shapes, roles), in one line; None when they can."""
        if _layout(features) == _layout(self.features):
            return None
        return (
            f"the example store {self.path} holds examples of ({_describe(self.features)}); the model "
            f"takes ({_describe(features)}): this device's data is not for this model"
        )

    @staticmethod
    def _stored_spec(conn: sqlite3.Connection) -> str:
        row = conn.execute("SELECT spec FROM store_features WHERE id = 1").fetchone()
        if row is None:
            raise sqlite3.DatabaseError("it has no feature spec")
        return str(row[0])

    def _migrate_from_v1(self, conn: sqlite3.Connection, features: Sequence[FeatureSpec] | None) -> None:
        """Schema 1 held (item_id, label): rewrite its rows as records of `features`, in one transaction."""
        inputs = [f for f in features or () if f.role == "input"]
        labels = [f for f in features or () if f.role == "label"]
        if not (
            features is not None
            and len(inputs) == 1
            and len(labels) == 1
            and len(features) == 2
            and inputs[0].dtype == "int32"
            and not inputs[0].shape
            and not labels[0].shape
        ):
            raise ExampleStoreError(
                f"{self.path} holds (item, label) examples from before feature specs; it can be migrated "
                "only to a model with one scalar int32 input and one scalar label, got "
                f"{None if features is None else _layout(features)}"
            )
        with conn:
            conn.execute("BEGIN IMMEDIATE")
            old = conn.execute(
                "SELECT id, item_id, label, timestamp, context FROM examples ORDER BY id"
            ).fetchall()
            columns = {
                inputs[0].name: np.asarray([r[1] for r in old], np.int64),
                labels[0].name: np.asarray([r[2] for r in old], np.float64),
            }
            try:
                checked = Examples(columns).validated(features)
            except InvalidExamples as e:
                raise ExampleStoreError(
                    f"{self.path}: its (item, label) examples do not fit the model's features ({e}); "
                    "left as they are"
                ) from None
            conn.execute("DROP TABLE examples")
            _create_schema(conn)
            conn.execute(
                "INSERT INTO store_features (id, spec) VALUES (1, ?)",
                (json.dumps([f.to_json() for f in features]),),
            )
            blobs = _pack_records(checked, record_dtype(features))
            conn.executemany(
                "INSERT INTO examples (id, features, timestamp, context) VALUES (?, ?, ?, ?)",
                [(r[0], blob, r[3], r[4]) for r, blob in zip(old, blobs, strict=True)],
            )
            conn.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")

    def _connection(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            # isolation_level=None: transactions are explicit (`with conn` / BEGIN), never implied.
            conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA busy_timeout = 30000")
            # Before the journal mode: switching a new file to WAL waits for the disk otherwise.
            conn.execute(f"PRAGMA synchronous = {self._synchronous}")
            conn.execute("PRAGMA journal_mode = WAL")
            self._local.conn = conn
            with self._lock:
                self._connections.append(conn)
        return conn

    def close(self) -> None:
        with self._lock:
            for conn in self._connections:
                conn.close()
            self._connections.clear()
        self._local = threading.local()

    def __enter__(self) -> ExampleStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- writes ------------------------------------------------------------------------

    def _checked(self, events: Sequence[Event]) -> tuple[list[bytes], list[tuple[float, str | None]]]:
        names = [f.name for f in self.features]
        shapes = {f.name: f.shape for f in self.features}
        for i, event in enumerate(events):
            if not isinstance(event.features, Mapping) or set(event.features) != set(names):
                got = sorted(event.features) if isinstance(event.features, Mapping) else event.features
                raise InvalidExamples(f"event {i}: expected the features {sorted(names)}, got {got!r}")
            for name, value in event.features.items():
                if np.shape(value) != shapes[name]:
                    raise InvalidExamples(
                        f"event {i}: feature {name!r} must have shape {list(shapes[name])}, "
                        f"got {list(np.shape(value))}"
                    )
                # numpy would read True as 1 in a column of integers.
                if np.asarray(value).dtype.kind == "b":
                    raise InvalidExamples(
                        f"event {i}: feature {name!r} must be integers or numbers, got {value!r}"
                    )
        times: list[tuple[float, str | None]] = []
        for i, event in enumerate(events):
            try:
                timestamp = float(event.timestamp)
            except (TypeError, ValueError):
                raise InvalidExamples(
                    f"event {i}: timestamp must be a number, got {event.timestamp!r}"
                ) from None
            if not math.isfinite(timestamp):
                raise InvalidExamples(f"event {i}: timestamp must be finite, got {timestamp}")
            times.append((timestamp, event.context))
        try:
            columns = {n: np.asarray([e.features[n] for e in events]) for n in names}
        except (TypeError, ValueError) as e:
            raise InvalidExamples(f"events' features must be numbers or arrays of numbers: {e}") from None
        if not events:
            return [], []
        checked = Examples(columns).validated(self.features)
        return _pack_records(checked, self._record), times

    def add(self, events: Iterable[Event]) -> int:
        """Append events atomically: all are stored, or (on any invalid event) none."""
        records, times = self._checked(list(events))
        conn = self._connection()
        with conn:
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(
                "INSERT INTO examples (features, timestamp, context) VALUES (?, ?, ?)",
                [(r, t, c) for r, (t, c) in zip(records, times, strict=True)],
            )
        return len(records)

    def add_examples(self, examples: Examples, timestamps: np.ndarray, *, replace: bool = False) -> int:
        """Append column-wise examples with their timestamps in one transaction (validated first:
        all or none); `replace`: the store's examples become these, in that same transaction."""
        checked = examples.validated(self.features)
        times = np.asarray(timestamps, np.float64)
        if times.shape != (checked.num_examples,) or not np.all(np.isfinite(times)):
            raise InvalidExamples(
                f"timestamps must be {checked.num_examples} finite numbers, one per example; "
                f"got shape {list(times.shape)}"
            )
        records = _pack_records(checked, self._record)
        conn = self._connection()
        with conn:
            conn.execute("BEGIN IMMEDIATE")
            if replace:
                conn.execute("DELETE FROM examples")
            conn.executemany(
                "INSERT INTO examples (features, timestamp, context) VALUES (?, ?, NULL)",
                zip(records, times.tolist(), strict=True),
            )
        return len(records)

    def delete_before(self, timestamp: float) -> int:
        """Retention: drop examples older than `timestamp`; returns how many."""
        conn = self._connection()
        with conn:
            conn.execute("BEGIN IMMEDIATE")
            return conn.execute("DELETE FROM examples WHERE timestamp < ?", (timestamp,)).rowcount

    # ---- reads -------------------------------------------------------------------------

    @property
    def revision(self) -> int:
        """Grows whenever examples are added, changed or deleted (by any process)."""
        row = self._connection().execute("SELECT value FROM store_meta WHERE key = 'revision'").fetchone()
        return int(row[0])

    def count(self, selection: Selection = EVERY_EXAMPLE) -> int:
        clause, args = _sql(selection)
        sql = f"SELECT COUNT(*) FROM (SELECT id FROM examples{clause})"
        return int(self._connection().execute(sql, args).fetchone()[0])

    def iter_events(self, selection: Selection = EVERY_EXAMPLE, chunk_size: int = 512) -> Iterator[Event]:
        """Events in `selection`, read in chunks from one consistent snapshot."""
        clause, args = _sql(selection)
        # A fresh connection: its read transaction sees a snapshot while the app keeps writing.
        conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        try:
            conn.execute("BEGIN")
            cursor = conn.execute(f"SELECT features, timestamp, context FROM examples{clause}", args)
            while rows := cursor.fetchmany(chunk_size):
                records = np.frombuffer(b"".join(r[0] for r in rows), self._record)
                for record, (_, timestamp, context) in zip(records, rows, strict=True):
                    yield Event({f.name: record[f.name] for f in self.features}, timestamp, context)
            conn.execute("COMMIT")
        finally:
            conn.close()

    def examples(self, selection: Selection = EVERY_EXAMPLE) -> Examples:
        """The selection as column-wise arrays, ready for batching."""
        clause, args = _sql(selection)
        rows = self._connection().execute(f"SELECT features FROM examples{clause}", args).fetchall()
        records = np.frombuffer(b"".join(r[0] for r in rows), self._record)
        return Examples({f.name: records[f.name].astype(f.dtype) for f in self.features})

    def distinct_values(self, feature: str) -> np.ndarray:
        """The distinct values of an integer feature over every example (e.g. the items a user has
        used, to exclude from recommendations)."""
        values: np.ndarray = np.unique(self.examples()[feature])
        return values

    # ---- device-private state (never uploaded) -----------------------------------------

    def save_local_state(self, key: str, value: bytes) -> None:
        conn = self._connection()
        with conn:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT OR REPLACE INTO local_state (key, value) VALUES (?, ?)", (key, value))

    def load_local_state(self, key: str) -> bytes | None:
        row = self._connection().execute("SELECT value FROM local_state WHERE key = ?", (key,)).fetchone()
        return None if row is None else bytes(row[0])

    def local_state_under(self, prefix: str) -> dict[str, bytes]:
        """Every entry whose key starts with `prefix`, in one read."""
        rows = (
            self._connection()
            .execute("SELECT key, value FROM local_state WHERE substr(key, 1, ?) = ?", (len(prefix), prefix))
            .fetchall()
        )
        return {str(key): bytes(value) for key, value in rows}

    def integrity_ok(self) -> bool:
        return bool(self._connection().execute("PRAGMA integrity_check").fetchone()[0] == "ok")


def _describe(features: Sequence[FeatureSpec]) -> str:
    """`item int32, label float32 (label)`: a layout in a few words."""
    return ", ".join(
        f"{f.name} {f.dtype}{list(f.shape) if f.shape else ''}" + (" (label)" if f.role == "label" else "")
        for f in features
    )


def _pack_records(examples: Examples, record: np.dtype) -> list[bytes]:
    packed = np.zeros(examples.num_examples, record)
    for name in record.names or ():
        packed[name] = examples[name]
    raw, size = packed.tobytes(), record.itemsize
    return [raw[i : i + size] for i in range(0, len(raw), size)]
