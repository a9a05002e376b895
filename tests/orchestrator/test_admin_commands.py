"""The admin commands' declarations (orchestrator/console/commands.py and routes.py) against the
server's admin routes (orchestrator/api/routes/admin.py), both ways: each declared route is served with its
method, path, answer, query and body, each served admin route is declared, and the console's
subcommands are the declared commands."""

from __future__ import annotations

import argparse
import typing

import pytest
from fastapi.routing import APIRoute

from orchestrator.api import schemas
from orchestrator.api.routes import admin
from orchestrator.console import cli
from orchestrator.console.commands import COMMANDS
from orchestrator.console.routes import POPULATION, PREFIX, ROUTES, AdminRoute
from tests.conftest import ROOT


def served() -> dict[tuple[str, str], APIRoute]:
    found = {}
    for route in admin.router.routes:
        assert isinstance(route, APIRoute)
        for method in route.methods or ():
            found[(method, route.path)] = route
    return found


def body_of(route: APIRoute) -> str | None:
    """How the served route takes a body: form fields, a JSON document it reads itself, or none."""
    if route.dependant.body_params:
        return "form"
    content = (route.openapi_extra or {}).get("requestBody", {}).get("content", {})
    return "json" if "application/json" in content else None


@pytest.mark.parametrize("declared", ROUTES, ids=lambda r: f"{r.method} {r.path}")
def test_each_declared_route_is_served_as_declared(declared: AdminRoute) -> None:
    route = served().get((declared.method, PREFIX + declared.path))

    assert route is not None, f"no route {declared.method} {PREFIX}{declared.path} in api/routes/admin.py"
    model = route.response_model
    many = typing.get_origin(model) is list
    assert many == declared.many
    one = typing.get_args(model)[0] if many else model
    if declared.answer is None:  # a JSON document of no contract type
        assert one in (dict[str, typing.Any], dict), one
    else:
        assert one is schemas.model_of(declared.answer), (one, declared.answer)
    assert {q.name for q in route.dependant.query_params} == set(declared.query)
    assert body_of(route) == declared.body


def test_every_admin_route_is_declared() -> None:
    declared = {(r.method, PREFIX + r.path) for r in ROUTES}

    assert set(served()) == declared
    assert len(ROUTES) == len(declared)  # each declared once


def test_the_console_commands_are_the_declared_ones_with_their_arguments() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli.add_commands(sub)

    pause = parser.parse_args(["pause", "movies", "--json"])
    change = parser.parse_args(["change-settings", "m", "target_reports=3", "min_reports=2"])

    assert set(sub.choices) == {c.name for c in COMMANDS} == set(cli.BY_NAME)
    assert all(c.route is None or c.route in ROUTES for c in COMMANDS)
    assert (pause.command, pause.name, pause.json) == ("pause", "movies", True)
    assert change.assignments == [("target_reports", 3), ("min_reports", 2)]


def test_a_route_path_quotes_the_population_name_whole() -> None:
    assert POPULATION.url(name="a/b c") == "/v1/admin/populations/a%2Fb%20c"


def test_the_contributors_page_shows_a_declaration_as_the_code_has_it() -> None:
    page = (ROOT / "docs" / "contributing.md").read_text()
    section = page.split("## Adding an admin command", 1)[1].split("\n## ", 1)[0]
    shown = section.split("```python\n", 1)[1].split("```", 1)[0]
    declared = ("commands.py", "routes.py")
    code = {
        line.strip()
        for name in declared
        for line in (ROOT / "orchestrator" / "console" / name).read_text().splitlines()
    }

    missing = [line for line in shown.splitlines() if line.strip() and line.strip() not in code]
    assert not missing, (
        f"docs/contributing.md shows lines orchestrator/console/{{commands,routes}}.py lack: {missing}"
    )
