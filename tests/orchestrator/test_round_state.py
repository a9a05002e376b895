"""The round state machine alone: deadlines, closings and admission, without a database. (What an
event counts is applied by the database alone: tests/orchestrator/test_round_counts.py.)"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.rounds import state as round_state
from orchestrator.rounds.state import (
    ABANDONED,
    COMMITTED,
    DEADLINE,
    DROPOUTS,
    OPEN,
    REFUSALS,
    REPORTING,
    Closing,
)


@dataclass
class Counts:
    """A round's counters as plain fields (the `Round` row has the same)."""

    target: int = 3
    capacity: int = 4
    min_reports: int = 2
    deadline: float = 10.0
    status: str = OPEN
    closed_at: float | None = None
    accepted: int = 0
    reported: int = 0
    total_weight: float = 0.0
    dropped: int = 0
    aborted: int = 0
    late: int = 0
    invalid: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    close_reason: str = ""
    stopped_phase: str | None = None
    devices_had: int | None = None
    devices_needed: int | None = None
    ended_by: str | None = None


def test_at_the_deadline_a_round_commits_with_min_reports_and_is_abandoned_with_fewer() -> None:
    enough, short = Counts(reported=2, accepted=3), Counts(reported=1, accepted=3)

    assert not round_state.past_deadline(enough, 9.99)
    assert round_state.past_deadline(enough, 10.0)
    committed = round_state.at_deadline(enough, outstanding=2)
    abandoned = round_state.at_deadline(short, outstanding=0)

    assert committed.status == COMMITTED and enough.dropped == 2
    assert abandoned == Closing(
        ABANDONED, "only 1 reports by the deadline; the round needed 2", REPORTING, 1, 2, DEADLINE
    )
    assert short.dropped == 0
    round_state.close(short, abandoned, 11.0)
    assert (short.status, short.stopped_phase, short.devices_had, short.devices_needed) == (
        ABANDONED,
        REPORTING,
        1,
        2,
    )
    assert (short.ended_by, short.close_reason) == (DEADLINE, abandoned.reason)
    round_state.close(enough, committed, 11.0)
    assert (enough.stopped_phase, enough.ended_by, enough.close_reason) == (None, None, committed.reason)


def test_a_round_that_fell_short_because_reports_were_refused_says_so() -> None:
    refused, empty = Counts(reported=1, invalid=1, accepted=3), Counts()

    assert round_state.at_deadline(refused, outstanding=1).ended_by == REFUSALS
    nobody = round_state.at_deadline(empty, outstanding=0)
    assert (nobody.ended_by, nobody.had, nobody.needed) == (DEADLINE, 0, 2)
    assert nobody.reason.endswith("(no device checked in)")


def test_a_shortfall_before_the_deadline_is_put_down_to_dropouts() -> None:
    closing = round_state.shortfall("share_keys", 2, 3, 0, timed_out=False, reason="r")
    assert (closing.status, closing.phase, closing.ended_by) == (ABANDONED, "share_keys", DROPOUTS)


def test_admission_stops_at_capacity() -> None:
    assert round_state.admissible(accepted=0, capacity=4, wanted=3) == 3
    assert round_state.admissible(accepted=2, capacity=4, wanted=3) == 2
    assert round_state.admissible(accepted=5, capacity=4, wanted=3) == 0
