"""A population's settings, manifest and aggregation pipeline, parsed once per process as one
`PopulationConfig`, and what its privacy budget still allows."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from sqlalchemy.orm import object_session

from contracts.manifest import Manifest
from contracts.task_config import TaskConfig
from orchestrator.aggregation.assemble import Pipeline
from orchestrator.aggregation.differential_privacy import DPConfig
from orchestrator.aggregation.maths import ServerOptimizerConfig
from orchestrator.db import Population
from orchestrator.populations.settings import PopulationSettings

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


@dataclass(frozen=True)
class PopulationConfig:
    """Everything a round reads of its population's settings and model, parsed and assembled once
    per settings version, so that a report and a commit read fields instead of parsing again."""

    settings: PopulationSettings
    manifest: Manifest
    pipeline: Pipeline  # the aggregation pipeline, assembled from the settings
    task: TaskConfig
    optimizer: ServerOptimizerConfig
    dp: DPConfig | None
    secure_training: bool
    # A report's weight is at most min(examples checked in with, task.max_examples) x this: a
    # ranking task with sampled negatives trains on them too.
    weight_per_example: int

    @classmethod
    def parse(cls, population: Population) -> PopulationConfig:
        settings = PopulationSettings.model_validate(population.settings)
        manifest = Manifest.from_json(population.manifest)
        task = settings.task()
        return cls(
            settings=settings,
            manifest=manifest,
            pipeline=pipeline_of(settings, {s.name: s.shape for s in manifest.global_params}),
            task=task,
            optimizer=settings.optimizer(),
            dp=settings.dp(),
            secure_training=settings.secure_training,
            weight_per_example=1 + (task.negatives_per_positive if manifest.task.negative_sampling else 0),
        )


def config_of(population: Population) -> PopulationConfig:
    """The population's config, parsed once per process and settings version."""
    session = object_session(population)
    if session is None:
        return PopulationConfig.parse(population)
    key = (session.get_bind(), population.id, population.settings_version, "config")
    found = _parsed.get(key)
    if found is None:
        found = _parsed[key] = PopulationConfig.parse(population)
    return cast(PopulationConfig, found)


def population_settings(population: Population) -> PopulationSettings:
    return config_of(population).settings


def population_manifest(population: Population) -> Manifest:
    return config_of(population).manifest


def _rounds_within_budget(population: Population) -> int | None:
    """How many training rounds the population's privacy budget allows; None without a budget."""

    def allowed() -> int | None:
        config = config_of(population)
        if config.dp is None or config.dp.epsilon_budget is None:
            return None
        return config.settings.privacy_spent(0).rounds_within_budget

    return parsed_once(population, "rounds_within_budget", allowed)


def privacy_budget_spent(population: Population) -> bool:
    """True when one more training round would take epsilon past the population's budget: no
    training round opens any more."""
    allowed = _rounds_within_budget(population)
    return allowed is not None and population.training_rounds_committed >= allowed


def pipeline_of(settings: PopulationSettings, shapes: Mapping[str, tuple[int, ...]]) -> Pipeline:
    """The population's aggregation pipeline: its robust rule, its DP and its accountant."""
    return Pipeline(
        shapes, settings.robust(), settings.dp(), lambda rounds: settings.privacy_spent(rounds).epsilon
    )
