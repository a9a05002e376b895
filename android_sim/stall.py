"""Why a fleet run saw no training round commit: read from the rounds that closed meanwhile, so
that the message points at the cause it saw rather than at one guess."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def stall_message(seconds: float, closed_since: Sequence[dict[str, Any]], last_problem: str) -> str:
    """The run's one-line error after `seconds` without a commit; `closed_since`: the training
    rounds that closed (abandoned) since the last commit, as the admin API lists them."""
    late = sum(int(r["counters"]["late"]) for r in closed_since)
    reported = sum(int(r["counters"]["reported"]) for r in closed_since)
    checked_in = sum(int(r["counters"]["checked_in"]) for r in closed_since)
    head = f"no training round committed for {seconds:.0f} s"
    problem = f" (last problem: {last_problem})" if last_problem else ""
    if late:
        # The devices took part, but their reports came after the deadline: a slow (or starved)
        # machine, not too few devices.
        return (
            f"{head}: {late} reports arrived after their round's deadline ({reported} in time, "
            f"{len(closed_since)} rounds abandoned){problem}; the devices train slower than the "
            "deadline allows (a busy CPU?): raise --round-seconds (or --stall-seconds)"
        )
    if closed_since and checked_in == 0:
        return (
            f"{head}: no device checked in to the last {len(closed_since)} rounds{problem}; are enough "
            "devices eligible? Try more --devices, or a shorter --day-seconds"
        )
    if closed_since:
        return (
            f"{head}: {checked_in} check-ins and {reported} reports in the last {len(closed_since)} "
            f"rounds were too few to commit one{problem}; try more --devices, a lower "
            "--target-reports or --min-examples"
        )
    return (
        f"{head}, and no round closed meanwhile{problem}; are enough devices eligible? Try more "
        "--devices, a lower --target-reports or --min-examples, or a higher --stall-seconds"
    )
