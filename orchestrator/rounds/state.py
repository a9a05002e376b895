"""The round state machine: a round's states, deadlines and counts, and the events that move it.

Pure: no database, no HTTP status, no aggregation maths. It reads and moves the counters of a
round (the `Round` row, or anything with the same fields) and says when the round closes and
why; `round_lifecycle` acts on that (commits through the aggregation pipeline, or abandons) and
`rounds` answers the devices.

    open --report: reported reaches target---------------------> committed
    open --tick at the deadline: reported >= min_reports--------> committed
    open --tick at the deadline: fewer---------------------------> abandoned ("only n of m reports")
    open (secure) --phases (secure_phases)--> unmasked ---------> committed
                                         \\--> too few, cannot unmask --> abandoned (its reason)

Events: a check-in is admitted within the round's capacity (`admissible`; the database applies it
in one statement, see `rounds._admit`), a report is counted as accepted, invalid or late, an abort
is counted (each a `Count`: what the event moves, declared once here; the database applies it in
one statement on the round's row, generated from it: `rounds.counts`), and a tick drops the
assignments still outstanding at the deadline.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

OPEN, COMMITTED, ABANDONED = "open", "committed", "abandoned"
# The phase a plaintext round stops in (a secure round's are secure_phases'): devices check in
# and report during the one phase.
REPORTING = "reporting"
# What ended a round that did not commit: a deadline passed with too few devices; devices left
# (aborted, vanished) before it; the server refused enough of their messages as invalid that the
# rest fell short; or the aggregate failed a check (a secure round's unmasking).
DEADLINE, DROPOUTS, REFUSALS, FAILED_CHECK = "deadline", "dropouts", "refusals", "failed_check"
# An evaluation round open when its population's privacy budget ran out (round_release).
PRIVACY_BUDGET = "privacy_budget"


class RoundCounts(Protocol):
    """What the machine reads and moves of a round."""

    status: str
    closed_at: float | None
    deadline: float
    target: int
    capacity: int
    min_reports: int
    accepted: int
    reported: int
    total_weight: float
    dropped: int
    aborted: int
    late: int
    invalid: int
    metrics: dict[str, float]
    close_reason: str
    stopped_phase: str | None
    devices_had: int | None
    devices_needed: int | None
    ended_by: str | None


@dataclass(frozen=True)
class Closing:
    """A round closes: COMMITTED (a new model version) or ABANDONED (the model kept), and why:
    the sentence an operator reads, and its parts (stored with the round, counted by the metrics):
    the phase it stopped in, the devices it had and needed there (None: no count says it), and
    what ended it (DEADLINE, DROPOUTS, REFUSALS, FAILED_CHECK, PRIVACY_BUDGET; None for a commit)."""

    status: str
    reason: str
    phase: str = REPORTING
    had: int | None = None
    needed: int | None = None
    ended_by: str | None = None


def shortfall(phase: str, had: int, needed: int, refused: int, timed_out: bool, reason: str) -> Closing:
    """An abandonment for want of devices: `had` of `needed` answered in `phase`; REFUSALS if the
    `refused` (invalid) messages would have made up the difference, else the deadline or dropouts."""
    timing = DEADLINE if timed_out else DROPOUTS
    ended_by = REFUSALS if refused and had + refused >= needed else timing
    return Closing(ABANDONED, reason, phase, had, needed, ended_by)


def admissible(accepted: int, capacity: int, wanted: int) -> int:
    """How many of `wanted` check-ins a round with `accepted` of `capacity` places admits."""
    return max(0, min(wanted, capacity - accepted))


@dataclass(frozen=True)
class Count:
    """What an event adds to a round's counters (and to its metric sums). `while_open`: only into a
    round still open, else the event does not count (the round closed first). The database applies
    a count in one statement on the round's row (`round_counts`), so events need no other lock."""

    adds: Mapping[str, float]
    metric_sums: Mapping[str, float] = field(default_factory=dict)
    while_open: bool = True


def report_count(weight: float, metric_sums: Mapping[str, float]) -> Count:
    """An accepted report: counted with its weight and metric sums."""
    return Count({"reported": 1, "total_weight": weight}, metric_sums)


INVALID = Count({"invalid": 1})  # a report refused as invalid: its assignment is spent
ABORT = Count({"aborted": 1})
LATE = Count({"late": 1}, while_open=False)  # a report after its round (or assignment) closed


def combined(counts: Sequence[Count]) -> Count:
    """Several events' counts as one (`while_open` if any of them is)."""
    adds: dict[str, float] = {}
    sums: dict[str, float] = {}
    for count in counts:
        for name, amount in count.adds.items():
            adds[name] = adds.get(name, 0) + amount
        sums = add_metric_sums(sums, count.metric_sums)
    return Count(adds, sums, any(count.while_open for count in counts))


def add_metric_sums(sums: Mapping[str, float], more: Mapping[str, float]) -> dict[str, float]:
    out = dict(sums)
    for name, value in more.items():
        out[name] = out.get(name, 0.0) + value
    return out


def target_reached(round_: RoundCounts) -> Closing | None:
    """After a report was counted: the round commits once its reports reach the target."""
    if round_.reported >= round_.target:
        return Closing(
            COMMITTED,
            f"{round_.reported} reports reached the target {round_.target}",
            had=round_.reported,
            needed=round_.target,
        )
    return None


def past_deadline(round_: RoundCounts, now: float) -> bool:
    return now >= round_.deadline


def at_deadline(round_: RoundCounts, outstanding: int) -> Closing:
    """A tick past the round's deadline: its `outstanding` assignments are dropped and it closes,
    committed with at least `min_reports` reports, abandoned with fewer."""
    round_.dropped += outstanding
    if round_.reported >= round_.min_reports:
        return Closing(
            COMMITTED,
            f"the deadline, with {round_.reported} of {round_.min_reports} reports needed",
            had=round_.reported,
            needed=round_.min_reports,
        )
    reason = f"only {round_.reported} reports by the deadline; the round needed {round_.min_reports}"
    if round_.invalid:
        reason += f" ({round_.invalid} refused as invalid)"
    if not round_.accepted:
        reason += " (no device checked in)"
    return shortfall(REPORTING, round_.reported, round_.min_reports, round_.invalid, True, reason)


def close(round_: RoundCounts, closing: Closing, now: float) -> None:
    """The round closes as `closing` says, and keeps why (the phase only if it did not commit)."""
    round_.status, round_.closed_at, round_.close_reason = closing.status, now, closing.reason[:500]
    round_.stopped_phase = closing.phase if closing.status == ABANDONED else None
    round_.devices_had, round_.devices_needed = closing.had, closing.needed
    round_.ended_by = closing.ended_by
