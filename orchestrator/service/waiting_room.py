"""Check-ins refused by a secure round's closed roster, held for the round that opens next.

A secure round takes check-ins only until its roster closes (about a second by day in the main
job); its four phases after that take several more, and every device that checked in meanwhile
was refused and told to come back at a random time over the next round (pace steering). The
next roster then filled only as fast as those devices trickled back: 1.8 s of a 5.6 s round at
the median in the secure main job, with about 240 refused check-ins a round, each a request for a
device and for the server.

The waiting room holds up to a round's capacity of those check-ins per population and process
instead, as the selectors of Bonawitz et al. (2019, section 4) hold connected devices until a
round needs them. A held check-in is a long poll like the phases' state reads: at each phase
change (`PHASE_CHANGES`, which a round's end announces) it checks in again, with whichever held
check-ins woke with it in one transaction, and is answered once it is admitted or refused for
another reason, or when its wait ends (the `wait` the device asked for, at most
`MAX_HOLD_SECONDS`, and not past the time it was told to come back): then with a fresh answer.
A device that asks for no wait, and check-ins beyond the room's places, are refused as before.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TypeGuard

from starlette.applications import Starlette

from contracts.protocol import Assignment
from orchestrator.rounds import checkins
from orchestrator.rounds.refusals import Refused
from orchestrator.rounds.secure.phase_changes import PHASE_CHANGES
from orchestrator.service.secure_states import open_phases

# However long a device says it can wait: the next round opens within seconds of a closed roster.
MAX_HOLD_SECONDS = 60.0
# Phase changes made by another server process are read this often while check-ins are held.
RECHECK_SECONDS = 1.0

Answer = Assignment | Refused


class WaitingRoom:
    """The check-ins held in this process, per population."""

    def __init__(self, app: Starlette, max_hold_seconds: float = MAX_HOLD_SECONDS) -> None:
        self._app = app
        self._max_hold = max_hold_seconds
        self._held: Counter[str] = Counter()

    async def check_in(
        self, population: str, check_in: Callable[[bool], Awaitable[Answer]], wait: float
    ) -> Answer:
        """`check_in(held)`'s answer; a refusal by a closed roster, while the room has a place for
        it and the device can `wait` (seconds), only after the device was held for the next round
        (`held`: checked in again)."""
        seen = PHASE_CHANGES.generation  # before the first answer: a change after it is not missed
        answer = await check_in(False)
        if not _waits(answer) or wait <= 0 or self._held[population] >= answer.waiting_places:
            return answer
        loop = asyncio.get_running_loop()
        give_up = loop.time() + min(self._max_hold, wait, answer.retry_after or 0.0)
        self._held[population] += 1
        try:
            while (left := give_up - loop.time()) > 0:
                PHASE_CHANGES.watch(self._open_phases, RECHECK_SECONDS)
                await PHASE_CHANGES.wait(seen, left)
                if PHASE_CHANGES.generation == seen:
                    break  # held to the end
                seen = PHASE_CHANGES.generation
                answer = await check_in(True)
                if not _waits(answer):
                    return answer
        finally:
            self._held[population] -= 1
        return await check_in(True)

    async def _open_phases(self) -> frozenset[tuple[int, str]]:
        return await open_phases(self._app)


def _waits(answer: Answer) -> TypeGuard[Refused]:
    return (
        isinstance(answer, Refused)
        and answer.reason == checkins.ROSTER_CLOSED
        and answer.waiting_places > 0
        and (answer.retry_after or 0.0) > 0
    )
