"""The round state machine: check-in, report, abort, deadlines, commit.

Every function here runs inside the caller's transaction and takes `now` explicitly, so a
restarted server continues from the last committed state and tests control time. A round:

    open --(target good reports)--------------------------> committed (new model version)
    open --(deadline, >= min_reports)---------------------> committed
    open --(deadline, fewer)------------------------------> abandoned (model kept)

after which the next round opens. Protocol refusals are returned as `Refused` values, not
raised, so that the counters they bump are committed with the answer. A population with
`aggregation: "secure"` runs its training rounds' phases in `secure_rounds` instead of taking
reports; this module opens them, advances them and commits their unmasked mean.
"""

from __future__ import annotations

import functools
import logging
import math
import secrets
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar, cast

import numpy as np
from safetensors.numpy import load
from sqlalchemy import CursorResult, bindparam, delete, func, insert, select, update
from sqlalchemy.orm import Session, object_session
from sqlalchemy.orm.attributes import set_committed_value

from contracts.manifest import Manifest
from contracts.params import (
    Params,
    ParamsError,
    check_params,
    check_sparse_delta,
    decode_params,
    decode_sparse_delta,
    encode_params,
    encode_sparse_delta,
    read_metadata,
)
from orchestrator import central_training, metrics, mixing, secure_rounds
from orchestrator.aggregation import apply_update
from orchestrator.db import Assignment, ModelVersion, Population, Report, Round
from orchestrator.limits import MAX_METRIC_MAGNITUDE, MAX_REPORT_HEADER_BYTES, json_document
from orchestrator.logs import log_on_commit
from orchestrator.on_commit import on_commit
from orchestrator.pipeline import Stage, apply_measurements
from orchestrator.pipeline.assemble import CentralPart, Pipeline, RoundInputs
from orchestrator.pipeline.private import CLIP_NORM, NEXT_CLIP_NORM, WITHIN_CLIP
from orchestrator.population_settings import PopulationSettings
from orchestrator.refusals import Refused as Refused  # re-exported: the routes answer with rounds.Refused

TRAINING, EVALUATION = "training", "evaluation"
T = TypeVar("T")
MAX_METRICS = 64
log = logging.getLogger("orchestrator.rounds")

# The statements of check-ins and reports are built once: building and hashing a statement
# costs several times more than SQLite takes to run it.
_POPULATION_BY_NAME = select(Population).where(Population.name == bindparam("name"))
# FOR NO KEY UPDATE, not FOR UPDATE: writers of a population still exclude each other, but the
# foreign-key checks of rows that point at it (a check-in's round update) do not wait for them,
# which would deadlock a check-in holding its round's row against a report waiting for that row.
_LOCK = {"key_share": True}  # the same, for Session.refresh
_POPULATION_BY_NAME_LOCKED = _POPULATION_BY_NAME.with_for_update(key_share=True)
_POPULATIONS_OF_ASSIGNMENTS = (
    select(Assignment.id, Round.population_id)
    .join(Round, Assignment.round_id == Round.id)
    .where(Assignment.id.in_(bindparam("assignment_ids", expanding=True)))
)
_POPULATIONS_BY_ID = (
    select(Population)
    .where(Population.id.in_(bindparam("ids", expanding=True)))
    .order_by(Population.id)  # always in the same order, so two servers never deadlock
    .with_for_update(key_share=True)
)
# Fresh values even for rounds already in the session: a check-in reads them before it takes the
# population's lock, and another server process may have reported into them meanwhile.
_OPEN_ROUNDS = (
    select(Round)
    .where(Round.population_id == bindparam("population_id"), Round.status == "open")
    .execution_options(populate_existing=True)
)
_TAKEN = select(Assignment.id, Assignment.round_id, Assignment.device_id, Assignment.status).where(
    Assignment.round_id.in_(bindparam("round_ids", expanding=True)),
    Assignment.device_id.in_(bindparam("device_ids", expanding=True)),
)
_INSERT_ASSIGNMENTS = insert(Assignment)
# Admission: a round's check-in counters move by one statement on the round's row, which also
# checks that the round is still open, so check-ins take no population lock (see `checkin`).
_ADMIT = (
    update(Round)
    .where(Round.id == bindparam("round_id"), Round.status == "open")
    .values(
        checked_in=Round.checked_in + bindparam("more_checked_in"),
        rejected_min_examples=Round.rejected_min_examples + bindparam("more_too_few"),
        rejected_capacity=Round.rejected_capacity + bindparam("more_full"),
        accepted=Round.accepted + bindparam("wanted"),
    )
    .returning(
        Round.capacity, Round.checked_in, Round.rejected_min_examples, Round.rejected_capacity, Round.accepted
    )
)
_GIVE_BACK = (  # the part of `wanted` beyond the round's capacity, refused as full
    update(Round)
    .where(Round.id == bindparam("round_id"))
    .values(
        accepted=Round.accepted - bindparam("over"),
        rejected_capacity=Round.rejected_capacity + bindparam("over"),
    )
    .returning(Round.rejected_capacity, Round.accepted)
)
_ROUND_COUNTERS = ("checked_in", "rejected_min_examples", "rejected_capacity", "accepted")
_ASSIGNMENT = select(
    Assignment.device_id, Assignment.status, Assignment.example_count, Assignment.round_id
).where(Assignment.id == bindparam("assignment_id"))
_FINISH_ASSIGNMENT = (
    update(Assignment)
    .where(Assignment.id == bindparam("assignment_id"))
    .values(status=bindparam("new_status"), finished_at=bindparam("now"))
)
_INSERT_REPORT = insert(Report)
_REPORT_WEIGHTS = (  # in the order the commit reads the reports
    select(Report.weight).where(Report.round_id == bindparam("round_id")).order_by(Report.assignment_id)
)


