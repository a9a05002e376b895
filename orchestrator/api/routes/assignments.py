from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fastapi import APIRouter, HTTPException, Request, Response
from sqlalchemy.orm import Session, sessionmaker
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool

from contracts.mixing import encode_examples
from contracts.params import decode_params, encode_sparse_delta
from contracts.protocol import ReportAccepted
from orchestrator import central_training, mixing, rounds
from orchestrator.api import schemas
from orchestrator.api.deps import (
    DATABASE_UNAVAILABLE,
    UNAUTHENTICATED,
    SessionFactoryDep,
    TokenDep,
    require_device,
    run_db,
)
from orchestrator.api.group_commit import GroupCommit
from orchestrator.central_training import CentralJob
from orchestrator.db import Assignment, ModelVersion, Population, Round
from orchestrator.devices import authenticate_all

router = APIRouter(prefix="/v1/assignments", tags=["devices"])


def _answer(result: ReportAccepted | rounds.Refused) -> ReportAccepted:
    if isinstance(result, rounds.Refused):
        headers = {"WWW-Authenticate": "Bearer"} if result.status == 401 else None
        raise HTTPException(result.status, result.message, headers=headers)
    return result


def _accepted(round_: Round) -> ReportAccepted:
    return ReportAccepted(
        round_id=round_.id, round_status=round_.status, reported=round_.reported, target=round_.target
    )


@dataclass(frozen=True)
class _ReportCall:
    """A report, or an abort (`abort`: no body): both count into their round under its
    population's lock, so they share one group commit."""

    assignment_id: str
    token: str
    body: bytes
    content_type: str
    abort: bool = False


ReportGroups = GroupCommit[None, _ReportCall, ReportAccepted | rounds.Refused]


def report_groups(app: Starlette, window_seconds: float) -> ReportGroups:
    """The group commit of reports and aborts: one transaction for those that arrive together.
    An abort in a transaction of its own waited for the population lock while holding one of the
    few worker threads (`worker_threads`), and check-ins then waited for a thread: at 500 visits/s
    on PostgreSQL that wait was most of the check-ins' p99."""

    async def transaction(_: None, calls: Sequence[_ReportCall]) -> list[ReportAccepted | rounds.Refused]:
        return await run_db(app, _report, app.state.sessionmaker, calls, app.state.clock())

    return GroupCommit(transaction, window_seconds, fail_together=DATABASE_UNAVAILABLE, name="report")


def _report(
    factory: sessionmaker[Session], calls: Sequence[_ReportCall], now: float
) -> list[ReportAccepted | rounds.Refused]:
    """Each report or abort in turn, in one transaction; an answer is built as soon as its call is
    in, since a later report in the same transaction may commit the round."""
    with factory.begin() as session:
        device_ids = authenticate_all(session, [call.token for call in calls])
        populations = rounds.populations_of_assignments(
            session,
            [call.assignment_id for call, device_id in zip(calls, device_ids, strict=True) if device_id],
        )
        answers: list[ReportAccepted | rounds.Refused] = []
        for call, device_id in zip(calls, device_ids, strict=True):
            population = populations.get(call.assignment_id)
            if device_id is None:
                answers.append(rounds.Refused(401, UNAUTHENTICATED))
            elif population is None:
                answers.append(rounds.Refused(404, f"no assignment {call.assignment_id!r}"))
            else:
                result = (
                    rounds.abort(session, population, call.assignment_id, device_id, now)
                    if call.abort
                    else rounds.report(
                        session, population, call.assignment_id, device_id, call.body, call.content_type, now
                    )
                )
                answers.append(result if isinstance(result, rounds.Refused) else _accepted(result))
        return answers


@router.post(
    "/{assignment_id}/report",
    response_model=schemas.ReportAccepted,
    summary="Report a task's result",
    description="A training task's report is `application/octet-stream`: safetensors holding the "
    "sparse delta of the manifest's global tensors (`<name>/rows` int32 increasing, `<name>/values` "
    "float32 `[k, ...]`, `<name>/shape` int64, the dense shape) with string metadata `num_examples` "
    '(an integer, e.g. "5") and `metrics` (a JSON object as a string). An evaluation task\'s report '
    "is `application/json`: `EvaluationReport`. docs/reference/wire-formats.md has the details.",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                "application/json": {"schema": {"$ref": "#/components/schemas/EvaluationReport"}},
            },
        }
    },
    responses=schemas.refusals(
        {
            403: "the assignment belongs to another device",
            404: "no such assignment",
            409: "the report is late or repeated, the assignment was aborted or refused, or the round "
            "uses secure aggregation",
            415: "a training report is application/octet-stream (safetensors), an evaluation report "
            "application/json; nothing was stored and the assignment is still open",
            422: "the report is malformed or out of bounds (the detail says which); the assignment is "
            "closed as invalid",
        }
    ),
)
async def report(assignment_id: str, request: Request, token: TokenDep) -> ReportAccepted:
    body = await request.body()  # under max_report_bytes, after the token was checked (api/edge.py)
    groups: ReportGroups = request.app.state.report_groups
    call = _ReportCall(assignment_id, token, body, request.headers.get("content-type", ""))
    return _answer(await groups.submit(None, call))


