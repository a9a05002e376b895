"""The fleet's end of a run: devices stuck in a request do not hold the run up; sleeping devices
cost their event loop the same whatever their number; a large fleet starts over a while."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from android_sim.fleet import TRAINING, DeviceSpec, Fleet, FleetOptions, StopSwitch, start_seconds
from android_sim.network import Connector
from android_sim.profiles import DeviceClass, DeviceProfile, SimClock
from contracts.features import FeatureSpec
from device_runtime.example_store import ExampleStore
from device_runtime.task_runner import TaskRunner
from tests.conftest import DEVICE_POLICY

FEATURES = [FeatureSpec("item", "int32", (), value_range=(0, 9))]
ALWAYS_ON = DeviceClass("test phone", 1.0, 1.0, 200.0, 2.0, 0.0, 0.5, 24.0, 1.0, 0.0)


class _Unanswering:
    """An ASGI server that takes every request and never answers (a server gone silent)."""

    def __init__(self) -> None:
        self.requests = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.requests += 1
            await asyncio.Event().wait()


def test_devices_stuck_in_a_request_are_switched_off_after_the_grace_period(tmp_path: Path) -> None:
    # Prepare: two enrolled, always eligible devices whose check-ins never get an answer
    server = _Unanswering()
    profile = DeviceProfile(ALWAYS_ON, timezone_hours=0.0, bedtime_hours=0.0, has_wifi=True, salt=1)
    specs = [DeviceSpec(TRAINING, profile, tmp_path / f"d{i}.sqlite", 10) for i in range(2)]
    for spec in specs:
        with ExampleStore(spec.store_path, FEATURES):
            pass

    async def scenario() -> tuple[int, float, int]:
        with TaskRunner(1) as runner:
            fleet = Fleet(
                "http://orchestrator.local",
                Connector(server),
                specs,
                tmp_path / "cache",
                runner,
                SimClock(60.0),
                FleetOptions(population="p", privacy_policy=DEVICE_POLICY),
            )
            for i, device in enumerate(fleet.devices):
                device.device_id = f"device-{i}"  # enrolled before: only the check-in hangs
            running = asyncio.create_task(fleet.run())
            while server.requests < 2:
                assert not running.done(), running
                await asyncio.sleep(0.05)

            # Execute: the run ends; the devices get 0.2 s to finish
            loop = asyncio.get_running_loop()
            started = loop.time()
            switched_off = await fleet.switch_off(0.2)
            await running
            return switched_off, loop.time() - started, fleet.stats.in_task

    switched_off, seconds, in_task = asyncio.run(scenario())

    # Assert: both were cut off mid-request at the grace period, not after the request's timeout
    assert switched_off == 2
    assert seconds < 5.0
    assert in_task == 0


def test_devices_hang_up_after_enrolling_and_keep_only_their_token(tmp_path: Path) -> None:
    # Prepare: the real orchestrator app in this process, three devices
    from pydantic import SecretStr

    from orchestrator.app import create_app
    from orchestrator.settings import Settings

    app = create_app(
        Settings(database_url=f"sqlite:///{tmp_path / 'o.sqlite'}", admin_token=SecretStr("t" * 32))
    )
    profile = DeviceProfile(ALWAYS_ON, timezone_hours=0.0, bedtime_hours=0.0, has_wifi=True, salt=1)
    specs = [DeviceSpec(TRAINING, profile, tmp_path / f"d{i}.sqlite", 10) for i in range(3)]

    async def scenario() -> Fleet:
        async with app.router.lifespan_context(app):
            connector = Connector(app)
            with TaskRunner(1) as runner:
                fleet = Fleet(
                    "http://orchestrator.local",
                    connector,
                    specs,
                    tmp_path / "cache",
                    runner,
                    SimClock(60.0),
                    FleetOptions(population="p", privacy_policy=DEVICE_POLICY),
                )
                # Execute
                await fleet.enroll()
                await fleet.aclose()
            await connector.aclose()
        return fleet

    fleet = asyncio.run(scenario())

    # Assert: each device is enrolled and holds its own token, and no connection (lean when idle)
    assert all(d.device_id and d.token for d in fleet.devices)
    assert len({d.token for d in fleet.devices}) == 3
    assert all(d.connection is None for d in fleet.devices)
    assert all(d.bytes_down > 0 for d in fleet.devices)  # the answers came through each one's link


def test_sleeping_devices_each_wait_on_their_own_timer_and_a_stop_wakes_them_all(tmp_path: Path) -> None:
    # A sleep on one shared asyncio.Event with a timeout scanned every other sleeper when it woke
    # (the event's list of waiters): 50,000 devices a shard saturated its event loop.
    profile = DeviceProfile(ALWAYS_ON, timezone_hours=0.0, bedtime_hours=0.0, has_wifi=True, salt=1)
    specs = [DeviceSpec(TRAINING, profile, tmp_path / f"d{i}.sqlite", 10) for i in range(200)]

    async def scenario() -> tuple[int, int, int, float]:
        with TaskRunner(1) as runner:
            fleet = Fleet(
                "http://orchestrator.local",
                Connector(),
                specs,
                tmp_path / "cache",
                runner,
                SimClock(60.0),
                FleetOptions(population="p", privacy_policy=DEVICE_POLICY),
            )
            stop = fleet._stop[TRAINING]
            short = [asyncio.create_task(fleet._sleep(d, 0.05)) for d in fleet.devices[:100]]
            long = [asyncio.create_task(fleet._sleep(d, 3_600.0)) for d in fleet.devices[100:]]
            await asyncio.sleep(0.01)
            asleep = stop.sleepers()
            await asyncio.gather(*short)  # their timers ended their sleeps alone
            after_short = stop.sleepers()
            loop = asyncio.get_running_loop()
            started = loop.time()
            fleet.stop()
            await asyncio.gather(*long)
            return asleep, after_short, stop.sleepers(), loop.time() - started

    asleep, after_short, after_stop, stop_took = asyncio.run(scenario())

    assert (asleep, after_short, after_stop) == (200, 100, 0)
    assert stop_took < 60.0  # woken by the stop, not by their hour's timers


def test_a_stop_switch_set_before_a_sleep_does_not_sleep() -> None:
    async def scenario() -> int:
        switch = StopSwitch()
        switch.set()
        await asyncio.wait_for(switch.sleep(3_600.0), timeout=5.0)
        return switch.sleepers()

    assert asyncio.run(scenario()) == 0


def test_a_large_fleet_starts_over_a_while_and_a_small_one_within_seconds() -> None:
    assert start_seconds(100) == 2.0  # a test's or a demo's fleet: as before
    assert start_seconds(1_000) == 10.0
    assert start_seconds(100_000) == 1_000.0
