"""The example store: selections, atomic validated writes, concurrency, damaged files."""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from android_sim.idle_store import IdleStore
from contracts.features import FeatureSpec, InvalidExamples
from device_runtime.example_store import Event, ExampleStore, ExampleStoreError
from device_runtime.task_environment import Selection
from model_export.config import ModelConfig

RATINGS = ModelConfig(num_items=50, top_k=10).features()
# A sentence and its next words: a sequence feature and a sequence label.
SENTENCES = (
    FeatureSpec("tokens", "int32", (4,), value_range=(0, 99)),
    FeatureSpec("next_tokens", "int32", (4,), role="label", value_range=(0, 99)),
)


def events(n: int, start: float = 0.0) -> list[Event]:
    return [Event({"item": i % 50, "label": float(1 + i % 5)}, timestamp=start + i) for i in range(n)]


def test_add_count_and_select(tmp_path: Path) -> None:
    store = ExampleStore(tmp_path / "s.sqlite", RATINGS)
    store.add(events(30))

    newest = list(store.iter_events(Selection(limit=3)))
    window = store.examples(Selection(since=10, until=20, newest_first=False))

    assert store.count() == 30
    assert [e.timestamp for e in newest] == [29.0, 28.0, 27.0]
    assert [int(e.features["item"]) for e in newest] == [29, 28, 27]
    assert list(window["item"]) == list(range(10, 20))
    assert window["label"].dtype == np.float32
    assert sorted(store.distinct_values("item")) == list(range(30))


def test_sequence_features_round_trip(tmp_path: Path) -> None:
    store = ExampleStore(tmp_path / "s.sqlite", SENTENCES)
    sentences = [[1, 2, 3, 4], [5, 6, 0, 0]]

    store.add(Event({"tokens": s, "next_tokens": [*s[1:], 0]}, float(t)) for t, s in enumerate(sentences))
    examples = store.examples(Selection(newest_first=False))

    assert examples["tokens"].tolist() == sentences
    assert examples["next_tokens"].tolist() == [[2, 3, 4, 0], [6, 0, 0, 0]]
    assert examples["tokens"].dtype == np.int32


def test_a_store_refuses_a_model_with_other_features(tmp_path: Path) -> None:
    ExampleStore(tmp_path / "s.sqlite", RATINGS).add(events(3))

    with pytest.raises(ExampleStoreError, match="holds examples with the features"):
        ExampleStore(tmp_path / "s.sqlite", SENTENCES)
    reopened = ExampleStore(tmp_path / "s.sqlite")  # its own spec

    assert reopened.count() == 3
    assert [f.name for f in reopened.features] == ["item", "label"]


def first_schema_store(path: Path) -> Path:
    """A store as schema 1 wrote it: (item 4, 5.0, 'chat') and (item 9, 2.0) columns, revision 7."""
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE examples (id INTEGER PRIMARY KEY, item_id INTEGER NOT NULL, label REAL NOT NULL, "
        "timestamp REAL NOT NULL, context TEXT);"
        "CREATE TABLE store_meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);"
        "INSERT INTO store_meta VALUES ('revision', 7);"
        "CREATE TABLE local_state (key TEXT PRIMARY KEY, value BLOB NOT NULL);"
        "INSERT INTO examples (item_id, label, timestamp, context) "
        "VALUES (4, 5.0, 1.0, 'chat'), (9, 2.0, 2.0, NULL);"
        "PRAGMA user_version = 1;"
    )
    conn.close()
    return path


def test_a_store_of_the_first_schema_is_migrated(tmp_path: Path) -> None:
    path = first_schema_store(tmp_path / "old.sqlite")

    with pytest.raises(
        ExampleStoreError, match="can be migrated only to a model with one scalar int32 input"
    ):
        ExampleStore(path, SENTENCES)
    with pytest.raises(ExampleStoreError, match=r"do not fit the model's features .*; left as they are"):
        ExampleStore(path, (replace(RATINGS[0], value_range=(0, 5)), RATINGS[1]))  # item 9 is outside
    store = ExampleStore(path, RATINGS)

    assert [
        (int(e.features["item"]), float(e.features["label"]), e.context) for e in store.iter_events()
    ] == [
        (9, 2.0, None),
        (4, 5.0, "chat"),
    ]
    assert store.revision > 7  # readers see that the examples changed form


