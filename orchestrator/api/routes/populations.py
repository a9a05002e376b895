from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Coroutine
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Path, Query, Request, Response
from fastapi.routing import APIRoute
from pydantic_core import to_json
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker, undefer

from contracts.protocol import MAX_WAIT_SECONDS, Assignment, Rejection
from orchestrator.api.binary_bodies import CACHE_CONTROL, DENSE_GLOBALS, IMMUTABLE, safetensors
from orchestrator.api.deps import (
    SessionFactoryDep,
    TokenDep,
    is_admin,
    require_device,
    run_db,
    token_of,
)
from orchestrator.api.openapi import ADMIN_TOO
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
from orchestrator.limits import MAX_COUNT, MAX_JSON_DEPTH
from orchestrator.rounds.refusals import Refused
from orchestrator.service.checkins import CheckInCall, CheckInGroups
from orchestrator.service.waiting_room import WaitingRoom

router = APIRouter(prefix="/v1/populations", tags=["devices"])
_MODEL_VERSION = {"X-Model-Version": {"description": "the model version", "schema": {"type": "integer"}}}


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
                        wait = _wait_of(request)
                        if wait is not False:  # else FastAPI's handler refuses the query
                            population: str = request.path_params["population"]
                            return await checkin(population, body, token_of(authorization), request, wait)
            return await fastapi_handler(request)

        return handler


def _wait_of(request: Request) -> float | Literal[False] | None:
    """The check-in's `wait` as `WaitQuery` validates it: None when absent, False when invalid."""
    given = request.query_params.get("wait")
    if given is None:
        return None
    try:
        wait = float(given)
    except ValueError:
        return False
    return wait if 0 < wait <= MAX_WAIT_SECONDS else False


_WAIT_DOC = (
    "seconds this device can wait for its answer: a check-in that finds a secure round's roster "
    "closed may then be held for the next round, up to its capacity (at most 60 s, and not past "
    "the time it would be told to come back); without it, such a check-in is refused at once"
)
WaitQuery = Annotated[float | None, Query(gt=0, le=MAX_WAIT_SECONDS, description=_WAIT_DOC)]


async def checkin(
    population: str, body: CheckInBody, token: TokenDep, request: Request, wait: WaitQuery = None
) -> Response:
    groups: CheckInGroups = request.app.state.checkin_groups
    room: WaitingRoom = request.app.state.waiting_room

    def check_in(held: bool) -> Awaitable[Assignment | Refused]:
        return groups.submit(population, CheckInCall(token, body.example_count, body.task, held))

    # Refused by a secure round's closed roster: held for the next round first, if it may wait.
    result = await room.check_in(population, check_in, wait or 0.0)
    if isinstance(result, Assignment):
        return Response(to_json(result), media_type="application/json")
    if result.status in (401, 404):
        headers = {"WWW-Authenticate": "Bearer"} if result.status == 401 else None
        raise HTTPException(result.status, result.message, headers=headers)
    # The body keeps the exact seconds (pace steering spreads devices' returns within a window of a
    # few seconds); the header, whole seconds by HTTP, is never earlier: rounded up, at least 1.
    retry = result.retry_after if result.retry_after is not None else 30.0
    return Response(
        to_json(Rejection(result.message, retry)),
        media_type="application/json",
        headers={"Retry-After": str(retry_after_header(retry))},
    )


def retry_after_header(seconds: float) -> int:
    """The `Retry-After` of a rejection whose body says `seconds`."""
    return max(1, math.ceil(seconds))


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
                    "description": "with a rejection only: seconds before checking in again, the "
                    "body's `retry_after_seconds` rounded up to a whole second (at least 1)",
                    "schema": {"type": "integer"},
                }
            }
        },
        **refusals({404: "no population of that name", 422: None}),
    },
    route_class_override=_CheckInRoute,
)


def _manifest(factory: sessionmaker[Session], token: str, admin: bool, population: str) -> dict[str, Any]:
    with factory() as session:
        if not admin:
            require_device(session, token)
        found = session.scalars(select(Population).where(Population.name == population)).first()
        if found is None:
            raise HTTPException(404, f"no population {population!r}")
        return dict(found.manifest)


@router.get(
    "/{population}/manifest",
    summary="The model's manifest (shapes, signatures, defaults); a device's token or the admin token",
    openapi_extra={ADMIN_TOO: True},
    responses={200: {"model": ManifestOut}, **refusals({404: "no population of that name"})},
)
async def manifest(
    population: str, token: TokenDep, factory: SessionFactoryDep, request: Request
) -> dict[str, Any]:
    return await run_db(request.app, _manifest, factory, token, is_admin(request.app, token), population)


def _task_config(factory: sessionmaker[Session], token: str, admin: bool, population: str) -> dict[str, Any]:
    with factory() as session:
        if not admin:
            require_device(session, token)
        query = select(Population).where(Population.name == population).options(undefer(Population.settings))
        found = session.scalars(query).first()
        if found is None:
            raise HTTPException(404, f"no population {population!r}")
        return dict(found.settings["task_config"])


@router.get(
    "/{population}/task-config",
    summary="The population's current task config; a device's token or the admin token",
    openapi_extra={ADMIN_TOO: True},
    description="The hyperparameters the population's devices train with now (over the manifest's "
    "`training_defaults`), as in an assignment's `task_config`. A device that serves recommendations "
    "without a current assignment reconstructs its local parameters with these, as training does.",
    responses={200: {"model": dict[str, Any]}, **refusals({404: "no population of that name"})},
)
async def task_config(
    population: str, token: TokenDep, factory: SessionFactoryDep, request: Request
) -> dict[str, Any]:
    return await run_db(request.app, _task_config, factory, token, is_admin(request.app, token), population)


def _global_params(
    factory: sessionmaker[Session], token: str, admin: bool, population: str, version: int
) -> bytes:
    with factory() as session:
        if not admin:  # the operator downloads the trained model with the admin token
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
    summary="Global parameters (safetensors); a device's token or the admin token",
    openapi_extra={ADMIN_TOO: True},
    description="The model version's global parameters, dense, as safetensors (docs/reference/"
    "wire-formats.md): one float32 tensor per manifest `global_params` entry, under its name and "
    "with its shape (0-D and 1-D tensors too). Immutable: cached for a year.",
    response_class=Response,
    responses={
        **binary(
            "safetensors: the dense global tensors",
            {**CACHE_CONTROL, **_MODEL_VERSION},
            safetensors("the dense global tensors", DENSE_GLOBALS),
        ),
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
    admin = is_admin(request.app, token)
    params = await run_db(request.app, _global_params, factory, token, admin, population, version)
    return Response(
        content=params,
        media_type="application/octet-stream",
        headers={"Cache-Control": IMMUTABLE, "X-Model-Version": str(version)},
    )
