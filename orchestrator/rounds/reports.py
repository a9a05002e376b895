"""Reports and aborts: a group of them read, checked and counted into their rounds in one transaction.

One pass, each check once. First, with no lock, the group's assignments are read with their rounds
and populations (one statement) and each report that may count is checked and parsed
(`report_checks`: most of its time), kept for the rest of the pass; what is known then decides whether
the group may close a round: one of its rounds is past its deadline, belongs to a secure
population, or may reach its target with the group's reports. Such a group takes its populations'
locks there and then, before it writes anything (the populations, then every round it may write
to: `population_locks.lock_rounds`, the rounds past their deadline closed first), reads its
assignments again under them and counts its events one by one (a report may commit its round, and
the next one is then late: `round_lifecycle.commit`). Any other group counts each round's events
together, in round id order, in one statement (`round_counts`: the only lock it takes is its
round's row, held until the transaction ends), marks their assignments and stores the reports.

Only a race with another server process, which nothing read before the count can foresee (it
finished one of the group's assignments meanwhile, or its reports took a round to its target after
this group's read), makes a group that took no locks need them: `Raced`, raised where it counts,
and the caller rolls back and runs the group again with `locked=True`, reusing what it checked.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import cast

from sqlalchemy import bindparam, insert, select, update
from sqlalchemy.orm import Session

from orchestrator.db import Assignment, Population, Report, Round
from orchestrator.observability import metrics
from orchestrator.observability.logs import log_on_commit
from orchestrator.populations.config import PopulationConfig, config_of
from orchestrator.populations.locks import lock_populations, lock_rounds, rounds_of_assignments
from orchestrator.rounds import buffered_caps, buffering, evaluation_intervals, state
from orchestrator.rounds import counts as round_counts
from orchestrator.rounds.lifecycle import EVALUATION, TRAINING, advance, commit, log, open_rounds
from orchestrator.rounds.refusals import Refused
from orchestrator.rounds.report_checks import parse_evaluation_report, parse_training_report
from orchestrator.rounds.secure import messages

_ASSIGNMENT = select(
    Assignment.device_id, Assignment.status, Assignment.example_count, Assignment.round_id
).where(Assignment.id == bindparam("assignment_id"))
# A group's assignments with their rounds and populations: one statement for the whole group. Fresh
# rounds and populations even if the session holds them: another process may have counted into them.
_ASSIGNMENTS = (
    select(
        Assignment.id,
        Assignment.device_id,
        Assignment.status,
        Assignment.example_count,
        Assignment.deadline,
        Round,
        Population,
    )
    .join(Round, Assignment.round_id == Round.id)
    .join(Population, Round.population_id == Population.id)
    .where(Assignment.id.in_(bindparam("ids", expanding=True)))
    .execution_options(populate_existing=True)
)
# Only an assignment still assigned: a count never follows another process's finish of it.
_FINISH_ASSIGNMENT = (
    update(Assignment)
    .where(Assignment.id == bindparam("assignment_id"), Assignment.status == "assigned")
    .values(status=bindparam("new_status"), finished_at=bindparam("now"))
)
_FINISH_ASSIGNMENTS = (
    update(Assignment)
    .where(Assignment.id.in_(bindparam("ids", expanding=True)), Assignment.status == "assigned")
    .values(status=bindparam("new_status"), finished_at=bindparam("now"))
    .returning(Assignment.id)
)
_INSERT_REPORT = insert(Report)
# The Content-Type a report of each kind of round is sent with.
_CONTENT_TYPES = {TRAINING: "application/octet-stream", EVALUATION: "application/json"}


# A report as parsed (`report_checks`): weight, delta (None for evaluation), metric sums; or why not.
Parsed = tuple[float, bytes | None, dict[str, float]] | Refused


@dataclass(frozen=True)
class Unread:
    """A report refused before its body is read (its round takes reports another way, or its
    Content-Type is not its round's): the assignment stays open, so that the device may send it
    again right, and its round counts nothing. `counted`: in the reports metric."""

    refused: Refused
    counted: bool


# What a report's content is, checked once per report (`_content`), by the events' positions.
Content = Parsed | Unread


class Raced(Exception):
    """Another server process changed the group's round or assignment between its read and its
    count (see the module's docstring): roll back, run the group again with `locked=True`."""


@dataclass(frozen=True)
class Event:
    """An authenticated device's report (`body`, `content_type`) or abort of an assignment."""

    assignment_id: str
    device_id: str
    body: bytes = b""
    content_type: str = ""
    abort: bool = False


@dataclass(frozen=True)
class Counted:
    """A report or abort counted into its round, and the round as it was just after."""

    round: Round
    status: str
    reported: int


@dataclass(frozen=True)
class Found:
    """An assignment as read: the parts a report or abort needs."""

    id: str
    status: str
    example_count: int
    round: Round
    population: Population
    device_id: str = ""  # its owner
    deadline: float = math.inf  # the assignment's own (a buffered population's differs from its round's)


def _read(session: Session, assignment_ids: Sequence[str]) -> dict[str, Found]:
    """The known ones of these assignments, with their rounds and populations, in one statement."""
    if not assignment_ids:
        return {}
    rows = session.execute(_ASSIGNMENTS, {"ids": sorted(set(assignment_ids))})
    return {
        id_: Found(id_, status, example_count, round_, population, owner, deadline)
        for id_, owner, status, example_count, deadline, round_, population in rows
    }


def find_assignment(
    session: Session, population: Population, assignment_id: str, device_id: str
) -> Found | Refused:
    """The caller's assignment in this population, with its round."""
    found = session.connection().execute(_ASSIGNMENT, {"assignment_id": assignment_id}).first()
    if found is None:
        return Refused(404, f"no assignment {assignment_id!r}", reason="unknown_assignment")
    owner, status, example_count, round_id = found
    if owner != device_id:
        return Refused(403, "this assignment belongs to another device", reason="not_yours")
    round_ = session.get(Round, round_id)
    assert round_ is not None
    if round_.population_id != population.id:
        return Refused(
            404,
            f"assignment {assignment_id!r} is not in population {population.name!r}",
            reason="unknown_assignment",
        )
    return Found(assignment_id, status, example_count, round_, population, owner)


@dataclass
class _Step:
    """What one event does in the counting step, in its round's turn."""

    index: int
    population: Population
    found: Found
    count: state.Count  # LATE, INVALID, ABORT or a report's
    refused: Refused | None = None  # the answer of a late or invalid report
    report: tuple[float, bytes | None, dict[str, float]] | None = None  # weight, delta, metric sums
    # A buffered population's training event: its buffer is found when it is counted (`_count`).
    buffered: bool = False


def receive(
    session: Session,
    events: Sequence[Event],
    now: float,
    locked: bool = False,
    contents: dict[int, Content] | None = None,
) -> list[Counted | Refused]:
    """Answer each event, in order, in the caller's transaction (see the module's docstring).
    `locked`: take the populations' locks before anything is read (the run after `Raced`).
    `contents`: the reports' contents as checked by an earlier run of the same events (by their
    positions), kept for the run after `Raced`; filled here."""
    contents = {} if contents is None else contents
    ids = [e.assignment_id for e in events]
    if locked:
        _lock(session, ids, {}, now)
        read = _read(session, ids)
    else:
        read = _read(session, ids)
        if _may_close(events, read, now, contents):
            locked = True
            _lock(session, ids, read, now)
            read = _read(session, ids)  # again under the locks: another process may have changed them
    answers: list[Counted | Refused | None] = [None] * len(events)
    # A group may hold one assignment twice (a replay): each later copy waits for the earlier's count.
    waves: list[list[int]] = []
    seen: Counter[str] = Counter()
    for index, event in enumerate(events):
        wave = seen[event.assignment_id]
        seen[event.assignment_id] += 1
        if wave == len(waves):
            waves.append([])
        waves[wave].append(index)
    for number, wave_indexes in enumerate(waves):
        if number:  # the copies of assignments an earlier wave has just counted
            read.update(_read(session, [events[i].assignment_id for i in wave_indexes]))
        steps: list[_Step] = []
        coming: Counter[int] = Counter()  # round id -> this wave's reports for it so far
        for index in wave_indexes:
            event, found = events[index], read.get(events[index].assignment_id)
            if found is None:
                answers[index] = Refused(404, f"no assignment {event.assignment_id!r}")
                continue
            step = _check(session, found, event, index, coming, contents, now)
            if isinstance(step, _Step):
                steps.append(step)
            else:
                answers[index] = step
        steps.sort(key=lambda s: (s.found.round.id, s.index))  # round id order: no deadlock
        if locked:  # one by one: a report may commit its round, and the next is then late
            for step in steps:
                answers[step.index] = _count(session, step, events[step.index], now)
            continue
        for _, of_round in itertools.groupby(steps, key=lambda s: s.found.round.id):
            for index, answer in _count_together(session, list(of_round), now).items():
                answers[index] = answer
    assert all(answer is not None for answer in answers)
    return cast(list[Counted | Refused], answers)


def _lock(session: Session, assignment_ids: Sequence[str], read: dict[str, Found], now: float) -> None:
    """Take the group's populations' locks, then its rounds' (and their open rounds'), in id order,
    and close the rounds past their deadline."""
    if read:
        places = {(f.population.id, f.round.id) for f in read.values()}
    else:  # locked from the start: only the ids, read before the locks
        places = set(rounds_of_assignments(session, assignment_ids).values())
    population_ids = sorted({p for p, _ in places})
    populations = lock_populations(session, population_ids)
    locked = lock_rounds(session, population_ids, sorted({r for _, r in places}))
    for population in populations:
        mine = [r for r in locked if r.population_id == population.id and r.status == state.OPEN]
        advance(session, population, now, {r.kind: r for r in mine})


def _may_close(
    events: Sequence[Event], read: dict[str, Found], now: float, contents: dict[int, Content]
) -> bool:
    """Whether the group may close a round, from its read: a round it reports into is past its
    deadline, belongs to a secure population, or may reach its target with the group's reports (it
    can only have more by now than were read, never fewer). Checks the content of each report that
    may count on the way (kept in `contents`), with no lock."""
    coming: Counter[int] = Counter()
    first: set[str] = set()
    may_close = False
    for index, event in enumerate(events):
        found = read.get(event.assignment_id)
        if found is None or event.assignment_id in first:
            continue  # unknown, or a later copy (read in its own wave)
        first.add(event.assignment_id)
        round_ = found.round
        config = config_of(found.population)
        # A buffered population's training event is counted under its population's lock
        # (`buffering`), into the buffer open then, whatever its own round's status.
        buffered = round_.kind == TRAINING and config.settings.buffered_training
        may_close = may_close or buffered
        if found.device_id != event.device_id or (round_.status != state.OPEN and not buffered):
            continue
        if not buffered and (now >= round_.deadline or config.secure_training):
            may_close = True  # its round must be advanced first
            continue
        if event.abort or found.status != "assigned":
            continue
        if index not in contents:  # checked by an earlier run of the group (after `Raced`)
            contents[index] = _content(config, found, event)  # with no lock, even when buffered
        if not buffered and not isinstance(contents[index], Unread | Refused):
            coming[round_.id] += 1
            may_close = may_close or round_.reported + coming[round_.id] >= round_.target
    return may_close


def _content(config: PopulationConfig, found: Found, event: Event) -> Content:
    """A report's content checked, in this order: its round takes reports, its Content-Type is the
    round's kind's (checked before parsing: the assignment stays open), and it parses."""
    round_ = found.round
    if round_.kind != EVALUATION and config.secure_training:  # a training round's or a cohort's
        return Unread(
            Refused(
                409,
                f"round {round_.id} uses secure aggregation: take part through /v1/assignments/{{id}}/secure",
            ),
            counted=False,
        )
    expected = _CONTENT_TYPES[round_.kind]
    sent = event.content_type.split(";")[0].strip().lower()
    if sent != expected:
        refused = Refused(
            415,
            f"a {round_.kind} report is Content-Type {expected} "
            f"({'safetensors' if round_.kind == TRAINING else '{num_examples, metrics}'}), "
            f"got {sent or 'none'!r}; nothing was stored",
            reason="content_type",
        )
        return Unread(refused, counted=True)
    if round_.kind == TRAINING:
        return parse_training_report(config, round_, found.example_count, event.body)
    return parse_evaluation_report(config, found.example_count, event.body)


def _check(
    session: Session,
    found: Found,
    event: Event,
    index: int,
    coming: Counter[int],
    contents: dict[int, Content],
    now: float,
) -> _Step | Refused | Counted:
    """The first step: whose the assignment is and whether it can still take the event, then the
    report's content (checked here unless `_may_close` checked it already)."""
    population = found.population
    if found.device_id != event.device_id:
        refused = Refused(403, "this assignment belongs to another device", reason="not_yours")
        if not event.abort:
            count_report(session, population, "unknown", event.assignment_id, refused)
        return refused
    round_ = found.round
    if event.abort and found.status == "aborted":
        # Its own device again: the first answer was lost (a dropped connection, a killed
        # process). Answered as the first was; nothing is counted twice.
        return Counted(round_, round_.status, round_.reported)
    buffered = round_.kind == TRAINING and config_of(population).settings.buffered_training
    closed = _closed(found, event.abort, now if buffered else None)
    if closed is not None:
        if event.abort:
            return closed
        if closed.reason == "late":  # counted in the round's `late`, in its turn
            return _Step(index, population, found, state.LATE, refused=closed)
        count_report(session, population, round_, event.assignment_id, closed)
        return closed
    if event.abort:
        return _Step(index, population, found, state.ABORT, buffered=buffered)
    if index not in contents:
        contents[index] = _content(config_of(population), found, event)
    report = contents[index]
    if isinstance(report, Unread):
        if report.counted:
            count_report(session, population, round_, event.assignment_id, report.refused)
        return report.refused
    if isinstance(report, Refused):
        return _Step(index, population, found, state.INVALID, refused=report, buffered=buffered)
    coming[round_.id] += 1
    weight, _, metric_sums = report
    if round_.kind == EVALUATION:
        # Its place among the round's reports as this transaction counts them (1, 2, ...).
        arrival = round_.reported + coming[round_.id]
        metric_sums = evaluation_intervals.grouped(arrival, round_.target, round_.min_reports, metric_sums)
    count = state.report_count(weight, metric_sums)
    return _Step(index, population, found, count, report=report, buffered=buffered)


def _into_buffer(session: Session, step: _Step, now: float) -> Refused | None:
    """A buffered population's event moved to the buffer open now (its staleness weighing a
    report), or why it cannot go into one (counted late in the round it trained in)."""
    found, population = step.found, step.population
    settings = config_of(population).settings
    buffer = open_rounds(session, population).get(TRAINING)
    placed = buffering.place(session, settings, found.round, buffer, found.id, now)
    if not isinstance(placed, Refused) and step.report is not None:
        twice = buffered_caps.second_in_buffer(session, population, settings, placed.buffer, found.device_id)
        if twice is not None:  # dropped, as a stale report's assignment: the device checks in again
            buffering.drop(session, found.id, now)
            placed = twice
    if isinstance(placed, Refused):
        round_counts.count(session, found.round, state.LATE)
        count_report(session, population, found.round, found.id, placed)
        return placed
    step.found = replace(found, round=placed.buffer)
    if step.report is not None:
        weight, delta, metric_sums = step.report
        step.report = (weight * placed.factor, delta, metric_sums)
        both = state.add_metric_sums(metric_sums, placed.metric_sums())
        step.count = state.report_count(weight * placed.factor, both)
    return None


def _count(session: Session, step: _Step, event: Event, now: float) -> Counted | Refused:
    """The second step under the populations' locks: count into the round, mark the assignment, store
    the report, commit the round at its target."""
    if step.buffered:
        refused = _into_buffer(session, step, now)
        if refused is not None:
            return refused
    population, found, round_ = step.population, step.found, step.found.round
    if step.count is state.LATE:
        round_counts.count(session, round_, state.LATE)
        assert step.refused is not None
        count_report(session, population, round_, found.id, step.refused)
        return step.refused
    if not round_counts.count(session, round_, step.count):  # the round closed since it was read
        late = _late(round_)
        if not event.abort:
            round_counts.count(session, round_, state.LATE)
            count_report(session, population, round_, found.id, late)
        return late
    new_status = _new_status(step)
    finished = session.connection().execute(
        _FINISH_ASSIGNMENT, {"assignment_id": found.id, "new_status": new_status, "now": now}
    )
    # Under the locks it was read after them: no other process finished it since.
    assert finished.rowcount, f"assignment {found.id} changed under its round's lock"
    if event.abort:
        if round_.kind != EVALUATION and config_of(population).secure_training:
            messages.count_leaving(session, round_.id, found.id)  # its phase's open devices
        metrics.count(session, metrics.ABORTS, (population.name, round_.kind))
        return Counted(round_, round_.status, round_.reported)
    if step.report is None:
        assert step.refused is not None
        count_report(session, population, round_, found.id, step.refused)
        return step.refused
    # Stored only now, under the round's lock: a report stored before it could wait for another
    # process's copy of the same report while holding a lock that copy waits for.
    session.connection().execute(_INSERT_REPORT, _report_row(step))
    count_report(session, population, round_, found.id, None)
    closing = state.target_reached(round_)
    if closing is not None:
        commit(session, population, round_, now, closing=closing)
    return Counted(round_, round_.status, round_.reported)


def _count_together(session: Session, steps: Sequence[_Step], now: float) -> dict[int, Counted | Refused]:
    """Without the populations' locks, one round's steps of a wave counted together: one count
    (`state.combined`), one mark per new status of the assignments, one insert of the
    reports, so that the round's row is held for a few statements whatever the group's size. None
    of them reaches the target (`_may_close` saw to it, unless another process's reports were
    counted since: `Raced`), so nothing commits here."""
    population, round_ = steps[0].population, steps[0].found.round
    answers: dict[int, Counted | Refused] = {}
    if not round_counts.count(session, round_, state.combined([s.count for s in steps])):
        # The round closed since it was read: every report is late, no abort counts.
        late, reports = _late(round_), [s for s in steps if s.count is not state.ABORT]
        if reports:
            round_counts.count(session, round_, state.combined([state.LATE] * len(reports)))
        for step in steps:
            answers[step.index] = late
            if step.count is not state.ABORT:
                count_report(session, population, round_, step.found.id, late)
        return answers
    if any(s.report is not None for s in steps) and state.target_reached(round_) is not None:
        raise Raced(f"round {round_.id} reached its target")
    finishing: dict[str, list[str]] = {}
    for step in steps:
        if step.count is not state.LATE:
            finishing.setdefault(_new_status(step), []).append(step.found.id)
    for new_status, ids in finishing.items():
        finished = session.connection().execute(
            _FINISH_ASSIGNMENTS, {"ids": ids, "new_status": new_status, "now": now}
        )
        if len(finished.all()) != len(ids):  # another process finished one after it was read
            raise Raced(f"an assignment of round {round_.id} was finished meanwhile")
    rows = [_report_row(step) for step in steps if step.report is not None]
    if rows:
        session.connection().execute(_INSERT_REPORT, rows)
    reported = round_.reported - len(rows)  # the answers: the round's count as each came in
    for step in steps:
        if step.refused is not None:  # late or invalid
            answers[step.index] = step.refused
            count_report(session, population, round_, step.found.id, step.refused)
        elif step.count is state.ABORT:
            metrics.count(session, metrics.ABORTS, (population.name, round_.kind))
            answers[step.index] = Counted(round_, round_.status, reported)
        else:
            reported += 1
            count_report(session, population, round_, step.found.id, None)
            answers[step.index] = Counted(round_, round_.status, reported)
    return answers


def _new_status(step: _Step) -> str:
    if step.count is state.ABORT:
        return "aborted"
    return "invalid" if step.report is None else "reported"


def _report_row(step: _Step) -> dict[str, object]:
    assert step.report is not None
    weight, delta, metric_sums = step.report
    return {
        "assignment_id": step.found.id,
        "round_id": step.found.round.id,
        "weight": weight,
        "delta": delta,
        # An evaluation's sums live only in its round's running sums, released with at least its
        # floor of devices (round_release); one device's are never kept.
        "metrics": metric_sums if step.found.round.kind == TRAINING else {},
    }


def _late(round_: Round) -> Refused:
    return Refused(
        409, f"the round's deadline has passed; the report is late (round {round_.status})", reason="late"
    )


def _closed(found: Found, abort: bool, buffered_at: float | None = None) -> Refused | None:
    """Why an assignment can no longer take a report or an abort, or None; a late report is
    counted in the round's `late` (a late abort is not a report, and is not counted).
    `buffered_at`: now, for a buffered population's training assignment, which outlives its round
    until its own deadline (its report goes into the open buffer)."""
    if found.status == "reported":
        return Refused(409, "this assignment has already reported", reason="repeated")
    if found.status == "aborted":
        return Refused(409, "this assignment was aborted", reason="repeated")
    if found.status == "invalid":
        return Refused(409, "this assignment's report was refused as invalid", reason="repeated")
    if buffered_at is not None and found.status == "assigned":
        if buffered_at >= found.deadline:
            return Refused(
                409,
                "the assignment's deadline has passed; the report is late (assignment dropped)",
                reason="late",
            )
        return None
    if found.status == "dropped" or found.round.status != state.OPEN:
        return _late(found.round)
    return None


# Report outcomes for metrics, by the class of refusal; any other refusal is an invalid report.
_OUTCOMES = {
    "late": "late",
    "repeated": "repeated",
    "unknown_assignment": "refused",
    "not_yours": "refused",
    "content_type": "refused",
    buffering.STALE: "stale",
    buffered_caps.TWICE: "refused",
    buffered_caps.OVER_CAP: "refused",
}


def count_report(
    session: Session, population: Population, round_: Round | str, assignment_id: str, refused: Refused | None
) -> None:
    """A report's outcome in the metrics (and the log, for what an operator looks into)."""
    kind = round_ if isinstance(round_, str) else round_.kind
    if refused is None:
        metrics.count(session, metrics.REPORTS, (population.name, kind, "accepted", ""))
        return
    outcome = _OUTCOMES.get(refused.reason, "invalid")
    reason = "" if outcome in ("late", "repeated") else refused.reason or "other"
    metrics.count(session, metrics.REPORTS, (population.name, kind, outcome, reason))
    if outcome in ("late", "invalid"):  # what an operator looks into; never the message (it quotes the body)
        log_on_commit(
            session,
            log,
            f"report {outcome}",
            population=population.name,
            round_id=None if isinstance(round_, str) else round_.id,
            assignment_id=assignment_id,
            kind=kind,
            reason=reason or outcome,
        )
