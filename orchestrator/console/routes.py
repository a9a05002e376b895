"""The admin API's routes as their clients call them: method, path under /v1/admin, the contract
view each answers with, its query and body. The console's commands (`console.commands`), its client
and `android_sim.admin` call these; tests/orchestrator/test_admin_commands.py checks them against
the server's routes (orchestrator/api/routes/admin.py), both ways.

Only the standard library and the contracts here: the console runs without the server's parts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import quote

from contracts.protocol import PopulationView, RoundView

PREFIX = "/v1/admin"


@dataclass(frozen=True)
class AdminRoute:
    """A route of the admin API as its clients call it: `path` under PREFIX with `{name}` for the
    population; `answer` the contract view it answers with (a list of them if `many`), None for
    a JSON document of no contract type; `query` the query parameters it takes; `body` how its
    request carries one."""

    method: Literal["GET", "POST", "PUT", "PATCH"]
    path: str
    answer: type | None
    many: bool = False
    query: tuple[str, ...] = ()
    body: Literal["json", "form"] | None = None

    def url(self, **path: str) -> str:
        """The route's path with its `{name}`... filled in, each part quoted whole."""
        return PREFIX + self.path.format(**{k: quote(v, safe="") for k, v in path.items()})


# ---- the admin API -------------------------------------------------------------------------

CREATE = AdminRoute("POST", "/populations", PopulationView, body="form")
POPULATIONS = AdminRoute("GET", "/populations", PopulationView, many=True)
POPULATION = AdminRoute("GET", "/populations/{name}", PopulationView)
ROUNDS = AdminRoute(
    "GET", "/populations/{name}/rounds", RoundView, many=True, query=("kind", "limit", "offset")
)
EVALUATE = AdminRoute("POST", "/populations/{name}/evaluations", RoundView, query=("duration_seconds",))
PAUSE = AdminRoute("POST", "/populations/{name}/pause", PopulationView)
RESUME = AdminRoute("POST", "/populations/{name}/resume", PopulationView)
ARCHIVE = AdminRoute("POST", "/populations/{name}/archive", PopulationView)
CHANGE_SETTINGS = AdminRoute("PATCH", "/populations/{name}/settings", PopulationView, body="json")
SETTINGS_CHANGES = AdminRoute("GET", "/populations/{name}/settings/changes", None, many=True)
MIXING = AdminRoute("GET", "/populations/{name}/mixing", None)
ATTACH_MIXING = AdminRoute("PUT", "/populations/{name}/mixing", None, body="form")

ROUTES = (
    CREATE,
    POPULATIONS,
    POPULATION,
    ROUNDS,
    EVALUATE,
    PAUSE,
    RESUME,
    ARCHIVE,
    CHANGE_SETTINGS,
    SETTINGS_CHANGES,
    MIXING,
    ATTACH_MIXING,
)
