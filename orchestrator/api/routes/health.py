"""Liveness and readiness: `/health` says the process answers, `/health/ready` that it has done
its start-up work (app.state.ready) and that the database answers."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.service.database import run_db

router = APIRouter(tags=["operations"])


@router.get("/health", summary="Liveness: answers without touching the database")
async def health() -> dict[str, str]:
    return {"status": "ok"}


def _database_answers(factory: sessionmaker[Session]) -> None:
    with factory() as session:
        session.execute(text("SELECT 1"))


@router.get(
    "/health/ready",
    summary="Readiness: start-up work done and the database answers (else 503 with Retry-After)",
    responses={503: {"description": "still starting, stopping, or the database is busy or unavailable"}},
)
async def ready(request: Request) -> JSONResponse:
    if not getattr(request.app.state, "ready", False):
        return JSONResponse(
            {"detail": "the server is starting or stopping; retry after the Retry-After seconds"},
            status_code=503,
            headers={"Retry-After": "1"},
        )
    await run_db(request.app, _database_answers, request.app.state.sessionmaker)  # unavailable: 503 (edge)
    return JSONResponse({"status": "ready"})
