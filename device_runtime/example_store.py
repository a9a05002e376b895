"""The device's local examples in a SQLite file. Examples never leave the device.

The app writes events as the user shares (or rates) things; the trainer and the
recommender read them. SQLite in WAL mode lets one writer and many readers work at once,
across threads and processes; each thread has its own connection. Every write is one
transaction, validated before it starts, so a bad event or a crash never leaves half a
batch behind. A trigger-maintained `revision` tells readers whether anything changed.
"""

from __future__ import annotations

import math
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from device_runtime.task_batches import Examples, InvalidExamples

_SCHEMA = """
CREATE TABLE IF NOT EXISTS examples (
    id INTEGER PRIMARY KEY,
    item_id INTEGER NOT NULL CHECK (item_id >= 0),
    label REAL NOT NULL,
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
"""


_SCHEMA_VERSION = 1


class ExampleStoreError(RuntimeError):
    """The store file cannot be opened or read as an example store."""


@dataclass(frozen=True)
class Event:
    """One thing the user did: shared (label 1) or rated (label = rating) `item_id` at `timestamp`."""

    item_id: int
    label: float
    timestamp: float
    context: str | None = None


@dataclass(frozen=True)
class Selection:
    """Which examples an iterator hands out: a time window, newest or oldest first, a cap."""

    since: float | None = None
    until: float | None = None
    limit: int | None = None
    newest_first: bool = True
    context: str | None = None

    def sql(self) -> tuple[str, list[object]]:
        where: list[str] = []
        args: list[object] = []
        if self.since is not None:
            where.append("timestamp >= ?")
            args.append(self.since)
        if self.until is not None:
            where.append("timestamp < ?")
            args.append(self.until)
        if self.context is not None:
            where.append("context = ?")
            args.append(self.context)
        clause = (" WHERE " + " AND ".join(where)) if where else ""
        order = " ORDER BY timestamp DESC, id DESC" if self.newest_first else " ORDER BY timestamp, id"
        limit = ""
        if self.limit is not None:
            limit = " LIMIT ?"
            args.append(max(int(self.limit), 0))
        return clause + order + limit, args


class ExampleStore:
    """A device's examples. `num_items` and `label_range`, when given, are enforced on write."""

    def __init__(
        self,
        path: Path,
        *,
        num_items: int | None = None,
        label_range: tuple[float, float] | None = None,
    ) -> None:
        self.path = Path(path)
        self.num_items = num_items
        self.label_range = label_range
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        try:
            conn = self._connection()
            # Opening an existing store only reads: the schema is written once, then marked done.
            if conn.execute("PRAGMA user_version").fetchone()[0] != _SCHEMA_VERSION:
                with conn:
                    conn.executescript(_SCHEMA + f"PRAGMA user_version = {_SCHEMA_VERSION};")
        except sqlite3.DatabaseError as e:
            raise ExampleStoreError(f"{self.path} is not a usable example store: {e}") from None

    def _connection(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            # isolation_level=None: transactions are explicit (`with conn` / BEGIN), never implied.
            conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA busy_timeout = 30000")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
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

    def _check(self, event: Event, index: int) -> tuple[int, float, float, str | None]:
        item = event.item_id
        if isinstance(item, bool) or not isinstance(item, (int, np.integer)) or item < 0:
            raise InvalidExamples(f"event {index}: item_id must be an integer >= 0, got {item!r}")
        if self.num_items is not None and item >= self.num_items:
            raise InvalidExamples(
                f"event {index}: item_id {item} is outside the catalog [0, {self.num_items})"
            )
        try:
            label, timestamp = float(event.label), float(event.timestamp)
        except (TypeError, ValueError):
            raise InvalidExamples(
                f"event {index}: label and timestamp must be numbers, got {event!r}"
            ) from None
        if not math.isfinite(label):
            raise InvalidExamples(f"event {index}: label must be finite, got {label}")
        if self.label_range is not None and not self.label_range[0] <= label <= self.label_range[1]:
            raise InvalidExamples(f"event {index}: label {label} outside {list(self.label_range)}")
        if not math.isfinite(timestamp):
            raise InvalidExamples(f"event {index}: timestamp must be finite, got {timestamp}")
        return int(item), label, timestamp, event.context

    def add(self, events: Iterable[Event]) -> int:
        """Append events atomically: all are stored, or (on any invalid event) none."""
        rows = [self._check(e, i) for i, e in enumerate(events)]
        conn = self._connection()
        with conn:
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(
                "INSERT INTO examples (item_id, label, timestamp, context) VALUES (?, ?, ?, ?)", rows
            )
        return len(rows)

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

    def count(self, selection: Selection = Selection()) -> int:
        clause, args = selection.sql()
        sql = f"SELECT COUNT(*) FROM (SELECT id FROM examples{clause})"
        return int(self._connection().execute(sql, args).fetchone()[0])

    def iter_events(self, selection: Selection = Selection(), chunk_size: int = 512) -> Iterator[Event]:
        """Events in `selection`, read in chunks from one consistent snapshot."""
        clause, args = selection.sql()
        # A fresh connection: its read transaction sees a snapshot while the app keeps writing.
        conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        try:
            conn.execute("BEGIN")
            cursor = conn.execute(f"SELECT item_id, label, timestamp, context FROM examples{clause}", args)
            while rows := cursor.fetchmany(chunk_size):
                for item_id, label, timestamp, context in rows:
                    yield Event(item_id, label, timestamp, context)
            conn.execute("COMMIT")
        finally:
            conn.close()

    def examples(self, selection: Selection = Selection()) -> Examples:
        """The selection as column-wise arrays, ready for batching."""
        clause, args = selection.sql()
        rows = self._connection().execute(f"SELECT item_id, label FROM examples{clause}", args).fetchall()
        if not rows:
            return Examples.concat([])
        data = np.asarray(rows, dtype=np.float64)
        return Examples(data[:, 0].astype(np.int64), data[:, 1].astype(np.float32))

    def used_items(self) -> np.ndarray:
        """Distinct item ids the user has examples for (e.g. to exclude from recommendations)."""
        rows = self._connection().execute("SELECT DISTINCT item_id FROM examples").fetchall()
        return np.asarray([r[0] for r in rows], dtype=np.int64)

    # ---- device-private state (never uploaded) -----------------------------------------

    def save_local_state(self, key: str, value: bytes) -> None:
        conn = self._connection()
        with conn:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT OR REPLACE INTO local_state (key, value) VALUES (?, ?)", (key, value))

    def load_local_state(self, key: str) -> bytes | None:
        row = self._connection().execute("SELECT value FROM local_state WHERE key = ?", (key,)).fetchone()
        return None if row is None else bytes(row[0])

    def integrity_ok(self) -> bool:
        return bool(self._connection().execute("PRAGMA integrity_check").fetchone()[0] == "ok")
