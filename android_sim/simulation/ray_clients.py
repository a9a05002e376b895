"""The fast simulation's client tasks on Ray: `simulate --backend ray`.

Each Ray worker is a process with its own interpreter and a shard of the devices (device i on
worker i mod workers): it gets the export's files and its devices' examples once, packs their
batches itself and keeps their state (kept locals, negative draws) for the whole run. A round
sends each worker the round's globals (put once in the object store) and the names of its
sampled devices. Where the server's aggregation is the plain weighted mean, each worker adds up
its devices' reports itself and sends one partial sum (`federated.SummingPool`): the server's part
of a round then grows with the workers, not with the round's clients, and the sum differs from the
single-process run's only in float64 summation order. Otherwise (clipping, robust means, DP,
secure aggregation's arithmetic) the reports come back and are handed to the server in the sampled
order, as in the single-process run. The server (aggregation, optimizer) stays in the driver.

Ray runs locally (worker processes of this machine) unless given a cluster's address; a cluster's
nodes need this project installed at the driver's version (docs/how-to/simulate-on-ray.md).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray

from android_sim.simulation.clients import LocalClients, WorkKind, client_works
from android_sim.simulation.rounds import Devices, summed
from contracts.features import Examples
from contracts.manifest import Manifest, load_manifest
from contracts.params import Params
from contracts.task_config import TaskConfig
from model_runtime.tflite_model import EvaluationSums
from orchestrator.aggregation.weighted_mean import PartialSum

# How long the workers may take to start (a cluster may have to free or add CPUs first).
START_SECONDS = 300.0


class ShardWorker:
    """One Ray worker: its devices' tasks on one interpreter, the export in a directory of its own."""

    def __init__(self, model_files: dict[str, bytes], devices: dict[int, Examples], task: TaskConfig) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="simulation-worker-"))
        for name, content in model_files.items():
            (self._dir / name).write_bytes(content)
        pool = Devices(self._dir, 1)
        self._clients = LocalClients(pool, client_works(devices, pool.manifest, task))
        self._version = -1

    def ready(self) -> int:
        return os.getpid()

    def _install(self, version: int, params: list[ray.ObjectRef]) -> None:
        # The reference comes wrapped, so that a worker fetches a round's globals once, not per call.
        if version != self._version:
            values: Params = ray.get(params[0])
            # Writable copies: the object store's arrays are read-only views.
            self._clients.set_global({k: np.array(v) for k, v in values.items()})
            self._version = version

    def map(self, kind: WorkKind, users: list[int], version: int, params: list[ray.ObjectRef]) -> list[Any]:
        self._install(version, params)
        return self._clients.map(kind, users)

    def map_summed(
        self,
        kind: WorkKind,
        users: list[int],
        version: int,
        params: list[ray.ObjectRef],
        shapes: dict[str, tuple[int, ...]],
    ) -> tuple[PartialSum | None, int]:
        self._install(version, params)
        return summed(self._clients.map(kind, users), shapes)

    def evaluate(
        self, kind: WorkKind, users: list[int], version: int, params: list[ray.ObjectRef]
    ) -> EvaluationSums:
        self._install(version, params)
        return self._clients.evaluate(kind, users)

    def close(self) -> None:
        self._clients.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class RayClients:
    """The devices' tasks sharded over `workers` Ray workers (processes of this machine, or of the
    cluster at `address`); `set_global`, `map` and `evaluate` as `simulation.LocalClients`."""

    def __init__(
        self,
        model_dir: Path,
        devices: Sequence[Examples],
        task: TaskConfig,
        workers: int,
        address: str | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.manifest: Manifest = load_manifest(model_dir, verify_model=False)
        self.workers = workers
        self._started = not ray.is_initialized()
        if self._started:
            start(workers, address)
        files = {p.name: p.read_bytes() for p in sorted(Path(model_dir).iterdir()) if p.is_file()}
        files_ref = ray.put(files)
        actor = ray.remote(num_cpus=1)(ShardWorker)
        self._actors: list[Any] = []
        try:
            for w in range(workers):
                shard = {i: devices[i] for i in range(w, len(devices), workers)}
                self._actors.append(actor.remote(files_ref, shard, task))
            ready, pending = ray.wait(
                [a.ready.remote() for a in self._actors], num_returns=workers, timeout=START_SECONDS
            )
            if pending:
                raise RuntimeError(
                    f"{len(pending)} of {workers} Ray workers did not start within {START_SECONDS:.0f} s: "
                    f"the cluster has {cpus():.0f} CPUs, each worker takes "
                    "one (see `ray status`)"
                )
            ray.get(ready)  # raises what failed in a worker's start (e.g. the export would not load)
        except BaseException:
            self.close()
            raise
        self._params: list[ray.ObjectRef] = []
        self._version = 0

    def set_global(self, params: Params) -> None:
        self._params = [ray.put(params)]
        self._version += 1

    def _shards(self, users: Sequence[int]) -> list[list[int]]:
        shards: list[list[int]] = [[] for _ in self._actors]
        for u in users:
            shards[int(u) % self.workers].append(int(u))
        return shards

    def map(self, kind: WorkKind, users: Sequence[int]) -> list[Any]:
        """Every user's result, in the users' order (the order the server sums them in)."""
        shards = self._shards(users)
        calls = [
            actor.map.remote(kind, shard, self._version, self._params)
            for actor, shard in zip(self._actors, shards, strict=True)
            if shard
        ]
        by_user: dict[int, Any] = {}
        for shard, results in zip([s for s in shards if s], ray.get(calls), strict=True):
            by_user.update(zip(shard, results, strict=True))
        return [by_user[int(u)] for u in users]

    def map_summed(
        self, kind: WorkKind, users: Sequence[int], shapes: Mapping[str, tuple[int, ...]]
    ) -> tuple[list[PartialSum], int]:
        """Each worker's reports added up where they were made, in the workers' order: the
        server adds a partial a worker, not a report a client (its sum differs from adding the
        reports one by one only in float64 summation order)."""
        calls = [
            actor.map_summed.remote(kind, shard, self._version, self._params, dict(shapes))
            for actor, shard in zip(self._actors, self._shards(users), strict=True)
            if shard
        ]
        partials: list[PartialSum] = []
        refused = 0
        for part, diverged in ray.get(calls):
            if part is not None:
                partials.append(part)
            refused += diverged
        return partials, refused

    def evaluate(self, kind: WorkKind, users: Sequence[int]) -> EvaluationSums:
        calls = [
            actor.evaluate.remote(kind, shard, self._version, self._params)
            for actor, shard in zip(self._actors, self._shards(users), strict=True)
            if shard
        ]
        total = EvaluationSums.zero()
        for sums in ray.get(calls):
            total = total + sums
        return total

    def close(self) -> None:
        for actor in self._actors:
            with contextlib.suppress(ray.exceptions.RayError):  # a dead worker has nothing to clean
                ray.get(actor.close.remote())
            ray.kill(actor)
        self._actors = []
        if self._started and ray.is_initialized():
            ray.shutdown()
            self._started = False


def cpus() -> float:
    return float(ray.cluster_resources().get("CPU", 0))  # type: ignore[no-untyped-call]


def start(workers: int, address: str | None) -> None:
    """Connect to the cluster at `address`, or start Ray on this machine with a CPU per worker."""
    if address:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
        return
    ray.init(
        num_cpus=max(workers, os.cpu_count() or 1),
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        # The devices' data goes to each worker once; the rounds' globals and reports are small.
        object_store_memory=256 * 1024 * 1024,
        # Ray's workers run at niceness 15 by default: on a machine shared with other work they
        # would get what is left of the CPUs, where the threads backend competes at 0.
        _system_config={"worker_niceness": 0},
    )
