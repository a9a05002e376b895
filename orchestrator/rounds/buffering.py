"""Buffered asynchronous rounds (FedBuff): what a buffered population does differently.

A buffered population's training round is a buffer. Devices check in whenever fewer than
`buffered.concurrency` hold an assignment (`room`); each trains on the version current at its
check-in and has `round_duration_seconds` to report. Its report goes into the buffer open when it
arrives, whichever round it checked in to (`place`), weighted by f(staleness) (the versions
committed since its download, `aggregation.staleness`), or is refused as `stale` past
`buffered.max_staleness`. The buffer commits at `buffer_size` reports through the population's
aggregation pipeline, as a synchronous round commits at its target; its devices still training
are not dropped (they report into the next buffer). Assignments past their own deadline are
dropped (`drop_expired`).

Every check-in and report of a buffered population takes its population's lock (it is read again
under it), so concurrency is exact and a buffer commits once with several server processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import CursorResult, bindparam, func, select, update
from sqlalchemy.orm import Session

from orchestrator.aggregation.staleness import staleness_weight
from orchestrator.db import Assignment, Population, Round
from orchestrator.observability import metrics
from orchestrator.populations.settings import PopulationSettings
from orchestrator.rounds.refusals import Refused

TRAINING = "training"
# A training round's metric sums that say how stale its reports were: the total of their
# staleness (its mean is that over `reported`) and one count per staleness (the histogram).
STALENESS_TOTAL = "staleness_total"
STALENESS_COUNT = "staleness_count_"  # + s
STALE = "stale"  # a refusal's reason

_TRAINING_ROUNDS = select(Round.id).where(
    Round.population_id == bindparam("population_id"), Round.kind == TRAINING
)
_IN_FLIGHT = (
    select(func.count())
    .select_from(Assignment)
    .where(
        Assignment.round_id.in_(_TRAINING_ROUNDS.scalar_subquery()),
        Assignment.status == "assigned",
        Assignment.deadline > bindparam("now"),
    )
)
_DROP_EXPIRED = (
    update(Assignment)
    .where(
        Assignment.round_id.in_(_TRAINING_ROUNDS.scalar_subquery()),
        Assignment.status == "assigned",
        Assignment.deadline <= bindparam("now"),
    )
    .values(status="dropped", finished_at=bindparam("now"))
    .execution_options(synchronize_session=False)
)
_DROP = (
    update(Assignment)
    .where(Assignment.id == bindparam("assignment_id"), Assignment.status == "assigned")
    .values(status="dropped", finished_at=bindparam("now"))
)


def room(session: Session, population: Population, settings: PopulationSettings, now: float) -> int:
    """How many more devices may start training now (the population must be locked)."""
    training = session.connection().execute(_IN_FLIGHT, {"population_id": population.id, "now": now})
    return max(0, settings.buffered.concurrency - int(training.scalar_one()))


def drop_expired(session: Session, population: Population, now: float) -> int:
    """Drop the population's training assignments past their own deadline; how many."""
    dropped: CursorResult[Any] = session.connection().execute(
        _DROP_EXPIRED, {"population_id": population.id, "now": now}
    )
    if dropped.rowcount:
        metrics.count(session, metrics.DROPPED, (population.name, TRAINING), dropped.rowcount)
    return int(dropped.rowcount)


@dataclass(frozen=True)
class Placed:
    """Where a buffered report goes: the open buffer, how stale it is and its weight's factor."""

    buffer: Round
    staleness: int
    factor: float

    def metric_sums(self) -> dict[str, float]:
        return {STALENESS_TOTAL: float(self.staleness), f"{STALENESS_COUNT}{self.staleness}": 1.0}


def place(
    session: Session,
    settings: PopulationSettings,
    trained_on: Round,
    buffer: Round | None,
    assignment_id: str,
    now: float,
) -> Placed | Refused:
    """The buffer a report of an assignment of round `trained_on` goes into, or why it cannot go
    into one (then its assignment is dropped: its device checks in again)."""
    if buffer is None:
        return Refused(409, "no training round is open; the report cannot be added", reason="late")
    staleness = buffer.base_version - trained_on.base_version
    if staleness > settings.buffered.max_staleness:
        session.connection().execute(_DROP, {"assignment_id": assignment_id, "now": now})
        return Refused(
            409,
            f"the report trained on version {trained_on.base_version}, {staleness} versions behind the "
            f"current {buffer.base_version}; this population adds reports at most "
            f"{settings.buffered.max_staleness} versions stale: check in again for the current version",
            reason=STALE,
        )
    factor = staleness_weight(settings.buffered.staleness_weighting, staleness)
    return Placed(buffer, staleness, factor)


def drop(session: Session, assignment_id: str, now: float) -> None:
    """Drop an assignment whose report no buffer takes (its device checks in again)."""
    session.connection().execute(_DROP, {"assignment_id": assignment_id, "now": now})


def staleness_histogram(round_metrics: dict[str, float]) -> dict[int, int]:
    """A buffer's reports by staleness, from its metric sums."""
    return {
        int(key.removeprefix(STALENESS_COUNT)): int(value)
        for key, value in sorted(round_metrics.items())
        if key.startswith(STALENESS_COUNT)
    }
