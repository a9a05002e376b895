from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Response

from orchestrator import rounds
from orchestrator.api.deps import ClockDep, SessionDep, SessionFactoryDep, TokenDep
from orchestrator.api.schemas import AssignmentOut, CheckIn, RejectionOut
from orchestrator.db import ModelVersion, Population
from orchestrator.devices import authenticate

router = APIRouter(prefix="/v1/populations", tags=["devices"])


@router.post(
    "/{population}/checkin", response_model=AssignmentOut | RejectionOut, summary="Check in for a task"
)
def checkin(
    population: str,
    body: CheckIn,
    token: TokenDep,
    factory: SessionFactoryDep,
    clock: ClockDep,
    response: Response,
) -> AssignmentOut | RejectionOut:
    with factory.begin() as session:
        device = authenticate(session, token)
        if device is None:
            raise HTTPException(401, "unknown device or wrong token")
        found = rounds.lock_population(session, population)
        if found is None:
            raise HTTPException(404, f"no population {population!r}")
        now = clock()
        result = rounds.checkin(session, found, device, body.example_count, body.task, now)
        if isinstance(result, rounds.Accepted):
            a, r = result.assignment, result.round
            settings = rounds.population_settings(found)
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
                task_config=settings.task_config,
            )
    retry = result.retry_after if result.retry_after is not None else 30.0
    response.headers["Retry-After"] = str(max(1, round(retry)))
    return RejectionOut(reason=result.message, retry_after_seconds=retry)


@router.get("/{population}/manifest", summary="The model's manifest (shapes, signatures, defaults)")
def manifest(population: str, token: TokenDep, session: SessionDep) -> dict[str, Any]:
    if authenticate(session, token) is None:
        raise HTTPException(401, "unknown device or wrong token")
    found = session.query(Population).filter_by(name=population).first()
    if found is None:
        raise HTTPException(404, f"no population {population!r}")
    return found.manifest


@router.get("/{population}/models/{version}/global", summary="Global parameters (safetensors)")
def global_params(population: str, version: int, token: TokenDep, session: SessionDep) -> Response:
    if authenticate(session, token) is None:
        raise HTTPException(401, "unknown device or wrong token")
    found = session.query(Population).filter_by(name=population).first()
    if found is None:
        raise HTTPException(404, f"no population {population!r}")
    model = session.get(ModelVersion, (found.id, version))
    if model is None:
        raise HTTPException(404, f"population {population!r} has no model version {version}")
    return Response(
        content=model.params,
        media_type="application/octet-stream",
        headers={"Cache-Control": "public, max-age=31536000, immutable", "X-Model-Version": str(version)},
    )
