"""The secure phases of the round state machine: phases, deadlines and per-phase counts.

A secure round (Bonawitz et al. 2017; SecAgg+) is an open round whose reports are replaced by
phases, each with its own deadline:

    advertise --(capacity devices advertised keys, or stragglers, or deadline)--> share_keys
    share_keys --(every advertiser sent shares, or stragglers, or deadline)-----> masked_input
    masked_input --(target inputs, every sharer's, or stragglers, or deadline)--> consistency
    consistency --(every survivor confirmed, or stragglers, or deadline)--------> unmasking
    unmasking --(the sum can be unmasked, every survivor answered, or deadline)--> done
    any phase --closes with fewer devices than the round needs-----------------> abandoned

Pure, like `round_state`: no database, no HTTP status, no cryptography. It knows a round's phase,
its deadline and its counters, and decides; `secure_phases` acts on its verdicts (drops the devices
a closed phase left behind, checks what only the protocol's maths can say: whether the sum can be
unmasked).

The counters live on the secure round's row (`secure_rounds`) and each event moves them by one
statement (`round_counts.count_secure`): how many devices reached each stage (advertised keys,
shared them, sent a masked input, confirmed the survivors, answered the unmasking) and how many
left at each stage (aborted, or dropped when a phase closed without them). Devices still open at
a stage are then those that reached it, less those that went on, less those that left there: a
phase's condition costs nothing per message, however many devices the round has.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from orchestrator.rounds.state import Closing, Count, shortfall

ADVERTISE, SHARE_KEYS, MASKED_INPUT, CONSISTENCY, UNMASKING, DONE = (
    "advertise",
    "share_keys",
    "masked_input",
    "consistency",
    "unmasking",
    "done",
)
PHASES = (ADVERTISE, SHARE_KEYS, MASKED_INPUT, CONSISTENCY, UNMASKING)
NEXT = dict(zip(PHASES, (*PHASES[1:], DONE), strict=True))

# A device's stage: how far it got. 0: checked in (the round's `accepted` counts them); then each
# phase's message. REACHED[s]: the counter of devices that reached stage s (s >= 1).
REACHED = ("accepted", "advertised", "sharers", "senders", "signers", "responders")
# LEFT[s]: devices whose assignment closed at stage s (aborted, or dropped by a phase's close).
# Past stage 3 nobody's leaving changes a phase's condition, so it is not counted.
LEFT = ("left_before_keys", "left_before_shares", "left_before_input", "left_before_confirmation")
COUNTERS = (*REACHED[1:], *LEFT)
# The stage a phase's message takes its device to.
STAGE_OF_MESSAGE = {phase: stage for stage, phase in enumerate(PHASES, start=1)}
# What a phase's close keeps: devices at this stage or past it; the others are dropped. (The
# consistency phase keeps only the confirmed among its signers, which no counter tells apart.)
KEPT_AT_CLOSE = {ADVERTISE: 1, SHARE_KEYS: 2, MASKED_INPUT: 3, CONSISTENCY: 4}
ALL = len(LEFT)  # a round that ends: nobody stays at a counted stage
_WHAT = {
    ADVERTISE: "advertised keys",
    SHARE_KEYS: "shared keys",
    MASKED_INPUT: "sent their masked input",
    CONSISTENCY: "confirmed the survivors",
}


class PhaseCounters(Protocol):
    """What the machine reads of a secure round's row: its counters."""

    advertised: int
    sharers: int
    senders: int
    signers: int
    responders: int
    left_before_keys: int
    left_before_shares: int
    left_before_input: int
    left_before_confirmation: int


@dataclass(frozen=True)
class Counts:
    """A round's phase conditions ("open": an assignment neither dropped nor finished)."""

    advertised: int
    waiting: int  # open assignments that have not advertised keys
    sharers: int
    open_unshared: int  # open advertisers that have not sent shares
    senders: int
    open_unsent: int  # open sharers without a masked input
    signers: int
    open_unsigned: int  # open senders without a confirmation
    responders: int


def reached(row: PhaseCounters, accepted: int) -> list[int]:
    return [accepted, *(int(getattr(row, name)) for name in REACHED[1:])]


def open_at(row: PhaseCounters, accepted: int) -> list[int]:
    """Devices still open at each counted stage."""
    got = reached(row, accepted)
    return [got[s] - got[s + 1] - int(getattr(row, LEFT[s])) for s in range(len(LEFT))]


def counts_of(row: PhaseCounters, accepted: int) -> Counts:
    """The phase conditions from the row's counters and the round's admitted check-ins."""
    waiting, unshared, unsent, unsigned = open_at(row, accepted)
    return Counts(
        row.advertised,
        waiting,
        row.sharers,
        unshared,
        row.senders,
        unsent,
        row.signers,
        unsigned,
        row.responders,
    )


def message(phase: str) -> Count:
    """A device's message in `phase`, accepted: it reached that phase's stage."""
    return Count({REACHED[STAGE_OF_MESSAGE[phase]]: 1})


def stage(advertised: bool, sent: Mapping[str, bool]) -> int:
    """A device's stage from its participant's flags (`advertised`: it has a participant; `sent`:
    each phase's message sent or not, by phase)."""
    if not advertised:
        return 0
    return 1 + sum(1 for phase in PHASES[1:] if sent.get(phase, False))


