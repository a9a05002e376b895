"""Reports and aborts as a service: the group commit that collects them, and the one transaction
that answers a group under the populations' locks; the routes only parse and answer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker
from starlette.applications import Starlette

from contracts.protocol import ReportAccepted
from orchestrator.devices import UNAUTHENTICATED, authenticate_all
from orchestrator.rounds import reports as round_reports
from orchestrator.rounds.refusals import Refused
from orchestrator.service.database import DATABASE_UNAVAILABLE, run_db
from orchestrator.service.group_commit import GroupCommit


@dataclass(frozen=True)
class ReportCall:
    """A report, or an abort (`abort`: no body): both count into their round under its
    population's lock, so they share one group commit."""

    assignment_id: str
    token: str
    body: bytes
    content_type: str
    abort: bool = False


ReportGroups = GroupCommit[None, ReportCall, ReportAccepted | Refused]


def report_groups(app: Starlette, window_seconds: float) -> ReportGroups:
    """The group commit of reports and aborts: one transaction for those that arrive together.
    An abort in a transaction of its own waited for the population lock while holding one of the
    few worker threads (`worker_threads`), and check-ins then waited for a thread: at 500 visits/s
    on PostgreSQL that wait was most of the check-ins' p99."""

    async def transaction(_: None, calls: Sequence[ReportCall]) -> list[ReportAccepted | Refused]:
        return await run_db(app, report_transaction, app.state.sessionmaker, calls, app.state.clock())

    return GroupCommit(transaction, window_seconds, fail_together=DATABASE_UNAVAILABLE, name="report")


def report_transaction(
    factory: sessionmaker[Session], calls: Sequence[ReportCall], now: float
) -> list[ReportAccepted | Refused]:
    """Each report or abort in turn, in one transaction; an answer is built as soon as its call is
    in, since a later report in the same transaction may commit the round.

    One pass: the group takes its populations' locks itself when it may close a round
    (`round_reports.receive`); run again under them only after a race with another server process
    that nothing read before the count could foresee (`round_reports.Raced`), with the reports'
    contents as the first run checked them."""
    contents: dict[int, round_reports.Content] = {}  # checked once, outside the locks
    try:
        return _reports_once(factory, calls, now, False, contents)
    except round_reports.Raced:
        return _reports_once(factory, calls, now, True, contents)


def _reports_once(
    factory: sessionmaker[Session],
    calls: Sequence[ReportCall],
    now: float,
    locked: bool,
    contents: dict[int, round_reports.Content],
) -> list[ReportAccepted | Refused]:
    with factory.begin() as session:
        device_ids = authenticate_all(session, [call.token for call in calls])
        events = [
            round_reports.Event(call.assignment_id, device_id, call.body, call.content_type, call.abort)
            for call, device_id in zip(calls, device_ids, strict=True)
            if device_id is not None
        ]
        answers = iter(round_reports.receive(session, events, now, locked, contents))
        return [
            _accepted(next(answers)) if device_id is not None else Refused(401, UNAUTHENTICATED)
            for device_id in device_ids
        ]


def _accepted(answer: round_reports.Counted | Refused) -> ReportAccepted | Refused:
    if isinstance(answer, Refused):
        return answer
    round_ = answer.round
    return ReportAccepted(
        round_id=round_.id, round_status=answer.status, reported=answer.reported, target=round_.target
    )
