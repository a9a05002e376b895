from __future__ import annotations

import math
import time
from typing import Annotated, Any, cast

from fastapi import APIRouter, File, Form, HTTPException, Query, Request, UploadFile
from sqlalchemy import Select, select
from sqlalchemy.orm import Session, sessionmaker

from contracts.mixing import MAX_CENTRAL_BYTES, MixingError
from contracts.protocol import (
    DevicesSeenView,
    ModelVersionView,
    PopulationView,
    PrivacyView,
    RoundView,
    TaskKind,
)
from orchestrator import devices
from orchestrator.api import schemas
from orchestrator.api.deps import AdminDep, ClockDep, SessionFactoryDep, run_db
from orchestrator.db import Population, Round, SettingsChange
from orchestrator.limits import MAX_COUNT, MAX_MANIFEST_BYTES, json_document
from orchestrator.populations import mixing as mixing_data
from orchestrator.populations import model_versions
from orchestrator.populations.config import population_manifest, population_settings
from orchestrator.populations.locks import lock_population
from orchestrator.populations.settings import MAX_SECONDS
from orchestrator.populations.settings_changes import SettingsChangeError, change_settings
from orchestrator.rounds import idle_backoff, pausing, release
from orchestrator.rounds.lifecycle import EVALUATION, advance, open_round, open_rounds, summarize_metrics
from orchestrator.service.population_creation import ExportedModel, PopulationError, create_population

router = APIRouter(prefix="/v1/admin", tags=["admin"])

COUNTERS = (
    "checked_in",
    "accepted",
    "rejected_capacity",
    "rejected_min_examples",
    "reported",
    "dropped",
    "late",
    "invalid",
    "aborted",
)


def round_out(r: Round) -> RoundView:
    return RoundView(
        id=r.id,
        kind=cast(TaskKind, r.kind),  # a round is of one of the two kinds
        status=r.status,
        base_version=r.base_version,
        result_version=r.result_version,
        target=r.target,
        capacity=r.capacity,
        min_reports=r.min_reports,
        opened_at=r.opened_at,
        deadline=r.deadline,
        closed_at=r.closed_at,
        counters={c: getattr(r, c) for c in COUNTERS},
        total_weight=r.total_weight,
        metrics=summarize_metrics(r),
        close_reason=r.close_reason,
        stopped_phase=r.stopped_phase,
        devices_had=r.devices_had,
        devices_needed=r.devices_needed,
        ended_by=r.ended_by,
        checkin_window=r.checkin_window,
    )


def privacy_out(p: Population) -> PrivacyView | None:
    settings = population_settings(p)
    if settings.dp() is None:
        return None
    spent = settings.privacy_spent(p.training_rounds_committed)
    return PrivacyView(
        epsilon=spent.epsilon if math.isfinite(spent.epsilon) else None,
        delta=spent.delta,
        sampling_rate=spent.sampling_rate,
        training_rounds=spent.rounds,
        epsilon_budget=spent.epsilon_budget,
        rounds_within_budget=spent.rounds_within_budget,
        budget_spent=spent.budget_spent,
        message=spent.message(),
    )


def population_out(session: Any, p: Population, now: float | None = None) -> PopulationView:
    now = time.time() if now is None else now
    return PopulationView(
        name=p.name,
        current_version=p.current_version,
        training_rounds_committed=p.training_rounds_committed,
        artifact_sha256=p.artifact_sha256,
        settings=p.settings,
        open_rounds=[round_out(r) for r in open_rounds(session, p).values()],
        privacy=privacy_out(p),
        recent_rounds=[round_out(r) for r in session.scalars(_recent_rounds(p.id))],
        idle_rounds=p.idle_rounds,
        next_round_at=p.next_round_at,
        backing_off=idle_backoff.describe(p, now),
        paused_at=p.paused_at,
        settings_version=p.settings_version,
        archived_at=p.archived_at,
        devices_seen=DevicesSeenView(*devices.seen(session, p.id, now)),
        model_versions=[ModelVersionView(*kept) for kept in model_versions.kept(session, p)],
    )


