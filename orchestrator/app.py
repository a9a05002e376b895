"""The FastAPI application: routes, the database, and the deadline ticker."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from orchestrator.api import openapi
from orchestrator.api.deps import DATABASE_UNAVAILABLE
from orchestrator.api.edge import Edge, VerifiedTokens
from orchestrator.api.rate_limits import WithOverallLimit
from orchestrator.api.routes import (
    admin,
    artifacts,
    assignments,
    devices,
    health,
    populations,
    secure_aggregation,
)
from orchestrator.api.routes import metrics as metrics_route
from orchestrator.dashboard import routes as dashboard
from orchestrator.db import Population, make_engine, sessions_that_keep_what_they_load
from orchestrator.migrate import migrate
from orchestrator.observability import metrics
from orchestrator.observability.logs import log_request
from orchestrator.populations.config import config_of
from orchestrator.populations.locks import lock_population
from orchestrator.rounds.lifecycle import advance
from orchestrator.rounds.secure.phase_changes import PHASE_CHANGES
from orchestrator.service import checkins, reports, secure_messages, secure_states, waiting_room
from orchestrator.settings import Settings

# The dashboard's sign-ins over every client address together: this many times one address's.
OVERALL_SIGN_INS = 4

log = logging.getLogger("orchestrator")


def tick(factory: sessionmaker[Session], now: float) -> None:
    """Close every round past its deadline; each population in its own transaction."""
    with factory() as session:
        names = list(session.scalars(select(Population.name)))
    for name in names:
        with factory.begin() as session:
            population = lock_population(session, name)
            if population is not None:
                advance(session, population, now)


def start_up_work(factory: sessionmaker[Session], now: float) -> None:
    """What a restart has to catch up on, done once before serving: the rounds whose deadline
    passed while the server was down closed (and the next opened), and each live population's
    settings, manifest and pipeline parsed (population_config), which its first request would
    otherwise do while holding the database."""
    tick(factory, now)
    with factory() as session:
        for population in session.scalars(select(Population).where(Population.archived_at.is_(None))):
            try:
                config_of(population)
            except Exception:  # its own requests will say what is wrong; the others must be served
                log.exception("start-up: population %s's settings or model do not parse", population.name)


_frozen = False


def _freeze_start_up_objects() -> None:
    """Take what start-up made (modules, mappers, validators: about 165,000 objects that live as
    long as the process) out of the cyclic garbage collector's sight, once per process. Each full
    collection traversed them all, about 100-140 ms during which the event loop, and every
    request with it, stood still; at 500 check-ins/s that came every 1-2 s and set the check-ins'
    p99. Garbage made later is collected as before."""
    global _frozen
    if not _frozen:
        gc.collect()  # start-up's own garbage goes first rather than staying for good
        gc.freeze()
        _frozen = True


def _json_safe(value: Any) -> Any:
    """`value` with NaN and infinities as strings: JSON has no literal for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


