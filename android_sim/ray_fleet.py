"""The HTTP fleet sharded over Ray actors: `run --shards N`.

One process's event loop drives at most a few hundred check-ins a second; with `--shards N` the
devices are split over N Ray actors (device i in shard i mod N), each a `Fleet` of its devices
on its own event loop and task threads, against the same orchestrator URL. The run's driver keeps
what the run needs of the whole fleet: the monitor's settings go to every shard (the open
evaluation round, training paused, stop), and the shards' counters and devices come back, merged,
for the monitor, the report and the plots, which read a `RayFleet` as they read a `Fleet`.

The shards open the devices' example stores by path: they run on this machine, or on machines
that mount the work directory at the same path (a shard that cannot see its stores stops the run
before it starts, with one line that says so).
"""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray

from android_sim.fleet import HELD_OUT, TRAINING, DeviceSpec, Fleet, FleetOptions, FleetStats, start_seconds
from android_sim.network import Connector
from android_sim.profiles import DAY, SimClock
from android_sim.run_config import RunError
from device_runtime.task_runner import TaskRunner

STATE_SECONDS = 0.5  # how often the driver refreshes the counters and pushes the monitor's settings


@dataclass(frozen=True)
class DeviceState:
    """What the driver keeps of a shard's device (the lean fields, no connection)."""

    device_id: str
    token: str | None
    outcomes: dict[str, int]
    trained: bool
    evaluated_round: int | None
    bytes_up: int
    bytes_down: int


class FleetShard:
    """One Ray actor: a `Fleet` of some of the devices, with its own event loop and task threads."""

    def __init__(
        self,
        base_url: str,
        specs: list[DeviceSpec],
        indices: list[int],
        cache_dir: Path,
        threads: int,
        day_seconds: float,
        clock: tuple[float, float],
        options: FleetOptions,
    ) -> None:
        sim_now, sent_at = clock  # the driver's simulated time when it sent it, and the wall time then
        start = sim_now + (time.time() - sent_at) * DAY / day_seconds
        self.runner = TaskRunner(threads)
        self.fleet = Fleet(
            base_url, Connector(), specs, cache_dir, self.runner, SimClock(day_seconds, start), options
        )
        for device, index in zip(self.fleet.devices, indices, strict=True):
            device.index = index  # the fleet's numbering, in the shard's messages too

    def unseen_store(self) -> str:
        """'' when this shard sees its devices' example stores, else which one it does not."""
        for device in self.fleet.devices:
            if not device.store_path.is_file():
                return f"shard on {socket.gethostname()} sees no example store at {device.store_path}"
        return ""

    async def enroll(self) -> list[DeviceState]:
        await self.fleet.enroll()
        return self.devices()

    async def run(self) -> None:
        await self.fleet.run()

    def configure(self, evaluation_round: int | None, training_paused: bool) -> FleetStats:
        """The monitor's settings in; the shard's counters out."""
        self.fleet.evaluation_round = evaluation_round
        self.fleet.training_paused = training_paused
        return self.fleet.stats

    def stop(self, roles: list[str]) -> None:
        self.fleet.stop(roles)

    async def switch_off(self, grace_seconds: float) -> int:
        return await self.fleet.switch_off(grace_seconds)

    def devices(self) -> list[DeviceState]:
        return [
            DeviceState(
                d.device_id,
                d.token,
                dict(d.outcomes),
                d.trained,
                d.evaluated_round,
                d.bytes_up,
                d.bytes_down,
            )
            for d in self.fleet.devices
        ]

    async def close(self) -> None:
        await self.fleet.aclose()
        self.runner.close()


def merged(stats: Sequence[FleetStats]) -> FleetStats:
    """The shards' counters as one fleet's."""
    total = FleetStats()
    for s in stats:
        total.outcomes.update(s.outcomes)
        total.left_because.update(s.left_because)
        total.in_task += s.in_task
        total.waiting_for_server = max(total.waiting_for_server, s.waiting_for_server)
        total.task_seconds.extend(s.task_seconds)
        total.central_bytes.extend(s.central_bytes)
        total.last_error = s.last_error or total.last_error
        total.switched_off += s.switched_off
        total.checkin_ms.update(s.checkin_ms)
        total.loop_lag_ms.update(s.loop_lag_ms)
    return total