RECENT_ROUNDS = 5


def _recent_rounds(population_id: int) -> Select[tuple[Round]]:
    return (
        select(Round)
        .where(Round.population_id == population_id, Round.status != "open")
        .order_by(Round.id.desc())
        .limit(RECENT_ROUNDS)
    )


def _population(session: Any, name: str) -> Population:
    found = session.scalars(select(Population).where(Population.name == name)).first()
    if found is None:
        raise HTTPException(404, f"no population {name!r}")
    return found  # type: ignore[no-any-return]


@router.post(
    "/populations",
    response_model=schemas.PopulationOut,
    status_code=201,
    summary="Create a population",
    responses=schemas.refusals(
        {
            409: "a population of that name already exists",
            422: "the model, manifest, global parameters or settings are invalid (the detail says which)",
        }
    ),
)
async def create(
    _: AdminDep,
    factory: SessionFactoryDep,
    clock: ClockDep,
    name: Annotated[str, Form()],
    model: Annotated[UploadFile, File(description="model.tflite")],
    manifest: Annotated[UploadFile, File(description="manifest.json")],
    global_params: Annotated[UploadFile, File(description="global_params.safetensors")],
    settings: Annotated[str, Form(description="PopulationSettings as JSON")] = "{}",
) -> PopulationView:
    try:
        manifest_json = json_document(await manifest.read(), "manifest", MAX_MANIFEST_BYTES)
        settings_json = json_document(settings, "settings")
    except ValueError as e:
        raise HTTPException(422, f"manifest and settings must be JSON: {e}") from None
    if not isinstance(settings_json, dict):
        raise HTTPException(422, "settings must be a JSON object")
    exported = ExportedModel(await model.read(), manifest_json, await global_params.read())
    with factory.begin() as session:
        try:
            population = create_population(session, name, exported, settings_json, clock())
        except PopulationError as e:
            raise HTTPException(422 if "already exists" not in str(e) else 409, str(e)) from None
        return population_out(session, population, clock())


def _list_populations(factory: sessionmaker[Session], now: float) -> list[PopulationView]:
    with factory() as session:
        return [
            population_out(session, p, now)
            for p in session.scalars(select(Population).order_by(Population.id))
        ]


@router.get("/populations", response_model=schemas.PopulationsOut, summary="All populations")
async def list_populations(
    _: AdminDep, factory: SessionFactoryDep, clock: ClockDep, request: Request
) -> list[PopulationView]:
    return await run_db(request.app, _list_populations, factory, clock())


def _status(factory: sessionmaker[Session], name: str, now: float) -> PopulationView:
    with factory() as session:
        return population_out(session, _population(session, name), now)


@router.get(
    "/populations/{name}",
    response_model=schemas.PopulationOut,
    summary="A population's status",
    responses=schemas.refusals({404: "no population of that name"}),
)
async def status(
    name: str, _: AdminDep, factory: SessionFactoryDep, clock: ClockDep, request: Request
) -> PopulationView:
    return await run_db(request.app, _status, factory, name, clock())


def _list_rounds(
    factory: sessionmaker[Session], name: str, kind: str | None, limit: int, offset: int
) -> list[RoundView]:
    with factory() as session:
        population = _population(session, name)
        query = select(Round).where(Round.population_id == population.id)
        if kind is not None:
            query = query.where(Round.kind == kind)
        query = query.order_by(Round.id.desc()).limit(limit).offset(offset)
        return [round_out(r) for r in session.scalars(query)]


@router.get(
    "/populations/{name}/rounds",
    response_model=schemas.RoundsOut,
    summary="Rounds, newest first",
    responses=schemas.refusals({404: "no population of that name"}),
)
async def list_rounds(
    name: str,
    _: AdminDep,
    factory: SessionFactoryDep,
    request: Request,
    kind: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=MAX_COUNT)] = 0,
) -> list[RoundView]:
    return await run_db(request.app, _list_rounds, factory, name, kind, limit, offset)


def _locked(session: Session, name: str) -> Population:
    """The population `name`, its row locked for the transaction (a 404 when there is none)."""
    population = lock_population(session, name)
    if population is None:
        raise HTTPException(404, f"no population {name!r}")
    return population


