import json
import time
from pathlib import Path

import numpy as np
import pytest

from android_sim.profiles import (
    DAY,
    DEFAULT_MIX,
    DeviceClass,
    DeviceProfile,
    SimClock,
    draw_profiles,
    load_mix,
)

NIGHT_OWL = DeviceClass("night owl", 1.0, 1.0, 10.0, 50.0, 0.0, 0.5, 6.0, 1.0, 0.0)


def profile(device_class: DeviceClass = NIGHT_OWL, *, wifi: bool = True) -> DeviceProfile:
    return DeviceProfile(device_class, timezone_hours=0.0, bedtime_hours=23.0, has_wifi=wifi, salt=1)


def test_a_device_is_eligible_only_in_its_charging_window_on_wifi() -> None:
    device = profile()

    assert device.conditions(23.5 * 3600).eligible  # 23:30, charging at home
    assert device.conditions(DAY + 4.5 * 3600).eligible  # 04:30 the next night
    assert not device.conditions(12 * 3600).eligible  # noon: not charging
    assert not device.conditions(5.5 * 3600).charging  # the window is 23:00-05:00
    assert not profile(wifi=False).conditions(23.5 * 3600).eligible  # metered only: never


def test_next_eligible_finds_the_window_and_none_without_wifi() -> None:
    assert profile().next_eligible(12 * 3600) == 23 * 3600
    assert profile(wifi=False).next_eligible(0.0) is None


def test_next_eligible_is_the_first_eligible_mark_of_a_slot_by_slot_scan() -> None:
    def scanned(device: DeviceProfile, sim_time: float, horizon: float = 2 * DAY) -> float | None:
        t = sim_time
        while t < sim_time + horizon:
            if device.conditions(t).eligible:
                return t
            t = (t // 900 + 1) * 900
        return None

    rng = np.random.default_rng(3)
    devices = draw_profiles(300, DEFAULT_MIX, rng)
    times = rng.uniform(0, 3 * DAY, size=300)
    for device, sim_time in zip(devices, times, strict=True):
        for t in (float(sim_time), float(sim_time // 900 * 900), 0.0):
            assert device.next_eligible(t) == scanned(device, t)
        assert device.next_eligible(float(sim_time), horizon=3600.0) == scanned(
            device, float(sim_time), 3600.0
        )


def test_picking_up_the_phone_interrupts_idleness_at_its_rate() -> None:
    restless = DeviceClass("restless", 1.0, 1.0, 10.0, 50.0, 0.0, 0.5, 24.0, 1.0, 0.3)
    device = profile(restless)

    idle = [device.conditions(t).idle for t in np.arange(0, 50 * DAY, 900.0)]

    assert 0.25 < 1 - np.mean(idle) < 0.35


def test_profiles_follow_the_mix() -> None:
    profiles = draw_profiles(4000, DEFAULT_MIX, np.random.default_rng(0))

    shares = {c.name: np.mean([p.device_class.name == c.name for p in profiles]) for c in DEFAULT_MIX}

    for c in DEFAULT_MIX:
        assert abs(shares[c.name] - c.weight) < 0.03


def test_sim_clock_compresses_a_day() -> None:
    clock = SimClock(day_seconds=60.0, start=1000.0)

    assert clock.speedup == 1440.0
    assert 1000.0 <= clock.now() < 1000.0 + 1440.0
    assert clock.wall_seconds_until(clock.now() + 1440.0 * 2) == pytest.approx(2.0, abs=0.05)


def test_a_tasks_seconds_are_not_compressed() -> None:
    """A day in 86.4 ms: the run's clock passes 1,000 simulated seconds per wall millisecond, while
    a task's clock passes its own seconds (a secure round's waits are not hours of the user's day)."""
    clock = SimClock(day_seconds=0.0864)
    task = clock.in_task()
    started, day_started = task(), clock.now()
    time.sleep(0.05)

    assert clock.now() - day_started >= 0.05 * 1e6
    assert 0.05 <= task() - started < 1.0
    assert abs(started - day_started) < 1e3  # it starts at the check-in's simulated time


def test_a_device_mix_file_is_checked(tmp_path: Path) -> None:
    good = tmp_path / "mix.json"
    good.write_text(json.dumps([{**NIGHT_OWL.__dict__, "name": "tablet"}]))
    assert load_mix(good)[0].name == "tablet"

    with pytest.raises(ValueError, match="does not exist"):
        load_mix(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        load_mix(tmp_path / "bad.json")
    (tmp_path / "partial.json").write_text(json.dumps([{"name": "x", "weight": 1}]))
    with pytest.raises(ValueError, match="expected exactly"):
        load_mix(tmp_path / "partial.json")
    with pytest.raises(ValueError, match="dropout_probability is a probability"):
        DeviceClass("x", 1.0, 1.0, 10.0, 50.0, 1.5, 0.5, 6.0, 1.0, 0.0)
