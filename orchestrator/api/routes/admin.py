"""The admin API: each route parses its request, calls its transaction in `service.admin` and
answers; the console and the simulator call these routes as `console.commands` declares them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, File, Form, HTTPException, Query, Request, UploadFile

from contracts.mixing import MAX_CENTRAL_BYTES
from contracts.protocol import PopulationView, RoundView
from orchestrator.api import schemas
from orchestrator.api.deps import AdminDep, ClockDep, SessionFactoryDep, run_db
from orchestrator.limits import MAX_COUNT, MAX_MANIFEST_BYTES, json_document
from orchestrator.populations.settings import MAX_SECONDS
from orchestrator.populations.settings_changes import SAFE_TO_CHANGE
from orchestrator.service import admin
from orchestrator.service.admin import AdminRefused
from orchestrator.service.population_creation import ExportedModel

router = APIRouter(prefix="/v1/admin", tags=["admin"])
T = TypeVar("T")


def answered(transaction: Callable[..., T], *args: Any) -> T:
    """The transaction's answer, or its refusal as the HTTP answer."""
    try:
        return transaction(*args)
    except AdminRefused as e:
        raise HTTPException(e.status, e.message) from None


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
    request: Request,
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
    return await run_db(request.app, answered, admin.create, factory, name, exported, settings_json, clock())


@router.get("/populations", response_model=schemas.PopulationsOut, summary="All populations")
async def list_populations(
    _: AdminDep, factory: SessionFactoryDep, clock: ClockDep, request: Request
) -> list[PopulationView]:
    return await run_db(request.app, admin.populations, factory, clock())


@router.get(
    "/populations/{name}",
    response_model=schemas.PopulationOut,
    summary="A population's status",
    responses=schemas.refusals({404: "no population of that name"}),
)
async def status(
    name: str, _: AdminDep, factory: SessionFactoryDep, clock: ClockDep, request: Request
) -> PopulationView:
    return await run_db(request.app, answered, admin.status, factory, name, clock())


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
    return await run_db(request.app, answered, admin.rounds, factory, name, kind, limit, offset)


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
    return answered(admin.schedule_evaluation, factory, name, clock(), duration_seconds)


@router.post(
    "/populations/{name}/pause",
    response_model=schemas.PopulationOut,
    summary="Pause a population: no new rounds; the open ones run to their end",
    responses=schemas.refusals({404: "no population of that name"}),
)
def pause(name: str, _: AdminDep, factory: SessionFactoryDep, clock: ClockDep) -> PopulationView:
    return answered(admin.pause, factory, name, clock())


@router.post(
    "/populations/{name}/resume",
    response_model=schemas.PopulationOut,
    summary="Resume a paused population: its next training round opens now",
    responses=schemas.refusals({404: "no population of that name", 409: "the population is archived"}),
)
def resume(name: str, _: AdminDep, factory: SessionFactoryDep, clock: ClockDep) -> PopulationView:
    return answered(admin.resume, factory, name, clock())


@router.post(
    "/populations/{name}/archive",
    response_model=schemas.PopulationOut,
    summary="Archive a population: paused for good (no new rounds; it cannot be resumed)",
    responses=schemas.refusals({404: "no population of that name"}),
)
def archive(name: str, _: AdminDep, factory: SessionFactoryDep, clock: ClockDep) -> PopulationView:
    return answered(admin.archive, factory, name, clock())


@router.patch(
    "/populations/{name}/settings",
    response_model=schemas.PopulationOut,
    summary="Change the settings that are safe to change while rounds run (from the next round on)",
    description='A JSON body `{"settings": {...}, "operator": "who"}`: the settings to change '
    f"({', '.join(sorted(SAFE_TO_CHANGE))}), validated as at creation, and who "
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
    operator = f"{operator} ({address})"
    return await run_db(
        request.app, answered, admin.change, factory, name, body["settings"], operator, clock()
    )


@router.get(
    "/populations/{name}/settings/changes",
    summary="The settings' changes, newest first",
    responses=schemas.refusals({404: "no population of that name"}),
)
async def settings_changes(
    name: str, _: AdminDep, factory: SessionFactoryDep, request: Request
) -> list[dict[str, Any]]:
    return await run_db(request.app, answered, admin.settings_changes, factory, name)


@router.get(
    "/populations/{name}/mixing",
    summary="A population's mixing strategy and centralized data",
    responses=schemas.refusals({404: "no population of that name"}),
)
async def get_mixing(name: str, _: AdminDep, factory: SessionFactoryDep, request: Request) -> dict[str, Any]:
    return await run_db(request.app, answered, admin.mixing, factory, name)


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
    request: Request,
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
    return await run_db(request.app, answered, admin.attach_mixing, factory, name, config, blob, clock())
