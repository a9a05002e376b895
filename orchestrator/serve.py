"""`python -m orchestrator serve`: one server process, or several sharing one port and one PostgreSQL.

Several processes (`--workers N`): uvicorn starts N worker processes that accept on the same
socket; each builds its own app from the environment (`orchestrator.app:create_app`), so the
command line's settings are passed on through it. Nothing lives only in a process's memory (every
transition is a database transaction, the population row lock serializes writers), so any worker
can answer any request. The parent applies the migrations once before the workers start, and gives
the workers a Prometheus multiprocess directory so that `/metrics` adds up all of them.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from orchestrator.observability.logs import log_config
from orchestrator.settings import AdminTokenError, Settings

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def serve(settings: Settings, workers: int) -> int:
    import uvicorn

    if workers < 1:
        print(f"error: --workers must be at least 1, got {workers}", file=sys.stderr)
        return 2
    if workers > 1 and settings.database_url.startswith("sqlite"):
        print(
            f"error: --workers {workers} needs a PostgreSQL database (ORCHESTRATOR_DATABASE_URL="
            "postgresql+psycopg://user@host/db); SQLite takes one writer at a time, so more server "
            "processes would only wait on its lock, each blocking its own requests meanwhile. "
            "Use --workers 1 with SQLite.",
            file=sys.stderr,
        )
        return 2
    try:
        settings.admin_token_digest()  # before any worker starts: none may run without a real secret
    except AdminTokenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from orchestrator.migrate import DatabaseUnusable, migrate

    try:
        # Here, before uvicorn, so that an unusable database is one line and exit code 2 rather
        # than a traceback from the app's start-up; the workers then find the schema current.
        migrate(settings.database_url)
    except DatabaseUnusable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # uvicorn's own lines (start-up, errors) at info at least: its debug lines are per connection.
    logging_config = log_config(settings.log_level, uvicorn_level=max(settings.log_level, "info", key=_rank))
    if workers == 1:
        from orchestrator.app import create_app

        # No access log: the request log (DEBUG, orchestrator.requests) says the same without headers.
        uvicorn.run(
            create_app(settings),
            host=settings.host,
            port=settings.port,
            log_config=logging_config,
            access_log=False,
            **proxy_options(settings),
        )
        return 0

    os.environ.update(
        ORCHESTRATOR_DATABASE_URL=settings.database_url,
        ORCHESTRATOR_HOST=settings.host,
        ORCHESTRATOR_PORT=str(settings.port),
    )
    metrics_dir = _multiprocess_metrics_dir()
    try:
        uvicorn.run(
            "orchestrator.app:create_app",
            factory=True,
            workers=workers,
            host=settings.host,
            port=settings.port,
            log_config=logging_config,
            access_log=False,
            **proxy_options(settings),
        )
    finally:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


def proxy_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's proxy options: forwarded headers believed only from the proxies the operator
    names (uvicorn's default believes 127.0.0.1, and its environment variable FORWARDED_ALLOW_IPS)."""
    if not settings.forwarded_allow_ips:
        return {"proxy_headers": False}
    return {"proxy_headers": True, "forwarded_allow_ips": settings.forwarded_allow_ips}


def _multiprocess_metrics_dir() -> Path | None:
    """The workers' shared metrics directory, emptied: samples of an earlier run must not add up
    with this one's. A fresh temporary one (returned, to remove at exit) unless the operator set it."""
    configured = os.environ.get(MULTIPROC_ENV)
    if configured:
        for stale in Path(configured).glob("*.db"):
            stale.unlink()
        return None
    created = Path(tempfile.mkdtemp(prefix="orchestrator-metrics-"))
    os.environ[MULTIPROC_ENV] = str(created)
    return created


def _rank(level: str) -> int:
    return ["debug", "info", "warning", "error"].index(level)
