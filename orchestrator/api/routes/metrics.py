"""`GET /metrics`: the Prometheus exposition, for the operator's scraper.

It takes a bearer token like the admin API: the counters name populations and show when rounds
open and how full they are, which helps whoever times hostile check-ins. The scraper may hold a
token of its own (`ORCHESTRATOR_METRICS_TOKEN`) that opens `/metrics` and nothing else, so that
the admin token need not sit in a Prometheus configuration.
"""

from __future__ import annotations

import hmac
import logging

from fastapi import APIRouter, Request, Response

from orchestrator.api.deps import DATABASE_UNAVAILABLE, SettingsDep, TokenDep, require_admin, run_db
from orchestrator.observability import metrics, round_counter
from orchestrator.service import buffer_metrics

router = APIRouter(tags=["admin"])
log = logging.getLogger("orchestrator")


@router.get(
    "/metrics",
    summary="Prometheus metrics (bearer: the metrics token or the admin token)",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}}},
)
async def scrape(request: Request, token: TokenDep, settings: SettingsDep) -> Response:
    metrics_token = settings.metrics_token
    if not (metrics_token and hmac.compare_digest(token.encode(), metrics_token.encode())):
        await require_admin(request, token)
    body, content_type = metrics.render()
    app = request.app
    try:
        app.state.round_counts = await run_db(app, round_counter.round_counts, app.state.sessionmaker)
        app.state.buffer_readings = await run_db(app, buffer_metrics.buffer_readings, app.state.sessionmaker)
    except DATABASE_UNAVAILABLE:  # the last reading: a counter must not go back meanwhile
        log.warning("metrics: rounds not read, the database is busy or unavailable")
    return Response(
        body
        + round_counter.exposition(getattr(app.state, "round_counts", {}))
        + buffer_metrics.exposition(getattr(app.state, "buffer_readings", {})),
        media_type=content_type,
    )
