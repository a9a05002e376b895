"""Report retention: by default a report's delta is deleted in the transaction that commits or
abandons its round, and its weight, metrics and the round's counts stay; `report_deltas: keep`
keeps them; the migration deletes those of rounds closed before it. On SQLite, and on PostgreSQL
when TEST_POSTGRES_URL is set (the `db` fixture)."""

from __future__ import annotations

from alembic import command
from orchestrator.populations.locks import lock_population
from orchestrator.rounds.lifecycle import advance
from orchestrator.rounds.refusals import Refused
from orchestrator.service.population_creation import ExportedModel
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.db import Report, Round
from orchestrator.migrate import alembic_config
from tests.orchestrator.conftest import make_population
from tests.orchestrator.test_rounds import checkin, delta_body, device, report


def deltas_by_round(factory: sessionmaker[Session]) -> dict[tuple[int, str], list[bool]]:
    """(round id, status) -> whether each of its reports still has its delta."""
    found: dict[tuple[int, str], list[bool]] = {}
    with factory() as session:
        for round_id, status, delta in session.execute(
            select(Round.id, Round.status, Report.delta).join(Report, Report.round_id == Round.id)
        ):
            found.setdefault((round_id, status), []).append(delta is not None)
    return found


def run_rounds(factory: sessionmaker[Session], model: ExportedModel) -> None:
    """A round that commits on its second report, then one abandoned at its deadline with one
    report of the two it needs, then one left open with a report."""
    for _ in range(2):
        dev = device(factory)
        answer = checkin(factory, dev)
        assert not isinstance(report(factory, dev, answer.assignment_id, delta_body(model, 0.1)), Refused)
    dev = device(factory)
    answer = checkin(factory, dev, now=3.0)
    report(factory, dev, answer.assignment_id, delta_body(model, 0.1), now=3.5)
    with factory.begin() as session:
        population = lock_population(session, "p")
        assert population is not None
        advance(session, population, 1000.0)  # past its deadline: abandoned
    dev = device(factory)
    answer = checkin(factory, dev, now=1001.0)
    report(factory, dev, answer.assignment_id, delta_body(model, 0.1), now=1001.5)


def test_no_delta_outlives_its_round_and_the_counts_stay(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=2, min_reports=2, round_duration_seconds=60)

    run_rounds(db, biased_model)

    kept = deltas_by_round(db)
    assert sorted(status for _, status in kept) == ["abandoned", "committed", "open"]
    for (_, status), has_delta in kept.items():
        assert has_delta == ([True] if status == "open" else [False] * len(has_delta)), (status, has_delta)
    with db() as session:
        closed = list(session.scalars(select(Round).where(Round.status != "open").order_by(Round.id)))
        weights = list(session.scalars(select(Report.weight).where(Report.round_id == closed[0].id)))
    assert [r.status for r in closed] == ["committed", "abandoned"]
    assert weights == [10.0, 10.0]  # the reports and their weights stay, without their deltas


def test_report_deltas_keep_keeps_them(db: sessionmaker[Session], biased_model: ExportedModel) -> None:
    make_population(
        db, biased_model, target_reports=2, min_reports=2, round_duration_seconds=60, report_deltas="keep"
    )

    run_rounds(db, biased_model)

    assert all(all(has) for has in deltas_by_round(db).values())


def test_the_migration_deletes_the_deltas_of_rounds_closed_before_it(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    # Prepare: reports kept in closed and open rounds, as every database before 0020 kept them.
    make_population(
        db, biased_model, target_reports=2, min_reports=2, round_duration_seconds=60, report_deltas="keep"
    )
    run_rounds(db, biased_model)
    url = db.kw["bind"].url.render_as_string(hide_password=False)
    config = alembic_config(url)
    command.downgrade(config, "0019")

    # Execute
    command.upgrade(config, "head")

    # Check
    kept = deltas_by_round(db)
    assert {status: has for (_, status), has in kept.items()} == {
        "committed": [False, False],
        "abandoned": [False],
        "open": [True],
    }