@dataclass(frozen=True)
class CheckIn:
    """An authenticated device asking for a task of `kind` with `example_count` examples."""

    device_id: str
    example_count: int
    kind: str


@dataclass(frozen=True)
class Accepted:
    """A check-in's assignment."""

    assignment_id: str
    round_id: int
    kind: str
    deadline: float
    model_version: int
    clip_norm: float | None = None  # the round's DP clip norm, when it is not the configured one


def _accepted(assignment_id: str, round_: Round) -> Accepted:
    clip_norm = round_.metrics.get(CLIP_NORM)
    return Accepted(assignment_id, round_.id, round_.kind, round_.deadline, round_.base_version, clip_norm)


# A population's settings and manifest never change after creation, so they are parsed once
# per process rather than on every check-in (pydantic validation would dominate its cost).
# Keyed by database too: one process (a test run, an admin tool) may open several.
_parsed: dict[tuple[object, int, str], Any] = {}


def _parsed_once(population: Population, what: str, parse: Callable[[], T]) -> T:
    session = object_session(population)
    if session is None:
        return parse()
    key = (session.get_bind(), population.id, what)
    if key not in _parsed:
        _parsed[key] = parse()
    return cast(T, _parsed[key])


def population_settings(population: Population) -> PopulationSettings:
    return _parsed_once(
        population, "settings", lambda: PopulationSettings.model_validate(population.settings)
    )


def population_manifest(population: Population) -> Manifest:
    return _parsed_once(population, "manifest", lambda: Manifest.from_json(population.manifest))


def population_pipeline(population: Population) -> Pipeline:
    """The population's aggregation pipeline, assembled once from its settings."""

    def assemble() -> Pipeline:
        shapes = {s.name: s.shape for s in population_manifest(population).global_params}
        return Pipeline(population_settings(population), shapes)

    return _parsed_once(population, "pipeline", assemble)


def _rounds_within_budget(population: Population) -> int | None:
    """How many training rounds the population's privacy budget allows; None without a budget."""

    def allowed() -> int | None:
        settings = population_settings(population)
        dp = settings.dp()
        if dp is None or dp.epsilon_budget is None:
            return None
        return settings.privacy_spent(0).rounds_within_budget

    return _parsed_once(population, "rounds_within_budget", allowed)


def privacy_budget_spent(population: Population) -> bool:
    """True when one more training round would take epsilon past the population's budget: no
    training round opens any more."""
    allowed = _rounds_within_budget(population)
    return allowed is not None and population.training_rounds_committed >= allowed


def lock_population(session: Session, name: str) -> Population | None:
    """The population row, locked: one writer per population at a time (FOR UPDATE on PostgreSQL;
    SQLite's BEGIN IMMEDIATE already serializes writers)."""
    return session.scalars(_POPULATION_BY_NAME_LOCKED, {"name": name}).first()


def find_population(session: Session, name: str) -> Population | None:
    """The population row, not locked: enough for a check-in (`checkin` locks it when a round must
    open or close)."""
    return session.scalars(_POPULATION_BY_NAME, {"name": name}).first()


def _relock(session: Session, population: Population) -> None:
    """Lock a population read without its lock, and re-read what may have changed meanwhile."""
    session.refresh(population, ["current_version", "training_rounds_committed"], with_for_update=_LOCK)


def populations_of_assignments(session: Session, assignment_ids: Sequence[str]) -> dict[str, Population]:
    """The (locked) population of each known assignment."""
    # Only the population ids before the lock: they never change, while an assignment and its
    # round must be read after the lock (another server process may have just changed them).
    population_ids: dict[str, int] = {}
    if assignment_ids:
        for assignment_id, population_id in session.connection().execute(
            _POPULATIONS_OF_ASSIGNMENTS, {"assignment_ids": list(assignment_ids)}
        ):
            population_ids[assignment_id] = population_id
    ids = sorted(set(population_ids.values()))
    locked = {p.id: p for p in session.scalars(_POPULATIONS_BY_ID, {"ids": ids})} if ids else {}
    return {assignment_id: locked[population_id] for assignment_id, population_id in population_ids.items()}


def population_of_assignment(session: Session, assignment_id: str) -> Population | None:
    """The (locked) population an assignment belongs to."""
    return populations_of_assignments(session, [assignment_id]).get(assignment_id)


def open_round(session: Session, population: Population, kind: str, now: float) -> Round:
    settings = population_settings(population)
    secure = kind == TRAINING and settings.secure_training
    if kind == TRAINING:
        target, capacity, min_reports = settings.target_reports, settings.capacity, settings.min_reports
        duration = settings.secure.duration_seconds if secure else settings.round_duration_seconds
    else:
        target = settings.evaluation_target_reports
        capacity = math.ceil(target * settings.oversampling)
        min_reports, duration = 1, settings.evaluation_round_duration_seconds
    dp = settings.dp()
    round_metrics = {}
    if kind == TRAINING and dp is not None and dp.adaptive:
        round_metrics[CLIP_NORM] = _next_clip_norm(session, population, dp.clip_norm)
    round_ = Round(
        population_id=population.id,
        kind=kind,
        status="open",
        base_version=population.current_version,
        result_version=None,
        target=target,
        capacity=capacity,
        min_reports=min_reports,
        opened_at=now,
        deadline=now + duration,
        closed_at=None,
        metrics=round_metrics,
    )
    session.add(round_)
    session.flush()
    metrics.count(session, metrics.ROUNDS, (population.name, kind, "opened"))
    log_on_commit(
        session,
        log,
        "round opened",
        population=population.name,
        round_id=round_.id,
        kind=kind,
        model_version=round_.base_version,
        target=target,
        capacity=capacity,
        deadline=round_.deadline,
    )
    if secure:
        secure_rounds.start(session, round_, population.name, settings, population_manifest(population))
    return round_


