"""Wake the requests that wait for a secure round's phase to change (long-polling devices).

A device between two phases asks for the round's state with `?until=<phase>`, and the server
holds the answer until the phase has changed. The state machine announces a change once its
transaction has committed (`on_commit`), from whichever thread ran it; the waiting requests, on
the event loop, then read the state again. A change made by another server process is not
announced here: while requests wait, one watcher per process reads the open secure rounds'
phases every `recheck` seconds and announces any change (`watch`). One query a second for the
process, not one state read per waiting device a second: with a thousand devices waiting those
re-reads alone had the server busy, and grew with the devices times the phase's length.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Awaitable, Callable, Hashable, Iterator
from types import FrameType
from typing import Any


class PhaseChanges:
    """A counter of phase changes in this process, and the requests waiting for the next one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation = 0
        # A dict (insertion-ordered) rather than a list: a thousand waiters leave in O(1) each.
        self._waiters: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = {}
        # One watcher per event loop (tests run several apps, each on its own loop).
        self._watchers: dict[asyncio.AbstractEventLoop, asyncio.Task[None]] = {}
        # Loops whose server is stopping: their waits end at once.
        self._released: set[asyncio.AbstractEventLoop] = set()

    @property
    def generation(self) -> int:
        """Read before reading the state, and pass to `wait`: a change in between is not missed."""
        return self._generation

    def notify(self) -> None:
        """A secure round's phase changed (its transaction committed); thread-safe."""
        with self._lock:
            self._generation += 1
            waiters, self._waiters = self._waiters, {}
        for loop, future in waiters.values():
            with contextlib.suppress(RuntimeError):  # its loop has closed: nobody waits any more
                loop.call_soon_threadsafe(_wake, future)

    async def wait(self, seen: int, timeout: float) -> None:
        """Return once a phase changed after `seen` was read, or after `timeout` seconds."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        entry = (loop, future)
        with self._lock:
            if self._generation != seen or loop in self._released:
                return
            self._waiters[id(future)] = entry
        try:
            await asyncio.wait_for(future, max(0.0, timeout))
        except TimeoutError:
            pass
        finally:
            with self._lock:
                self._waiters.pop(id(future), None)

    def release(self, loop: asyncio.AbstractEventLoop) -> None:
        """The server on `loop` is stopping: wake its waiters, and let no new wait hold. Each held
        request then answers the state it read, and the server need not wait out the holds (up to
        the devices' own `wait`, 120 s) before it exits."""
        with self._lock:
            self._released.add(loop)
            mine = {key: entry for key, entry in self._waiters.items() if entry[0] is loop}
            for key in mine:
                del self._waiters[key]
        for _, future in mine.values():
            _wake(future)

    @contextlib.contextmanager
    def released_on_exit_signals(self) -> Iterator[None]:
        """While inside, SIGTERM and SIGINT also release the running loop's holds (after the
        handler in place, uvicorn's, has begun its graceful shutdown, which waits for every
        request in flight). Only the main thread receives signals; elsewhere this does nothing."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        before: dict[int, Any] = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

        def on_exit(sig: int, frame: FrameType | None) -> None:
            previous = before[sig]
            if callable(previous):
                previous(sig, frame)
            # A signal handler may run while this thread holds the lock: hand over to the loop.
            with contextlib.suppress(RuntimeError):  # the loop has closed already
                loop.call_soon_threadsafe(self.release, loop)

        for sig in before:
            signal.signal(sig, on_exit)
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)
            with self._lock:
                self._released.discard(loop)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def watch(self, read_phases: Callable[[], Awaitable[Hashable]], recheck: float) -> None:
        """Have one task on the running loop announce the changes other processes make: while
        requests wait, it calls `read_phases` (the open rounds' phases) every `recheck` seconds
        and notifies when the answer differs from the last. It ends once nobody waits; the next
        waiter starts it again."""
        loop = asyncio.get_running_loop()
        watcher = self._watchers.get(loop)
        if watcher is None or watcher.done():
            for other in [other for other in self._watchers if other.is_closed()]:
                del self._watchers[other]
            self._watchers[loop] = loop.create_task(self._watch(read_phases, recheck))

    async def _watch(self, read_phases: Callable[[], Awaitable[Hashable]], recheck: float) -> None:
        last = await read_phases()
        while True:
            await asyncio.sleep(recheck)
            if not self.waiting:
                return
            phases = await read_phases()
            if phases != last:
                self.notify()
            last = phases


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


# One per process: the state machine announces, the secure routes wait.
PHASE_CHANGES = PhaseChanges()
