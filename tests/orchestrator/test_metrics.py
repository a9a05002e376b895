"""The state machine's counters move with what its transactions commit, and only then; database
errors and group-commit retries are counted too."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from orchestrator.observability import metrics, round_counter
from orchestrator.populations.locks import lock_population
from orchestrator.service.population_creation import ExportedModel
from prometheus_client import REGISTRY
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.rounds import checkins
from orchestrator.service.group_commit import GroupCommit
from tests.orchestrator.conftest import make_population
from tests.orchestrator.test_rounds import checkin, delta_body, device, report


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def total(name: str) -> float:
    """`name` summed over all its labels."""
    return sum(s.value for family in REGISTRY.collect() for s in family.samples if s.name == name)


def test_counters_move_when_the_transaction_commits_and_never_for_a_rolled_back_one(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=1, min_examples=5)
    devices = [device(db) for _ in range(3)]
    accepted = {"population": "p", "kind": "training", "answer": "accepted"}
    before = value("orchestrator_checkins_total", **accepted)

    with pytest.raises(RuntimeError), db.begin() as session:
        population = lock_population(session, "p")
        assert population is not None
        checkins.checkin(session, population, [checkins.CheckIn(devices[0], 50, "training")], 1.0)
        raise RuntimeError("rolled back")
    after_rollback = value("orchestrator_checkins_total", **accepted)
    answer = checkin(db, devices[0])
    checkin(db, devices[1], count=2)  # under min_examples
    report(db, devices[0], answer.assignment_id, delta_body(biased_model, 0.1))

    assert after_rollback == before
    assert value("orchestrator_checkins_total", **accepted) == before + 1
    assert (
        value("orchestrator_checkins_total", population="p", kind="training", answer="too_few_examples") >= 1
    )
    assert (
        value("orchestrator_reports_total", population="p", kind="training", outcome="accepted", reason="")
        >= 1
    )
    assert round_counter.round_counts(db)[("p", "training", "committed")] >= 1
    assert value("orchestrator_aggregation_duration_seconds_count", population="p") >= 1


def test_invalid_and_late_reports_are_counted_by_reason(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=5, round_duration_seconds=10.0)
    first, second = device(db), device(db)
    labels = {"population": "p", "kind": "training"}
    norm_before = value("orchestrator_reports_total", **labels, outcome="invalid", reason="update_norm")
    late_before = value("orchestrator_reports_total", **labels, outcome="late", reason="")
    one, two = checkin(db, first), checkin(db, second)

    report(db, first, one.assignment_id, delta_body(biased_model, 1e6))
    report(db, second, two.assignment_id, delta_body(biased_model, 0.1), now=60.0)

    assert (
        value("orchestrator_reports_total", **labels, outcome="invalid", reason="update_norm")
        == norm_before + 1
    )
    assert value("orchestrator_reports_total", **labels, outcome="late", reason="") == late_before + 1


def test_database_errors_are_counted_by_class(db: sessionmaker[Session]) -> None:
    engine = db.kw["bind"]
    metrics.count_database_errors(engine)
    before = total("orchestrator_database_errors_total")

    with pytest.raises(DBAPIError), db() as session:
        session.execute(text("SELECT * FROM no_such_table"))

    assert total("orchestrator_database_errors_total") == before + 1


def test_group_commit_retries_are_counted() -> None:
    async def transaction(_: str, requests: Sequence[int]) -> list[int]:
        if 1 in requests:
            raise RuntimeError("rolled back")
        return list(requests)

    async def run() -> None:
        groups = GroupCommit(transaction, window_seconds=1.0, name="test")
        await asyncio.gather(*(groups.submit("p", i) for i in range(3)), return_exceptions=True)

    before = value("orchestrator_database_retries_total", operation="test")

    asyncio.run(run())

    assert value("orchestrator_database_retries_total", operation="test") == before + 3


def test_an_abandoned_round_is_counted_with_the_phase_it_stopped_in_and_what_ended_it(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=3, min_reports=2, round_duration_seconds=10)
    labels = {"population": "p", "kind": "training", "phase": "reporting", "ended_by": "deadline"}
    before = value("orchestrator_rounds_abandoned_total", **labels)
    a = device(db)
    answer = checkin(db, a)
    report(db, a, answer.assignment_id, delta_body(biased_model, 0.1))

    checkin(db, device(db), now=12.0)  # past the deadline: one report of the two needed

    assert value("orchestrator_rounds_abandoned_total", **labels) == before + 1