def _next_clip_norm(session: Session, population: Population, initial: float) -> float:
    """Adaptive clipping: the clip norm the last committed training round chose for its successor
    (an abandoned round passes its own on), or the configured one before any round."""
    last = session.scalars(
        select(Round)
        .where(Round.population_id == population.id, Round.kind == TRAINING, Round.status != "open")
        .order_by(Round.id.desc())
        .limit(1)
    ).first()
    if last is None:
        return initial
    key = NEXT_CLIP_NORM if last.status == "committed" else CLIP_NORM
    return float(last.metrics.get(key, initial))


def open_rounds(session: Session, population: Population) -> dict[str, Round]:
    rounds = session.scalars(_OPEN_ROUNDS, {"population_id": population.id}).all()
    return {r.kind: r for r in rounds}


def _up_to_date(population: Population, current: Mapping[str, Round], now: float) -> bool:
    """Whether `advance` has nothing to do: no round to close or open, no secure phase to move."""
    return (
        (TRAINING in current or privacy_budget_spent(population))
        and all(now < r.deadline for r in current.values())
        and not population_settings(population).secure_training
    )


def advance(session: Session, population: Population, now: float) -> dict[str, Round]:
    """Close rounds past their deadline (drop their outstanding assignments), open the next;
    returns the open rounds by kind. The population must be locked."""
    current = open_rounds(session, population)
    if _up_to_date(population, current, now):
        return current  # the common case: nothing to close, one query
    secure = population_settings(population).secure_training
    for round_ in current.values():
        if round_.kind == TRAINING and secure:
            advance_secure(session, population, round_, now)
            continue
        if now < round_.deadline:
            continue
        # The round's row lock: a check-in admitted into it (which takes no population lock) has
        # committed before its assignments are dropped, and none is admitted after.
        session.refresh(round_, list(_ROUND_COUNTERS), with_for_update=_LOCK)
        dropped: CursorResult[Any] = session.execute(  # type: ignore[assignment]
            update(Assignment)
            .where(Assignment.round_id == round_.id, Assignment.status == "assigned")
            .values(status="dropped", finished_at=now)
        )
        outstanding = dropped.rowcount
        round_.dropped += outstanding
        if outstanding:
            metrics.count(session, metrics.DROPPED, (population.name, round_.kind), outstanding)
        if round_.reported >= round_.min_reports:
            _commit(session, population, round_, now)
        else:
            round_.status, round_.closed_at = "abandoned", now
            _count_closed(session, population, round_, "abandoned")
            if round_.kind == TRAINING:
                open_round(session, population, TRAINING, now)
    current = open_rounds(session, population)
    if TRAINING not in current and not privacy_budget_spent(population):
        current[TRAINING] = open_round(session, population, TRAINING, now)
    return current


def advance_secure(session: Session, population: Population, round_: Round, now: float) -> None:
    """Close the secure round's phases that are over; commit or abandon it when it ends."""
    settings = population_settings(population)
    outcome = secure_rounds.advance(session, round_, settings, population_manifest(population), now)
    if isinstance(outcome, secure_rounds.Commit):
        round_.metrics = {
            **round_.metrics,  # the phases' durations
            "secure_survivors": float(outcome.survivors),
            "unmask_seconds": outcome.unmask_seconds,
        }
        _commit(session, population, round_, now, outcome.mean_delta, outcome.survivors)
    elif isinstance(outcome, secure_rounds.Abandon):
        round_.status, round_.closed_at = "abandoned", now
        _count_closed(session, population, round_, "abandoned")
        open_round(session, population, TRAINING, now)


class RoundClosed(Exception):
    """A round closed (another server process committed or closed it) between a check-in's read of
    the open rounds and its admission. The transaction must be rolled back and retried with
    `checkin(..., lock=True)`, which cannot meet a closed round."""


