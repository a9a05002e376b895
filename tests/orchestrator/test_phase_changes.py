"""Requests waiting for a secure round's phase to change are woken by the state machine's thread."""

from __future__ import annotations

import asyncio
import threading
import time

from orchestrator.rounds.secure.phase_changes import PhaseChanges


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


def test_a_change_made_by_another_process_wakes_the_waiters_through_one_watcher() -> None:
    # Prepare: the phases as the database holds them; another process changes them (no notify here)
    changes = PhaseChanges()
    phases = {"round 1": "share_keys"}
    reads = 0

    async def read_phases() -> frozenset[tuple[str, str]]:
        nonlocal reads
        reads += 1
        return frozenset(phases.items())

    async def scenario() -> float:
        seen = changes.generation
        for _ in range(50):  # fifty devices waiting, each asking the watcher to run
            changes.watch(read_phases, 0.05)
        asyncio.get_running_loop().call_later(0.3, phases.update, {"round 1": "masked_input"})
        started = time.monotonic()
        await asyncio.gather(*(changes.wait(seen, 30.0) for _ in range(50)))
        return time.monotonic() - started

    # Execute
    waited = asyncio.run(scenario())

    # Assert: all woke at the change, and the phases were read once per recheck for the process
    # (about 0.3 / 0.05 times), not once per waiting device
    assert 0.2 < waited < 10
    assert reads < 50


def test_a_stopping_server_releases_its_waiters_and_no_new_wait_holds() -> None:
    # Prepare
    changes = PhaseChanges()

    async def scenario() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        seen = changes.generation
        loop.call_later(0.2, changes.release, loop)  # the server was told to stop
        started = time.monotonic()
        await asyncio.gather(changes.wait(seen, 30.0), changes.wait(seen, 30.0))
        released_after = time.monotonic() - started
        started = time.monotonic()
        await changes.wait(seen, 30.0)  # a request that arrives after the signal
        return released_after, time.monotonic() - started

    # Execute
    released_after, new_wait = asyncio.run(scenario())

    # Assert: the held waits ended at the release, not at their 30 s limit; a new one does not hold
    assert 0.1 < released_after < 10
    assert new_wait < 1
