from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, Response
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from contracts.mixing import encode_examples
from contracts.params import decode_params, encode_sparse_delta
from contracts.protocol import ReportAccepted
from orchestrator.api import schemas
from orchestrator.api.binary_bodies import CENTRAL_EXAMPLES, SPARSE_DELTA, safetensors
from orchestrator.api.deps import (
    SessionFactoryDep,
    TokenDep,
    require_device,
    run_db,
)
from orchestrator.db import Assignment, ModelVersion, Population, Round
from orchestrator.populations import central_training, mixing
from orchestrator.populations.central_training import CentralJob
from orchestrator.populations.config import population_manifest, population_settings
from orchestrator.populations.locks import population_of_assignment
from orchestrator.rounds.lifecycle import EVALUATION
from orchestrator.rounds.refusals import Refused
from orchestrator.service.reports import ReportCall, ReportGroups

router = APIRouter(prefix="/v1/assignments", tags=["devices"])


def _answer(result: ReportAccepted | Refused) -> ReportAccepted:
    if isinstance(result, Refused):
        headers = {"WWW-Authenticate": "Bearer"} if result.status == 401 else None
        raise HTTPException(result.status, result.message, headers=headers)
    return result


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
                "application/octet-stream": safetensors(
                    "a training task's report", SPARSE_DELTA, "TrainingReportMetadata"
                ),
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
    call = ReportCall(assignment_id, token, body, request.headers.get("content-type", ""))
    return _answer(await groups.submit(None, call))


@router.post(
    "/{assignment_id}/abort",
    response_model=schemas.ReportAccepted,
    summary="Give up an assignment",
    responses=schemas.refusals(
        {
            403: "the assignment belongs to another device",
            404: "no such assignment",
            409: "the assignment has already reported, or its round has closed (an abort repeated "
            "by its own device is answered 200 as the first was, and counted once)",
        }
    ),
)
async def abort(assignment_id: str, request: Request, token: TokenDep) -> ReportAccepted:
    groups: ReportGroups = request.app.state.report_groups
    return _answer(await groups.submit(None, ReportCall(assignment_id, token, b"", "", abort=True)))


def _open_assignment(session: Session, token: str, assignment_id: str) -> tuple[Population, Assignment]:
    """The device's own open assignment and its population; 404/409 otherwise."""
    device_id = require_device(session, token)
    population = population_of_assignment(session, assignment_id)
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
        manifest = population_manifest(population)
        # The examples only: a device never receives the dataset's group ids.
        examples = mixing.central_examples(session, population, manifest).examples
        return encode_examples(mixing.assignment_examples(examples, config, assignment_id), manifest.features)


@router.get(
    "/{assignment_id}/central-examples",
    summary="Example transfer: the assignment's centralized examples (safetensors)",
    response_class=Response,
    responses={
        **schemas.binary(
            "safetensors: one tensor per manifest feature, [n, *shape]",
            media=safetensors("the assignment's centralized examples", CENTRAL_EXAMPLES.split("; ")[0]),
        ),
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
        if round_.kind == EVALUATION:  # a training round's or a cohort's trains
            raise HTTPException(404, f"assignment {assignment_id!r} is an evaluation; it trains nothing")
        version = session.get(ModelVersion, (population.id, round_.base_version))
        if version is None:
            raise HTTPException(409, f"model version {round_.base_version} of the assignment was pruned")
        manifest = population_manifest(population)
        params = decode_params(version.params, manifest.global_params, "model version")
        task = population_settings(population).task()
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
        **schemas.binary(
            "safetensors: a sparse delta, as a training report's tensors (no metadata)",
            media=safetensors("the centralized loss's gradient", SPARSE_DELTA),
        ),
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