def checkin(
    session: Session,
    population: Population,
    requests: Sequence[CheckIn],
    now: float,
    lock: bool = False,
) -> list[Accepted | Refused]:
    """Answer authenticated check-ins, in order, in the caller's transaction.

    Check-ins that arrive together are answered together: one look-up of the devices' existing
    assignments, one insert and one counter update per round, however many there are.

    The population lock is taken only when a round must open or close (or with `lock`), so that
    check-ins do not queue behind each other and behind reports for it (on PostgreSQL, with
    several server processes). Otherwise a check-in's only lock is its round's row, from the
    admission's counter update to the commit: the update admits up to the round's capacity and
    only into a round still open (else `RoundClosed`); the unique (round, device) index refuses
    a device's second assignment made at the same time in another process (IntegrityError: the
    retried transaction finds the first one).
    """
    settings = population_settings(population)
    current = open_rounds(session, population)
    if lock or not _up_to_date(population, current, now):
        _relock(session, population)
        current = advance(session, population, now)
    devices = {r.device_id for r in requests}
    taken: dict[tuple[int, str], tuple[str, str]] = {
        (round_id, device_id): (assignment_id, status)
        for assignment_id, round_id, device_id, status in session.connection().execute(
            _TAKEN, {"round_ids": [r.id for r in current.values()], "device_ids": list(devices)}
        )
    }
    answers: list[Accepted | Refused | None] = []  # None: waits for its round's admission
    tally: Counter[tuple[str, ...]] = Counter()  # (population, kind, answer) for metrics
    candidates: dict[int, list[int]] = {}  # round id -> indexes of requests that may be admitted
    too_few: Counter[int] = Counter()  # round id -> check-ins refused for too few examples
    pending: dict[tuple[int, str], int] = {}  # (round id, device) -> index of its candidate request
    repeats: list[tuple[int, int]] = []  # (index, index of the same device's candidate request)
    steered: dict[int, float] = {}  # secure round id -> when a refused device should come back
    for request in requests:
        round_ = current.get(request.kind)
        if round_ is None and request.kind == TRAINING and privacy_budget_spent(population):
            spent = settings.privacy_spent(population.training_rounds_committed)
            # The budget never comes back: a day's retry window keeps devices from asking often.
            retry_after = max(settings.retry_after_seconds, 86400.0)
            answers.append(Refused(409, spent.message(), retry_after))
            continue
        if round_ is None:
            tally[population.name, request.kind, "no_round"] += 1
            answers.append(
                Refused(409, f"no {request.kind} round is open", retry_after=settings.retry_after_seconds)
            )
            continue
        retry_after = max(settings.retry_after_seconds, round_.deadline - now)
        existing = taken.get((round_.id, request.device_id))
        if existing is not None:
            assignment_id, status = existing
            if status == "assigned":  # a retried check-in gets the same assignment back
                tally[population.name, request.kind, "again"] += 1
                answers.append(_accepted(assignment_id, round_))
            else:  # one assignment per device per round: a device cannot weigh in twice
                tally[population.name, request.kind, "already_took_part"] += 1
                answers.append(
                    Refused(
                        409, f"this device already took part in round {round_.id} ({status})", retry_after
                    )
                )
            continue
        if (
            request.kind == TRAINING
            and settings.secure_training
            and not secure_rounds.accepting(session, round_)
        ):
            # Its deadline adds up every phase's bound, but a secure round whose roster is full
            # usually ends within seconds, and the next one opens then: come back about then.
            if round_.id not in steered:
                steered[round_.id] = secure_rounds.next_round_in(
                    session, round_, now, settings.retry_after_seconds
                )
            answers.append(Refused(409, "the secure round has closed its check-ins", steered[round_.id]))
            continue
        if request.example_count < settings.min_examples:
            too_few[round_.id] += 1
            tally[population.name, request.kind, "too_few_examples"] += 1
            message = (
                f"{request.example_count} examples; this population needs at least {settings.min_examples}"
            )
            answers.append(Refused(409, message, retry_after))
            continue
        first = pending.setdefault((round_.id, request.device_id), len(answers))
        if first == len(answers):
            candidates.setdefault(round_.id, []).append(first)
        else:  # the same device twice in one group: the second gets the first's answer
            repeats.append((len(answers), first))
        answers.append(None)
    by_id = {r.id: r for r in current.values()}
    new_assignments: list[dict[str, Any]] = []
    for round_id in sorted(candidates.keys() | too_few.keys()):  # in id order: no deadlock between groups
        round_, waiting = by_id[round_id], candidates.get(round_id, [])
        admitted = _admit(session, round_, len(waiting), too_few[round_id])
        for position, index in enumerate(waiting):
            request = requests[index]
            if position >= admitted:
                tally[population.name, request.kind, "full"] += 1
                retry_after = max(settings.retry_after_seconds, round_.deadline - now)
                answers[index] = Refused(409, "this round is full", retry_after)
                continue
            tally[population.name, request.kind, "accepted"] += 1
            assignment_id = secrets.token_hex(16)
            new_assignments.append(
                {
                    "id": assignment_id,
                    "round_id": round_id,
                    "device_id": request.device_id,
                    "status": "assigned",
                    "example_count": request.example_count,
                    "created_at": now,
                    "deadline": round_.deadline,
                    "finished_at": None,
                }
            )
            answers[index] = _accepted(assignment_id, round_)
    for index, first in repeats:  # counted once in the round's counters, as the first
        answers[index] = answers[first]
        answer = "again" if isinstance(answers[first], Accepted) else "full"
        tally[population.name, requests[index].kind, answer] += 1
    if new_assignments:
        # Plain rows on the connection, not ORM objects: they are not read back in this transaction.
        session.connection().execute(_INSERT_ASSIGNMENTS, new_assignments)
    metrics.count_all(session, metrics.CHECKINS, tally)
    return cast(list[Accepted | Refused], answers)  # every None was filled above


def _admit(session: Session, round_: Round, wanted: int, too_few: int) -> int:
    """Count a group's check-ins into an open round and admit up to `wanted` of them within its
    capacity; returns how many were admitted. Raises RoundClosed if the round is no longer open."""
    # `accepted` only grows while a round is open: a round already full stays full.
    wanted_now = 0 if round_.accepted >= round_.capacity else wanted
    admitted = (
        session.connection()
        .execute(
            _ADMIT,
            {
                "round_id": round_.id,
                "more_checked_in": wanted + too_few,
                "more_too_few": too_few,
                "more_full": wanted - wanted_now,
                "wanted": wanted_now,
            },
        )
        .first()
    )
    if admitted is None:
        raise RoundClosed(f"round {round_.id} closed during a check-in")
    capacity, *counters = admitted
    accepted_before = int(counters[-1]) - wanted_now
    granted = max(0, min(wanted_now, int(capacity) - accepted_before))
    if granted < wanted_now:  # the group overfilled the round: the rest is refused as full
        given_back = (
            session.connection()
            .execute(_GIVE_BACK, {"round_id": round_.id, "over": wanted_now - granted})
            .one()
        )
        counters[2:] = given_back
    # The session's copy of the round shows the counters as they now are in this transaction.
    for name, value in zip(_ROUND_COUNTERS, counters, strict=True):
        set_committed_value(round_, name, value)
    return granted


@dataclass(frozen=True)
class _Found:
    """An assignment as read after the population lock: the parts a report or abort needs."""

    id: str
    status: str
    example_count: int
    round: Round


