"""A round's counts applied by one statement on its row (orchestrator/rounds/counts.py): what
another transaction counted meanwhile is kept, and a closed round takes no count but a late one."""

from __future__ import annotations

from typing import Any

from orchestrator.service.population_creation import ExportedModel
from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.db import Round
from orchestrator.rounds import counts as round_counts
from orchestrator.rounds import state
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
