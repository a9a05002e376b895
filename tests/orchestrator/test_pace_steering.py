"""Pace steering: devices turned away from a full round come back spread over a window that grows
when rounds see more check-ins than they need and shrinks when they see fewer."""

from __future__ import annotations

import math

import pytest
from orchestrator.populations.locks import lock_population
from orchestrator.rounds.lifecycle import advance
from orchestrator.rounds.refusals import Refused
from orchestrator.service.population_creation import ExportedModel
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.rounds import pace_steering
from tests.orchestrator.conftest import make_population
from tests.orchestrator.test_rounds import checkin, current_round, device


def test_the_first_round_s_window_is_its_duration() -> None:
    assert pace_steering.next_window(None, 0, 10, 300.0) == 300.0


def test_a_round_that_saw_too_many_check_ins_widens_the_next_window_and_too_few_narrow_it() -> None:
    wanted = pace_steering.CHECKINS_PER_SLOT * 10
    assert pace_steering.next_window(100.0, int(wanted), 10, 300.0) == pytest.approx(100.0)
    assert pace_steering.next_window(100.0, int(wanted * 2), 10, 300.0) == pytest.approx(100.0 * 2**0.5)
    assert pace_steering.next_window(100.0, int(wanted / 2), 10, 300.0) == pytest.approx(100.0 / 2**0.5)


def test_the_window_moves_at_most_twofold_a_round() -> None:
    # A round nobody checked in to (a fleet still starting) halves it, no more; a crowd doubles it.
    assert pace_steering.next_window(300.0, 0, 1_300, 300.0) == pytest.approx(150.0)
    assert pace_steering.next_window(300.0, 38_403, 1_300, 300.0) == pytest.approx(600.0)


def test_the_window_stays_within_its_bounds() -> None:
    assert pace_steering.next_window(1.5, 0, 1_000, 300.0) == pace_steering.MIN_WINDOW_SECONDS
    huge = pace_steering.next_window(pace_steering.MAX_WINDOW_SECONDS, 10**9, 1, 300.0)
    assert huge == pace_steering.MAX_WINDOW_SECONDS


def test_a_refusal_draws_within_the_window_and_never_below_the_floor() -> None:
    assert pace_steering.come_back_in(100.0, 10.0, 250.0, 0.5) == 50.0
    assert pace_steering.come_back_in(100.0, 10.0, 250.0, 0.01) == 10.0
    # A round opened before pace steering has no window: back by its deadline, as before.
    assert pace_steering.come_back_in(None, 10.0, 250.0, 0.5) == 250.0


def test_devices_turned_away_from_a_full_round_come_back_spread_over_its_window(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    # Arrange: rounds of capacity 2 that last 100 s, and 30 devices.
    make_population(
        db,
        biased_model,
        target_reports=2,
        oversampling=1.0,
        round_duration_seconds=100.0,
        retry_after_seconds=1.0,
    )
    devices = [device(db) for _ in range(30)]
    first = current_round(db)

    # Act: all of them check in to the first round.
    answers = [checkin(db, d, now=1.0) for d in devices]

    # Assert: two admitted; the rest told to come back at different times within the first window
    # (the round's 100 s), not all at its deadline.
    refused = [a for a in answers if isinstance(a, Refused)]
    assert first.checkin_window == 100.0 and len(refused) == 28
    waits = [a.retry_after for a in refused if a.retry_after is not None]
    assert all(1.0 <= w <= 100.0 for w in waits)
    assert len({round(w, 3) for w in waits}) > 20 and max(waits) - min(waits) > 50.0

    # Act: the round ends at its deadline; the next one opens.
    with db.begin() as session:
        population = lock_population(session, "p")
        assert population is not None
        advance(session, population, 200.0)
    second = current_round(db)

    # Assert: 30 check-ins where 4 x 2 were wanted widen the window by sqrt(30 / 8).
    assert second.id != first.id
    assert second.checkin_window == pytest.approx(
        100.0 * math.sqrt(30 / (pace_steering.CHECKINS_PER_SLOT * 2))
    )


def test_a_device_with_too_few_examples_comes_back_after_the_round_spread_over_its_window() -> None:
    assert pace_steering.come_back_after_round(100.0, 10.0, 250.0, 0.5) == 300.0
    assert pace_steering.come_back_after_round(100.0, 10.0, 0.0, 0.0) == 10.0
    assert pace_steering.come_back_after_round(None, 10.0, 250.0, 0.5) == 250.0


def test_devices_with_too_few_examples_do_not_all_come_back_at_the_next_round_s_opening(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    # Arrange: rounds that last 100 s and need 5 examples; 30 devices with 2 each.
    make_population(
        db,
        biased_model,
        target_reports=2,
        round_duration_seconds=100.0,
        retry_after_seconds=1.0,
        min_examples=5,
    )
    devices = [device(db) for _ in range(30)]

    # Act: they check in to the first round at its 1st second.
    answers = [checkin(db, d, count=2, now=1.0) for d in devices]

    # Assert: all refused, told to come back after the round's deadline (99 s away), spread over
    # its 100 s window rather than all at the next round's opening.
    waits = [a.retry_after for a in answers if isinstance(a, Refused) and a.retry_after is not None]
    assert len(waits) == 30
    assert all(99.0 <= w <= 199.0 for w in waits)
    assert len({round(w, 3) for w in waits}) > 20 and max(waits) - min(waits) > 50.0
