"""Buffered asynchronous rounds (FedBuff) in one process: the orchestrator's `rounds: buffered`.

`concurrency` devices train at once, each on the version current when it started, for a time
drawn from a log-normal (the fleet's slow tiers make a long tail); the earliest to finish reports
next. Its report goes into the buffer weighted by the orchestrator's own staleness function
(`orchestrator.aggregation.staleness`), or is refused past `max_staleness`; every `buffer_size`
reports the server commits a version through the same `Server` (the orchestrator's pipeline and
optimizer) as a synchronous round, and a device that finished is replaced by another, not
training, drawn uniformly. Time is simulated (a unit is a median task), not the wall clock.

The reports are computed in batches: when the next finisher's report is needed, every device in
flight whose report is not computed yet is run, grouped by the version it trains on, so the
thread pool gets about `concurrency` tasks at a time.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from android_sim.simulation.rounds import ClientPool, Report, Rounds, Server, TrainingRun, W_contra
from contracts.params import Params
from orchestrator.aggregation.staleness import STALENESS_WEIGHTINGS, staleness_weight


@dataclass(frozen=True)
class Buffering:
    """A buffered population's settings (`buffered.*`) and how long its devices take."""

    buffer_size: int = 20
    concurrency: int = 26
    staleness_weighting: str = "inverse_sqrt"
    max_staleness: int = 10
    duration_sigma: float = 0.5  # log-normal spread of a device's training time (median 1)

    def __post_init__(self) -> None:
        for name in ("buffer_size", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.staleness_weighting not in STALENESS_WEIGHTINGS:
            raise ValueError(
                f"staleness_weighting must be one of {', '.join(STALENESS_WEIGHTINGS)}, "
                f"got {self.staleness_weighting!r}"
            )
        if not 0 <= self.duration_sigma <= 5:
            raise ValueError(f"duration_sigma must be in [0, 5], got {self.duration_sigma}")


@dataclass
class BufferedStats:
    """What the buffers took: reports counted (by staleness), refused as stale, diverged."""

    counted_by_staleness: Counter[int] = field(default_factory=Counter)
    stale: int = 0
    diverged: int = 0
    simulated_time: float = 0.0

    def to_json(self) -> dict[str, Any]:
        counted = sum(self.counted_by_staleness.values())
        finished = counted + self.stale
        total = sum(s * n for s, n in self.counted_by_staleness.items())
        return {
            "counted": counted,
            "refused_stale": self.stale,
            "diverged": self.diverged,
            "counted_share": counted / finished if finished else 0.0,
            "staleness_mean": total / counted if counted else 0.0,
            "staleness_histogram": {str(s): n for s, n in sorted(self.counted_by_staleness.items())},
            "simulated_time": round(self.simulated_time, 3),
        }


@dataclass(order=True)
class _Training:
    finish: float
    number: int  # ties broken by start order
    user: int = field(compare=False)
    version: int = field(compare=False)


def train_buffered(
    devices: ClientPool[W_contra],
    server: Server,
    train_users: Sequence[int],
    work: W_contra,
    rounds: Rounds,
    buffering: Buffering,
    validate: Callable[[Params], dict[str, float]],
) -> tuple[TrainingRun, BufferedStats]:
    """Commit `rounds.rounds` versions of `buffering.buffer_size` reports each; validate every
    `rounds.evaluate_every` versions (and after the last)."""
    if buffering.concurrency > len(train_users):
        raise ValueError(
            f"concurrency {buffering.concurrency} exceeds the {len(train_users)} training devices"
        )
    rng = np.random.default_rng(rounds.sampling_seed)
    population = np.asarray(train_users)
    run, stats = TrainingRun(server.params), BufferedStats()
    started = time.perf_counter()
    run.curve.append({"round": 0, **validate(server.params)})
    versions: dict[int, Params] = {0: server.params}
    in_flight: list[_Training] = []
    busy: set[int] = set()
    reports: dict[int, Report] = {}  # by start number, computed in batches
    starts = current = 0

    def start(now: float) -> None:
        nonlocal starts
        user = int(rng.choice(population))
        while user in busy:
            user = int(rng.choice(population))
        busy.add(user)
        duration = float(rng.lognormal(0.0, buffering.duration_sigma))
        heapq.heappush(in_flight, _Training(now + duration, starts, user, current))
        starts += 1

    def compute() -> None:
        waiting: dict[int, list[_Training]] = {}
        for training in in_flight:
            if training.number not in reports:
                waiting.setdefault(training.version, []).append(training)
        for version, group in sorted(waiting.items()):
            devices.set_global(versions[version])
            for training, report in zip(group, devices.map(work, [t.user for t in group]), strict=True):
                reports[training.number] = report

    for _ in range(buffering.concurrency):
        start(0.0)
    buffer: list[Report] = []
    while current < rounds.rounds:
        finished = heapq.heappop(in_flight)
        if finished.number not in reports:
            heapq.heappush(in_flight, finished)
            compute()
            heapq.heappop(in_flight)
        report = reports.pop(finished.number)
        busy.discard(finished.user)
        stats.simulated_time = finished.finish
        staleness = current - finished.version
        if report is None:  # diverged: the device aborts, nothing reaches the buffer
            stats.diverged += 1
        elif staleness > buffering.max_staleness:
            stats.stale += 1
        else:
            stats.counted_by_staleness[staleness] += 1
            delta, weight = report
            buffer.append((delta, weight * staleness_weight(buffering.staleness_weighting, staleness)))
        if len(buffer) == buffering.buffer_size:
            run.refused += server.commit(buffer)
            buffer = []
            current += 1
            versions[current] = server.params
            oldest = min([t.version for t in in_flight], default=current)
            for old in [v for v in versions if v < oldest]:
                del versions[old]  # no device in flight trains on it any more
            if current % rounds.evaluate_every == 0 or current == rounds.rounds:
                run.curve.append({"round": current, **validate(server.params)})
        start(finished.finish)  # its place is taken at once, on the version now current
    run.params = server.params
    run.seconds = time.perf_counter() - started
    return run, stats