@router.post(
    "/{assignment_id}/abort",
    response_model=schemas.ReportAccepted,
    summary="Give up an assignment",
    responses=schemas.refusals(
        {
            403: "the assignment belongs to another device",
            404: "no such assignment",
            409: "the assignment has already reported or aborted, or its round has closed",
        }
    ),
)
async def abort(assignment_id: str, request: Request, token: TokenDep) -> ReportAccepted:
    groups: ReportGroups = request.app.state.report_groups
    return _answer(await groups.submit(None, _ReportCall(assignment_id, token, b"", "", abort=True)))


def _open_assignment(session: Session, token: str, assignment_id: str) -> tuple[Population, Assignment]:
    """The device's own open assignment and its population; 404/409 otherwise."""
    device_id = require_device(session, token)
    population = rounds.population_of_assignment(session, assignment_id)
    assignment = session.get(Assignment, assignment_id)
    if population is None or assignment is None or assignment.device_id != device_id:
        raise HTTPException(404, f"no assignment {assignment_id!r} of this device")
    if assignment.status != "assigned":
        raise HTTPException(409, f"assignment {assignment_id!r} is {assignment.status}, no longer open")
    return population, assignment


def _central_examples(factory: sessionmaker[Session], token: str, assignment_id: str) -> bytes:
    with factory() as session:
        population, _ = _open_assignment(session, token, assignment_id)
        config = mixing.mixing_of(session, population)
        if config.strategy != "example_transfer":
            raise HTTPException(
                404, f"assignment {assignment_id!r}'s population does not mix by example transfer"
            )
        manifest = rounds.population_manifest(population)
        # The examples only: a device never receives the dataset's group ids.
        examples = mixing.central_examples(session, population, manifest).examples
        return encode_examples(mixing.assignment_examples(examples, config, assignment_id), manifest.features)


@router.get(
    "/{assignment_id}/central-examples",
    summary="Example transfer: the assignment's centralized examples (safetensors)",
    response_class=Response,
    responses={
        **schemas.binary("safetensors: one tensor per manifest feature, [n, *shape]"),
        **schemas.refusals(
            {
                404: "no such assignment of this device, or its population does not mix by example transfer",
                409: "the assignment is no longer open",
            }
        ),
    },
)
async def central_examples(
    assignment_id: str, token: TokenDep, factory: SessionFactoryDep, request: Request
) -> Response:
    blob = await run_db(request.app, _central_examples, factory, token, assignment_id)
    return Response(content=blob, media_type="application/octet-stream")


def _gradient_job(factory: sessionmaker[Session], token: str, assignment_id: str) -> CentralJob:
    with factory() as session:
        population, assignment = _open_assignment(session, token, assignment_id)
        round_ = session.get(Round, assignment.round_id)
        assert round_ is not None  # an assignment's round is never deleted
        if round_.kind != rounds.TRAINING:
            raise HTTPException(404, f"assignment {assignment_id!r} is an evaluation; it trains nothing")
        version = session.get(ModelVersion, (population.id, round_.base_version))
        if version is None:
            raise HTTPException(409, f"model version {round_.base_version} of the assignment was pruned")
        manifest = rounds.population_manifest(population)
        params = decode_params(version.params, manifest.global_params, "model version")
        task = rounds.population_settings(population).task()
        job = mixing.central_job(
            session, population, manifest, round_.base_version, params, task, "gradient_transfer"
        )
        if job is None:
            raise HTTPException(
                404, f"assignment {assignment_id!r}'s population does not mix by gradient transfer"
            )
        return job


def _central_gradient(job: CentralJob) -> bytes:
    try:
        found = central_training.central_gradient(job)
    except central_training.CentralTrainingError as e:
        raise HTTPException(503, f"{e}; this model version has no central gradient to send") from None
    # Rows only: a row-sparse global's rows that the centralized data touches.
    return encode_sparse_delta(found.gradient)


@router.get(
    "/{assignment_id}/central-gradient",
    summary="Gradient transfer: the centralized loss's gradient at the round's globals (sparse safetensors)",
    response_class=Response,
    responses={
        **schemas.binary("safetensors: a sparse delta, as a training report's tensors (no metadata)"),
        **schemas.refusals(
            {
                404: "no such assignment of this device, an evaluation, or a population that does not "
                "mix by gradient transfer",
                409: "the assignment is no longer open, or its model version was pruned",
                503: "the model version cannot give a central gradient now (the detail says why)",
            }
        ),
    },
)
async def central_gradient(
    assignment_id: str, token: TokenDep, factory: SessionFactoryDep, request: Request
) -> Response:
    job = await run_db(request.app, _gradient_job, factory, token, assignment_id)
    # Computed outside the database session (once per model version, then cached).
    blob = await run_in_threadpool(_central_gradient, job)
    return Response(content=blob, media_type="application/octet-stream")
