"""Pausing a population: no new rounds while paused, the open ones finish; resuming opens one."""

from __future__ import annotations

import pytest
from orchestrator.populations.locks import lock_population
from orchestrator.rounds.lifecycle import advance
from orchestrator.rounds.refusals import Refused
from orchestrator.service.population_creation import ExportedModel
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.app import tick
from orchestrator.rounds import pausing
from tests.orchestrator.conftest import make_population
from tests.orchestrator.test_idle_backoff import population, training_rounds
from tests.orchestrator.test_rounds import checkin, delta_body, device, report


def set_paused(factory: sessionmaker[Session], paused: bool, now: float) -> None:
    with factory.begin() as session:
        found = lock_population(session, "p")
        assert found is not None
        if paused:
            pausing.pause(session, found, now)
        else:
            pausing.resume(session, found, now)
            advance(session, found, now)


def test_a_paused_population_finishes_its_open_round_and_opens_none_until_resumed(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=1, round_duration_seconds=10)
    a = device(db)
    answer = checkin(db, a, now=1.0)
    set_paused(db, True, 2.0)

    report(db, a, answer.assignment_id, delta_body(biased_model, 0.1), now=3.0)  # the open round commits
    tick(db, 100.0)
    refused = checkin(db, device(db), now=101.0)
    paused_rounds = training_rounds(db)
    set_paused(db, False, 102.0)

    assert [r.status for r in paused_rounds] == ["committed"]  # none opened while paused
    assert population(db).current_version == 1
    assert isinstance(refused, Refused) and "the population is paused" in refused.message
    assert population(db).paused_at is None
    assert [r.status for r in training_rounds(db)] == ["committed", "open"]
    assert training_rounds(db)[-1].opened_at == 102.0


def test_an_open_round_of_a_paused_population_is_still_abandoned_at_its_deadline(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=2, min_reports=2, round_duration_seconds=10)
    checkin(db, device(db), now=1.0)
    set_paused(db, True, 2.0)

    tick(db, 11.0)

    assert [r.status for r in training_rounds(db)] == ["abandoned"]
    assert population(db).paused_at == 2.0


def test_an_archived_population_opens_no_round_and_cannot_be_resumed(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=2, min_reports=2, round_duration_seconds=10)
    with db.begin() as session:
        found = lock_population(session, "p")
        assert found is not None
        pausing.archive(session, found, 2.0)

    tick(db, 11.0)
    refused = checkin(db, device(db), now=12.0)

    assert [r.status for r in training_rounds(db)] == ["abandoned"]
    assert isinstance(refused, Refused) and "the population is archived" in refused.message
    with pytest.raises(pausing.ArchivedError, match="cannot be resumed"), db.begin() as session:
        found = lock_population(session, "p")
        assert found is not None
        pausing.resume(session, found, 13.0)
    assert (population(db).archived_at, population(db).paused_at) == (2.0, 2.0)


def test_resuming_opens_a_round_even_if_the_round_open_at_the_pause_closed_idle_meanwhile(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    # Prepare: the population is paused with a round open that no device checks in to; it closes
    # idle while paused, which sets an idle back-off
    make_population(db, biased_model, target_reports=2, min_reports=2, round_duration_seconds=10)
    set_paused(db, True, 2.0)
    tick(db, 11.0)
    assert population(db).next_round_at is not None

    # Execute: the operator resumes it before the back-off would end
    set_paused(db, False, 12.0)

    # Assert: a round opens at once (the operator asked for it), and the back-off is over
    assert [r.status for r in training_rounds(db)] == ["abandoned", "open"]
    assert training_rounds(db)[-1].opened_at == 12.0
    assert (population(db).idle_rounds, population(db).next_round_at) == (0, None)