class RayFleet(Fleet):
    """A `Fleet` whose devices run in Ray actors (`start` them after building it as a `Fleet`);
    this object holds their merged counters and, after enrollment and after the run, their
    devices' state (so that serving and the report read it as one fleet's; a device the driver
    serves from connects from here)."""

    _shards: Sequence[Any] = ()  # the actors, from `start`
    _started = False

    def start(self, shards: int, threads: int, address: str | None = None) -> RayFleet:
        """Start the shards (this object is built as a `Fleet` is): `shards` actors of `threads`
        task threads each, on a local Ray instance, or on the cluster at `address`."""
        if shards < 2:
            raise ValueError(f"a sharded fleet needs at least 2 shards, got {shards}")
        self._started = not ray.is_initialized()
        if self._started:
            if address:
                ray.init(address=address, log_to_driver=False, configure_logging=False)
            else:
                ray.init(
                    num_cpus=max(shards, os.cpu_count() or 1),
                    include_dashboard=False,
                    log_to_driver=False,
                    configure_logging=False,
                    _system_config={"worker_niceness": 0},  # see ray_clients.start
                )
        actor = ray.remote(num_cpus=1)(FleetShard)
        # Absolute paths: on a cluster the work directory is mounted at the same path everywhere.
        specs = [
            DeviceSpec(d.role, d.profile, d.store_path.resolve(), d.num_examples, d.new_store)
            for d in self.devices
        ]
        clock = (self.clock.now(), time.time())
        # The whole fleet's start spread: each shard's devices start over it, as one fleet's would.
        start = self.options.start_seconds
        if start is None:
            start = start_seconds(len(self.devices))
        self._shards = [
            actor.remote(
                self.base_url,
                specs[s::shards],
                list(range(s, len(specs), shards)),
                self.cache_dir.resolve(),
                threads,
                self.clock.day_seconds,
                clock,
                # Each shard its own draws.
                replace(self.options, seed=self.options.seed * 1_000 + s, start_seconds=start),
            )
            for s in range(shards)
        ]
        unseen = [m for m in ray.get([a.unseen_store.remote() for a in self._shards]) if m]
        if unseen:
            for a in self._shards:
                ray.kill(a)
            self._shards = ()
            if self._started:
                ray.shutdown()
                self._started = False
            raise RunError(
                f"{unseen[0]}; the shards open the devices' example stores by path: on a cluster of "
                "several machines, put --work-dir on storage that every machine mounts at the same path"
            )
        return self

    def _merge_devices(self, shard: int, states: Sequence[DeviceState]) -> None:
        for device, state in zip(self.devices[shard :: len(self._shards)], states, strict=True):
            device.device_id, device.token = state.device_id, state.token
            device.outcomes = collections.Counter(state.outcomes)
            device.trained, device.evaluated_round = state.trained, state.evaluated_round
            device.bytes_up, device.bytes_down = state.bytes_up, state.bytes_down

    async def _refresh(self) -> None:
        configure = (a.configure.remote(self.evaluation_round, self.training_paused) for a in self._shards)
        self.stats = merged(await asyncio.gather(*configure))

    async def _collect_devices(self) -> None:
        for shard, states in enumerate(await asyncio.gather(*(a.devices.remote() for a in self._shards))):
            self._merge_devices(shard, states)

    async def enroll(self, concurrency: int = 32) -> None:
        for shard, states in enumerate(await asyncio.gather(*(a.enroll.remote() for a in self._shards))):
            self._merge_devices(shard, states)

    async def run(self) -> None:
        """Run every shard until `stop()`; the counters and the monitor's settings meanwhile."""
        for event in self._stop.values():
            event.clear()
        runs = [asyncio.ensure_future(a.run.remote()) for a in self._shards]
        try:
            while not all(r.done() for r in runs):
                await asyncio.wait(runs, timeout=STATE_SECONDS)
                await self._refresh()
            for r in runs:
                r.result()  # raises what stopped a shard
        finally:
            await self._refresh()
            await self._collect_devices()

    def stop(self, roles: Sequence[str] = (TRAINING, HELD_OUT)) -> None:
        super().stop(roles)
        for a in self._shards:
            a.stop.remote(list(roles))

    async def switch_off(self, grace_seconds: float) -> int:
        super().stop()
        counts = await asyncio.gather(*(a.switch_off.remote(grace_seconds) for a in self._shards))
        await self._refresh()  # the shards counted theirs
        return sum(counts)

    async def aclose(self) -> None:
        if self._shards:
            await asyncio.gather(*(a.close.remote() for a in self._shards), return_exceptions=True)
            for a in self._shards:
                ray.kill(a)
            self._shards = ()
        await super().aclose()
        if self._started and ray.is_initialized():
            ray.shutdown()
            self._started = False
