"""A secure round's phase messages (keys, shares, masked inputs, confirmations, unmasking shares), those
that arrive together handled in one transaction (a group commit, as check-ins and reports are).

A phase's messages come in bursts: every device of a round hears of a phase in the same answer
batch and sends its message for it moments later. Each message in its own transaction paid its
own commit, token look-up, population lock and reads of its round: in a 1,000-device round over
HTTP those were 41% of the server's time in the messages (the commit 22%, the caller's checks
19%). Together, the tokens and the populations are one query each, the round's rows are read once
(the session keeps what it loads) and the group commits once.

Each message is handled as it would be alone, in arrival order: a message may close its phase,
and the next one in the group then finds the next phase. A refused message (a `Refused` value,
returned before its handler writes anything) changes nothing; a message that raises fails the
group's transaction, and the group commit then runs each message in a transaction of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker
from starlette.applications import Starlette

from orchestrator.db import Population, Round
from orchestrator.rounds import checkins
from orchestrator.rounds.lifecycle import advance_secure
from orchestrator.rounds.refusals import Refused
from orchestrator.service.database import DATABASE_UNAVAILABLE, run_db
from orchestrator.service.group_commit import GroupCommit
from orchestrator.service.secure_states import in_their_rounds, state_of

# A phase's handler (`secure_rounds.advertise`, `share_keys`, ...): its answer, or why it is refused.
Handler = Callable[[Session, Round, str, Any, float], dict[str, Any] | Refused]


@dataclass(frozen=True)
class MessageCall:
    handler: Handler
    assignment_id: str
    token: str
    body: Any  # parsed JSON, or the masked input's bytes
    until: str | None  # a phase: the answer carries the state once the round has reached it


MessageGroups = GroupCommit[None, MessageCall, dict[str, Any] | Refused]


def message_groups(app: Starlette, window_seconds: float) -> MessageGroups:
    """The group commit of phase messages (one group for all populations, which are locked in id
    order, as reports are)."""

    async def transaction(_key: None, calls: Sequence[MessageCall]) -> list[dict[str, Any] | Refused]:
        return await run_db(app, handle_messages, app.state.sessionmaker, calls, app.state.clock())

    return GroupCommit(transaction, window_seconds, fail_together=DATABASE_UNAVAILABLE, name="secure_message")


async def send_message(app: Starlette, call: MessageCall) -> dict[str, Any] | Refused:
    """One device's message, handled with whichever messages arrive at the same moment."""
    groups: MessageGroups = app.state.secure_messages
    return await groups.submit(None, call)


def handle_messages(
    factory: sessionmaker[Session], calls: Sequence[MessageCall], now: float
) -> list[dict[str, Any] | Refused]:
    """Each call's answer, or the refusal it gets (401, 403, 404, 409, 422), in one transaction."""
    with factory.begin() as session:
        # A round whose phase ran out before its message is advanced first: the message is then
        # out of phase, or its device was dropped with it.
        return in_their_rounds(
            session,
            calls,
            now,
            lambda call, population, status, round_: _message(session, call, population, status, round_, now),
        )


def _message(
    session: Session, call: MessageCall, population: Population, status: str, round_: Round, now: float
) -> dict[str, Any] | Refused:
    if status != "assigned" or round_.status != "open":
        return Refused(409, f"this assignment is {status} and its round {round_.status}")
    answer = call.handler(session, round_, call.assignment_id, call.body, now)
    if isinstance(answer, Refused):
        return answer
    # The message may complete its phase: close it now rather than at the next tick.
    advance_secure(session, population, round_, now)
    if call.until is None:
        return answer
    status = checkins.assignment_status(session, call.assignment_id)
    return {**answer, "state": state_of(session, status, round_, call.assignment_id, now, call.until)}
