"""A secure round's state as each device may see it, read for the devices that ask together in one
transaction (a group commit, as check-ins are answered).

A phase change wakes every device held for it (`?until=`) in the same turn of the event loop: each
then re-read the state in its own transaction, one after the other, each authenticating its token,
finding its assignment's population and reading the round. The ~52 held requests of a main-job
round took 0.58 s at the median and 2.1 s at p90 to hear that a phase had opened, and 8.8 of the
server's 51 busy seconds. Read together, the tokens and the populations are one query each, the
round's rows are read once, and every device hears of the phase in the same answer batch.

The caller's checks (`in_their_rounds`) and the answer (`state_of`) are shared with the phase messages
(`secure_messages`), which read their state in their own group's transaction. Refusals are
`Refused` values; the routes turn them into HTTP answers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from sqlalchemy.orm import Session, sessionmaker
from starlette.applications import Starlette

from orchestrator.db import Population, Round
from orchestrator.devices import UNAUTHENTICATED, authenticate_all
from orchestrator.populations.locks import populations_of_assignments
from orchestrator.rounds import checkins
from orchestrator.rounds.lifecycle import advance_secure
from orchestrator.rounds.refusals import Refused
from orchestrator.rounds.secure import messages as secure_rounds
from orchestrator.service.database import DATABASE_UNAVAILABLE, run_db
from orchestrator.service.group_commit import GroupCommit


@dataclass(frozen=True)
class StateCall:
    assignment_id: str
    token: str
    until: str | None  # a phase: the state says what that phase hands out only once it is reached


StateReads = GroupCommit[None, StateCall, dict[str, Any] | Refused]


def state_reads(app: Starlette, window_seconds: float) -> StateReads:
    """The group commit of state reads (one group for all populations: they only read, and lock
    their populations in id order)."""

    async def transaction(_key: None, calls: Sequence[StateCall]) -> list[dict[str, Any] | Refused]:
        return await run_db(app, read_states, app.state.sessionmaker, calls, app.state.clock())

    return GroupCommit(transaction, window_seconds, fail_together=DATABASE_UNAVAILABLE, name="secure_state")


async def read_state(app: Starlette, call: StateCall) -> dict[str, Any] | Refused:
    """One device's state, read with whichever devices ask at the same moment."""
    groups: StateReads = app.state.secure_state_reads
    return await groups.submit(None, call)


async def open_phases(app: Starlette) -> frozenset[tuple[int, str]]:
    """The phases of the secure rounds under way, as the phase-change watcher compares them: a
    round that opens, changes phase or ends changes the set."""
    return await run_db(app, _open_phases, app.state.sessionmaker)


def _open_phases(factory: sessionmaker[Session]) -> frozenset[tuple[int, str]]:
    with factory.begin() as session:
        return secure_rounds.open_phases(session)


def read_states(
    factory: sessionmaker[Session], calls: Sequence[StateCall], now: float
) -> list[dict[str, Any] | Refused]:
    """Each call's state, or the refusal it gets (401, 403, 404, 409), in one transaction."""
    with factory.begin() as session:
        return in_their_rounds(
            session,
            calls,
            now,
            lambda call, _population, status, round_: state_of(
                session, status, round_, call.assignment_id, now, call.until
            ),
        )


class Caller(Protocol):
    @property
    def assignment_id(self) -> str: ...

    @property
    def token(self) -> str: ...


C = TypeVar("C", bound=Caller)


def in_their_rounds(
    session: Session,
    calls: Sequence[C],
    now: float,
    answer: Callable[[C, Population, str, Round], dict[str, Any] | Refused],
) -> list[dict[str, Any] | Refused]:
    """Each call's `answer(call, population, assignment status, round)` once its caller is checked
    (refused with 401/403/404/409 otherwise), in the session's transaction: the tokens and the
    populations one query each. A round whose phase deadline has passed is advanced first (every
    other change of phase comes after a message, which advances the round, or with the ticker)."""
    device_ids = authenticate_all(session, [call.token for call in calls])
    populations = populations_of_assignments(session, [call.assignment_id for call in calls])
    answers: list[dict[str, Any] | Refused] = []
    for call, device_id in zip(calls, device_ids, strict=True):
        found = _checked(
            session, call.assignment_id, device_id, populations.get(call.assignment_id), now, False
        )
        if isinstance(found, Refused):
            answers.append(found)
            continue
        population, status, round_ = found
        if round_.status == "open" and secure_rounds.deadline_passed(session, round_, now):
            advance_secure(session, population, round_, now)
            status = checkins.assignment_status(session, call.assignment_id)
        answers.append(answer(call, population, status, round_))
    return answers


def _checked(
    session: Session,
    assignment_id: str,
    device_id: str | None,
    population: Population | None,
    now: float,
    advance_rounds: bool,
) -> tuple[Population, str, Round] | Refused:
    """The caller's (locked) `population`, assignment status and secure round, from its
    authenticated `device_id`; refused with 401/403/404/409 otherwise."""
    if device_id is None:
        return Refused(401, UNAUTHENTICATED)
    if population is None:
        return Refused(404, f"no assignment {assignment_id!r}")
    found = checkins.secure_round_of(session, population, assignment_id, device_id, now, advance_rounds)
    if isinstance(found, Refused):
        return found
    return (population, *found)


def state_of(
    session: Session, status: str, round_: Round, assignment_id: str, now: float, until: str | None
) -> dict[str, Any]:
    return {"assignment_status": status, **secure_rounds.state(session, round_, assignment_id, now, until)}
