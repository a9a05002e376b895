"""Requests waiting for a secure round's phase to change are woken by the state machine's thread."""

from __future__ import annotations

import asyncio
import threading
import time

from orchestrator.phase_changes import PhaseChanges


def test_a_change_announced_from_another_thread_wakes_the_waiters_at_once() -> None:
    # Prepare
    changes = PhaseChanges()

    async def scenario() -> float:
        seen = changes.generation
        threading.Timer(0.2, changes.notify).start()  # a transaction committing on a worker thread
        started = time.monotonic()
        await asyncio.gather(changes.wait(seen, 30.0), changes.wait(seen, 30.0))
        return time.monotonic() - started

    # Execute
    waited = asyncio.run(scenario())

    # Assert: both woke when the change came, not at their 30 s limit
    assert 0.1 < waited < 10


def test_a_change_between_reading_the_state_and_waiting_is_not_missed() -> None:
    # Prepare: the waiter read the generation, then the phase changed before it began to wait
    changes = PhaseChanges()
    seen = changes.generation
    changes.notify()

    # Execute
    started = time.monotonic()
    asyncio.run(changes.wait(seen, 30.0))

    # Assert
    assert time.monotonic() - started < 5
