"""A round's counts applied by one statement on its row (orchestrator/rounds/counts.py), the only
place an event's count (orchestrator/rounds/state.py) is applied: reports, invalid, late and aborted
ones, alone or combined; what another transaction counted meanwhile is kept, and a closed round
takes no count but a late one."""

from __future__ import annotations

from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.db import Round
from orchestrator.rounds import counts as round_counts
from orchestrator.rounds import state
from orchestrator.service.population_creation import ExportedModel
from tests.orchestrator.conftest import make_population
from tests.orchestrator.test_rounds import checkin, device, round_by_id


def test_a_count_adds_to_the_row_as_it_is_not_to_a_stale_copy(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=5)
    round_id = checkin(db, device(db)).round_id

    with db() as stale:
        copy = stale.get(Round, round_id)
        assert copy is not None and copy.reported == 0
        stale.commit()  # the copy stays as it was read
        with db.begin() as other:  # another transaction counts meanwhile
            first = other.get(Round, round_id)
            assert first is not None
            assert round_counts.count(other, first, state.report_count(2.0, {"loss_sum": 1.0}))
        with stale.begin():
            counted = round_counts.count(stale, copy, state.report_count(3.0, {"loss_sum": 0.5, "n": 1.0}))

            assert counted
            assert (copy.reported, copy.total_weight, copy.status) == (2, 5.0, "open")
            assert copy.metrics == {"loss_sum": 1.5, "n": 1.0}
            assert state.target_reached(copy) is None

    stored = round_by_id(db, round_id)
    assert (stored.reported, stored.total_weight, stored.metrics) == (2, 5.0, {"loss_sum": 1.5, "n": 1.0})


def test_a_report_counted_into_the_round_as_read_adds_its_metric_sums_in_the_same_statement(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=5)
    round_id = checkin(db, device(db)).round_id
    run: list[str] = []

    def executed(_conn: Any, _cursor: Any, statement: str, *_: object) -> None:
        run.append(statement)

    with db.begin() as session:
        round_ = session.get(Round, round_id)
        assert round_ is not None
        engine = session.get_bind()
        event.listen(engine, "before_cursor_execute", executed)
        try:
            for weight, loss in ((2.0, 1.0), (1.0, 0.5)):
                report = state.report_count(weight, {"loss_sum": loss})
                assert round_counts.count(session, round_, report)
        finally:
            event.remove(engine, "before_cursor_execute", executed)

    assert len(run) == 2 and all(s.startswith("UPDATE rounds SET") and "metrics" in s for s in run), run
    stored = round_by_id(db, round_id)
    assert (stored.reported, stored.total_weight, stored.metrics) == (2, 3.0, {"loss_sum": 1.5})


def test_a_closed_round_takes_no_count_but_a_late_one(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=5)
    round_id = checkin(db, device(db)).round_id
    with db.begin() as session:
        round_ = session.get(Round, round_id)
        assert round_ is not None
        state.close(round_, state.Closing(state.ABANDONED, "test"), 3.0)

    with db.begin() as session:
        round_ = session.get(Round, round_id)
        assert round_ is not None
        refused = [round_counts.count(session, round_, c) for c in (state.ABORT, state.INVALID)]
        late = round_counts.count(session, round_, state.LATE)

    assert refused == [False, False] and late
    stored = round_by_id(db, round_id)
    assert (stored.aborted, stored.invalid, stored.late, stored.status) == (0, 0, 1, "abandoned")


def _round(session: Session, round_id: int) -> Round:
    round_ = session.get(Round, round_id)
    assert round_ is not None
    return round_


def test_reports_are_counted_with_their_weights_and_sums_and_the_target_commits(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=3)
    round_id = checkin(db, device(db)).round_id

    with db.begin() as session:
        round_ = _round(session, round_id)
        closings = []
        for weight, sums in ((10.0, {"loss_sum": 1.5}), (5.0, {"loss_sum": 0.5, "n": 1.0}), (1.0, {})):
            assert round_counts.count(session, round_, state.report_count(weight, sums))
            closings.append(state.target_reached(round_))
        first, second, third = closings

        assert first is None and second is None
        assert third == state.Closing(state.COMMITTED, "3 reports reached the target 3", had=3, needed=3)
        assert (round_.reported, round_.total_weight) == (3, 16.0)
        assert round_.metrics == {"loss_sum": 2.0, "n": 1.0}
        assert round_.status == state.OPEN  # the machine says it closes; closing is the caller's act
        assert third is not None
        state.close(round_, third, 12.0)
    stored = round_by_id(db, round_id)
    assert (stored.status, stored.closed_at, stored.reported) == (state.COMMITTED, 12.0, 3)


def test_invalid_late_and_aborted_reports_are_counted(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=3)
    round_id = checkin(db, device(db)).round_id

    with db.begin() as session:
        round_ = _round(session, round_id)
        for count in (state.INVALID, state.LATE, state.LATE, state.ABORT):
            assert round_counts.count(session, round_, count)

    stored = round_by_id(db, round_id)
    assert (stored.invalid, stored.late, stored.aborted, stored.reported) == (1, 2, 1, 0)


def test_counts_combine_into_one_as_if_applied_one_by_one(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=5)
    one_by_one_id = checkin(db, device(db)).round_id
    counts = [
        state.report_count(10.0, {"loss_sum": 1.5}),
        state.ABORT,
        state.INVALID,
        state.report_count(5.0, {"loss_sum": 0.5, "n": 1.0}),
    ]
    with db.begin() as session:
        for count in counts:
            assert round_counts.count(session, _round(session, one_by_one_id), count)
        one_by_one = _round(session, one_by_one_id)
        state.close(one_by_one, state.Closing(state.ABANDONED, "test"), 3.0)
    together_id = checkin(db, device(db), now=4.0).round_id
    assert together_id != one_by_one_id
    combined = state.combined(counts)
    with db.begin() as session:
        assert round_counts.count(session, _round(session, together_id), combined)

    assert combined.while_open and not state.combined([state.LATE] * 2).while_open
    counters = ("reported", "total_weight", "aborted", "invalid", "late", "metrics")
    first, together = round_by_id(db, one_by_one_id), round_by_id(db, together_id)
    assert [getattr(together, c) for c in counters] == [getattr(first, c) for c in counters]
    assert (together.reported, together.total_weight, together.aborted, together.invalid) == (2, 15.0, 1, 1)
    assert together.metrics == {"loss_sum": 2.0, "n": 1.0}
