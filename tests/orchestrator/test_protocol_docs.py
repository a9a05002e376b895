"""docs/reference/http-protocol.md says what the OpenAPI document says: the same routes, each with
the same token, request content types, success status and content type, and refusals; and the
statuses the page documents in prose (the DP budget's check-in rejection) are the document's."""

from __future__ import annotations

import re
from typing import Any

import pytest
from fastapi.routing import APIRoute
from pydantic import SecretStr

from orchestrator.app import create_app
from orchestrator.dashboard import routes as dashboard
from orchestrator.settings import Settings
from tests.conftest import ROOT
from tests.orchestrator.conftest import ADMIN_TOKEN

PAGE = ROOT / "docs" / "reference" / "http-protocol.md"
TOKENS = {"deviceToken": "device", "adminToken": "admin", "metricsToken": "metrics"}
Row = tuple[str, str, str, str]  # token, request content types, success, refusals


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return create_app(Settings(database_url="sqlite://", admin_token=SecretStr(ADMIN_TOKEN))).openapi()


def page_routes() -> dict[tuple[str, str], Row]:
    """The page's route table: (method, path) -> its other cells."""
    rows = {}
    for line in PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0] in ("GET", "POST", "PUT", "PATCH", "DELETE"):
            method, path, *rest = cells
            rows[(method, path.strip("`"))] = (rest[0], rest[1], rest[2], rest[3])
    return rows


def document_routes(document: dict[str, Any]) -> dict[tuple[str, str], Row]:
    """The same cells, as the OpenAPI document has them."""
    rows = {}
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            token = " or ".join(TOKENS[next(iter(s))] for s in operation["security"]) or "none"
            bodies = operation.get("requestBody", {}).get("content", {})
            responses = operation["responses"]
            (success,) = [s for s in responses if s.startswith("2")]
            (content,) = responses[success]["content"]
            refusals = [s for s in responses if s[0] in "45"]
            rows[(method.upper(), path)] = (
                token,
                ", ".join(f"`{c}`" for c in bodies) or "-",
                f"{success} `{content}`",
                ", ".join(refusals) or "-",
            )
    return rows


def test_the_protocol_page_lists_every_route_as_the_openapi_document_does(document: dict[str, Any]) -> None:
    documented, page = document_routes(document), page_routes()

    assert sorted(page) == sorted(documented), "routes differ between the page and /openapi.json"
    for route, cells in documented.items():
        assert page[route] == cells, f"{route}: the page says {page[route]}, /openapi.json {cells}"


def test_every_refusal_on_the_page_is_explained_and_has_the_one_error_body(document: dict[str, Any]) -> None:
    explained = set(re.findall(r"^\| (\d{3}) \|", PAGE.read_text(), re.MULTILINE))
    used = {s for row in page_routes().values() for s in row[3].split(", ") if s != "-"}
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    bodies = [
        response["content"]
        for operations in document["paths"].values()
        for operation in operations.values()
        for status, response in operation["responses"].items()
        if status[0] in "45"
    ]

    assert used <= explained, f"statuses used but not explained: {sorted(used - explained)}"
    assert all(body == error for body in bodies)
    assert "HTTPValidationError" not in document["components"]["schemas"]


def test_a_spent_privacy_budget_is_a_200_rejection_with_a_day_s_retry_everywhere_it_is_said(
    document: dict[str, Any],
) -> None:
    checkin = document["paths"]["/v1/populations/{population}/checkin"]["post"]
    page = " ".join(PAGE.read_text().split())

    assert "budget is spent (`Retry-After: 86400`" in " ".join(checkin["description"].split())
    assert "Retry-After" in checkin["responses"]["200"]["headers"]
    assert "409" not in checkin["responses"]
    assert "rejected with the budget's message and `Retry-After: 86400`" in page


def test_the_dashboard_s_pages_are_in_their_own_table_and_not_in_the_openapi_document(
    document: dict[str, Any],
) -> None:
    pages = {
        (method, route.path): route.responses
        for route in dashboard.router.routes
        if isinstance(route, APIRoute)
        for method in route.methods or ()
    }
    table = {}
    for line in PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] in ("GET", "POST"):
            table[(cells[0], cells[1].strip("`"))] = (cells[3].split()[0], cells[4])

    assert sorted(table) == sorted(pages), "the dashboard's routes differ between the page and the server"
    for route, responses in pages.items():
        statuses = sorted(int(s) for s in responses)
        success, refusals = table[route]
        assert success == str(statuses[0]), route
        assert refusals == (", ".join(str(s) for s in statuses[1:]) or "-"), route
    assert not any(path == "/" or path.startswith("/dashboard") for path in document["paths"])