def _find_assignment(
    session: Session,
    population: Population,
    assignment_id: str,
    device_id: str,
    now: float,
    advance_rounds: bool = True,
) -> _Found | Refused:
    """The caller's assignment in this (locked) population, after closing rounds past their deadline
    (unless `advance_rounds` is False: the caller advances what it needs itself)."""
    # Once per transaction and population: with `now` fixed, a second advance finds nothing to
    # close, and a transaction may carry many reports (group commit).
    advanced: set[tuple[int, float]] = session.info.setdefault("advanced", set())
    if advance_rounds and (population.id, now) not in advanced:
        advance(session, population, now)
        advanced.add((population.id, now))
    found = session.connection().execute(_ASSIGNMENT, {"assignment_id": assignment_id}).first()
    if found is None:
        return Refused(404, f"no assignment {assignment_id!r}", reason="unknown_assignment")
    owner, status, example_count, round_id = found
    if owner != device_id:
        return Refused(403, "this assignment belongs to another device", reason="not_yours")
    # An open round is already in the session (advance loaded it); only a closed one is read again.
    round_ = session.get(Round, round_id)
    assert round_ is not None
    if round_.population_id != population.id:
        return Refused(
            404,
            f"assignment {assignment_id!r} is not in population {population.name!r}",
            reason="unknown_assignment",
        )
    return _Found(assignment_id, status, example_count, round_)


def secure_round_of(
    session: Session,
    population: Population,
    assignment_id: str,
    device_id: str,
    now: float,
    advance_rounds: bool = True,
) -> tuple[str, Round] | Refused:
    """The status of the caller's assignment and its round, when that round is a secure one.
    A caller that only reads (the state of the round) passes `advance_rounds=False` and advances
    the secure round only when a phase deadline has passed: every other phase change comes with
    a device's message, which advances it, or with the ticker."""
    assignment = _find_assignment(session, population, assignment_id, device_id, now, advance_rounds)
    if isinstance(assignment, Refused):
        return assignment
    if assignment.round.kind != TRAINING or not population_settings(population).secure_training:
        return Refused(409, f"round {assignment.round.id} does not use secure aggregation; report instead")
    return assignment.status, assignment.round


def assignment_status(session: Session, assignment_id: str) -> str:
    """An assignment's status as it is now in this transaction."""
    found = session.connection().execute(_ASSIGNMENT, {"assignment_id": assignment_id}).first()
    assert found is not None
    return str(found[1])


def _finish(session: Session, assignment: _Found, status: str, now: float) -> None:
    session.connection().execute(
        _FINISH_ASSIGNMENT, {"assignment_id": assignment.id, "new_status": status, "now": now}
    )


def _closed(assignment: _Found, report: bool = True) -> Refused | None:
    """Why an assignment can no longer take a report or an abort, or None; a late report is
    counted in the round's `late` (a late abort is not a report, and is not counted)."""
    round_ = assignment.round
    if assignment.status == "reported":
        return Refused(409, "this assignment has already reported", reason="repeated")
    if assignment.status == "aborted":
        return Refused(409, "this assignment was aborted", reason="repeated")
    if assignment.status == "invalid":
        return Refused(409, "this assignment's report was refused as invalid", reason="repeated")
    if assignment.status == "dropped" or round_.status != "open":
        round_.late += int(report)
        return Refused(
            409, f"the round's deadline has passed; the report is late (round {round_.status})", reason="late"
        )
    return None


def report(
    session: Session,
    population: Population,
    assignment_id: str,
    device_id: str,
    body: bytes,
    content_type: str,
    now: float,
) -> Round | Refused:
    """Validate and store a report; commit the round when it reaches its target."""
    assignment = _find_assignment(session, population, assignment_id, device_id, now)
    if isinstance(assignment, Refused):
        _count_report(session, population, "unknown", assignment_id, assignment)
        return assignment
    closed = _closed(assignment)
    if closed is not None:
        _count_report(session, population, assignment.round, assignment_id, closed)
        return closed
    round_ = assignment.round
    settings = population_settings(population)
    if round_.kind == TRAINING and settings.secure_training:
        return Refused(
            409, f"round {round_.id} uses secure aggregation: take part through /v1/assignments/{{id}}/secure"
        )
    parsed = (
        _parse_training_report(population, settings, round_, assignment.example_count, body)
        if round_.kind == TRAINING
        else _parse_evaluation_report(population, assignment.example_count, body, content_type)
    )
    if isinstance(parsed, Refused):
        round_.invalid += 1
        _finish(session, assignment, "invalid", now)
        _count_report(session, population, round_, assignment_id, parsed)
        return parsed
    weight, delta, metrics = parsed
    session.connection().execute(
        _INSERT_REPORT,
        {
            "assignment_id": assignment.id,
            "round_id": round_.id,
            "weight": weight,
            "delta": delta,
            "metrics": metrics,
        },
    )
    _finish(session, assignment, "reported", now)
    round_.reported += 1
    round_.total_weight += weight
    sums = dict(round_.metrics)
    for k, v in metrics.items():
        sums[k] = sums.get(k, 0.0) + v
    round_.metrics = sums
    _count_report(session, population, round_, assignment_id, None)
    if round_.reported >= round_.target:
        _commit(session, population, round_, now)
    return round_


# Report outcomes for metrics, by the class of refusal; any other refusal is an invalid report.
_OUTCOMES = {"late": "late", "repeated": "repeated", "unknown_assignment": "refused", "not_yours": "refused"}


def _count_report(
    session: Session, population: Population, round_: Round | str, assignment_id: str, refused: Refused | None
) -> None:
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


def abort(
    session: Session, population: Population, assignment_id: str, device_id: str, now: float
) -> Round | Refused:
    assignment = _find_assignment(session, population, assignment_id, device_id, now)
    if isinstance(assignment, Refused):
        return assignment
    closed = _closed(assignment, report=False)
    if closed is not None:
        return closed
    _finish(session, assignment, "aborted", now)
    assignment.round.aborted += 1
    metrics.count(session, metrics.ABORTS, (population.name, assignment.round.kind))
    return assignment.round


