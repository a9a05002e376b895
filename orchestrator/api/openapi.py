"""The OpenAPI document (`/openapi.json`): FastAPI's, completed with what it cannot see.

Routes declare their own refusals, request bodies and binary answers (`schemas.refusals`,
`schemas.binary`, `schemas.json_body`); this adds what every route of a kind answers before or
around it, derived from the same code that answers it:
- the bearer token each route takes, as a security scheme (device, admin, metrics) rather than an
  optional `authorization` header, and `security: []` on the routes that take none;
- the edge's refusals (api/edge.py), from each route's `Gate`: 401 (and 403 on admin routes) for a
  missing or wrong token, 429 where a rate limit applies, 413 on routes that take a body, 503 on
  every route that reads the database; and 400 where FastAPI parses a multipart form. (A request
  the HTTP server cannot parse at all is answered 400 `text/plain` by uvicorn on any route before
  the application sees it: not a route's answer, so not in its responses.)
- one error body (`schemas.Error`) for every refusal, FastAPI's own 422 included;
- the multipart forms' file parts as files (`api/binary_bodies.py`).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute, iter_route_contexts
from pydantic import BaseModel

from orchestrator.api import binary_bodies, schemas
from orchestrator.api.deps import bearer_token
from orchestrator.api.edge import ADMIN, DEVICE, Edge
from orchestrator.settings import Settings

DEVICE_TOKEN, ADMIN_TOKEN, METRICS_TOKEN = "deviceToken", "adminToken", "metricsToken"
# In a device route's `openapi_extra`: the admin token opens it too (the operator's downloads).
ADMIN_TOO = "x-admin-token-too"
SECURITY_SCHEMES = {
    DEVICE_TOKEN: {
        "type": "http",
        "scheme": "bearer",
        "description": "the token `POST /v1/devices` returned (shown once)",
    },
    ADMIN_TOKEN: {
        "type": "http",
        "scheme": "bearer",
        "description": "the operator's secret (ORCHESTRATOR_ADMIN_TOKEN)",
    },
    METRICS_TOKEN: {
        "type": "http",
        "scheme": "bearer",
        "description": "the scraper's token (ORCHESTRATOR_METRICS_TOKEN); opens /metrics only",
    },
}
# Routes that never touch the database: no 503.
WITHOUT_DATABASE = frozenset({"/health", "/metrics"})
WWW_AUTHENTICATE = {"WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}}
_ERROR_REF = {"$ref": "#/components/schemas/Error"}


def document(app: FastAPI, settings: Settings) -> dict[str, Any]:
    """The application's OpenAPI document, built once."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title,
            version=app.version,
            description=app.description,
            routes=app.routes,
            tags=app.openapi_tags,
        )
        _complete(app, schema, settings)
        app.openapi_schema = schema
    return app.openapi_schema


def _complete(app: FastAPI, schema: dict[str, Any], settings: Settings) -> None:
    components = schema.setdefault("components", {})
    found = components.setdefault("schemas", {})
    models: tuple[type[BaseModel], ...] = (
        schemas.Error,
        *schemas.REQUEST_BODIES,
        binary_bodies.TrainingReportMetadata,
    )
    for model in models:
        definition = model.model_json_schema(ref_template="#/components/schemas/{model}")
        found.update(definition.pop("$defs", {}))
        found[model.__name__] = definition
    # FastAPI's own validation bodies: replaced by Error everywhere below.
    found.pop("HTTPValidationError", None)
    found.pop("ValidationError", None)
    components["securitySchemes"] = SECURITY_SCHEMES
    binary_bodies.complete_multipart(schema)
    edge = Edge(_not_an_app, settings)
    # Routes as FastAPI documents them: included routers' routes with their prefixes.
    for context in iter_route_contexts(app.routes):
        route = context.original_route
        path = context.path_format
        if not isinstance(route, APIRoute) or not route.include_in_schema or path is None:
            continue
        for method in route.methods or ():
            operation = schema["paths"][path].get(method.lower())
            if operation is not None:
                _complete_operation(operation, path, route, method, edge)


def _complete_operation(
    operation: dict[str, Any], path: str, route: APIRoute, method: str, edge: Edge
) -> None:
    gate = edge.gate(method, path.replace("{", "").replace("}", ""))
    responses: dict[str, Any] = operation.setdefault("responses", {})
    if path == "/metrics":
        operation["security"] = [{METRICS_TOKEN: []}, {ADMIN_TOKEN: []}]
    elif gate.credential == ADMIN or path.startswith("/v1/admin"):
        operation["security"] = [{ADMIN_TOKEN: []}]
    elif gate.credential == DEVICE or _takes_bearer(route.dependant):
        # ADMIN_TOO (a route's openapi_extra): the operator reads it with the admin token as well.
        admin_too = operation.pop(ADMIN_TOO, False)
        operation["security"] = [{DEVICE_TOKEN: []}] + ([{ADMIN_TOKEN: []}] if admin_too else [])
    else:
        operation["security"] = []  # explicitly none: e.g. the artifact, enrollment, /health
    if operation["security"]:
        # The scheme says it; a client must not take the header for an optional parameter.
        parameters = [p for p in operation.get("parameters", []) if p["name"].lower() != "authorization"]
        if parameters:
            operation["parameters"] = parameters
        else:
            operation.pop("parameters", None)
        _add(responses, 401, WWW_AUTHENTICATE)
        if operation["security"][-1] == {ADMIN_TOKEN: []} and {DEVICE_TOKEN: []} not in operation["security"]:
            _add(responses, 403, description="the bearer token is not the admin token")
    if gate.rate_limit is not None:
        _add(responses, 429, schemas.RETRY_AFTER)
    if "multipart/form-data" in operation.get("requestBody", {}).get("content", {}):
        _add(responses, 400)  # FastAPI's answer to a form it cannot parse
    if method in ("POST", "PUT", "PATCH"):
        _add(
            responses, 413, description=f"the body exceeds this route's limit of {gate.max_body_bytes} bytes"
        )
    if path not in WITHOUT_DATABASE:
        _add(responses, 503, schemas.RETRY_AFTER)
    if (
        _cannot_fail_validation(operation)
        and responses.get("422", {}).get("description") == "Validation Error"
    ):
        del responses["422"]  # FastAPI adds it to every route with parameters, even plain strings
    for status, response in responses.items():
        if status.startswith(("4", "5")):
            response["content"] = {"application/json": {"schema": _ERROR_REF}}
            if status == "422" and response.get("description") == "Validation Error":
                response["description"] = schemas.REFUSALS[422]
    operation["responses"] = dict(sorted(responses.items()))


def _add(
    responses: dict[str, Any], status: int, headers: dict[str, Any] | None = None, description: str = ""
) -> None:
    response = responses.setdefault(str(status), {"description": description or schemas.REFUSALS[status]})
    if headers:
        response.setdefault("headers", {}).update(headers)


def _cannot_fail_validation(operation: dict[str, Any]) -> bool:
    """Whether no request can fail FastAPI's validation: no body it reads, only plain strings."""
    return "requestBody" not in operation and all(
        p["schema"] == {"type": "string", "title": p["schema"].get("title")}
        for p in operation.get("parameters", [])
    )


def _takes_bearer(dependant: Dependant) -> bool:
    return any(d.call is bearer_token or _takes_bearer(d) for d in dependant.dependencies)


async def _not_an_app(*_: Any) -> None:
    """The edge is built here only for its gates; it never forwards a request."""
    raise AssertionError("not an application")
