"""Changing a population's settings mid-flight: only those safe to change while rounds run,
validated as at creation, each change a new settings version kept with who made it and when.

A round keeps the target, capacity and deadline it opened with; a change applies from the next
round. Every server process re-reads the settings when the population's `settings_version`
moves (population_config.parsed_once keys its cache by it)."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from orchestrator.db import Population, SettingsChange
from orchestrator.observability.logs import log_on_commit
from orchestrator.populations.settings import PopulationSettings, settings_problems

# Counts and times that each round reads when it opens. Not the aggregation, the privacy
# settings, the optimizer or the task config: a round or an account in progress depends on them.
SAFE_TO_CHANGE = frozenset(
    {
        "target_reports",
        "oversampling",
        "min_reports",
        "round_duration_seconds",
        "min_examples",
        "retry_after_seconds",
        "keep_model_versions",
        "report_deltas",
        "evaluation_every",
        "evaluation_target_reports",
        "min_evaluation_reports",
        "evaluation_round_duration_seconds",
    }
)
MAX_OPERATOR_LENGTH = 100
log = logging.getLogger("orchestrator")


class SettingsChangeError(ValueError):
    """The change cannot be made; the message says why and what is allowed."""


def change_settings(
    session: Session, population: Population, changes: Any, operator: str, now: float
) -> SettingsChange:
    """Apply `changes` (a JSON object of settings) to the locked `population` as a new version."""
    if not isinstance(changes, dict) or not changes:
        raise SettingsChangeError("the change must be a non-empty JSON object of settings")
    unsafe = sorted(set(changes) - SAFE_TO_CHANGE)
    if unsafe:
        raise SettingsChangeError(
            f"cannot change {', '.join(unsafe)} while the population runs; these can change: "
            f"{', '.join(sorted(SAFE_TO_CHANGE))}"
        )
    if not operator or len(operator) > MAX_OPERATOR_LENGTH:
        raise SettingsChangeError(f"the operator must be named in 1-{MAX_OPERATOR_LENGTH} characters")
    merged = {**population.settings, **changes}
    if "min_examples" in changes:  # the devices' copy in the task config, as at creation
        merged["task_config"] = {**merged.get("task_config", {}), "min_examples": changes["min_examples"]}
    try:
        checked = PopulationSettings.model_validate(merged).model_dump()
    except ValidationError as e:
        raise SettingsChangeError(f"invalid settings: {settings_problems(e)}") from None
    before = {k: population.settings.get(k) for k in changes}
    population.settings = checked
    population.settings_version += 1
    change = SettingsChange(
        population_id=population.id,
        version=population.settings_version,
        changes={k: checked[k] for k in changes},
        previous=before,
        changed_by=operator,
        changed_at=now,
    )
    session.add(change)
    log_on_commit(
        session,
        log,
        "settings changed",
        population=population.name,
        settings_version=population.settings_version,
        changes=change.changes,
        previous=before,
        changed_by=operator,
    )
    return change
