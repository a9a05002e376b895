"""`GET /metrics`: the Prometheus exposition, for the operator's scraper.

It takes a bearer token like the admin API: the counters name populations and show when rounds
open and how full they are, which helps whoever times hostile check-ins. The scraper may hold a
token of its own (`ORCHESTRATOR_METRICS_TOKEN`) that opens `/metrics` and nothing else, so that
the admin token need not sit in a Prometheus configuration.
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request, Response

from orchestrator import metrics
from orchestrator.api.deps import SettingsDep, TokenDep, require_admin

router = APIRouter(tags=["admin"])


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
    return Response(body, media_type=content_type)
