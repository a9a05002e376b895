"""How many cores a benchmark run actually got, on a machine shared with other jobs: the load
average, a CPU probe, and the CPU seconds of this process and of named worker processes."""

from __future__ import annotations

import os
import threading
import time


def load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _spin(n: int) -> float:
    t0 = time.perf_counter()
    x = 0
    for i in range(n):
        x ^= i
    return time.perf_counter() - t0


def cpu_probe(n: int = 20_000_000) -> float:
    """How many cores' worth of work 2 processes got, running the same loop as 1 did alone."""
    import multiprocessing

    alone = _spin(n)
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        pool.map(_spin, [1000, 1000])  # started
        t0 = time.perf_counter()
        pool.map(_spin, [n, n])
        together = time.perf_counter() - t0
    return 2 * alone / together


class CpuMeter:
    """CPU seconds and wall time of this process and of the processes whose command line names
    `worker` (Ray sets an actor's to `ray::ClassName`), sampled every 0.2 s: what share of the
    cores a configuration actually got, on a machine shared with other jobs. A worker's CPU is
    counted from when it is first seen as that actor (its process start is not)."""

    def __init__(self, worker: str = "") -> None:
        self.worker = worker
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self.rss_kb: dict[int, float] = {}  # each worker's resident memory when last seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while not self._stop.wait(0.2):
            for pid in _pids(self.worker) if self.worker else []:
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue  # gone meanwhile
                cpu = (int(fields[11]) + int(fields[12])) / tick
                self._first.setdefault(pid, cpu)
                self._last[pid] = cpu
                self.rss_kb[pid] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE") / 1024

    def __enter__(self) -> CpuMeter:
        self._wall, self._own = time.perf_counter(), time.process_time()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.wall = time.perf_counter() - self._wall
        self.own = time.process_time() - self._own
        self.workers = sum(self._last[p] - self._first[p] for p in self._last)

    def figures(self) -> dict[str, float]:
        return {
            "wall_seconds": self.wall,
            "driver_cpu_seconds": self.own,
            "worker_cpu_seconds": self.workers,
            "cores_used": (self.own + self.workers) / self.wall,
        }


def _pids(name: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if name.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def process_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
