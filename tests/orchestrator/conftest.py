"""Orchestrator fixtures: a real SQLite file, and a real uvicorn server on loopback."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import httpx
import pytest
from orchestrator.service.population_creation import ExportedModel, create_population
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from model_export.config import ModelConfig
from orchestrator.db import make_engine, sessions_that_keep_what_they_load
from orchestrator.local import LocalOrchestrator
from orchestrator.migrate import migrate
from tests.conftest import BIASED

# A fresh secret per test session, as every server needs one (orchestrator/settings.py).
ADMIN_TOKEN = secrets.token_urlsafe(32)
# A training report's Content-Type (an evaluation report's is application/json).
OCTETS = {"Content-Type": "application/octet-stream"}


# Set (as .ci/run does) to also run the database tests on a real PostgreSQL server, e.g.
# postgresql+psycopg://postgres@127.0.0.1:5432/postgres; each test gets a fresh database.
POSTGRES_URL = os.environ.get("TEST_POSTGRES_URL")
BACKENDS = ["sqlite", "postgresql"] if POSTGRES_URL else ["sqlite"]


@contextlib.contextmanager
def fresh_postgres_database() -> Iterator[str]:
    assert POSTGRES_URL
    # No pool: a connection kept across the test would be dead if the test restarted the server.
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    name = f"test_{secrets.token_hex(6)}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield POSTGRES_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=BACKENDS)
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    with contextlib.ExitStack() as stack:
        if request.param == "sqlite":
            url = f"sqlite:///{tmp_path / 'orchestrator.sqlite'}"
        else:
            url = stack.enter_context(fresh_postgres_database())
        migrate(url)
        engine = make_engine(url)
        yield sessions_that_keep_what_they_load(engine)  # as the server's
        engine.dispose()


@pytest.fixture
def biased_model(export: Callable[[ModelConfig], Path]) -> ExportedModel:
    return ExportedModel.from_dir(export(BIASED))


def make_population(
    factory: sessionmaker[Session], model: ExportedModel, now: float = 0.0, **settings: object
) -> str:
    with factory.begin() as session:
        create_population(session, "p", model, dict(settings), now)
    return "p"


class Server(LocalOrchestrator):
    """`python -m orchestrator serve` in its own process with the tests' admin token; `database` is
    an SQLite file or a database URL."""

    def __init__(
        self,
        database: Path | str,
        port: int | None = None,
        settings: Mapping[str, object] | None = None,
        log_path: Path | None = None,
    ) -> None:
        url = database if isinstance(database, str) else f"sqlite:///{database}"
        super().__init__(url, ADMIN_TOKEN, port=port, tick_seconds=0.2, settings=settings, log_path=log_path)


@pytest.fixture(params=BACKENDS)
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Server]:
    with contextlib.ExitStack() as stack:
        if request.param == "sqlite":
            database: Path | str = tmp_path / "orchestrator.sqlite"
        else:
            database = stack.enter_context(fresh_postgres_database())
        running = Server(database).start()
        try:
            yield running
        finally:
            running.stop()


def admin_create_population(url: str, model_dir: Path, name: str, settings: str) -> httpx.Response:
    files = {
        "model": ("model.tflite", (model_dir / "model.tflite").read_bytes()),
        "manifest": ("manifest.json", (model_dir / "manifest.json").read_bytes()),
        "global_params": (
            "global_params.safetensors",
            (model_dir / "global_params.safetensors").read_bytes(),
        ),
    }
    return httpx.post(
        f"{url}/v1/admin/populations",
        data={"name": name, "settings": settings},
        files=files,
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=60,
    )
