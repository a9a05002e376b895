from __future__ import annotations

import json
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, cast

from fastapi import APIRouter, HTTPException, Path, Request, Response
from fastapi.routing import APIRoute
from pydantic_core import to_json
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker
from starlette.applications import Starlette

from contracts.mixing import MixingConfig
from contracts.protocol import Assignment, Rejection, TaskKind
from orchestrator import mixing, rounds, secure_rounds
from orchestrator.api.deps import (
    DATABASE_UNAVAILABLE,
    UNAUTHENTICATED,
    SessionFactoryDep,
    TokenDep,
    require_device,
    run_db,
    token_of,
)
from orchestrator.api.group_commit import GroupCommit
from orchestrator.api.schemas import (
    CHECK_IN,
    AssignmentOut,
    CheckInBody,
    ManifestOut,
    RejectionOut,
    binary,
    refusals,
)
from orchestrator.db import ModelVersion, Population
from orchestrator.devices import authenticate_all
from orchestrator.limits import MAX_COUNT, MAX_JSON_DEPTH

router = APIRouter(prefix="/v1/populations", tags=["devices"])


@dataclass(frozen=True)
class _CheckInCall:
    token: str
    example_count: int
    kind: str


CheckInGroups = GroupCommit[str, _CheckInCall, Assignment | rounds.Refused]


def checkin_groups(app: Starlette, window_seconds: float) -> CheckInGroups:
    """The group commit of check-ins, keyed by population."""

    async def transaction(
        population: str, calls: Sequence[_CheckInCall]
    ) -> list[Assignment | rounds.Refused]:
        return await run_db(app, _checkin, app.state.sessionmaker, population, calls, app.state.clock())

    return GroupCommit(transaction, window_seconds, fail_together=DATABASE_UNAVAILABLE, name="checkin")


