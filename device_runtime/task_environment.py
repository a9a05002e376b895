"""What the phone's core asks of the phone: its examples, its kept state, its keys, its conditions.

The core (a round's task, the secure round's device side, serving, the participation loop) takes
these interfaces and nothing more concrete, as the federated compute client's task environment
does, so that a port implements them with the platform's own parts:

- `ExampleSource`: the examples the app logged, read by a `Selection` (the SQLite `ExampleStore`
  is one; a port may read the app's own database);
- `KeptState`: a key-value store for what the device keeps between tasks (FURL's kept locals,
  the participation log, serving's cached reconstruction), never uploaded;
- `KeyStore`: the device's private signing key, kept apart from the examples (on a phone the
  platform's key store: Android Keystore, the iOS Keychain);
- `TaskEnvironment.should_continue`: the training conditions (charging, unmetered network, idle
  screen), asked between the task's steps; a False answer interrupts the task.

`Environment` puts parts together into a `TaskEnvironment`. Whatever a test harness or a
simulator adds (a slower phone, a store it keeps closed between rounds) plugs in from outside
through these interfaces; nothing here knows of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from contracts.features import Examples, FeatureSpec


@dataclass(frozen=True)
class Selection:
    """Which examples a read hands out: a time window, newest or oldest first, a cap."""

    since: float | None = None
    until: float | None = None
    limit: int | None = None
    newest_first: bool = True
    context: str | None = None


class ExampleSource(Protocol):
    """The examples the app logged on the device, column-wise per the model's feature spec."""

    @property
    def revision(self) -> int:
        """Changes whenever the examples do (serving caches a reconstruction per revision)."""
        ...

    def count(self) -> int: ...

    def examples(self, selection: Selection) -> Examples: ...

    def distinct_values(self, feature: str) -> np.ndarray:
        """The distinct values of an integer feature over every example (e.g. the items used)."""
        ...

    def mismatch(self, features: Sequence[FeatureSpec]) -> str | None:
        """Why these examples cannot feed a model of `features`, in one line; None when they can."""
        ...


class KeptState(Protocol):
    """A key-value store on the device for what it keeps between tasks; each save is atomic."""

    def load_local_state(self, key: str) -> bytes | None: ...

    def save_local_state(self, key: str, value: bytes) -> None: ...


class DeviceStore(ExampleSource, KeptState, Protocol):
    """One store holding both (the SQLite `ExampleStore` does)."""


class KeyStore(Protocol):
    """Where the device's private keys live, apart from its examples and kept state."""

    def load_key(self, name: str) -> bytes | None: ...

    def save_key(self, name: str, value: bytes) -> None: ...


class TaskEnvironment(Protocol):
    """What one task reads, keeps and asks."""

    @property
    def examples(self) -> ExampleSource: ...

    @property
    def state(self) -> KeptState: ...

    def should_continue(self) -> bool:
        """Whether the device's training conditions still hold (asked between the task's steps)."""
        ...


def always() -> bool:
    return True


@dataclass(frozen=True)
class Environment:
    """A `TaskEnvironment` of parts: `conditions` answers `should_continue`."""

    examples: ExampleSource
    state: KeptState
    conditions: Callable[[], bool] = always

    @classmethod
    def of(cls, store: DeviceStore, conditions: Callable[[], bool] = always) -> Environment:
        """One store for the examples and the kept state (the SQLite `ExampleStore`)."""
        return cls(store, store, conditions)

    def should_continue(self) -> bool:
        return self.conditions()


@runtime_checkable
class RoundStorage(Protocol):
    """A device's store as it may keep it between rounds: closed, with what a check-in reads (the
    example count, the participation log). `session(then)` opens it for one round, running `then`
    on it first, off the event loop. A store without `session` is simply open all along."""

    def count(self) -> int: ...

    def load_local_state(self, key: str) -> bytes | None: ...

    def save_local_state(self, key: str, value: bytes) -> None: ...

    def session(self, then: Callable[[], None]) -> AbstractAsyncContextManager[DeviceStore]: ...


@asynccontextmanager
async def open_store(store: DeviceStore, then: Callable[[], None]) -> AsyncIterator[DeviceStore]:
    """An open store's round: `then` runs on a worker thread (a commit), the store is as it was."""
    await asyncio.to_thread(then)
    yield store
