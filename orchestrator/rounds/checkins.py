"""A round's check-ins (and finding a secure round's assignment); its reports and aborts are
`round_reports`'.

Every function here runs inside the caller's transaction and takes `now` explicitly, so a
restarted server continues from the last committed state and tests control time. Protocol
refusals are returned as `Refused` values, not raised, so that the counters they bump are
committed with the answer. Opening, closing and committing rounds is `round_lifecycle`'s.
"""

from __future__ import annotations

import random
import secrets
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import bindparam, insert, select, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from orchestrator.aggregation.private import CLIP_NORM
from orchestrator.db import Assignment, Population, Round, RoundAdmission
from orchestrator.observability import metrics
from orchestrator.populations.config import population_settings, privacy_budget_spent, training_rounds_done
from orchestrator.populations.locks import (
    ADMISSION_COUNTERS,
    relock,
)
from orchestrator.rounds import buffered_caps, buffering, cohorts, idle_backoff, pace_steering, pausing
from orchestrator.rounds import state as round_state
from orchestrator.rounds.lifecycle import (
    COHORT,
    EVALUATION,
    TRAINING,
    advance,
    open_rounds,
    up_to_date,
)
from orchestrator.rounds.refusals import Refused
from orchestrator.rounds.reports import Found, find_assignment
from orchestrator.rounds.secure import messages

# The refusal of a check-in into a secure round whose roster has closed (its `reason`).
ROSTER_CLOSED = "roster_closed"
# The statements of check-ins and reports are built once: building and hashing a statement
# costs several times more than SQLite takes to run it.
_TAKEN = select(Assignment.id, Assignment.round_id, Assignment.device_id, Assignment.status).where(
    Assignment.round_id.in_(bindparam("round_ids", expanding=True)),
    Assignment.device_id.in_(bindparam("device_ids", expanding=True)),
)
# When a device turned away comes back (pace steering): spread, not secret.
_draw = random.Random()
_INSERT_ASSIGNMENTS = insert(Assignment)
# Admission: a round's check-in counters move by one statement on its admission row (not the
# round's, which reports' counts lock), so check-ins take no population lock and wait for no
# report (see `checkin`).
_ADMIT = (
    update(RoundAdmission)
    .where(RoundAdmission.round_id == bindparam("admitted_round"))
    .values(
        checked_in=RoundAdmission.checked_in + bindparam("more_checked_in"),
        rejected_min_examples=RoundAdmission.rejected_min_examples + bindparam("more_too_few"),
        rejected_capacity=RoundAdmission.rejected_capacity + bindparam("more_full"),
        accepted=RoundAdmission.accepted + bindparam("wanted"),
    )
    .returning(
        RoundAdmission.checked_in,
        RoundAdmission.rejected_min_examples,
        RoundAdmission.rejected_capacity,
        RoundAdmission.accepted,
    )
)
_GIVE_BACK = (  # the part of `wanted` beyond the round's capacity, refused as full
    update(RoundAdmission)
    .where(RoundAdmission.round_id == bindparam("admitted_round"))
    .values(
        accepted=RoundAdmission.accepted - bindparam("over"),
        rejected_capacity=RoundAdmission.rejected_capacity + bindparam("over"),
    )
    .returning(RoundAdmission.rejected_capacity, RoundAdmission.accepted)
)
# Read after the admission's statement, so in a statement of its own (a fresh snapshot on
# PostgreSQL): a round closed by a transaction that held the admission row meanwhile shows closed.
_STATUS = select(Round.status).where(Round.id == bindparam("round_id"))
_ASSIGNMENT = select(
    Assignment.device_id, Assignment.status, Assignment.example_count, Assignment.round_id
).where(Assignment.id == bindparam("assignment_id"))


@dataclass(frozen=True)
class CheckIn:
    """An authenticated device asking for a task of `kind` with `example_count` examples."""

    device_id: str
    example_count: int
    kind: str
    # Checked in again from the waiting room: its refusals were counted when it first came.
    held: bool = False


