"""The reports' group commit (api/routes/assignments.py): reports and aborts that arrive together
share one transaction, and each gets its own answer."""

from __future__ import annotations

from orchestrator.rounds.refusals import Refused
from orchestrator.service.population_creation import ExportedModel
from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

from contracts.protocol import ReportAccepted
from orchestrator.devices import enroll
from orchestrator.service.reports import ReportCall as _ReportCall
from orchestrator.service.reports import report_transaction as _report
from tests.orchestrator.conftest import make_population
from tests.orchestrator.test_rounds import checkin, delta_body, round_by_id

TENSORS = "application/octet-stream"


def enrolled(factory: sessionmaker[Session]) -> tuple[str, str]:
    """(device id, token) of a new device."""
    with factory.begin() as session:
        return enroll(session, 0.0)


def test_reports_and_aborts_that_arrive_together_share_one_transaction_and_get_their_own_answers(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=2, oversampling=2.0)  # room for four
    (first, first_token), (second, second_token), (quitter, quitter_token), (late, late_token) = (
        enrolled(db) for _ in range(4)
    )
    first_a, second_a, quitter_a, late_a = (checkin(db, d) for d in (first, second, quitter, late))
    body = delta_body(biased_model, 1.0)
    calls = [
        _ReportCall(first_a.assignment_id, first_token, body, TENSORS),
        _ReportCall(quitter_a.assignment_id, quitter_token, b"", "", abort=True),
        _ReportCall(second_a.assignment_id, second_token, body, TENSORS),  # the round's target
        _ReportCall(late_a.assignment_id, late_token, b"", "", abort=True),  # after the commit
        _ReportCall("nope", first_token, b"", "", abort=True),
        _ReportCall(quitter_a.assignment_id, f"{quitter}.forged", b"", "", abort=True),
    ]
    commits: list[object] = []

    def count(connection: object) -> None:
        commits.append(connection)

    engine = db.kw["bind"]
    event.listen(engine, "commit", count)
    try:
        answers = _report(db, calls, 2.0)
    finally:
        event.remove(engine, "commit", count)

    assert len(commits) == 1
    reported, aborted, committed = answers[:3]
    assert isinstance(reported, ReportAccepted) and (reported.reported, reported.round_status) == (1, "open")
    assert isinstance(aborted, ReportAccepted) and (aborted.reported, aborted.round_status) == (1, "open")
    assert isinstance(committed, ReportAccepted) and committed.round_status == "committed"
    refusals = answers[3:]
    assert all(isinstance(r, Refused) for r in refusals)
    assert [r.status for r in refusals if isinstance(r, Refused)] == [409, 404, 401]
    round_ = round_by_id(db, first_a.round_id)
    assert (round_.status, round_.reported, round_.aborted, round_.late) == ("committed", 2, 1, 0)
