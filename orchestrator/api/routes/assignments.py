from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request
from sqlalchemy.orm import Session, sessionmaker

from orchestrator import rounds
from orchestrator.api.deps import ClockDep, SessionFactoryDep, SettingsDep, TokenDep, require_device, run_db
from orchestrator.api.schemas import ReportAccepted
from orchestrator.db import Round

router = APIRouter(prefix="/v1/assignments", tags=["devices"])


def _answer(result: Round | rounds.Refused) -> ReportAccepted:
    if isinstance(result, rounds.Refused):
        raise HTTPException(result.status, result.message)
    return ReportAccepted(
        round_id=result.id, round_status=result.status, reported=result.reported, target=result.target
    )


def _report(
    factory: sessionmaker[Session], assignment_id: str, token: str, body: bytes, content_type: str, now: float
) -> Round | rounds.Refused:
    with factory.begin() as session:
        device_id = require_device(session, token)
        population = rounds.population_of_assignment(session, assignment_id)
        if population is None:
            return rounds.Refused(404, f"no assignment {assignment_id!r}")
        return rounds.report(session, population, assignment_id, device_id, body, content_type, now)


@router.post(
    "/{assignment_id}/report",
    response_model=ReportAccepted,
    summary="Report a task's result",
    description="Training: a safetensors body with the manifest's global tensors (the delta) and "
    "metadata `num_examples` and `metrics` (JSON). Evaluation: JSON `{num_examples, metrics}`. "
    "409 when late or repeated, 422 when malformed, 403 when not the caller's.",
)
async def report(
    assignment_id: str,
    request: Request,
    token: TokenDep,
    factory: SessionFactoryDep,
    clock: ClockDep,
    settings: SettingsDep,
) -> ReportAccepted:
    declared = int(request.headers.get("content-length") or 0)
    if declared > settings.max_report_bytes:
        raise HTTPException(
            413, f"report of {declared} bytes exceeds the limit of {settings.max_report_bytes}"
        )
    body = await request.body()
    if len(body) > settings.max_report_bytes:
        raise HTTPException(
            413, f"report of {len(body)} bytes exceeds the limit of {settings.max_report_bytes}"
        )
    content_type = request.headers.get("content-type", "")
    return _answer(
        await run_db(request.app, _report, factory, assignment_id, token, body, content_type, clock())
    )


def _abort(
    factory: sessionmaker[Session], assignment_id: str, token: str, now: float
) -> Round | rounds.Refused:
    with factory.begin() as session:
        device_id = require_device(session, token)
        population = rounds.population_of_assignment(session, assignment_id)
        if population is None:
            return rounds.Refused(404, f"no assignment {assignment_id!r}")
        return rounds.abort(session, population, assignment_id, device_id, now)


@router.post("/{assignment_id}/abort", response_model=ReportAccepted, summary="Give up an assignment")
async def abort(
    assignment_id: str, request: Request, token: TokenDep, factory: SessionFactoryDep, clock: ClockDep
) -> ReportAccepted:
    return _answer(await run_db(request.app, _abort, factory, assignment_id, token, clock()))
