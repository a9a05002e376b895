"""Changing a population's settings mid-flight: safe ones only, validated, versioned, applied
from the next round on, in every process's view of the population."""

from __future__ import annotations

import pytest
from orchestrator.populations.config import population_settings
from orchestrator.populations.locks import find_population, lock_population
from orchestrator.populations.settings_changes import SettingsChangeError, change_settings
from orchestrator.service.population_creation import ExportedModel
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.app import tick
from orchestrator.db import SettingsChange
from tests.orchestrator.conftest import make_population
from tests.orchestrator.test_idle_backoff import training_rounds
from tests.orchestrator.test_rounds import checkin, device


def change(factory: sessionmaker[Session], changes: object, now: float = 5.0) -> None:
    with factory.begin() as session:
        found = lock_population(session, "p")
        assert found is not None
        change_settings(session, found, changes, "alice (127.0.0.1)", now)


def test_a_change_applies_from_the_next_round_and_is_kept_with_who_and_when(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=2, min_reports=1, round_duration_seconds=10)
    checkin(db, device(db), now=1.0)  # the round is not idle
    with db() as session:  # this process has parsed the settings of version 0
        parsed = find_population(session, "p")
        assert parsed is not None and population_settings(parsed).target_reports == 2

    change(db, {"target_reports": 5, "min_examples": 3})
    tick(db, 11.0)

    first, second = training_rounds(db)
    assert (first.target, second.target) == (2, 5)
    with db() as session:
        population = find_population(session, "p")
        assert population is not None and population.settings_version == 1
        settings = population_settings(population)
        assert (settings.target_reports, settings.min_examples, settings.task_config["min_examples"]) == (
            5,
            3,
            3,
        )
        (kept,) = session.scalars(select(SettingsChange)).all()
    assert (kept.version, kept.changed_by, kept.changed_at) == (1, "alice (127.0.0.1)", 5.0)
    assert kept.changes == {"target_reports": 5, "min_examples": 3}
    assert kept.previous == {"target_reports": 2, "min_examples": 1}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"aggregation": "secure"}, "cannot change aggregation while the population runs"),
        ({"min_reports": 9}, "min_reports (9) must be <= target_reports (2)"),
        ({"target_reports": -1}, "target_reports"),
        ({}, "non-empty JSON object"),
        ([1], "non-empty JSON object"),
    ],
)
def test_an_unsafe_or_invalid_change_is_refused_and_changes_nothing(
    db: sessionmaker[Session], biased_model: ExportedModel, changes: object, message: str
) -> None:
    make_population(db, biased_model, target_reports=2, min_reports=1)

    with pytest.raises(SettingsChangeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        change(db, changes)

    with db() as session:
        population = find_population(session, "p")
        assert population is not None and population.settings_version == 0
        assert population.settings["target_reports"] == 2
        assert session.scalars(select(SettingsChange)).all() == []
