"""A device's example store as an idle device keeps it: closed, with what a check-in reads.

Between rounds a phone has no reason to hold its SQLite file open, and a simulated fleet of
thousands cannot afford to open it for every check-in attempt (most of which a full round turns
away). A check-in needs two things from the store: how many examples the device holds (the
server's example floor) and the participation log (the privacy policy's daily caps).
`IdleStore` keeps those in memory and opens the file only when the device is accepted into a
round (`opened()`), and once to read a log entry it has not seen.

It is the only writer of the log entries it holds (the device's agent writes them through it,
to the file first), so its copies stay exact. Its example count is the one it was given or last
read; each `opened()` reads it afresh, so examples the app adds count from the next round.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

from device_runtime.example_store import ExampleStore

# Open files an open store holds in a fleet: a connection (the file and its WAL) for each thread
# that touched it (the event loop's worker threads, the task runner's) and the shared -shm;
# measured 8.5 (tests/android_sim/test_idle_store_slots.py).
FILES_PER_OPEN_STORE = 10


def store_slots() -> int:
    """How many stores one process of a simulated fleet may hold open at once: half its
    open-files limit, the other half left to the devices' connections. The soft limit is raised
    to the hard one first (a fleet process holds thousands of files; the soft limit is the
    default for a process that holds a few). Without a bound, devices piling up in rounds (an
    abandoned round's still waiting for the task runner while the next one's are accepted) ran a
    100,000-device shard out of files: `sqlite3.OperationalError: unable to open database file`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):  # not allowed here: keep the soft limit
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(1, soft // 2 // FILES_PER_OPEN_STORE)


class IdleStore:
    __slots__ = ("_all_state", "_count", "_durable", "_open", "_slots", "_state", "path")

    def __init__(
        self,
        path: Path,
        num_examples: int | None = None,
        *,
        new: bool = False,
        durable: bool = True,
        slots: asyncio.Semaphore | None = None,
    ) -> None:
        """`num_examples`: what the store holds, when the caller knows (it wrote the store);
        otherwise the first `count()` opens the file to read it. `new`: the caller wrote the
        store with examples only, so it holds no local state and a first check-in need not open
        it (a fleet opened every device's file on its event loop for that). `durable=False`: the
        file is opened without waiting for the disk (`ExampleStore(durable=False)`), for a
        simulated device whose store is the run's own scratch file. `slots`: shared by a
        fleet's devices, bounds the stores its rounds hold open (`session()`) at once
        (`store_slots()`); a device accepted into a round waits for one."""
        self.path = path
        self._slots = slots
        self._durable = durable
        self._count = num_examples
        self._state: dict[str, bytes | None] | None = None  # local state entries read or written
        self._all_state = new  # `_state` holds every entry of the file (a key not in it has none)
        self._open: ExampleStore | None = None

    @contextmanager
    def opened(self) -> Iterator[ExampleStore]:
        """The store, open while the device takes part (nested calls share one open store)."""
        if self._open is not None:
            yield self._open
            return
        store = self._open = ExampleStore(self.path, durable=self._durable)
        try:
            self._count = store.count()
            yield store
        finally:
            self._open = None
            store.close()

    def count(self) -> int:
        """The examples the device holds (as last read, or as given)."""
        if self._open is not None:
            return self._count if self._count is not None else self._open.count()
        if self._count is None:
            with self.opened():
                pass
        assert self._count is not None
        return self._count

    @asynccontextmanager
    async def session(self, then: Callable[[], None] | None = None) -> AsyncIterator[ExampleStore]:
        """`opened()` for an event loop: the file opens and closes on a worker thread (closing
        it checkpoints its WAL, milliseconds of disk writes that would stall every device).
        `then` runs on the same thread hop as the opening, with the store open (the agent records
        the participation there): in a fleet each hop waits its turn among the devices admitted at
        once, so one hop instead of two or three shortens every admitted device's way to its keys."""
        if self._open is not None:
            if then is not None:
                await asyncio.to_thread(then)
            yield self._open
            return
        async with self._slots if self._slots is not None else contextlib.nullcontext():
            store = await asyncio.to_thread(self._open_for_round, then)
            try:
                yield store
            finally:
                self._open = None
                await asyncio.to_thread(store.close)

    def _open_for_round(self, then: Callable[[], None] | None) -> ExampleStore:
        store = self._open = ExampleStore(self.path, durable=self._durable)
        try:
            self._count = store.count()
            if then is not None:
                then()
        except BaseException:
            self._open = None
            store.close()
            raise
        return store

    def load_local_state(self, key: str) -> bytes | None:
        """An entry as last read or written; one not seen yet is read with every entry of its
        namespace (the part of its key up to its first '/'), so that a device's first check-in
        opens the file once for both of its participation counts."""
        state = self._state if self._state is not None else {}
        if key not in state and not self._all_state:
            namespace = key.partition("/")[0] + "/" if "/" in key else key
            with self.opened() as store:
                state.update(store.local_state_under(namespace))
            state.setdefault(key, None)
            self._state = state
        return state.get(key)

    def save_local_state(self, key: str, value: bytes) -> None:
        """Written to the file (opened for it, unless open), then kept."""
        with self.opened() as store:
            store.save_local_state(key, value)
        if self._state is None:
            self._state = {}
        self._state[key] = value
