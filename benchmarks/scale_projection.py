"""benchmarks.scale's projection: 10 million devices on a Ray cluster, from the measured rates."""

from __future__ import annotations

import math
from typing import Any

from benchmarks.scale_simulation import CLIENTS

TEN_MILLION = 10_000_000


def projection(
    sim: dict[str, Any], commit: dict[str, float], bytes_per_device: float, fleet: dict[str, Any]
) -> dict[str, Any]:
    """10 million devices on a cluster of `workers` Ray workers (a core each): a round costs the
    round trip, the largest worker's share of the clients at one worker's rate on a core of its
    own (the 1-worker run's tasks over its worker's CPU seconds, their adding up included), and
    the driver's commit of the workers' partial sums, which takes each round alone. Not counted:
    the driver's cost of one call per worker and the partials' transfer (each the float64 sums of
    the rows its worker's devices touched), which grow with the workers. Beside it, the HTTP
    orchestrator's bound: a core's worth of its CPU per report (measured in the fleet runs,
    check-ins and downloads included)."""
    rounds = sim["rounds"]
    trip = sim["round_trip_seconds"]
    per_worker = rounds * CLIENTS / sim["cpu"]["ray 1"]["worker_cpu_seconds"]
    rows = []
    for workers in (64, 256, 1024):
        for clients in (1_000, 10_000, 100_000):
            merged = commit["partials_base"] + commit["per_partial"] * min(workers, clients)
            round_seconds = trip + math.ceil(clients / workers) / per_worker + merged
            rows.append(
                {
                    "workers": workers,
                    "clients_per_round": clients,
                    "round_seconds": round_seconds,
                    "tasks_per_second": clients / round_seconds,
                    "minutes_per_ten_million_tasks": TEN_MILLION / (clients / round_seconds) / 60,
                }
            )
    cheapest = min(r["orchestrator_cpu_ms_per_report"] for r in fleet["runs"].values())
    return {
        "per_worker_tasks_per_second": per_worker,
        "data_gb": TEN_MILLION * bytes_per_device / 1e9,
        "rows": rows,
        "orchestrator_reports_per_core_second": 1e3 / cheapest,
        "orchestrator_core_hours_per_ten_million": TEN_MILLION * cheapest / 1e3 / 3600,
    }


def print_projection(
    project: dict[str, Any], sim: dict[str, Any], commit: dict[str, float], bytes_per_device: float
) -> None:
    print(
        f"projection, 10 million devices ({project['data_gb']:.0f} GB of examples across the workers, "
        f"{bytes_per_device / 1e3:.1f} KB a device), {project['per_worker_tasks_per_second']:.0f} tasks/s "
        f"a worker on a core of its own, {sim['round_trip_seconds'] * 1e3:.1f} ms a round trip, the "
        f"driver's commit {commit['partials_base'] * 1e3:.1f} ms + {commit['per_partial'] * 1e3:.2f} ms "
        f"a worker's partial sum ({commit['partial_bytes'] / 1e6:.2f} MB for {CLIENTS} clients' reports, "
        "its transfer not counted):"
    )
    for row in project["rows"]:
        print(
            f"  {row['workers']:>5} workers, rounds of {row['clients_per_round']:>6,}: "
            f"{row['round_seconds']:6.2f} s a round, {row['tasks_per_second']:8.0f} tasks/s, "
            f"10 million tasks in {row['minutes_per_ten_million_tasks']:.0f} min"
        )
    print(
        f"  the HTTP orchestrator beside it (measured above, one process, SQLite): "
        f"{project['orchestrator_reports_per_core_second']:.0f} reports per core-second: 10 million "
        f"tasks take {project['orchestrator_core_hours_per_ten_million']:.1f} orchestrator core-hours"
    )
