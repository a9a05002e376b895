"""The example store: selections, atomic validated writes, concurrency, damaged files."""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading
from pathlib import Path

import numpy as np
import pytest

from device_runtime.example_store import Event, ExampleStore, ExampleStoreError, Selection
from device_runtime.task_batches import InvalidExamples


def events(n: int, start: float = 0.0) -> list[Event]:
    return [Event(item_id=i % 50, label=float(1 + i % 5), timestamp=start + i) for i in range(n)]


def test_add_count_and_select(tmp_path: Path) -> None:
    store = ExampleStore(tmp_path / "s.sqlite", num_items=50, label_range=(1.0, 5.0))
    store.add(events(30))

    newest = list(store.iter_events(Selection(limit=3)))
    window = store.examples(Selection(since=10, until=20, newest_first=False))

    assert store.count() == 30
    assert [e.timestamp for e in newest] == [29.0, 28.0, 27.0]
    assert list(window.item_ids) == list(range(10, 20))
    assert window.labels.dtype == np.float32
    assert sorted(store.used_items()) == list(range(30))


def test_revision_grows_on_every_change_but_not_on_private_state(tmp_path: Path) -> None:
    store = ExampleStore(tmp_path / "s.sqlite")
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
        (Event(50, 3.0, 0.0), "outside the catalog"),
        (Event(-1, 3.0, 0.0), "integer >= 0"),
        (Event(3, float("nan"), 0.0), "finite"),
        (Event(3, 9.0, 0.0), "outside"),
        (Event(3, 3.0, float("inf")), "timestamp"),
        (Event(True, 3.0, 0.0), "integer"),  # type: ignore[arg-type]
    ],
)
def test_a_bad_event_rejects_the_whole_batch(tmp_path: Path, bad: Event, message: str) -> None:
    store = ExampleStore(tmp_path / "s.sqlite", num_items=50, label_range=(1.0, 5.0))
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
    store = ExampleStore(path, num_items=50)
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
    store = ExampleStore(Path(path), num_items=50)
    for k in range(20):
        store.add(events(5, start=start + 5 * k))


def test_two_processes_writing_at_once(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    ExampleStore(path).close()
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