async def request_validation_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's 422 in the body every refusal has (`schemas.Error`): one line in `detail`, each
    failing part in `errors`. A NaN or infinity the client sent is echoed as a string: FastAPI's
    own handler echoes it as a float, cannot encode that as JSON and answers 500."""
    assert isinstance(exc, RequestValidationError)
    errors = [
        {k: error.get(k) for k in ("loc", "msg", "type", "input")}
        for error in _json_safe(jsonable_encoder(exc.errors()))
    ]
    shown = "; ".join(f"{'.'.join(str(part) for part in e['loc'])}: {e['msg']}" for e in errors[:3])
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return JSONResponse(
        status_code=422, content={"detail": f"invalid request: {shown}{more}", "errors": errors}
    )


async def unreadable_json_body(request: Request, exc: Exception) -> Any:
    """A JSON body that is not UTF-8, or nested too deep to parse, is content the route cannot
    take: a 422 like any other JSON that fails, rather than FastAPI's bare 400 "There was an error
    parsing the body" (which no route documents, as it says neither what nor what was expected).
    Every other HTTPException goes to FastAPI's own handler. (Starlette's class: FastAPI raises
    that one, and its own is a subclass.)"""
    assert isinstance(exc, HTTPException)
    cause = exc.__cause__
    if exc.status_code != 400 or not isinstance(cause, UnicodeDecodeError | RecursionError):
        return await http_exception_handler(request, exc)
    if isinstance(cause, UnicodeDecodeError):
        what = f"not UTF-8 (byte {cause.start} is 0x{cause.object[cause.start]:02x})"
    else:
        what = "nested too deep to parse"
    issue = {"loc": ["body"], "msg": f"{what}; expected a JSON document in UTF-8", "type": "json_invalid"}
    return JSONResponse(
        status_code=422,
        content={"detail": f"invalid request: body: {issue['msg']}", "errors": [{**issue, "input": None}]},
    )


def create_app(settings: Settings | None = None, clock: Callable[[], float] = time.time) -> FastAPI:
    """The server's application. Raises settings.AdminTokenError without a real admin secret."""
    settings = settings or Settings()
    admin_token_digest = settings.admin_token_digest()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Few worker threads: the database serializes writes anyway, and with anyio's default of
        # 40 threads the one holding the connection waits behind the others for the GIL.
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.worker_threads
        await run_in_threadpool(migrate, settings.database_url)
        engine = make_engine(settings.database_url, busy_seconds=0.0)  # run_db waits, off the loop
        metrics.count_database_errors(engine)
        app.state.sessionmaker = sessions_that_keep_what_they_load(engine)
        app.state.db_inline = engine.dialect.name == "sqlite"
        app.state.checkin_groups = checkins.checkin_groups(app, settings.group_commit_seconds)
        app.state.report_groups = reports.report_groups(app, settings.group_commit_seconds)
        app.state.secure_state_reads = secure_states.state_reads(app, settings.group_commit_seconds)
        app.state.secure_messages = secure_messages.message_groups(app, settings.group_commit_seconds)
        app.state.waiting_room = waiting_room.WaitingRoom(app)

        async def ticker() -> None:
            while True:
                await asyncio.sleep(settings.tick_seconds)
                try:
                    await run_in_threadpool(tick, app.state.sessionmaker, clock())
                except DATABASE_UNAVAILABLE as error:  # the next tick retries
                    log.warning("deadline tick: database unavailable (%s)", type(error).__name__)
                except Exception:  # keep ticking; the next tick retries
                    log.exception("deadline tick failed")

        # Before the server answers anything (uvicorn accepts once this start-up returns): the
        # first requests after a restart must not wait behind it for SQLite's one connection.
        await run_in_threadpool(start_up_work, app.state.sessionmaker, clock())
        task = asyncio.create_task(ticker())
        _freeze_start_up_objects()
        app.state.ready = True
        try:
            with PHASE_CHANGES.released_on_exit_signals():
                yield
        finally:
            app.state.ready = False
            task.cancel()
            engine.dispose()

    app = FastAPI(
        title="FedRecon orchestrator",
        description="Runs Federated Reconstruction rounds for on-device personalization. Devices enroll, "
        "check in, download the model and global parameters, and report deltas; local parameters "
        "and examples never reach this server. Every refusal answers the `Error` body; bodies that are "
        "tensors are safetensors (`application/octet-stream`), laid out as docs/reference/wire-formats.md "
        "says; docs/reference/http-protocol.md walks through a round.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.clock = clock
    app.state.admin_token_digest = admin_token_digest
    app.state.verified_tokens = VerifiedTokens()
    # Per address, and over every address at OVERALL_SIGN_INS times that: no header or address
    # a caller chooses buys unlimited guesses at the admin token.
    app.state.dashboard_sign_ins = WithOverallLimit(
        dashboard.sign_in_buckets(
            settings.dashboard_sign_in_burst, settings.dashboard_sign_in_interval_seconds
        ),
        dashboard.sign_in_buckets(
            OVERALL_SIGN_INS * settings.dashboard_sign_in_burst,
            settings.dashboard_sign_in_interval_seconds / OVERALL_SIGN_INS,
        ),
    )
    app.add_exception_handler(RequestValidationError, request_validation_error)
    app.add_exception_handler(HTTPException, unreadable_json_body)
    app.add_middleware(Edge, settings=settings)
    for module in (
        devices,
        populations,
        artifacts,
        assignments,
        secure_aggregation,
        admin,
        health,
        metrics_route,
        dashboard,
    ):
        app.include_router(module.router)
    static_paths = frozenset(path for route in app.routes if "{" not in (path := getattr(route, "path", "{")))
    app.add_middleware(metrics.RequestMetrics, static_paths=static_paths, on_request=log_request)
    setattr(app, "openapi", functools.partial(openapi.document, app, settings))  # noqa: B010 (a method)
    return app