@router.post(
    "/populations/{name}/evaluations",
    response_model=schemas.RoundOut,
    status_code=201,
    summary="Open an evaluation round",
    responses=schemas.refusals(
        {
            404: "no population of that name",
            409: "an evaluation round is already open, the population is paused or archived, or its "
            "privacy budget is spent (an evaluation's sums are not noised)",
        }
    ),
)
def schedule_evaluation(
    name: str,
    _: AdminDep,
    factory: SessionFactoryDep,
    clock: ClockDep,
    duration_seconds: Annotated[
        float | None,
        Query(
            gt=0,
            le=MAX_SECONDS,
            description="how long this round takes reports (default: the population's "
            "evaluation_round_duration_seconds); it closes at its target before, e.g. a day for "
            "devices that may take part only at night in their own time zones",
        ),
    ] = None,
) -> RoundView:
    with factory.begin() as session:
        population = _locked(session, name)
        if pausing.paused(population):
            raise HTTPException(409, "the population is paused: resume it first")
        refusal = release.may_open_evaluation(population)
        if refusal is not None:
            raise HTTPException(409, refusal)
        if EVALUATION in open_rounds(session, population):
            raise HTTPException(409, "an evaluation round is already open")
        return round_out(open_round(session, population, EVALUATION, clock(), duration_seconds))


@router.post(
    "/populations/{name}/pause",
    response_model=schemas.PopulationOut,
    summary="Pause a population: no new rounds; the open ones run to their end",
    responses=schemas.refusals({404: "no population of that name"}),
)
def pause(name: str, _: AdminDep, factory: SessionFactoryDep, clock: ClockDep) -> PopulationView:
    now = clock()
    with factory.begin() as session:
        population = _locked(session, name)
        pausing.pause(session, population, now)
        return population_out(session, population, now)


@router.post(
    "/populations/{name}/resume",
    response_model=schemas.PopulationOut,
    summary="Resume a paused population: its next training round opens now",
    responses=schemas.refusals({404: "no population of that name", 409: "the population is archived"}),
)
def resume(name: str, _: AdminDep, factory: SessionFactoryDep, clock: ClockDep) -> PopulationView:
    now = clock()
    with factory.begin() as session:
        population = _locked(session, name)
        try:
            pausing.resume(session, population, now)
        except pausing.ArchivedError as e:
            raise HTTPException(409, str(e)) from None
        advance(session, population, now)
        return population_out(session, population, now)


@router.post(
    "/populations/{name}/archive",
    response_model=schemas.PopulationOut,
    summary="Archive a population: paused for good (no new rounds; it cannot be resumed)",
    responses=schemas.refusals({404: "no population of that name"}),
)
def archive(name: str, _: AdminDep, factory: SessionFactoryDep, clock: ClockDep) -> PopulationView:
    now = clock()
    with factory.begin() as session:
        population = _locked(session, name)
        pausing.archive(session, population, now)
        return population_out(session, population, now)


@router.patch(
    "/populations/{name}/settings",
    response_model=schemas.PopulationOut,
    summary="Change the settings that are safe to change while rounds run (from the next round on)",
    description='A JSON body `{"settings": {...}, "operator": "who"}`: the settings to change '
    "(target_reports, oversampling, min_reports, round_duration_seconds, min_examples, "
    "retry_after_seconds, keep_model_versions, evaluation_every, evaluation_target_reports, "
    "min_evaluation_reports, evaluation_round_duration_seconds), validated as at creation, and who "
    "changes them (kept with the caller's address, the time and the new settings version).",
    responses=schemas.refusals(
        {
            404: "no population of that name",
            422: "not JSON of that shape, a setting that is not safe to change, or invalid settings",
        }
    ),
    openapi_extra=schemas.json_body(
        "the settings to change and who changes them",
        {
            "type": "object",
            "required": ["settings", "operator"],
            "properties": {"settings": {"type": "object"}, "operator": {"type": "string"}},
            "additionalProperties": False,
        },
    ),
)
async def patch_settings(
    name: str, _: AdminDep, factory: SessionFactoryDep, clock: ClockDep, request: Request
) -> PopulationView:
    try:
        body = json_document(await request.body(), "the settings change")
    except ValueError as e:
        raise HTTPException(422, str(e)) from None
    if not isinstance(body, dict) or set(body) != {"settings", "operator"}:
        raise HTTPException(422, 'the body must be {"settings": {...}, "operator": "who changes them"}')
    operator = body["operator"]
    if not isinstance(operator, str):
        raise HTTPException(422, "operator must be a string")
    address = request.client.host if request.client else "unknown"
    return await run_db(
        request.app, _change_settings, factory, name, body["settings"], f"{operator} ({address})", clock()
    )


