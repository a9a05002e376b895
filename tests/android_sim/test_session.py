"""A fleet session's final evaluation: real devices, a real orchestrator process, HTTP on loopback."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from android_sim.fleet import HELD_OUT, TRAINING, Fleet
from android_sim.profiles import DAY, DeviceClass, DeviceProfile
from android_sim.run import load_workload, population_settings, prepare_devices
from android_sim.session import run_fleet
from tests.android_sim.test_run import small, work

__all__ = ["work"]  # the fixture: a work directory holding the small run's export

# Never drops out, never picked up: a device reports whenever its charging window is open.
STEADY = DeviceClass("steady phone", 1.0, 1.0, 200.0, 2.0, 0.0, 0.5, 24.0, 1.0, 0.0)


def test_the_final_evaluation_waits_a_simulated_day_for_the_held_out_devices_night(work: Path) -> None:
    # Prepare: training devices always eligible; the held-out ones charge only from 20 s after the
    # fleet's clock starts, for 6 s of its 30 s day: after the training round and the population's
    # 4 s evaluation round, as a secure main job's training ended at simulated 13:36 UTC (1-8 of its
    # 150 held-out devices in their window over its evaluation round's 4 simulated hours: 7 reports)
    config = small(work, rounds=1, target_reports=4, round_seconds=4.0, day_seconds=30.0, min_examples=1)
    console = Console(width=120, record=True)
    workload = load_workload(config, console)
    devices = prepare_devices(config, workload, work / "devices")
    speedup = DAY / config.day_seconds
    start = float(np.random.default_rng(config.seed).uniform(0, DAY))  # the session's clock starts here
    night = 6.0 * speedup / 3_600  # simulated hours
    bedtime = (start + 20.0 * speedup) % DAY / 3_600
    specs = [
        replace(
            spec,
            profile=DeviceProfile(
                replace(STEADY, charging_hours=night) if spec.role == HELD_OUT else STEADY,
                timezone_hours=0.0,
                bedtime_hours=bedtime,
                has_wifi=True,
                salt=i,
            ),
        )
        for i, spec in enumerate(devices.specs)
    ]
    held_out = sum(1 for spec in specs if spec.role == HELD_OUT)
    settings = population_settings(config, workload, len(specs) - held_out)

    async def serve(fleet: Fleet, status: dict[str, Any]) -> None:
        return None

    # Execute
    session = asyncio.run(run_fleet(config, "night", workload.model_dir, specs, settings, serve, console))

    # Assert: the training round committed, and the final evaluation took the held-out devices'
    # reports once their night came, closing at its target
    assert held_out >= 6 and session.status["training_rounds_committed"] >= 1
    final = session.final
    assert final is not None and final["status"] == "committed", final
    assert final["counters"]["reported"] >= config.target_reports
    assert final["deadline"] - final["opened_at"] >= config.day_seconds
    outcomes = session.fleet.stats.outcomes
    assert outcomes[(HELD_OUT, "reported")] >= config.target_reports
    assert outcomes[(TRAINING, "reported")] >= config.target_reports // 2