# ---- report validation -----------------------------------------------------------------


def evaluation_metrics(manifest: Manifest) -> tuple[str, ...]:
    """The sums an evaluation report holds: the model's loss, weight and declared metrics."""
    return ("loss_sum", "weight_sum", *(f"{m.name}_sum" for m in manifest.metrics))


def _max_weight(population: Population, manifest: Manifest, example_count: int) -> int:
    """The largest |query| a device that claimed `example_count` examples can honestly report."""
    task = _parsed_once(population, "task", lambda: population_settings(population).task())
    # A ranking task with sampled negatives trains on them too.
    per_example = 1 + (task.negatives_per_positive if manifest.task.negative_sampling else 0)
    return min(example_count, task.max_examples) * per_example


def _check_metrics(raw: Any) -> dict[str, float] | Refused:
    if not isinstance(raw, Mapping) or len(raw) > MAX_METRICS:
        return Refused(422, f"metrics must be an object of at most {MAX_METRICS} numbers", reason="metrics")
    metrics: dict[str, float] = {}
    for k, v in raw.items():
        if (
            not isinstance(k, str)
            or not 0 < len(k) <= 64
            or not k.replace("_", "").isascii()
            or not (k.replace("_", "").isalnum())
        ):
            return Refused(
                422,
                f"metric name {k!r:.80} must be 1-64 ASCII letters, digits or underscores",
                reason="metrics",
            )
        # abs(v) <= bound is False for NaN and infinities, and compares a huge int without
        # converting it (float() of a 400-digit int would overflow).
        if isinstance(v, bool) or not isinstance(v, int | float) or not abs(v) <= MAX_METRIC_MAGNITUDE:
            return Refused(
                422,
                f"metric {k!r} must be a finite number of magnitude <= {MAX_METRIC_MAGNITUDE:g}, "
                f"got {v!r:.40}",
                reason="metrics",
            )
        metrics[k] = float(v)
    return metrics


REPORT_METADATA = ("metrics", "num_examples")


def _header_size(body: bytes) -> int | Refused:
    """The size of a safetensors payload's JSON header, refused when it exceeds the bound."""
    size = int.from_bytes(body[:8], "little") if len(body) >= 8 else 0
    if size > MAX_REPORT_HEADER_BYTES:
        return Refused(
            422,
            f"not a valid safetensors payload: its header claims {size} bytes; the limit is "
            f"{MAX_REPORT_HEADER_BYTES} (tensor entries and the metadata num_examples and metrics)",
            reason="tensors",
        )
    return size


def _check_dp_metrics(metrics: dict[str, float], adaptive: bool) -> Refused | None:
    """Devices may send WITHIN_CLIP (0 or 1; required under adaptive clipping) and no other "dp_"
    metric: those are the server's, and a device's would be summed into them."""
    reserved = sorted(k for k in metrics if k.startswith("dp_") and k != WITHIN_CLIP)
    if reserved:
        return Refused(422, f"metrics {reserved} are reserved for the server (names starting with 'dp_')")
    within = metrics.get(WITHIN_CLIP)
    if within not in (None, 0.0, 1.0) or (adaptive and within is None):
        return Refused(
            422,
            f"metric {WITHIN_CLIP!r} must be 1 (the delta was within the clip norm) or 0 (it was "
            f"clipped){'; adaptive clipping needs it' if adaptive else ''}, got {within!r}",
        )
    return None


def _parse_training_report(
    population: Population, settings: PopulationSettings, round_: Round, example_count: int, body: bytes
) -> tuple[float, bytes, dict[str, float]] | Refused:
    manifest = population_manifest(population)
    header = _header_size(body)
    if isinstance(header, Refused):
        return header
    try:
        metadata = read_metadata(body)
        delta = check_sparse_delta(decode_sparse_delta(body), manifest.global_params, "report")
    except (ParamsError, RecursionError) as e:
        problem = str(e) if isinstance(e, ParamsError) else "the safetensors header nests too deeply"
        return Refused(
            422,
            f"{problem}; a report is the sparse delta of the manifest's global tensors: safetensors with "
            "'<name>/rows' (int32, increasing), '<name>/values' (float32) and '<name>/shape' (int64) each",
            reason="tensors",
        )
    if "num_examples" not in metadata or not set(metadata) <= set(REPORT_METADATA):
        return Refused(
            422,
            f"report metadata must be 'num_examples' (an integer) and optionally 'metrics' (a JSON object); "
            f"got keys {sorted(metadata)[:8]}",
            reason="metadata",
        )
    try:
        weight = int(metadata["num_examples"])
        raw_metrics = json_document(metadata.get("metrics", "{}"), "the report's metrics")
    except ValueError as e:
        return Refused(
            422,
            f"report metadata must hold 'num_examples' (an integer) and 'metrics' (a JSON object): {e}",
            reason="metadata",
        )
    # `min_examples` counts a device's examples (checked at check-in and on the device); the
    # weight is |query|, which an honest device's split makes smaller, so only >= 1 is required here.
    limit = _max_weight(population, manifest, example_count)
    if not 1 <= weight <= limit:
        return Refused(
            422,
            f"num_examples {weight} is outside [1, {limit}] "
            f"(the device checked in with {example_count} examples)",
            reason="num_examples",
        )
    # float64 sums: a float32 dot product over many values can be off by more than the
    # margin a device clips below the DP bound with.
    norm = math.sqrt(sum(float(np.vdot(v, v)) for v in (t.values.astype(np.float64) for t in delta.values())))
    if norm > settings.update_norm_bound:
        return Refused(
            422,
            f"update norm {norm:.4g} exceeds the bound {settings.update_norm_bound:.4g}",
            reason="update_norm",
        )
    dp = settings.dp()
    clip_norm = None if dp is None else float(round_.metrics.get(CLIP_NORM, dp.clip_norm))
    if clip_norm is not None and norm > clip_norm:
        return Refused(
            422,
            f"update norm {norm:.6g} exceeds this round's DP clip norm {clip_norm:g}: a device "
            "clips its whole delta (all global tensors together) to L2 <= task_config.clip_norm",
            reason="update_norm",
        )
    metrics = _check_metrics(raw_metrics)
    if isinstance(metrics, Refused):
        return metrics
    refused = _check_dp_metrics(metrics, dp is not None and dp.adaptive)
    if refused is not None:
        return refused
    # Only the tensors are stored (the metadata is in the columns): anything else a device put
    # in its header is not kept.
    return float(weight), encode_sparse_delta(delta), metrics


