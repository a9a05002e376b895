"""What bounds one device's privacy loss in a buffered population under DP.

The accountant (`aggregation.buffered_privacy`) holds only if a device is in at most one report
of each buffer and in at most `differential_privacy.max_participations` buffers: nothing samples
devices in buffered rounds, so these two caps are the whole bound, and the server enforces both.
A device past its cap is told so at check-in (for a day: the cap never comes back); a second
report of one device into the same buffer is refused (its assignment is dropped, so the device
checks in again and reports into a later buffer).
"""

from __future__ import annotations

from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from orchestrator.db import Assignment, Population, Report, Round
from orchestrator.populations.settings import PopulationSettings
from orchestrator.rounds.refusals import Refused

TRAINING = "training"
OVER_CAP = "max_participations"  # a refusal's reason
TWICE = "twice_in_buffer"

_COUNTED = (
    select(func.count())
    .select_from(Assignment)
    .join(Round, Round.id == Assignment.round_id)
    .where(
        Round.population_id == bindparam("population_id"),
        Round.kind == TRAINING,
        Assignment.device_id == bindparam("device_id"),
        Assignment.status.in_(bindparam("statuses", expanding=True)),
    )
)
_IN_BUFFER = (
    select(func.count())
    .select_from(Report)
    .join(Assignment, Assignment.id == Report.assignment_id)
    .where(Report.round_id == bindparam("buffer_id"), Assignment.device_id == bindparam("device_id"))
)


def _capped(cap: int, retry_after: float | None = None) -> Refused:
    return Refused(
        409,
        f"this device's reports are in {cap} buffers, the population's differential_privacy."
        "max_participations: its privacy bound allows no more",
        retry_after=retry_after,
        reason=OVER_CAP,
    )


def cap_of(settings: PopulationSettings) -> int | None:
    """The population's cap on one device's buffers, or None when it has none (no DP)."""
    dp = settings.dp() if settings.buffered_training else None
    return None if dp is None else dp.max_participations


def participations(session: Session, population: Population, device_id: str, in_flight: bool = False) -> int:
    """The device's reports counted into this population's buffers so far (and, `in_flight`, its
    assignments still training: a device may train on two versions at once, each may count)."""
    statuses = ["reported", "assigned"] if in_flight else ["reported"]
    found = session.connection().execute(
        _COUNTED, {"population_id": population.id, "device_id": device_id, "statuses": statuses}
    )
    return int(found.scalar_one())


def over_cap(
    session: Session, population: Population, settings: PopulationSettings, device_id: str
) -> Refused | None:
    """Why this device may not train again (its cap is reached), or None."""
    cap = cap_of(settings)
    if cap is None:
        return None
    if participations(session, population, device_id, in_flight=True) < cap:
        return None
    return _capped(cap, retry_after=max(settings.retry_after_seconds, 86400.0))


def second_in_buffer(
    session: Session, population: Population, settings: PopulationSettings, buffer: Round, device_id: str
) -> Refused | None:
    """Why a report of this device cannot enter `buffer` (it already holds one of its, or the
    device's reports are in `max_participations` buffers already), or None."""
    cap = cap_of(settings)
    if cap is None:
        return None
    if participations(session, population, device_id) >= cap:
        return _capped(cap)
    held = session.connection().execute(_IN_BUFFER, {"buffer_id": buffer.id, "device_id": device_id})
    if int(held.scalar_one()) == 0:
        return None
    return Refused(
        409,
        f"buffer {buffer.id} already holds a report of this device; under differential privacy a "
        "device is in one report per buffer: check in again for the next",
        reason=TWICE,
    )
