"""Wake the requests that wait for a secure round's phase to change (long-polling devices).

A device between two phases asks for the round's state with `?until=<phase>`, and the server
holds the answer until the phase has changed. The state machine announces a change once its
transaction has committed (`on_commit`), from whichever thread ran it; the waiting requests, on
the event loop, then read the state again. A change made by another server process is not
announced here: the waiters also read again every `recheck` seconds, which bounds the delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class PhaseChanges:
    """A counter of phase changes in this process, and the requests waiting for the next one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation = 0
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    @property
    def generation(self) -> int:
        """Read before reading the state, and pass to `wait`: a change in between is not missed."""
        return self._generation

    def notify(self) -> None:
        """A secure round's phase changed (its transaction committed); thread-safe."""
        with self._lock:
            self._generation += 1
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # its loop has closed: nobody waits any more
                loop.call_soon_threadsafe(_wake, future)

    async def wait(self, seen: int, timeout: float) -> None:
        """Return once a phase changed after `seen` was read, or after `timeout` seconds."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        entry = (loop, future)
        with self._lock:
            if self._generation != seen:
                return
            self._waiters.append(entry)
        try:
            await asyncio.wait_for(future, max(0.0, timeout))
        except TimeoutError:
            pass
        finally:
            with self._lock, contextlib.suppress(ValueError):
                self._waiters.remove(entry)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


# One per process: the state machine announces, the secure routes wait.
PHASE_CHANGES = PhaseChanges()
