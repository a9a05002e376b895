"""Prometheus metrics: what the server does, counted where the state machine decides, served at /metrics.

With several server processes (uvicorn `--workers`, gunicorn) each process writes its samples to
files in `PROMETHEUS_MULTIPROC_DIR` and `/metrics` adds them up, whichever process answers the
scrape; `python -m orchestrator serve --workers N` sets that directory up. Without it the samples
live in the process. Round, check-in and report counters are bumped only when their transaction
commits (`on_commit`), so a rolled-back or retried transaction is never counted.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.registry import REGISTRY
from sqlalchemy import Engine, event
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.orm import Session

from orchestrator.observability.on_commit import on_commit

REQUESTS = Counter(
    "orchestrator_http_requests",
    "HTTP requests answered, by method, route template and status",
    ["method", "route", "status"],
)
REQUEST_SECONDS = Histogram(
    "orchestrator_http_request_duration_seconds",
    "Time from a request's arrival to the end of its answer, by method and route template",
    ["method", "route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
# orchestrator_rounds_total (opened, committed, abandoned) is read from the database at each
# scrape: orchestrator/observability/round_counter.py.
ROUNDS_ABANDONED = Counter(
    "orchestrator_rounds_abandoned",
    "Rounds that closed without committing, by the phase they stopped in and what ended them "
    "(deadline, dropouts, refusals, failed_check, privacy_budget)",
    ["population", "kind", "phase", "ended_by"],
)
CHECKINS = Counter(
    "orchestrator_checkins",
    "Check-ins of authenticated devices by answer: accepted, again (the same assignment back), "
    "full, too_few_examples, already_took_part, over_cap (a buffered DP device past max_participations), "
    "no_round, roster_closed (a secure round past its keys)",
    ["population", "kind", "answer"],
)
REPORTS = Counter(
    "orchestrator_reports",
    "Reports by outcome (accepted, late, stale, repeated, invalid, refused) and, for invalid and refused "
    "ones, the class of reason",
    ["population", "kind", "outcome", "reason"],
)
ABORTS = Counter("orchestrator_aborts", "Assignments the device gave up", ["population", "kind"])
DROPPED = Counter(
    "orchestrator_assignments_dropped",
    "Assignments still outstanding when their round closed",
    ["population", "kind"],
)
AGGREGATION_SECONDS = Histogram(
    "orchestrator_aggregation_duration_seconds",
    "Time to aggregate a training round's reports into a new model version",
    ["population"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
# orchestrator_report_staleness_versions and the buffers' fill are read from the database at each
# scrape too: orchestrator/service/buffer_metrics.py.
DATABASE_ERRORS = Counter(
    "orchestrator_database_errors",
    "Errors the database driver raised, by exception class (their transaction was rolled back)",
    ["error"],
)
DATABASE_RETRIES = Counter(
    "orchestrator_database_retries",
    "Requests retried in a transaction of their own after their group's transaction failed",
    ["operation"],
)

_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def count(session: Session, counter: Counter, labels: tuple[str, ...], amount: float = 1.0) -> None:
    """Add `amount` to `counter` when the session's transaction commits."""
    child = counter.labels(*labels)
    on_commit(session, lambda: child.inc(amount))


def count_all(session: Session, counter: Counter, tally: Mapping[tuple[str, ...], int]) -> None:
    """`count` for each labels -> amount of `tally`, with one callback for all of them."""
    children = [(counter.labels(*labels), amount) for labels, amount in tally.items() if amount]
    if children:

        def publish() -> None:
            for child, amount in children:
                child.inc(amount)

        on_commit(session, publish)


def observe(session: Session, histogram: Histogram, labels: tuple[str, ...], value: float) -> None:
    """Observe `value` in `histogram` when the session's transaction commits."""
    child = histogram.labels(*labels)
    on_commit(session, lambda: child.observe(value))


def count_database_errors(engine: Engine) -> None:
    """Count every error the database driver raises on `engine`, by its class."""

    @event.listens_for(engine, "handle_error")
    def _count(context: ExceptionContext) -> None:
        DATABASE_ERRORS.labels(type(context.original_exception).__name__).inc()


def render() -> tuple[bytes, str]:
    """The Prometheus text exposition of every metric, over all server processes."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]
ASGIApp = Callable[[Scope, Receive, Send], Any]


class RequestMetrics:
    """ASGI middleware: counts every HTTP request by its route template (`/v1/assignments/
    {assignment_id}/report`, never the path itself, so the labels stay few) and status, and
    times it. A request that raises is counted as the 500 the server answers. `static_paths`: the
    paths of routes that FastAPI does not name in the request's scope (`/openapi.json`, `/docs`);
    any other path no route took is `unmatched`."""

    def __init__(
        self,
        app: ASGIApp,
        static_paths: frozenset[str] = frozenset(),
        on_request: Callable[[Scope, str, int, float], None] | None = None,
    ) -> None:
        self.app = app
        self.static_paths = static_paths
        self.on_request = on_request
        self._children: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_and_note_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            seconds = time.perf_counter() - start
            route = getattr(scope.get("route"), "path", None) or (
                scope["path"] if scope["path"] in self.static_paths else "unmatched"
            )
            method = scope["method"] if scope["method"] in _METHODS else "other"
            key = (method, route, status)
            children = self._children.get(key)
            if children is None:  # label look-ups take a lock; do them once per route and status
                children = (
                    REQUESTS.labels(method, route, str(status)),
                    REQUEST_SECONDS.labels(method, route),
                )
                self._children[key] = children
            children[0].inc()
            children[1].observe(seconds)
            if self.on_request is not None:
                self.on_request(scope, route, status, seconds)
