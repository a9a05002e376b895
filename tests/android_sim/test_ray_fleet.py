"""`run --shards 2`: the fleet's devices in two Ray actors against one orchestrator over HTTP,
their counters and devices merged into one run report."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from android_sim.fleet import TRAINING, DeviceSpec, FleetOptions, FleetStats
from android_sim.network import Connector
from android_sim.profiles import DEFAULT_MIX, SimClock, draw_profiles
from android_sim.run import run
from android_sim.run_config import RunError
from device_runtime.task_runner import TaskRunner
from tests.android_sim.test_run import reconcile, small, work  # noqa: F401 (the work fixture)

ray = pytest.importorskip("ray")

from android_sim.ray_fleet import RayFleet, merged  # noqa: E402


@pytest.fixture
def local_ray() -> Iterator[None]:
    """Two CPUs on this machine for the shards, shut down after the test (no Ray process is left)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 1024**2)
    try:
        yield
    finally:
        ray.shutdown()


def test_the_shards_counters_add_up() -> None:
    a, b = FleetStats(), FleetStats()
    a.outcomes[("training", "reported")] = 3
    b.outcomes[("training", "reported")] = 4
    b.outcomes[("held-out", "reported")] = 1
    a.task_seconds, b.task_seconds = [0.1], [0.2, 0.3]
    a.switched_off, b.switched_off = 1, 2
    b.last_error = "device 3: refused"
    a.time_checkin(0.004)
    b.time_checkin(0.004)
    b.time_checkin(1.234)

    total = merged([a, b])

    assert total.count("training", "reported") == 7 and total.total("reported") == 8
    assert sorted(total.task_seconds) == [0.1, 0.2, 0.3]
    assert total.switched_off == 3 and total.last_error == "device 3: refused"
    assert total.checkin_ms == {4.0: 2, 1200.0: 1}
    assert total.checkin_percentile(50) == 4.0 and total.checkin_percentile(99) == 1200.0


def test_a_fleet_sharded_over_two_ray_actors_trains_and_reports(local_ray: None, work: Path) -> None:  # noqa: F811
    result = run(small(work, shards=2), Console(width=120, record=True))

    assert result.rounds_committed >= 3
    report = json.loads(result.report_path.read_text())
    outcomes = report["fleet"]["device_side_outcomes"]
    # Every report a committed round holds came from a shard's device (a round may commit at its
    # deadline with its minimum, 3, rather than its target, 6, on a loaded machine).
    committed = [r for r in report["rounds"] if r["kind"] == "training" and r["status"] == "committed"]
    held = sum(r["counters"]["reported"] for r in committed)
    assert held >= 3 * 3 and outcomes.get("training/reported", 0) >= held
    # Every shard's check-ins are timed, in one histogram.
    fleet = report["fleet"]
    assert fleet["checkins_timed"] >= outcomes["training/reported"]
    assert 0 < fleet["checkin_p50_ms"] <= fleet["checkin_p99_ms"]
    # What the two shards' devices did adds up to what the server counted.
    reconcile(result)
    assert any(r["kind"] == "evaluation" and r["counters"]["reported"] for r in report["rounds"])
    # The driver serves from the shards' enrolled devices (their tokens came back).
    assert result.hit_rates is not None and result.hit_rates.devices > 0
    for plot in result.plots:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ray.is_initialized()  # the fixture's Ray: the run shut down only what it started


def test_a_shard_that_cannot_see_its_stores_stops_the_run_before_it_starts(
    local_ray: None,
    tmp_path: Path,
) -> None:
    # As on a cluster whose machines do not share the work directory: the path exists nowhere.
    profiles = draw_profiles(4, DEFAULT_MIX, np.random.default_rng(0))
    specs = [DeviceSpec(TRAINING, profiles[i], tmp_path / f"elsewhere/{i}.sqlite", 5) for i in range(4)]
    with TaskRunner(1) as runner:
        fleet = RayFleet(
            "http://127.0.0.1:9", Connector(), specs, tmp_path, runner, SimClock(60.0), FleetOptions("p")
        )
        with pytest.raises(RunError, match=r"sees no example store at .*elsewhere/0\.sqlite.*--work-dir"):
            fleet.start(shards=2, threads=1)
    assert ray.is_initialized()  # the fixture's Ray is left running