@dataclass(frozen=True)
class Accepted:
    """A check-in's assignment."""

    assignment_id: str
    round_id: int
    kind: str
    deadline: float
    model_version: int
    clip_norm: float | None = None  # the round's DP clip norm, when it is not the configured one


def _accepted(assignment_id: str, round_: Round, deadline: float | None = None) -> Accepted:
    """`deadline`: the assignment's own, when it is not its round's (a buffered population's)."""
    clip_norm = round_.metrics.get(CLIP_NORM)
    deadline = round_.deadline if deadline is None else deadline
    kind = TRAINING if round_.kind == COHORT else round_.kind  # a device trains in a cohort
    return Accepted(assignment_id, round_.id, kind, deadline, round_.base_version, clip_norm)


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
    # A device checking in for training ends the population's idle back-off (idle_backoff),
    # whether it was backing off already or its last round closes idle just now.
    wants_training = any(r.kind == TRAINING for r in requests)
    waking = wants_training and population.next_round_at is not None
    if lock or waking or not up_to_date(population, current, now):
        relock(session, population)
        current = advance(session, population, now)
        if wants_training and TRAINING not in current and population.next_round_at is not None:
            idle_backoff.wake(session, population)
            current = advance(session, population, now)
    # A buffered secure population's training check-ins join its cohorts (`cohorts`).
    places = (
        cohorts.places(session, population, settings, now)
        if wants_training and TRAINING in current and settings.secure_training and settings.buffered_training
        else None
    )
    in_rounds = [r.id for r in current.values()] + ([c.id for c in places.open] if places else [])
    devices = {r.device_id for r in requests}
    taken: dict[tuple[int, str], tuple[str, str]] = {
        (round_id, device_id): (assignment_id, status)
        for assignment_id, round_id, device_id, status in session.connection().execute(
            _TAKEN, {"round_ids": in_rounds, "device_ids": list(devices)}
        )
    }
    answers: list[Accepted | Refused | None] = []  # None: waits for its round's admission
    tally: Counter[tuple[str, ...]] = Counter()  # (population, kind, answer) for metrics
    candidates: dict[int, list[int]] = {}  # round id -> indexes of requests that may be admitted
    too_few: Counter[int] = Counter()  # round id -> check-ins refused for too few examples
    pending: dict[tuple[int, str], int] = {}  # (round id, device) -> index of its candidate request
    repeats: list[tuple[int, int]] = []  # (index, index of the same device's candidate request)
    steered: dict[int, messages.ComeBack] = {}  # secure round id -> when its refused come back
    for request in requests:
        round_ = current.get(request.kind)
        if round_ is None and request.kind == TRAINING and privacy_budget_spent(population):
            spent = settings.privacy_spent(population.training_rounds_committed)
            # The budget never comes back: a day's retry window keeps devices from asking often.
            # (On the wire a 200 rejection with Retry-After, like every "no task now" answer.)
            retry_after = max(settings.retry_after_seconds, 86400.0)
            answers.append(Refused(409, spent.message(), retry_after))
            continue
        if round_ is None and request.kind == TRAINING and training_rounds_done(population):
            # Done until an admin raises the limit: devices ask again a day later, as above.
            done = f"the population has committed its {settings.max_training_rounds} training rounds"
            answers.append(Refused(409, done, max(settings.retry_after_seconds, 86400.0)))
            continue
        if round_ is None:
            tally[population.name, request.kind, "no_round"] += 1
            why = ""
            if pausing.paused(population):
                state = "archived" if population.archived_at is not None else "paused"
                why = f" (the population is {state})"
            answers.append(
                Refused(
                    409, f"no {request.kind} round is open{why}", retry_after=settings.retry_after_seconds
                )
            )
            continue
        capped = None
        if request.kind == TRAINING:
            capped = buffered_caps.over_cap(session, population, settings, request.device_id)
        if capped is not None:
            tally[population.name, request.kind, "over_cap"] += 1
            answers.append(capped)
            continue
        if request.kind == TRAINING and places is not None:
            held = _held(places, taken, request.device_id)
            if held is not None:  # a retried check-in: its assignment in its cohort, again
                tally[population.name, request.kind, "again"] += 1
                answers.append(held)
                continue
            if isinstance(places.accepting, Refused):
                tally[population.name, request.kind, "full"] += 1
                answers.append(places.accepting)
                continue
            round_ = places.accepting
        buffered = request.kind == TRAINING and settings.buffered_training
        # A buffer commits at K reports, long before its deadline: come back soon, not at its end.
        retry_after = (
            settings.retry_after_seconds
            if buffered
            else max(settings.retry_after_seconds, round_.deadline - now)
        )
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
        if request.kind == TRAINING and settings.secure_training and not messages.accepting(session, round_):
            # Its deadline adds up every phase's bound, but a secure round whose roster is full
            # usually ends within seconds, and the next one opens then: come back during the next
            # round (each device at its own time in it: pace steering).
            if round_.id not in steered:
                steered[round_.id] = messages.next_round_in(
                    session, round_, now, settings.retry_after_seconds
                )
            comes_back = steered[round_.id].at(_draw.random())
            if not request.held:
                tally[population.name, request.kind, ROSTER_CLOSED] += 1
            answers.append(
                Refused(
                    409,
                    "the secure round has closed its check-ins",
                    comes_back,
                    reason=ROSTER_CLOSED,
                    waiting_places=round_.capacity,
                )
            )
            continue
        if request.example_count < settings.min_examples:
            too_few[round_.id] += 1
            tally[population.name, request.kind, "too_few_examples"] += 1
            message = (
                f"{request.example_count} examples; this population needs at least {settings.min_examples}"
            )
            come_back = pace_steering.come_back_after_round(
                round_.checkin_window, settings.retry_after_seconds, round_.deadline - now, _draw.random()
            )
            answers.append(Refused(409, message, come_back))
            continue
        first = pending.setdefault((round_.id, request.device_id), len(answers))
        if first == len(answers):
            candidates.setdefault(round_.id, []).append(first)
        else:  # the same device twice in one group: the second gets the first's answer
            repeats.append((len(answers), first))
        answers.append(None)
    by_id = {r.id: r for r in [*current.values(), *(places.open if places else [])]}
    new_assignments: list[dict[str, Any]] = []
    for round_id in sorted(candidates.keys() | too_few.keys()):  # in id order: no deadlock between groups
        round_, waiting = by_id[round_id], candidates.get(round_id, [])
        buffered = round_.kind == TRAINING and settings.buffered_training
        # A buffered population admits up to its concurrency, whichever round its devices train in
        # (its lock is held: `up_to_date` is never so for it).
        room = buffering.room(session, population, settings, now) if buffered else None
        admitted = _admit(session, round_, len(waiting), too_few[round_id], room)
        deadline = now + settings.round_duration_seconds if buffered else round_.deadline
        for position, index in enumerate(waiting):
            request = requests[index]
            if position >= admitted and buffered:
                tally[population.name, request.kind, "full"] += 1
                concurrency = settings.buffered.concurrency
                message = f"{concurrency} devices are training, as many as this population trains at once"
                answers[index] = Refused(409, message, settings.retry_after_seconds * (0.5 + _draw.random()))
                continue
            if position >= admitted:
                tally[population.name, request.kind, "full"] += 1
                retry_after = pace_steering.come_back_in(
                    round_.checkin_window, settings.retry_after_seconds, round_.deadline - now, _draw.random()
                )
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
                    "deadline": deadline,
                    "finished_at": None,
                }
            )
            answers[index] = _accepted(assignment_id, round_, deadline)
    for index, first in repeats:  # counted once in the round's counters, as the first
        answers[index] = answers[first]
        answer = "again" if isinstance(answers[first], Accepted) else "full"
        tally[population.name, requests[index].kind, answer] += 1
    if new_assignments:
        # Plain rows on the connection, not ORM objects: they are not read back in this transaction.
        session.connection().execute(_INSERT_ASSIGNMENTS, new_assignments)
    metrics.count_all(session, metrics.CHECKINS, tally)
    return cast(list[Accepted | Refused], answers)  # every None was filled above