def leaving(at: int) -> Count:
    """A device at stage `at` leaves (aborts): one fewer open there."""
    return Count({LEFT[at]: 1} if at < len(LEFT) else {})


def dropped_below(row: PhaseCounters, accepted: int, kept: int) -> Count:
    """A phase closes, dropping every open device below stage `kept` (ALL: the round ends)."""
    return Count({LEFT[s]: n for s, n in enumerate(open_at(row, accepted)[:kept]) if n})


@dataclass(frozen=True)
class Rules:
    """What a round's settings say about its phases."""

    enough: int  # devices a phase needs to go on (the round's minimum, never fewer than 3)
    capacity: int  # check-ins the roster takes
    target: int  # masked inputs that close their phase
    straggler_wait: float | None  # see `phase_over`
    patient_until: float  # the latest the advertise phase may wait for `enough` devices
    seconds: Mapping[str, float]  # each phase's length from its opening


@dataclass(frozen=True)
class Verdict:
    """A tick of the machine on the current phase: whether it is over, whether by its deadline,
    and the phase's deadline as it now stands (patience and stragglers move it)."""

    over: bool
    timed_out: bool
    deadline: float


def phase_over(
    phase: str,
    n: Counts,
    accepted: int,
    rules: Rules,
    now: float,
    deadline: float,
    started: float,
    unmaskable: Callable[[], bool],
) -> Verdict:
    """Whether `phase` (not the unmasking: `unmasking_over`) closes now. `unmaskable`: whether the
    masked inputs in so far could be unmasked, asked only when the answer matters (it costs the
    protocol's check)."""
    timed_out = now >= deadline
    if phase == ADVERTISE:
        # Devices advertise as they check in: the roster closes with the round's check-ins.
        full = accepted >= rules.capacity
        if timed_out and n.advertised < rules.enough and deadline < rules.patient_until:
            # Too few by the deadline: wait once more, so that the check-ins of a slow hour add up
            # to one round instead of several abandoned ones.
            deadline, timed_out = rules.patient_until, False
        # A device that vanished between its check-in and its keys holds a full roster open.
        if timed_out or (full and not n.waiting):
            return Verdict(True, timed_out, deadline)
        return _stragglers(rules, full and n.advertised >= rules.enough, now, deadline, started)
    if phase == SHARE_KEYS:
        if timed_out or not n.open_unshared:
            return Verdict(True, timed_out, deadline)
        return _stragglers(rules, n.sharers >= rules.enough, now, deadline, started)
    if phase == MASKED_INPUT:
        if timed_out or n.senders >= rules.target or not n.open_unsent:
            return Verdict(True, timed_out, deadline)
        # Enough to stop waiting for stragglers only if these inputs could be unmasked: else the
        # round would end abandoned at the unmasking however it went, while the slower phones
        # still training might have made it.
        waits = rules.straggler_wait is not None and n.senders >= rules.enough
        return _stragglers(rules, waits and unmaskable(), now, deadline, started)
    if phase == CONSISTENCY:
        if timed_out or not n.open_unsigned:
            return Verdict(True, timed_out, deadline)
        # (a confirmation is one round trip: none is a straggler at the phase's first instant)
        return _stragglers(rules, n.signers >= rules.enough and now > started, now, deadline, started)
    raise ValueError(f"phase_over decides the phases before the unmasking, not {phase!r}")


def _stragglers(rules: Rules, enough: bool, now: float, deadline: float, started: float) -> Verdict:
    """Whether the phase stops waiting for the devices that have not answered yet.

    A device that vanished silently is still active until the phase's deadline, which must leave
    room for the slowest phone. Once `enough` devices have answered to go on, the phase waits for
    the rest at most `straggler_wait` times as long as it took to get there (a deadline sized from
    this round's own pace); the configured deadline still applies."""
    if rules.straggler_wait is None or not enough:
        return Verdict(False, False, deadline)
    deadline = min(deadline, now + rules.straggler_wait * (now - started))
    return Verdict(now >= deadline, False, deadline)


def unmasking_over(can_unmask: bool, timed_out: bool, everyone_answered: bool) -> bool:
    """The unmasking closes once the answers can unmask the sum, or no more can come."""
    return can_unmask or timed_out or everyone_answered


def next_deadline(phase: str, rules: Rules, now: float) -> tuple[str, float]:
    """The phase after `phase`, opening now, and its deadline."""
    following = NEXT[phase]
    return following, now + rules.seconds.get(following, 0.0)


def had(phase: str, n: Counts) -> int:
    """The devices that took part in `phase` by its close (the consistency phase: its signers,
    of whom only the confirmed go on; `secure_phases` counts those)."""
    return (n.advertised, n.sharers, n.senders, n.signers)[PHASES.index(phase)]


def too_few(phase: str, count: int, rules: Rules, refused: int, timed_out: bool) -> Closing | None:
    """A phase that closed with fewer than `enough` devices abandons the round (REFUSALS if the
    `refused` messages would have made up the difference)."""
    if count >= rules.enough:
        return None
    what = _WHAT[phase]
    reason = f"only {count} devices {what} in the {phase} phase; a secure round needs at least {rules.enough}"
    return shortfall(phase, count, rules.enough, refused, timed_out, reason)
