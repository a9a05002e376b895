"""Finding a population and taking its lock: one writer per population at a time."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from orchestrator.db import Assignment, Population, Round, RoundAdmission

# Built once: building and hashing a statement costs several times more than SQLite takes to run it.
_POPULATION_BY_NAME = select(Population).where(Population.name == bindparam("name"))
# FOR NO KEY UPDATE, not FOR UPDATE: writers of a population still exclude each other, but the
# foreign-key checks of rows that point at it (a check-in's round update) do not wait for them,
# which would deadlock a check-in holding its round's row against a report waiting for that row.
KEY_SHARE = {"key_share": True}  # the same, for Session.refresh
_POPULATION_BY_NAME_LOCKED = _POPULATION_BY_NAME.with_for_update(key_share=True)
_POPULATIONS_OF_ASSIGNMENTS = (
    select(Assignment.id, Round.population_id, Assignment.round_id)
    .join(Round, Assignment.round_id == Round.id)
    .where(Assignment.id.in_(bindparam("assignment_ids", expanding=True)))
)
_POPULATIONS_BY_ID_UNLOCKED = (
    select(Population).where(Population.id.in_(bindparam("ids", expanding=True))).order_by(Population.id)
)
# Always in the same order, so two servers never deadlock; read afresh under the lock, even when the
# transaction read them before it (reports read their populations first without it).
_POPULATIONS_BY_ID = _POPULATIONS_BY_ID_UNLOCKED.with_for_update(key_share=True).execution_options(
    populate_existing=True
)
# The rounds a transaction under its populations' locks may write to, locked at once in id order:
# every transaction that holds several rounds' rows took them in that order, so none waits for
# another in a cycle (a report counted into its round takes no population lock; see round_counts).
_ROUNDS_TO_LOCK = (
    select(Round)
    .where(
        (Round.population_id.in_(bindparam("population_ids", expanding=True)) & (Round.status == "open"))
        | Round.id.in_(bindparam("round_ids", expanding=True))
    )
    .order_by(Round.id)
    .with_for_update(key_share=True)
    .execution_options(populate_existing=True)
)

# A round's admission row, locked after its round's: a check-in admitted into the round meanwhile
# has committed, and none is admitted until this transaction ends (it closes the round, or not).
_ADMISSIONS_TO_LOCK = (
    select(
        RoundAdmission.round_id,
        RoundAdmission.checked_in,
        RoundAdmission.rejected_min_examples,
        RoundAdmission.rejected_capacity,
        RoundAdmission.accepted,
    )
    .where(RoundAdmission.round_id.in_(bindparam("round_ids", expanding=True)))
    .order_by(RoundAdmission.round_id)
    .with_for_update(key_share=True)
)
ADMISSION_COUNTERS = ("checked_in", "rejected_min_examples", "rejected_capacity", "accepted")


def lock_population(session: Session, name: str) -> Population | None:
    """The population row, locked: one writer per population at a time (FOR UPDATE on PostgreSQL;
    SQLite's BEGIN IMMEDIATE already serializes writers)."""
    return session.scalars(_POPULATION_BY_NAME_LOCKED, {"name": name}).first()


def find_population(session: Session, name: str) -> Population | None:
    """The population row, not locked: enough for a check-in (`checkin` locks it when a round must
    open or close)."""
    return session.scalars(_POPULATION_BY_NAME, {"name": name}).first()


def relock(session: Session, population: Population) -> None:
    """Lock a population read without its lock, and re-read what may have changed meanwhile."""
    settings_version = population.settings_version
    session.refresh(population, _MUTABLE, with_for_update=KEY_SHARE)
    if population.settings_version != settings_version:  # changed meanwhile: read them again
        session.expire(population, ["settings"])


# What changes on a population after its creation.
_MUTABLE = [
    "current_version",
    "training_rounds_committed",
    "idle_rounds",
    "next_round_at",
    "paused_at",
    "settings_version",
    "archived_at",
]


def populations_of_assignments(session: Session, assignment_ids: Sequence[str]) -> dict[str, Population]:
    """The (locked) population of each known assignment."""
    return {a: population for a, (population, _) in where_assignments_are(session, assignment_ids).items()}


def where_assignments_are(
    session: Session, assignment_ids: Sequence[str], lock: bool = True
) -> dict[str, tuple[Population, int]]:
    """The population (locked, with `lock`) and the round id of each known assignment."""
    # Only the population ids before the lock: they never change, while an assignment and its
    # round must be read after the lock (another server process may have just changed them).
    found = rounds_of_assignments(session, assignment_ids)
    ids = sorted({population_id for population_id, _ in found.values()})
    query = _POPULATIONS_BY_ID if lock else _POPULATIONS_BY_ID_UNLOCKED
    populations = {p.id: p for p in session.scalars(query, {"ids": ids})} if ids else {}
    return {a: (populations[population_id], round_id) for a, (population_id, round_id) in found.items()}


def rounds_of_assignments(session: Session, assignment_ids: Sequence[str]) -> dict[str, tuple[int, int]]:
    """The population id and round id of each known assignment, read with no lock (they never
    change)."""
    if not assignment_ids:
        return {}
    rows = session.connection().execute(_POPULATIONS_OF_ASSIGNMENTS, {"assignment_ids": list(assignment_ids)})
    return {assignment_id: (population_id, round_id) for assignment_id, population_id, round_id in rows}


def lock_populations(session: Session, population_ids: Sequence[int]) -> list[Population]:
    """These populations, locked in id order and read afresh."""
    return list(session.scalars(_POPULATIONS_BY_ID, {"ids": list(population_ids)})) if population_ids else []


def lock_rounds(session: Session, population_ids: Sequence[int], round_ids: Sequence[int]) -> list[Round]:
    """Lock, in id order, the open rounds of these (locked) populations and the rounds `round_ids`,
    and re-read them: what a transaction holding its populations' locks may then write to."""
    if not (population_ids or round_ids):
        return []
    rounds = list(
        session.scalars(
            _ROUNDS_TO_LOCK, {"population_ids": list(population_ids), "round_ids": list(round_ids)}
        )
    )
    lock_admissions(session, rounds)
    return rounds


def lock_admissions(session: Session, rounds: Sequence[Round]) -> None:
    """Lock these (locked) rounds' admission rows, in id order, and read their counters afresh: a
    transaction that may close a round holds them, so no check-in is admitted into it meanwhile
    (`rounds.checkin`)."""
    by_id = {r.id: r for r in rounds}
    if not by_id:
        return
    for round_id, *counters in session.connection().execute(
        _ADMISSIONS_TO_LOCK, {"round_ids": sorted(by_id)}
    ):
        for name, value in zip(ADMISSION_COUNTERS, counters, strict=True):
            set_committed_value(by_id[round_id], name, value)


def population_of_assignment(session: Session, assignment_id: str) -> Population | None:
    """The (locked) population an assignment belongs to."""
    return populations_of_assignments(session, [assignment_id]).get(assignment_id)
