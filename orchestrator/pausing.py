"""Pausing a population: no new round opens while it is paused; the open ones run to their end
(committed or abandoned as usual). Resuming lets the next training round open at once.
Archiving pauses it for good: it cannot be resumed; its models and rounds stay readable."""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session

from orchestrator.db import Population
from orchestrator.observability.logs import log_on_commit

log = logging.getLogger("orchestrator.rounds")


def paused(population: Population) -> bool:
    return population.paused_at is not None


def pause(session: Session, population: Population, now: float) -> None:
    """Pause the (locked) population; pausing a paused one changes nothing."""
    if paused(population):
        return
    # An idle back-off is moot while paused, and would be stale after it.
    population.paused_at, population.idle_rounds, population.next_round_at = now, 0, None
    log_on_commit(session, log, "population paused", population=population.name, paused_at=now)


class ArchivedError(ValueError):
    """An archived population cannot run again."""


def archive(session: Session, population: Population, now: float) -> None:
    """Pause the (locked) population for good; archiving an archived one changes nothing."""
    if population.archived_at is not None:
        return
    pause(session, population, now)
    population.archived_at = now
    log_on_commit(session, log, "population archived", population=population.name, archived_at=now)


def resume(session: Session, population: Population, now: float) -> None:
    """Resume the (locked) population; the caller advances it, which opens a training round."""
    if population.archived_at is not None:
        raise ArchivedError(f"population {population.name!r} is archived: it cannot be resumed")
    if not paused(population):
        return
    log_on_commit(
        session,
        log,
        "population resumed",
        population=population.name,
        paused_seconds=now - (population.paused_at or now),
    )
    # The round open at the pause may have closed idle meanwhile and set a back-off: resuming is
    # the operator asking for a round now, so it ends.
    population.paused_at, population.idle_rounds, population.next_round_at = None, 0, None