def _change_settings(
    factory: sessionmaker[Session], name: str, changes: Any, operator: str, now: float
) -> PopulationView:
    with factory.begin() as session:
        population = _locked(session, name)
        try:
            change_settings(session, population, changes, operator, now)
        except SettingsChangeError as e:
            raise HTTPException(422, str(e)) from None
        return population_out(session, population, now)


def _settings_changes(factory: sessionmaker[Session], name: str) -> list[dict[str, Any]]:
    with factory() as session:
        population = _population(session, name)
        found = session.scalars(
            select(SettingsChange)
            .where(SettingsChange.population_id == population.id)
            .order_by(SettingsChange.version.desc())
        )
        return [
            {
                "version": c.version,
                "changes": c.changes,
                "previous": c.previous,
                "changed_by": c.changed_by,
                "changed_at": c.changed_at,
            }
            for c in found
        ]


@router.get(
    "/populations/{name}/settings/changes",
    summary="The settings' changes, newest first",
    responses=schemas.refusals({404: "no population of that name"}),
)
async def settings_changes(
    name: str, _: AdminDep, factory: SessionFactoryDep, request: Request
) -> list[dict[str, Any]]:
    return await run_db(request.app, _settings_changes, factory, name)


def _mixing(factory: sessionmaker[Session], name: str) -> dict[str, Any]:
    with factory() as session:
        return mixing_data.describe(session, _population(session, name))


@router.get(
    "/populations/{name}/mixing",
    summary="A population's mixing strategy and centralized data",
    responses=schemas.refusals({404: "no population of that name"}),
)
async def get_mixing(name: str, _: AdminDep, factory: SessionFactoryDep, request: Request) -> dict[str, Any]:
    return await run_db(request.app, _mixing, factory, name)


@router.put(
    "/populations/{name}/mixing",
    summary="Attach a mixing strategy and centralized examples (safetensors)",
    responses=schemas.refusals(
        {
            404: "no population of that name",
            413: "the centralized examples exceed their limit",
            422: "the mixing config or the examples are invalid (the detail says which)",
        }
    ),
)
async def attach_mixing(
    name: str,
    _: AdminDep,
    factory: SessionFactoryDep,
    clock: ClockDep,
    mixing: Annotated[str, Form(description="MixingConfig as JSON (contracts.mixing)")],
    examples: Annotated[
        UploadFile | None,
        File(
            description="centralized examples: safetensors, one tensor per feature, optionally '@group' "
            "(int64 ids saying which examples belong together, e.g. each one's public account); omit to keep"
        ),
    ] = None,
) -> dict[str, Any]:
    try:
        config = json_document(mixing, "the mixing config")
    except ValueError as e:
        raise HTTPException(422, str(e)) from None
    blob = None
    if examples is not None:
        # Bounded before anything parses it.
        blob = await examples.read(MAX_CENTRAL_BYTES + 1)
        if len(blob) > MAX_CENTRAL_BYTES:
            raise HTTPException(
                413, f"the centralized examples exceed the limit of {MAX_CENTRAL_BYTES} bytes"
            )
    with factory.begin() as session:
        population = _locked(session, name)
        try:
            mixing_data.attach(session, population, population_manifest(population), config, blob, clock())
        except MixingError as e:
            raise HTTPException(422, str(e)) from None
        return mixing_data.describe(session, population)