def _held(
    places: cohorts.Places, taken: dict[tuple[int, str], tuple[str, str]], device_id: str
) -> Accepted | None:
    """The device's assignment still open in one of the open cohorts, if it has one."""
    for cohort in places.open:
        assignment_id, status = taken.get((cohort.id, device_id), ("", ""))
        if status == "assigned":
            return _accepted(assignment_id, cohort)
    return None


def _admit(session: Session, round_: Round, wanted: int, too_few: int, room: int | None = None) -> int:
    """Count a group's check-ins into an open round and admit up to `wanted` of them within its
    capacity (or, with `room`, up to `room`: a buffered population's, read under its lock);
    returns how many were admitted. Raises RoundClosed if the round is no longer open."""
    # `accepted` only grows while a round is open: a round already full stays full.
    if room is not None:
        wanted_now = min(wanted, room)
    else:
        wanted_now = 0 if round_.accepted >= round_.capacity else wanted
    connection = session.connection()
    params = {
        "admitted_round": round_.id,
        "more_checked_in": wanted + too_few,
        "more_too_few": too_few,
        "more_full": wanted - wanted_now,
        "wanted": wanted_now,
    }
    admitted = connection.execute(_ADMIT, params).first()
    # A round closes with its admission row locked (`population_locks.lock_rounds`): if it closed
    # before this admission took the row, its status now says so; if after, it waits for this
    # transaction and drops the assignments made here.
    if admitted is None or connection.execute(_STATUS, {"round_id": round_.id}).scalar() != round_state.OPEN:
        raise RoundClosed(f"round {round_.id} closed during a check-in")
    capacity, counters = round_.capacity, list(admitted)
    accepted_before = int(counters[-1]) - wanted_now
    granted = (
        wanted_now if room is not None else round_state.admissible(accepted_before, int(capacity), wanted_now)
    )
    if granted < wanted_now:  # the group overfilled the round: the rest is refused as full
        given_back = (
            session.connection()
            .execute(_GIVE_BACK, {"admitted_round": round_.id, "over": wanted_now - granted})
            .one()
        )
        counters[2:] = given_back
    # The session's copy of the round shows the counters as they now are in this transaction.
    for name, value in zip(ADMISSION_COUNTERS, counters, strict=True):
        set_committed_value(round_, name, value)
    return granted


def _find_assignment(
    session: Session,
    population: Population,
    assignment_id: str,
    device_id: str,
    now: float,
    advance_rounds: bool = True,
) -> Found | Refused:
    """The caller's assignment in this (locked) population, after closing rounds past their deadline
    (unless `advance_rounds` is False: the caller advances what it needs itself)."""
    # Once per transaction and population: with `now` fixed, a second advance finds nothing to
    # close.
    advanced: set[tuple[int, float]] = session.info.setdefault("advanced", set())
    if advance_rounds and (population.id, now) not in advanced:
        advance(session, population, now)
        advanced.add((population.id, now))
    return find_assignment(session, population, assignment_id, device_id)


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
    if assignment.round.kind == EVALUATION or not population_settings(population).secure_training:
        return Refused(409, f"round {assignment.round.id} does not use secure aggregation; report instead")
    return assignment.status, assignment.round


def assignment_status(session: Session, assignment_id: str) -> str:
    """An assignment's status as it is now in this transaction."""
    found = session.connection().execute(_ASSIGNMENT, {"assignment_id": assignment_id}).first()
    assert found is not None
    return str(found[1])
