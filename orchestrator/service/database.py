"""Running a blocking database transaction from the event loop, and what says the database itself is
unavailable; shared by the services and the routes (`api.deps` re-exports them)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool

T = TypeVar("T")

# What a database that is locked, down or out of connections raises: the request is answered
# 503 with a retry window (api/edge.py), not 500.
DATABASE_UNAVAILABLE = (OperationalError, PoolTimeoutError)


def _locked(error: OperationalError) -> bool:
    text = str(error.orig).lower()
    return "locked" in text or "busy" in text


async def run_db(app: Starlette, fn: Callable[..., T], *args: Any) -> T:
    """Run a blocking database transaction: inline on the event loop for SQLite, where a
    transaction takes about a millisecond and writes are serialized anyway (thread hand-offs
    and GIL convoys cost more than the work), in the threadpool for a networked database.

    SQLite runs with no busy wait (a wait on the event loop would stall every request, /health
    included): a transaction that finds the file locked by another connection was rolled back
    whole, and is retried after an asynchronous sleep until `database_busy_seconds` have passed;
    then the locked error goes up (a 503)."""
    if not app.state.db_inline:
        return await run_in_threadpool(fn, *args)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + app.state.settings.database_busy_seconds
    delay = 0.002
    while True:
        try:
            return fn(*args)
        except OperationalError as error:
            if not _locked(error) or loop.time() + delay > deadline:
                raise
        await asyncio.sleep(delay)
        delay = min(2 * delay, 0.05)
