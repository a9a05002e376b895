"""Pace steering: a device turned away from a full round comes back at a random time in a window
sized so that each round sees about `CHECKINS_PER_SLOT` times the check-ins it admits.

Without it, every device turned away came back at the round's deadline: a population many times a
round's capacity checked in all at once, round after round (100,000 phones for rounds of 1,000
made the server and the fleet answer about 100,000 refusals a round, and no round committed in
time). Bonawitz et al., "Towards Federated Learning at Scale" (2019), section 2.3, steer the same
way: randomized reconnection times, so that devices connect as often as the rounds need, not more.

The window is a small controller over rounds. A round opens with its predecessor's window
scaled by how far that round's check-ins were from the wanted number (a square root of the
ratio, since the devices turned away in one round return over the next few; at most 2x either
way); the first round's
window is its own duration. It is kept on the round's row (`Round.checkin_window`), written when
the round opens and read with it: a refusal adds no statement.
"""

from __future__ import annotations

import math

# Check-ins wanted per round, in multiples of its capacity: enough that a round fills in a
# fraction of its time (about 1/4 of it if they arrive evenly), few enough that the server and
# the devices spend little on refusals.
CHECKINS_PER_SLOT = 4.0
# At most this factor a round, either way: a round no device checked in to (a fleet still
# starting, a quiet night) once collapsed the window from 300 s to 4 s, and the next round's
# crowd then came back all at once.
MAX_STEP = 2.0
MIN_WINDOW_SECONDS = 1.0
MAX_WINDOW_SECONDS = 7 * 86_400.0  # a week: a device of a very large population takes part rarely


def next_window(previous: float | None, checked_in: int, capacity: int, duration: float) -> float:
    """The window for a round that opens now: `duration` (its own) for the first round, else its
    predecessor's window (`previous`; None before any round or before pace steering) corrected
    towards CHECKINS_PER_SLOT x `capacity` check-ins, from the `checked_in` the predecessor saw."""
    if previous is None:
        return _bounded(duration)
    wanted = CHECKINS_PER_SLOT * max(capacity, 1)
    step = min(MAX_STEP, max(1.0 / MAX_STEP, math.sqrt(max(checked_in, 1) / wanted)))
    return _bounded(previous * step)


def come_back_in(window: float | None, floor: float, until_deadline: float, draw: float) -> float:
    """Seconds until a device turned away from a full round should check in again: a uniform
    `draw` in [0, 1) over the round's `window`, at least `floor` (the population's
    `retry_after_seconds`). A round opened before pace steering has no window: its deadline."""
    if window is None:
        return max(floor, until_deadline)
    return max(floor, draw * window)


def come_back_after_round(window: float | None, floor: float, until_deadline: float, draw: float) -> float:
    """Seconds until a device that this round cannot take (too few examples) should check in again:
    after the round's deadline, a uniform `draw` over the `window` later (at least `floor`). At the
    deadline itself, every such device of a large population came back at the next round's opening
    (4,299 at once a round at 100,000 devices)."""
    if window is None:
        return max(floor, until_deadline)
    return max(floor, until_deadline + draw * window)


def _bounded(window: float) -> float:
    return min(MAX_WINDOW_SECONDS, max(MIN_WINDOW_SECONDS, window))
