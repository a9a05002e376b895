from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from orchestrator import rounds
from orchestrator.api.deps import ClockDep, SessionFactoryDep, TokenDep, require_device, run_db
from orchestrator.api.schemas import AssignmentOut, CheckIn, RejectionOut
from orchestrator.db import ModelVersion, Population

router = APIRouter(prefix="/v1/populations", tags=["devices"])


@router.post(
    "/{population}/checkin", response_model=AssignmentOut | RejectionOut, summary="Check in for a task"
)
async def checkin(
    population: str,
    body: CheckIn,
    token: TokenDep,
    factory: SessionFactoryDep,
    clock: ClockDep,
    request: Request,
    response: Response,
) -> AssignmentOut | RejectionOut:
    result = await run_db(request, _checkin, factory, population, body, token, clock())
    if isinstance(result, AssignmentOut):
        return result
    retry = result.retry_after if result.retry_after is not None else 30.0
    response.headers["Retry-After"] = str(max(1, round(retry)))
    return RejectionOut(reason=result.message, retry_after_seconds=retry)


def _checkin(
    factory: sessionmaker[Session], population: str, body: CheckIn, token: str, now: float
) -> AssignmentOut | rounds.Refused:
    with factory.begin() as session:
        device = require_device(session, token)
        found = rounds.lock_population(session, population)
        if found is None:
            raise HTTPException(404, f"no population {population!r}")
        result = rounds.checkin(session, found, device, body.example_count, body.task, now)
        if isinstance(result, rounds.Refused):
            return result
        a, r = result.assignment, result.round
        return AssignmentOut(
            assignment_id=a.id,
            round_id=r.id,
            kind=r.kind,
            deadline=a.deadline,
            seconds_left=a.deadline - now,
            model_version=r.base_version,
            artifact_sha256=found.artifact_sha256,
            artifact_url=f"/v1/artifacts/{found.artifact_sha256}",
            params_url=f"/v1/populations/{found.name}/models/{r.base_version}/global",
            manifest_url=f"/v1/populations/{found.name}/manifest",
            report_url=f"/v1/assignments/{a.id}/report",
            abort_url=f"/v1/assignments/{a.id}/abort",
            task_config=rounds.population_settings(found).task_config,
        )


def _manifest(factory: sessionmaker[Session], token: str, population: str) -> dict[str, Any]:
    with factory() as session:
        require_device(session, token)
        found = session.scalars(select(Population).where(Population.name == population)).first()
        if found is None:
            raise HTTPException(404, f"no population {population!r}")
        return dict(found.manifest)


@router.get("/{population}/manifest", summary="The model's manifest (shapes, signatures, defaults)")
async def manifest(
    population: str, token: TokenDep, factory: SessionFactoryDep, request: Request
) -> dict[str, Any]:
    return await run_db(request, _manifest, factory, token, population)


def _global_params(factory: sessionmaker[Session], token: str, population: str, version: int) -> bytes:
    with factory() as session:
        require_device(session, token)
        found = session.scalars(select(Population).where(Population.name == population)).first()
        if found is None:
            raise HTTPException(404, f"no population {population!r}")
        model = session.get(ModelVersion, (found.id, version))
        if model is None:
            raise HTTPException(404, f"population {population!r} has no model version {version}")
        return model.params


@router.get("/{population}/models/{version}/global", summary="Global parameters (safetensors)")
async def global_params(
    population: str, version: int, token: TokenDep, factory: SessionFactoryDep, request: Request
) -> Response:
    params = await run_db(request, _global_params, factory, token, population, version)
    return Response(
        content=params,
        media_type="application/octet-stream",
        headers={"Cache-Control": "public, max-age=31536000, immutable", "X-Model-Version": str(version)},
    )