def test_revision_grows_on_every_change_but_not_on_private_state(tmp_path: Path) -> None:
    store = ExampleStore(tmp_path / "s.sqlite", RATINGS)
    r0 = store.revision
    store.add(events(3))
    r1 = store.revision
    store.save_local_state("x", b"cache")
    r2 = store.revision
    store.delete_before(1.0)

    assert r0 < r1 == r2 < store.revision
    assert store.count() == 2


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (Event({"item": 50, "label": 3.0}, 0.0), r"outside the rows of \['item_embeddings'\] \[0, 49\]"),
        (Event({"item": -1, "label": 3.0}, 0.0), r"feature 'item' outside"),
        (Event({"item": 3, "label": float("nan")}, 0.0), "'label' of example 3 is NaN"),
        (Event({"item": 3, "label": 9.0}, 0.0), r"feature 'label' outside its range \[1, 5\]"),
        (Event({"item": 3, "label": 3.0}, float("inf")), "timestamp"),
        (Event({"item": True, "label": 3.0}, 0.0), "event 3: feature 'item' must be integers"),
        (Event({"item": 2.5, "label": 3.0}, 0.0), "'item' must be integers"),
        (
            Event({"item": [1, 2], "label": 3.0}, 0.0),
            r"event 3: feature 'item' must have shape \[\], got \[2\]",
        ),
        (Event({"item": 3}, 0.0), r"event 3: expected the features \['item', 'label'\]"),
        (Event({"item": 3, "label": 3.0, "extra": 1}, 0.0), "expected the features"),
    ],
)
def test_a_bad_event_rejects_the_whole_batch(tmp_path: Path, bad: Event, message: str) -> None:
    store = ExampleStore(tmp_path / "s.sqlite", RATINGS)
    store.add(events(5))
    revision = store.revision

    with pytest.raises(InvalidExamples, match=message):
        store.add([*events(3, start=100), bad])

    assert store.count() == 5
    assert store.revision == revision
    assert store.integrity_ok()


def test_a_file_that_is_not_a_store(tmp_path: Path) -> None:
    path = tmp_path / "junk.sqlite"
    path.write_bytes(b"definitely not sqlite" * 100)

    with pytest.raises(ExampleStoreError, match="not a usable example store"):
        ExampleStore(path)


def test_app_writes_while_the_trainer_reads(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    store = ExampleStore(path, RATINGS)
    store.add(events(100))
    errors: list[BaseException] = []
    seen_counts: list[int] = []

    def app() -> None:
        try:
            for k in range(50):
                store.add(events(10, start=1000 + 10 * k))
        except BaseException as e:
            errors.append(e)

    def trainer() -> None:
        try:
            for _ in range(50):
                batch = list(store.iter_events(Selection(newest_first=False)))
                seen_counts.append(len(batch))
                # Each read is a snapshot: whole batches of 10, never half of one.
                assert len(batch) % 10 == 0
        except BaseException as e:
            errors.append(e)

    threads = [
        threading.Thread(target=app),
        threading.Thread(target=trainer),
        threading.Thread(target=trainer),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert not errors, errors
    assert store.count() == 600
    assert min(seen_counts) >= 100
    assert store.integrity_ok()


def _writer_process(path: str, start: int) -> None:
    store = ExampleStore(Path(path), RATINGS)
    for k in range(20):
        store.add(events(5, start=start + 5 * k))


def test_two_processes_writing_at_once(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    ExampleStore(path, RATINGS).close()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer_process, args=(str(path), s)) for s in (0, 10_000)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)

    assert [p.exitcode for p in procs] == [0, 0]
    store = ExampleStore(path)
    assert store.count() == 200
    assert store.integrity_ok()
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_an_idle_store_opens_durable_unless_told_the_file_is_scratch(tmp_path: Path) -> None:
    # Arrange: a store with examples, as a fleet writes it.
    path = tmp_path / "s.sqlite"
    with ExampleStore(path, RATINGS, durable=False) as written:
        written.add(events(3))

    # Act / Assert: a phone's idle store waits for the disk (NORMAL = 1); a simulated device's
    # scratch store does not (OFF = 0), and both read the same examples.
    for durable, synchronous in ((True, 1), (False, 0)):
        idle = IdleStore(path, durable=durable)
        with idle.opened() as store:
            assert store._connection().execute("PRAGMA synchronous").fetchone()[0] == synchronous
            assert store.count() == 3