def _parse_evaluation_report(
    population: Population, example_count: int, body: bytes, content_type: str
) -> tuple[float, None, dict[str, float]] | Refused:
    if not content_type.startswith("application/json"):
        return Refused(
            422, "an evaluation report is JSON: {num_examples, metrics}; no tensors", reason="format"
        )
    try:
        data = json_document(body, "evaluation report")
    except ValueError as e:
        return Refused(422, f"{e}; an evaluation report is JSON: {{num_examples, metrics}}", reason="format")
    if not isinstance(data, dict) or set(data) != {"num_examples", "metrics"}:
        return Refused(422, "evaluation report must be exactly {num_examples, metrics}", reason="format")
    metrics = _check_metrics(data["metrics"])
    if isinstance(metrics, Refused):
        return metrics
    manifest = population_manifest(population)
    expected = evaluation_metrics(manifest)
    if set(metrics) != set(expected):
        return Refused(422, f"evaluation metrics must be exactly {list(expected)}", reason="metrics")
    weight = data["num_examples"]
    # The same bound as training reports: sampled negatives count too.
    limit = _max_weight(population, manifest, example_count)
    if isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= limit:
        return Refused(
            422, f"num_examples must be an integer in [1, {limit}], got {weight!r}", reason="num_examples"
        )
    if any(v < 0 for v in metrics.values()) or metrics["weight_sum"] != weight:
        return Refused(
            422, "metric sums must be >= 0 and weight_sum must equal num_examples", reason="metrics"
        )
    for metric in manifest.metrics:
        # A metric whose per-example value is bounded bounds its weighted sum.
        if metric.value_range is not None:
            low, high = metric.value_range
            total = metrics[f"{metric.name}_sum"]
            if not low * weight <= total <= high * weight:
                return Refused(
                    422,
                    f"{metric.name}_sum must be within [{low:g}, {high:g}] x weight_sum, got {total}",
                    reason="metrics",
                )
    return float(weight), None, metrics


# ---- commit ----------------------------------------------------------------------------


def _commit(
    session: Session,
    population: Population,
    round_: Round,
    now: float,
    mean_delta: Params | None = None,
    survivors: int = 0,
) -> None:
    """Aggregate the round's reports into a new model version (training) or just close it.
    A secure round passes its unmasked `mean_delta` over its `survivors`, since it has no
    individual reports. How the reports combine is the population's pipeline's (`pipeline`)."""
    round_.status, round_.closed_at = "committed", now
    if round_.kind == EVALUATION:
        _count_closed(session, population, round_, "committed")
        return
    started = time.perf_counter()
    manifest = population_manifest(population)
    params, state = _base_version(session, population, manifest, round_.base_version)
    settings = population_settings(population)
    pipeline = population_pipeline(population)
    job = mixing.central_job(
        session, population, manifest, round_.base_version, params, settings.task(), "parallel_training"
    )
    inputs = RoundInputs(
        rounds_committed=population.training_rounds_committed,
        metrics=round_.metrics,
        central=None if job is None else _central_part(job),
    )
    stage: Stage
    if mean_delta is None:
        if not pipeline.private:  # robust clipping's inputs (under DP every report weighs the same)
            weights = list(session.scalars(_REPORT_WEIGHTS, {"round_id": round_.id}))
            inputs = replace(inputs, weights=weights, reference=_norm_reference(session, population))
        stage = pipeline.plaintext_round(inputs)
        # One report's delta in memory at a time where the stages allow it: O(model), not
        # O(reports x model).
        reports = (
            select(Report.weight, Report.delta)
            .where(Report.round_id == round_.id)
            .order_by(Report.assignment_id)
            .execution_options(yield_per=16)
        )
        for weight, blob in session.execute(reports):
            stage.accept(decode_sparse_delta(blob), weight)
    else:
        stage = pipeline.secure_round(mean_delta, survivors, inputs)
    aggregate = stage.finish()
    round_.metrics = apply_measurements(round_.metrics, aggregate)
    if aggregate.norm_reference is not None:
        round_.norm_reference = dict(aggregate.norm_reference)
    new_params, new_state = apply_update(settings.optimizer(), params, aggregate.mean_delta, state)
    check_params(new_params, manifest.global_params, "aggregated model")
    metrics.observe(session, metrics.AGGREGATION_SECONDS, (population.name,), time.perf_counter() - started)
    version = population.current_version + 1
    session.add(
        ModelVersion(
            population_id=population.id,
            version=version,
            params=encode_params(new_params),
            optimizer_state=encode_params(new_state),
            round_id=round_.id,
            created_at=now,
        )
    )
    population.current_version = version
    population.training_rounds_committed += 1
    latest = (session.get_bind(), population.id)
    on_commit(session, functools.partial(_keep_latest, latest, version, new_params, new_state))
    if job is not None:  # the next round's central delta, computed while its devices train
        following = mixing.central_job(
            session, population, manifest, version, new_params, settings.task(), "parallel_training"
        )
        if following is not None:
            on_commit(session, functools.partial(central_training.precompute, following))
    # Gradient transfer: the new version's central gradient, ready before its devices ask for it.
    gradient = mixing.central_job(
        session, population, manifest, version, new_params, settings.task(), "gradient_transfer"
    )
    if gradient is not None:
        on_commit(session, functools.partial(central_training.precompute_gradient, gradient))
    round_.result_version = version
    _count_closed(session, population, round_, "committed")
    if not privacy_budget_spent(population):
        open_round(session, population, TRAINING, now)
    if settings.keep_model_versions:
        prune_model_versions(session, population, settings.keep_model_versions)
    every = settings.evaluation_every
    if (
        every
        and population.training_rounds_committed % every == 0
        and EVALUATION not in open_rounds(session, population)
    ):
        open_round(session, population, EVALUATION, now)


