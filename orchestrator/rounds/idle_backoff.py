"""No empty rounds: a population no device checks in to backs off opening training rounds.

A training round that closes without a single check-in counts as idle; after the k-th idle round
in a row the next one opens only `min(d * 2^(k-1), IDLE_BACKOFF_CAP_SECONDS)` later (d: that
round's own duration), instead of at once. A device's check-in ends the back-off: its
transaction opens a round and admits it (`wake`), so no device waits for the timer; a round that
closes with any check-in resets the count. Opening a training round clears `next_round_at`, so
that check-ins into it take the usual path without the population's lock. The population's
status shows both fields.
"""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session

from orchestrator.db import Population, Round
from orchestrator.observability.logs import log_on_commit

IDLE_BACKOFF_CAP_SECONDS = 3600.0
log = logging.getLogger("orchestrator.rounds")


def backing_off(population: Population, now: float) -> bool:
    """Whether no training round opens now (unless a device checks in)."""
    return population.next_round_at is not None and now < population.next_round_at


def training_round_closed(session: Session, population: Population, round_: Round, now: float) -> None:
    """Count a closed training round as idle (no check-in) or not, and set the back-off."""
    # A buffer may fill with reports of devices that checked in to an earlier one: not idle.
    if round_.checked_in or round_.reported:
        population.idle_rounds, population.next_round_at = 0, None
        return
    population.idle_rounds += 1
    duration = max(round_.deadline - round_.opened_at, 1.0)
    wait = min(duration * 2 ** (population.idle_rounds - 1), IDLE_BACKOFF_CAP_SECONDS)
    population.next_round_at = now + wait
    log_on_commit(
        session,
        log,
        "population idle: backing off",
        population=population.name,
        idle_rounds=population.idle_rounds,
        next_round_at=population.next_round_at,
        wait_seconds=wait,
    )


def wake(session: Session, population: Population) -> None:
    """A device checks in for training: the back-off ends (the caller then opens a round)."""
    if population.next_round_at is None:
        return
    log_on_commit(
        session,
        log,
        "population woke: a device checked in",
        population=population.name,
        idle_rounds=population.idle_rounds,
    )
    population.idle_rounds, population.next_round_at = 0, None


def describe(population: Population, now: float) -> str:
    """One line for the status: empty when the population is not backing off."""
    if not backing_off(population, now):
        return ""
    assert population.next_round_at is not None
    return (
        f"no device checked in to the last {population.idle_rounds} training round(s): the next opens "
        f"in {population.next_round_at - now:.0f} s, or as soon as a device checks in"
    )
