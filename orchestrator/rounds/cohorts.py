"""Which cohort a checking-in device of a buffered secure population joins (the buffer's side is
`cohort_sums`).

Devices that check in at about the same time are grouped into a cohort: an ordinary secure round
(kind "cohort"), sized as a synchronous one (a roster of ceil(target_reports x oversampling), its
masked-input phase closing at target_reports, at least min_reports survivors), all on the version
current when it opened. The cohort in its advertise phase takes the check-ins until its roster
closes; the next check-in then opens the next cohort, if the population has room for a whole
roster: the devices holding an assignment in its open cohorts plus a new roster stay within
`buffered.concurrency`. So several cohorts may be open at once, each in its own phase, and a
device that checks in while there is no room is told to come back, as a plaintext buffered
population tells it when its concurrency is reached. Every call runs under the population's lock
(a buffered population's check-ins take it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from orchestrator.db import Assignment, Population, Round
from orchestrator.populations.settings import PopulationSettings
from orchestrator.rounds.lifecycle import COHORT, open_cohorts, open_round
from orchestrator.rounds.refusals import Refused
from orchestrator.rounds.secure import messages

_TRAINING_IN_COHORTS = (
    select(func.count())
    .select_from(Assignment)
    .join(Round, Assignment.round_id == Round.id)
    .where(
        Round.population_id == bindparam("population_id"),
        Round.kind == COHORT,
        Round.status == "open",
        Assignment.status == "assigned",
    )
)
_draw = random.Random()  # when a device turned away comes back: spread, not secret


@dataclass(frozen=True)
class Places:
    """Where a training check-in goes: the cohort taking check-ins (or why none may take it), and
    every open cohort (a device already in one gets its assignment there back)."""

    accepting: Round | Refused
    open: list[Round]


def places(session: Session, population: Population, settings: PopulationSettings, now: float) -> Places:
    """The cohort in its advertise phase, or a new one if the population has room for its roster."""
    cohorts = open_cohorts(session, population)
    for cohort in reversed(cohorts):
        if messages.accepting(session, cohort):
            return Places(cohort, cohorts)
    training = int(
        session.connection().execute(_TRAINING_IN_COHORTS, {"population_id": population.id}).scalar_one()
    )
    roster, concurrency = settings.secure_roster, settings.buffered.concurrency
    if training + roster > concurrency:
        message = (
            f"{training} devices are training in {len(cohorts)} cohorts; the next cohort of {roster} opens "
            f"when it fits this population's concurrency of {concurrency}"
        )
        return Places(Refused(409, message, settings.retry_after_seconds * (0.5 + _draw.random())), cohorts)
    cohort = open_round(session, population, COHORT, now)
    return Places(cohort, [*cohorts, cohort])
