"""No empty rounds: an idle population backs off opening training rounds until a device checks in."""

from __future__ import annotations

import itertools

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.app import tick
from orchestrator.db import Population, Round
from orchestrator.rounds import checkins
from orchestrator.rounds.idle_backoff import IDLE_BACKOFF_CAP_SECONDS
from orchestrator.service.population_creation import ExportedModel
from orchestrator.service.population_views import population_out
from tests.orchestrator.conftest import make_population
from tests.orchestrator.test_rounds import checkin, device


def training_rounds(factory: sessionmaker[Session]) -> list[Round]:
    with factory() as session:
        return list(session.scalars(select(Round).where(Round.kind == "training").order_by(Round.id)))


def population(factory: sessionmaker[Session]) -> Population:
    with factory() as session:
        return session.scalars(select(Population)).one()


def test_rounds_nobody_checks_in_to_open_ever_later_up_to_the_cap(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=2, min_reports=2, round_duration_seconds=10)

    # Tick every second for a simulated day: an idle population, no device at all.
    for now in range(1, 86_400, 1):
        if now % 600 == 0 or now < 700:  # every second at first, then every ten minutes
            tick(db, float(now))

    opened = [r.opened_at for r in training_rounds(db)]
    gaps = [b - a for a, b in itertools.pairwise(opened)]
    # Round 1 opens at 0 and closes at 10; then 10 s, 20 s, 40 s... between a close and the next open.
    assert opened[:4] == [0.0, 20.0, 50.0, 100.0]
    assert all(later >= earlier for earlier, later in itertools.pairwise(gaps))
    assert max(gaps) <= IDLE_BACKOFF_CAP_SECONDS + 10 + 600  # the cap, the round, the tick's period
    assert len(opened) < 40  # without the back-off: 8,640 rounds of 10 s
    idle = population(db)
    assert idle.idle_rounds == len(opened) - (1 if idle.next_round_at is None else 0)
    assert all(r.close_reason.endswith("(no device checked in)") for r in training_rounds(db)[:-1])


def test_a_device_checking_in_ends_the_back_off_and_is_admitted_at_once(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=2, min_reports=1, round_duration_seconds=10)
    # Three idle rounds, closed at 11, 31 and 61 (opened 0, 21, 51): backing off until 61 + 40.
    for now in (11.0, 21.0, 31.0, 51.0, 61.0):
        tick(db, now)
    backing_off = population(db)
    with db() as session:
        status = population_out(session, session.scalars(select(Population)).one(), 80.0)
    assert (backing_off.idle_rounds, backing_off.next_round_at) == (3, 101.0)
    assert status.open_rounds == [] and "as soon as a device checks in" in status.backing_off
    assert status.idle_rounds == 3 and status.next_round_at == 101.0

    answer = checkin(db, device(db), now=80.0)

    assert isinstance(answer, checkins.Accepted)
    woke = population(db)
    assert (woke.idle_rounds, woke.next_round_at) == (0, None)
    with db() as session:
        status = population_out(session, session.scalars(select(Population)).one(), 80.0)
    assert status.backing_off == "" and status.open_rounds[0].counters["accepted"] == 1


def test_a_round_with_a_check_in_resets_the_count_and_the_next_opens_at_once(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=2, min_reports=2, round_duration_seconds=10)
    tick(db, 11.0)  # idle: the next opens at 21
    tick(db, 21.0)
    checkin(db, device(db), now=22.0)  # one device of the two needed: abandoned, but not idle

    tick(db, 32.0)

    assert population(db).idle_rounds == 0 and population(db).next_round_at is None
    assert training_rounds(db)[-1].opened_at == 32.0


def test_a_check_in_that_finds_the_last_round_just_closed_idle_is_admitted_to_a_new_one(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=2, min_reports=1, round_duration_seconds=10)

    answer = checkin(db, device(db), now=12.0)  # no tick closed the idle round before it

    assert isinstance(answer, checkins.Accepted)
    assert [r.status for r in training_rounds(db)] == ["abandoned", "open"]
    assert (population(db).idle_rounds, population(db).next_round_at) == (0, None)