# The model version this process committed last, per population: the next round's commit starts
# from it. Reading it back and decoding it (parameters and optimizer state, 1.5 MB each for
# 3,706 x 50) took 8-10 ms of a 50-70 ms commit under load, while check-ins into the round
# waited for its row. Versions never change once written, and a copy is kept only once its
# transaction committed, so it is never wrong, only sometimes not the version asked for.
_latest: dict[tuple[object, int], tuple[int, Params, Params]] = {}


def _keep_latest(key: tuple[object, int], version: int, params: Params, state: Params) -> None:
    for array in (*params.values(), *state.values()):
        array.flags.writeable = False  # shared by the commits that start from it
    _latest[key] = (version, params, state)


def _base_version(
    session: Session, population: Population, manifest: Manifest, version: int
) -> tuple[Params, Params]:
    """Model `version`'s (parameters, optimizer state): this process's copy if it committed that
    version, else read from the database (another process committed it, or this one restarted)."""
    kept = _latest.get((session.get_bind(), population.id))
    if kept is not None and kept[0] == version:
        return kept[1], kept[2]
    base = session.get(ModelVersion, (population.id, version))
    assert base is not None
    params = decode_params(base.params, manifest.global_params, "model version")
    return params, dict(load(base.optimizer_state))


def _central_part(job: central_training.CentralJob) -> CentralPart:
    """Parallel training's central delta at the round's base version (None if it diverged)."""
    try:
        return CentralPart(central_training.central_update(job), job.mixing.weight)
    except central_training.CentralTrainingError:
        return CentralPart(None, job.mixing.weight)


def _norm_reference(session: Session, population: Population) -> dict[str, float] | None:
    """The reference update norms the population's last committed training round left, if any."""
    return session.scalars(
        select(Round.norm_reference)
        .where(
            Round.population_id == population.id,
            Round.kind == TRAINING,
            Round.status == "committed",
            Round.norm_reference.is_not(None),
        )
        .order_by(Round.id.desc())
        .limit(1)
    ).first()


def _count_closed(session: Session, population: Population, round_: Round, transition: str) -> None:
    metrics.count(session, metrics.ROUNDS, (population.name, round_.kind, transition))
    log_on_commit(
        session,
        log,
        f"round {transition}",
        population=population.name,
        round_id=round_.id,
        kind=round_.kind,
        model_version=round_.result_version,
        reported=round_.reported,
        accepted=round_.accepted,
        dropped=round_.dropped,
        aborted=round_.aborted,
        late=round_.late,
        invalid=round_.invalid,
    )


def prune_model_versions(session: Session, population: Population, keep: int) -> int:
    """Delete the versions older than the newest `keep`, except version 0 (the export) and any
    version an open round works from; returns how many went. Each version holds the dense
    parameters and optimizer state (about 1.5 MB for 3,706 x 50), so keeping every round's
    would grow the database without bound; SQLite reuses the freed pages."""
    in_use = select(Round.base_version).where(Round.population_id == population.id, Round.status == "open")
    result = session.execute(
        delete(ModelVersion).where(
            ModelVersion.population_id == population.id,
            ModelVersion.version > 0,
            ModelVersion.version <= population.current_version - keep,
            ModelVersion.version.not_in(in_use),
        )
    )
    return int(cast(CursorResult[Any], result).rowcount)


def summarize_metrics(round_: Round) -> dict[str, float]:
    """Per-round metrics: the sums devices sent, and the example-weighted means they stand for
    (`<name>` for each `<name>_sum`; also `rmse` from `squared_error` and `accuracy` from `correct`)."""
    sums = dict(round_.metrics)
    out = dict(sums)
    for prefix in ("", "query_"):
        weight = sums.get(f"{prefix}weight_sum", 0.0)
        if weight > 0:
            for key, total in sums.items():
                if not key.endswith("_sum") or key.startswith("query_") != (prefix == "query_"):
                    continue
                name = key.removeprefix(prefix).removesuffix("_sum")
                if name != "weight":
                    out[f"{prefix}{name}"] = total / weight
            if f"{prefix}squared_error_sum" in sums:
                out[f"{prefix}rmse"] = math.sqrt(max(sums[f"{prefix}squared_error_sum"], 0.0) / weight)
            if f"{prefix}correct_sum" in sums:
                out[f"{prefix}accuracy"] = sums[f"{prefix}correct_sum"] / weight
    if round_.reported:
        for k in ("reconstruction_loss", "update_loss"):
            if k in sums:
                out[k] = sums[k] / round_.reported
    return out


def reports_in_round(session: Session, round_id: int) -> int:
    return int(
        session.scalar(select(func.count()).select_from(Report).where(Report.round_id == round_id)) or 0
    )
