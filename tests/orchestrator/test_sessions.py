"""The server's sessions keep what they load for the whole transaction (a real SQLite file)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.db import Artifact, make_engine, sessions_that_keep_what_they_load
from orchestrator.migrate import migrate


def _selects_of_three_gets(engine: Engine, factory: sessionmaker[Session]) -> int:
    """How many SELECTs a transaction runs to read one row three times, holding it in between
    nowhere (as functions that each call `session.get` and return a value do)."""
    selects = 0

    def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        nonlocal selects
        selects += statement.lstrip().upper().startswith("SELECT")

    event.listen(engine, "before_cursor_execute", count)
    try:
        with factory.begin() as session:
            for _ in range(3):
                found = session.get(Artifact, "a" * 64)
                assert found is not None and found.content == b"model"
                del found
    finally:
        event.remove(engine, "before_cursor_execute", count)
    return selects


def test_a_row_read_three_times_in_one_transaction_is_selected_once(tmp_path: Path) -> None:
    # Prepare: a real SQLite file with one artifact
    url = f"sqlite:///{tmp_path / 'orchestrator.sqlite'}"
    migrate(url)
    engine = make_engine(url)
    with sessions_that_keep_what_they_load(engine).begin() as session:
        session.add(Artifact(sha256="a" * 64, content=b"model", created_at=0.0))

    # Execute: the same reads with the server's sessions and with SQLAlchemy's default ones
    kept = _selects_of_three_gets(engine, sessions_that_keep_what_they_load(engine))
    default = _selects_of_three_gets(engine, sessionmaker(engine, expire_on_commit=False))

    # Assert: one SELECT, where the weakly held identity map reads the row again each time
    assert kept == 1
    assert default == 3
    engine.dispose()


def test_a_session_lets_go_of_its_objects_when_it_closes(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'orchestrator.sqlite'}"
    migrate(url)
    engine = make_engine(url)
    factory = sessions_that_keep_what_they_load(engine)
    with factory.begin() as session:
        session.add(Artifact(sha256="b" * 64, content=b"model", created_at=0.0))
    with factory() as session:
        assert session.get(Artifact, "b" * 64) is not None
        held = dict(session.info)
        assert any(len(objects) == 1 for objects in held.values())
    assert all(not objects for objects in held.values())
    engine.dispose()
