"""A round's counters moved by one statement on its row.

The state machine (`round_state`) says what an event adds to a round (a `Count`); this applies it
as `UPDATE rounds SET reported = reported + 1, ... WHERE id = :id AND status = 'open' RETURNING
...`: the statement checks that the round is still open, moves the counters whatever another
server process did meanwhile, and takes the round's row lock until the transaction ends. So a
report, an abort or a check-in's admission needs no population lock: two reports of one round in
two processes wait for each other only for that statement's row, never for each other's parsing.
The session's copy of the round then shows the row as this transaction now holds it, which the
target check and a commit read.

A secure round's phase counters move the same way, on its secure round's row (`count_secure`).
"""

from __future__ import annotations

import functools
from typing import Any

from sqlalchemy import Update, bindparam, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from orchestrator.db import Round, SecureRound
from orchestrator.rounds import state as round_state
from orchestrator.rounds.secure import state as secure_round_state

# Everything the state machine reads of a round, returned by every count.
FRESH = (
    "status",
    "target",
    "reported",
    "total_weight",
    "dropped",
    "aborted",
    "late",
    "invalid",
    "metrics",
)
_SET_METRICS = update(Round).where(Round.id == bindparam("round_id")).values(metrics=bindparam("sums"))


@functools.cache
def _statement(names: tuple[str, ...], while_open: bool, with_sums: bool = False) -> Update:
    """Built once per kind of count: building a statement costs more than running it. `with_sums`:
    the metric sums are written too, if no report was counted since the round was read."""
    where = [Round.id == bindparam("round_id")]
    if while_open:
        where.append(Round.status == round_state.OPEN)
    values: dict[str, Any] = {name: getattr(Round, name) + bindparam(f"add_{name}") for name in names}
    if with_sums:
        where.append(Round.reported == bindparam("reported_read"))
        values["metrics"] = bindparam("sums", type_=Round.metrics.type)
    return update(Round).where(*where).values(values).returning(*(getattr(Round, n) for n in FRESH))


def count(session: Session, round_: Round, event: round_state.Count) -> bool:
    """Apply `event` to the round's row in one statement; False if the round had closed
    (`while_open`): nothing counted. A report's metric sums are added to the sums as the
    transaction read them, in the same statement, if no report was counted into the round since
    (only reports move its sums; always so with one writer, as on SQLite); else a second statement
    adds them under the row lock the first took."""
    names = tuple(sorted(event.adds))
    params: dict[str, Any] = {"round_id": round_.id, **{f"add_{n}": event.adds[n] for n in names}}
    if event.metric_sums and event.while_open and "reported" in event.adds:
        sums = round_state.add_metric_sums(round_.metrics or {}, event.metric_sums)
        at_once = {**params, "reported_read": round_.reported, "sums": sums}
        row = session.connection().execute(_statement(names, True, True), at_once).first()
        if row is not None:
            for name, value in zip(FRESH, row, strict=True):
                set_committed_value(round_, name, value)
            return True
    row = session.connection().execute(_statement(names, event.while_open), params).first()
    if row is None:
        return False
    fresh = dict(zip(FRESH, row, strict=True))
    if event.metric_sums:
        fresh["metrics"] = round_state.add_metric_sums(fresh["metrics"] or {}, event.metric_sums)
        session.connection().execute(_SET_METRICS, {"round_id": round_.id, "sums": fresh["metrics"]})
    for name, value in fresh.items():
        set_committed_value(round_, name, value)
    return True


@functools.cache
def _secure_statement(names: tuple[str, ...]) -> Update:
    values: dict[str, Any] = {name: getattr(SecureRound, name) + bindparam(f"add_{name}") for name in names}
    fresh = (getattr(SecureRound, n) for n in secure_round_state.COUNTERS)
    return (
        update(SecureRound)
        .where(SecureRound.round_id == bindparam("secure_round_id"))
        .values(values)
        .returning(*fresh)
    )


def count_secure(session: Session, secure_round: SecureRound, event: round_state.Count) -> None:
    """Apply a secure round's `event` (`secure_round_state`) to its row in one statement; the
    session's copy then shows every counter as this transaction now holds it."""
    names = tuple(sorted(event.adds))
    if not names:
        return
    params: dict[str, Any] = {
        "secure_round_id": secure_round.round_id,
        **{f"add_{n}": event.adds[n] for n in names},
    }
    row = session.connection().execute(_secure_statement(names), params).one()
    for name, value in zip(secure_round_state.COUNTERS, row, strict=True):
        set_committed_value(secure_round, name, value)
