"""A population's settings, manifest and aggregation pipeline, parsed once per process, and what
its privacy budget still allows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

from sqlalchemy.orm import object_session

from contracts.manifest import Manifest
from orchestrator.db import Population
from orchestrator.pipeline.assemble import Pipeline
from orchestrator.population_settings import PopulationSettings

T = TypeVar("T")


# A population's manifest never changes and its settings only with its settings_version
# (settings_changes), so they are parsed once per process and version rather than on every
# check-in (pydantic validation would dominate its cost). Keyed by database too: one process (a
# test run, an admin tool) may open several.
_parsed: dict[tuple[object, int, int, str], Any] = {}


def parsed_once(population: Population, what: str, parse: Callable[[], T]) -> T:
    session = object_session(population)
    if session is None:
        return parse()
    key = (session.get_bind(), population.id, population.settings_version, what)
    if key not in _parsed:
        _parsed[key] = parse()
    return cast(T, _parsed[key])


def population_settings(population: Population) -> PopulationSettings:
    return parsed_once(population, "settings", lambda: PopulationSettings.model_validate(population.settings))


def population_manifest(population: Population) -> Manifest:
    return parsed_once(population, "manifest", lambda: Manifest.from_json(population.manifest))


def population_pipeline(population: Population) -> Pipeline:
    """The population's aggregation pipeline, assembled once from its settings."""

    def assemble() -> Pipeline:
        shapes = {s.name: s.shape for s in population_manifest(population).global_params}
        return Pipeline(population_settings(population), shapes)

    return parsed_once(population, "pipeline", assemble)


def _rounds_within_budget(population: Population) -> int | None:
    """How many training rounds the population's privacy budget allows; None without a budget."""

    def allowed() -> int | None:
        settings = population_settings(population)
        dp = settings.dp()
        if dp is None or dp.epsilon_budget is None:
            return None
        return settings.privacy_spent(0).rounds_within_budget

    return parsed_once(population, "rounds_within_budget", allowed)


def privacy_budget_spent(population: Population) -> bool:
    """True when one more training round would take epsilon past the population's budget: no
    training round opens any more."""
    allowed = _rounds_within_budget(population)
    return allowed is not None and population.training_rounds_committed >= allowed
