"""Work that happens only if a transaction commits: counting and logging what the state machine decided.

The state machine decides inside a transaction that may still roll back (a failed group commit
is retried one request at a time, a database error undoes everything), so what it decided is
published after the commit and dropped on a rollback: a counter or a log line never reports a
transition that did not happen, nor one twice.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import event
from sqlalchemy.orm import Session, SessionTransaction

_PENDING = "on_commit"


def on_commit(session: Session, callback: Callable[[], None]) -> None:
    """Call `callback` once the session's current transaction has committed; never if it rolls back."""
    session.info.setdefault(_PENDING, []).append(callback)


@event.listens_for(Session, "after_commit")
def _publish(session: Session) -> None:
    for callback in session.info.pop(_PENDING, ()):
        callback()


@event.listens_for(Session, "after_transaction_end")
def _discard(session: Session, transaction: SessionTransaction) -> None:
    # After a commit this finds nothing left; after a rollback (or a lost connection) it drops
    # what the transaction had decided.
    if transaction.parent is None:
        session.info.pop(_PENDING, None)