class _CheckInRoute(APIRoute):
    """The check-in route, documented and validated by FastAPI from `checkin`'s signature, with a
    shortcut for the common case: every device checks in every round, and FastAPI's dependency
    resolution cost more than the check-in's share of its transaction. A check-in with a bearer
    token and a JSON body that is a valid `CheckIn` is parsed here the way FastAPI parses it
    (`json.loads`, then the model's validation) and goes straight to `checkin`; anything else goes
    through FastAPI's own handler, so every refusal of a malformed request is FastAPI's."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        fastapi_handler = super().get_route_handler()

        async def handler(request: Request) -> Response:
            authorization = request.headers.get("authorization")
            content_type = request.headers.get("content-type") or ""
            if authorization and authorization.startswith("Bearer ") and "json" in content_type:
                try:
                    document = json.loads(await request.body())
                except RecursionError:  # FastAPI's handler would call it "an error parsing the body"
                    raise HTTPException(
                        422, f"the check-in nests deeper than {MAX_JSON_DEPTH} levels"
                    ) from None
                except ValueError:  # FastAPI's handler says what is wrong
                    document = None
                if document is not None and content_type == "application/json":
                    try:
                        body = CHECK_IN.validate_python(document)
                    except ValueError:  # as above
                        pass
                    else:
                        population: str = request.path_params["population"]
                        return await checkin(population, body, token_of(authorization), request)
            return await fastapi_handler(request)

        return handler


async def checkin(population: str, body: CheckInBody, token: TokenDep, request: Request) -> Response:
    groups: CheckInGroups = request.app.state.checkin_groups
    result = await groups.submit(population, _CheckInCall(token, body.example_count, body.task))
    if isinstance(result, Assignment):
        return Response(to_json(result), media_type="application/json")
    if result.status in (401, 404):
        headers = {"WWW-Authenticate": "Bearer"} if result.status == 401 else None
        raise HTTPException(result.status, result.message, headers=headers)
    retry = result.retry_after if result.retry_after is not None else 30.0
    return Response(
        to_json(Rejection(result.message, retry)),
        media_type="application/json",
        headers={"Retry-After": str(max(1, round(retry)))},
    )


router.add_api_route(
    "/{population}/checkin",
    checkin,
    methods=["POST"],
    response_model=AssignmentOut | RejectionOut,
    summary="Check in for a task",
    description="200 with an `Assignment` (`accepted: true`), or with a `Rejection` (`accepted: false`) "
    "and `Retry-After` when there is no task for this device now: no round of that kind is open, the "
    "round is full, the device holds too few examples, a secure round has closed its check-ins, or the "
    "population's privacy budget is spent (`Retry-After: 86400`, for good: no training round opens "
    "again). The assignment's URLs are paths on this server (`/v1/...`), appended to the base URL "
    "the device checked in at.",
    responses={
        200: {
            "headers": {
                "Retry-After": {
                    "description": "with a rejection only: seconds before checking in again",
                    "schema": {"type": "integer"},
                }
            }
        },
        **refusals({404: "no population of that name", 422: None}),
    },
    route_class_override=_CheckInRoute,
)


def _checkin(
    factory: sessionmaker[Session], population: str, calls: Sequence[_CheckInCall], now: float
) -> list[Assignment | rounds.Refused]:
    """One transaction for check-ins that arrived together; each call gets its own answer.

    Retried once, with the population locked, when another server process closed the round or
    gave one of these devices its assignment at the same time (rounds.checkin)."""
    try:
        return _checkin_once(factory, population, calls, now, lock=False)
    except (rounds.RoundClosed, IntegrityError):
        return _checkin_once(factory, population, calls, now, lock=True)


def _checkin_once(
    factory: sessionmaker[Session], population: str, calls: Sequence[_CheckInCall], now: float, lock: bool
) -> list[Assignment | rounds.Refused]:
    with factory.begin() as session:
        device_ids = authenticate_all(session, [call.token for call in calls])
        known = [
            rounds.CheckIn(device_id, call.example_count, call.kind)
            for call, device_id in zip(calls, device_ids, strict=True)
            if device_id is not None
        ]
        found = rounds.find_population(session, population)
        mixed = mixing.mixing_of(session, found) if found is not None else MixingConfig()
        answers = iter(
            rounds.checkin(session, found, known, now, lock)
            if found is not None
            else [rounds.Refused(404, f"no population {population!r}")] * len(known)
        )
        return [
            _assignment_out(found, next(answers), now, mixed, lambda r: secure_rounds.parameters(session, r))
            if device_id is not None
            else rounds.Refused(401, UNAUTHENTICATED)
            for device_id in device_ids
        ]


def _task_config(population: Population, clip_norm: float | None) -> dict[str, Any]:
    """The population's task config; under adaptive clipping, with the round's clip norm."""
    task_config = rounds.population_settings(population).task_config
    return task_config if clip_norm is None else {**task_config, "clip_norm": clip_norm}


def _assignment_out(
    population: Population | None,
    answer: rounds.Accepted | rounds.Refused,
    now: float,
    mixed: MixingConfig,
    secure_parameters: Callable[[int], dict[str, Any]],
) -> Assignment | rounds.Refused:
    if isinstance(answer, rounds.Refused):
        return answer
    assert population is not None  # only a population hands out assignments
    sha, name = population.artifact_sha256, population.name
    settings = rounds.population_settings(population)
    secure = answer.kind == rounds.TRAINING and settings.secure_training
    version, assignment = answer.model_version, answer.assignment_id
    training = answer.kind == rounds.TRAINING
    gradient = training and mixed.strategy == "gradient_transfer"
    return Assignment(
        assignment_id=assignment,
        round_id=answer.round_id,
        kind=cast(TaskKind, answer.kind),  # a round is of one of the two kinds
        deadline=answer.deadline,
        seconds_left=answer.deadline - now,
        model_version=version,
        artifact_sha256=sha,
        artifact_url=f"/v1/artifacts/{sha}",
        params_url=f"/v1/populations/{name}/models/{version}/global",
        manifest_url=f"/v1/populations/{name}/manifest",
        report_url=f"/v1/assignments/{assignment}/report",
        abort_url=f"/v1/assignments/{assignment}/abort",
        task_config=_task_config(population, answer.clip_norm),
        aggregation="secure" if secure else "plaintext",
        secure_url=f"/v1/assignments/{assignment}/secure" if secure else None,
        # Saves the device a round trip before its keys: the advertise phase is the round's longest.
        secure_parameters=secure_parameters(answer.round_id) if secure else None,
        central_examples_url=(
            f"/v1/assignments/{assignment}/central-examples"
            if training and mixed.strategy == "example_transfer"
            else None
        ),
        central_gradient_url=f"/v1/assignments/{assignment}/central-gradient" if gradient else None,
        central_gradient_weight=mixed.weight if gradient else None,
    )


def _manifest(factory: sessionmaker[Session], token: str, population: str) -> dict[str, Any]:
    with factory() as session:
        require_device(session, token)
        found = session.scalars(select(Population).where(Population.name == population)).first()
        if found is None:
            raise HTTPException(404, f"no population {population!r}")
        return dict(found.manifest)


@router.get(
    "/{population}/manifest",
    summary="The model's manifest (shapes, signatures, defaults)",
    responses={200: {"model": ManifestOut}, **refusals({404: "no population of that name"})},
)
async def manifest(
    population: str, token: TokenDep, factory: SessionFactoryDep, request: Request
) -> dict[str, Any]:
    return await run_db(request.app, _manifest, factory, token, population)


def _global_params(factory: sessionmaker[Session], token: str, population: str, version: int) -> bytes:
    with factory() as session:
        require_device(session, token)
        found = session.scalars(select(Population).where(Population.name == population)).first()
        if found is None:
            raise HTTPException(404, f"no population {population!r}")
        model = session.get(ModelVersion, (found.id, version))
        if model is None:
            if 0 < version < found.current_version:
                raise HTTPException(
                    404,
                    f"model version {version} of population {population!r} was pruned (the population "
                    f"keeps its newest versions; keep_model_versions); the current version is "
                    f"{found.current_version}",
                )
            raise HTTPException(
                404,
                f"population {population!r} has no model version {version}; the current version is "
                f"{found.current_version}",
            )
        return model.params


@router.get(
    "/{population}/models/{version}/global",
    summary="Global parameters (safetensors)",
    description="The model version's global parameters, dense, as safetensors (docs/reference/"
    "wire-formats.md): one float32 tensor per manifest `global_params` entry, under its name and "
    "with its shape (0-D and 1-D tensors too). Immutable: cached for a year.",
    response_class=Response,
    responses={
        **binary("safetensors: the dense global tensors"),
        **refusals(
            {404: "no population of that name, or no such model version (or it was pruned)", 422: None}
        ),
    },
)
async def global_params(
    population: str,
    version: Annotated[int, Path(ge=0, le=MAX_COUNT)],
    token: TokenDep,
    factory: SessionFactoryDep,
    request: Request,
) -> Response:
    params = await run_db(request.app, _global_params, factory, token, population, version)
    return Response(
        content=params,
        media_type="application/octet-stream",
        headers={"Cache-Control": "public, max-age=31536000, immutable", "X-Model-Version": str(version)},
    )
