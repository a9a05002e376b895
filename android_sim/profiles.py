"""Device profiles: how fast a simulated phone computes, how its network behaves, when it may train.

A phone trains only when it is idle, charging and on an unmetered network (the conditions
federated learning on Android waits for). Here that happens in a nightly charging window in
the phone's own time zone, on a daily cycle compressed into `SimClock.day_seconds` of wall
time; the user picks the phone up now and then (it stops being idle). Within a task the clock
runs at 1x (`SimClock.in_task`), so what makes tasks abort mid-way is mostly the class's
`dropout_probability`. Profiles are drawn from a mix of device classes.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

DAY = 86_400.0


@dataclass(frozen=True)
class DeviceClass:
    name: str
    weight: float  # share of the fleet (normalized over the mix)
    compute_slowdown: float  # task time relative to this machine's
    bandwidth_mbps: float  # both directions
    latency_ms: float  # per request
    dropout_probability: float  # per task: stops mid-task
    vanish_share: float  # of those dropouts: stop silently (the rest abort and tell the server)
    charging_hours: float  # length of the nightly charging window
    unmetered_share: float  # share of devices of this class with wifi at home
    wake_probability: float  # chance per 15 simulated minutes that the user picks the phone up

    def __post_init__(self) -> None:
        problems = []
        if not self.name:
            problems.append("name must not be empty")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "name" and (
                not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
            ):
                problems.append(f"{f.name} must be a finite number >= 0, got {value!r}")
        if not problems:
            if self.compute_slowdown < 1 or self.bandwidth_mbps <= 0:
                problems.append("compute_slowdown must be >= 1 and bandwidth_mbps > 0")
            for name in ("dropout_probability", "vanish_share", "unmetered_share", "wake_probability"):
                if getattr(self, name) > 1:
                    problems.append(f"{name} is a probability, got {getattr(self, name)}")
            if self.charging_hours > 24:
                problems.append(f"charging_hours must be <= 24, got {self.charging_hours}")
        if problems:
            raise ValueError(f"device class {self.name!r}: " + "; ".join(problems))


DEFAULT_MIX: tuple[DeviceClass, ...] = (
    DeviceClass("flagship", 0.25, 1.0, 50.0, 30.0, 0.02, 0.5, 8.0, 0.95, 0.03),
    DeviceClass("mid-range", 0.50, 2.0, 20.0, 60.0, 0.05, 0.5, 7.0, 0.85, 0.05),
    DeviceClass("low-end", 0.25, 4.0, 5.0, 150.0, 0.10, 0.5, 6.0, 0.70, 0.08),
)


def load_mix(path: Path) -> tuple[DeviceClass, ...]:
    """A JSON list of device classes (every field of `DeviceClass`)."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"device mix file {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"device mix file {path} is not JSON: {e}") from None
    expected = [f.name for f in fields(DeviceClass)]
    if not isinstance(raw, list) or not raw or not all(isinstance(c, dict) for c in raw):
        raise ValueError(f"device mix file {path}: expected a non-empty JSON list of objects with {expected}")
    mix = []
    for entry in raw:
        if set(entry) != set(expected):
            raise ValueError(
                f"device mix file {path}: class {entry.get('name')!r} has fields {sorted(entry)}, "
                f"expected exactly {expected}"
            )
        mix.append(DeviceClass(**entry))
    return tuple(mix)


@dataclass(frozen=True)
class Conditions:
    idle: bool
    charging: bool
    unmetered: bool

    @property
    def eligible(self) -> bool:
        return self.idle and self.charging and self.unmetered

    def as_dict(self) -> dict[str, bool]:
        return {"idle": self.idle, "charging": self.charging, "unmetered": self.unmetered}


@dataclass(frozen=True)
class DeviceProfile:
    device_class: DeviceClass
    timezone_hours: float  # offset of the phone's local time from simulated UTC
    bedtime_hours: float  # local time the charging window starts
    has_wifi: bool
    salt: int  # per-device seed for when the user picks the phone up

    def _local_time(self, sim_time: float) -> float:
        return (sim_time + self.timezone_hours * 3_600.0) % DAY

    def _charging(self, sim_time: float) -> bool:
        since_bedtime = (self._local_time(sim_time) - self.bedtime_hours * 3_600.0) % DAY
        return since_bedtime < self.device_class.charging_hours * 3_600.0

    def _woken(self, sim_time: float) -> bool:
        slot = int(sim_time // 900)  # 15 simulated minutes
        digest = hashlib.blake2b(f"{self.salt}:{slot}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") / 2**64 < self.device_class.wake_probability

    def conditions(self, sim_time: float) -> Conditions:
        charging = self._charging(sim_time)
        # Unmetered at home, and the phone charges at home overnight.
        return Conditions(
            idle=charging and not self._woken(sim_time),
            charging=charging,
            unmetered=charging and self.has_wifi,
        )

    def next_eligible(self, sim_time: float, horizon: float = 2 * DAY) -> float | None:
        """The first simulated time >= `sim_time` when the device may train (15-minute resolution):
        `sim_time`, or the first 15-minute mark after it that is eligible."""
        if not self.has_wifi:
            return None  # never unmetered, so never eligible
        t = sim_time
        while t < sim_time + horizon:
            if self._charging(t):
                if self.conditions(t).eligible:
                    return t
                t = (t // 900 + 1) * 900
                continue
            # Outside its charging window no mark is eligible: skip to the last mark a slot or
            # more before the window opens (scanning every mark of two days, with a hash each, kept
            # a fleet of 100,000 busy for minutes before its first check-in).
            opens = t + DAY - (self._local_time(t) - self.bedtime_hours * 3_600.0) % DAY
            t = max((t // 900 + 1) * 900, ((opens - 900) // 900) * 900)
        return None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["device_class"] = self.device_class.name
        return data


def draw_profiles(count: int, mix: Sequence[DeviceClass], rng: np.random.Generator) -> list[DeviceProfile]:
    weights = np.array([c.weight for c in mix], dtype=np.float64)
    if weights.sum() <= 0:
        raise ValueError("the device mix needs at least one class with weight > 0")
    classes = rng.choice(len(mix), size=count, p=weights / weights.sum())
    profiles = []
    for i in range(count):
        device_class = mix[int(classes[i])]
        profiles.append(
            DeviceProfile(
                device_class,
                # Most users in a few neighbouring time zones, as for an app launched in one region.
                timezone_hours=float(rng.normal(0.0, 3.0)),
                bedtime_hours=float(rng.normal(23.0, 1.5)) % 24.0,
                has_wifi=bool(rng.random() < device_class.unmetered_share),
                salt=int(rng.integers(2**62)),
            )
        )
    return profiles


class SimClock:
    """Simulated time: one simulated day passes in `day_seconds` of wall time."""

    def __init__(self, day_seconds: float, start: float = 0.0) -> None:
        if day_seconds <= 0:
            raise ValueError(f"day_seconds must be > 0, got {day_seconds}")
        self.day_seconds = day_seconds
        self.start = start  # simulated seconds since midnight UTC at wall time zero
        self._wall_zero = time.monotonic()

    @property
    def speedup(self) -> float:
        return DAY / self.day_seconds

    def now(self) -> float:
        return self.start + (time.monotonic() - self._wall_zero) * self.speedup

    def in_task(self) -> Callable[[], float]:
        """Simulated time for a task that starts now: from here it runs at 1x. The user's day is
        compressed, a task's seconds are not (a phone spends them as seconds too); at the day's
        pace, a secure round's four seconds on this machine would be 1.6 hours of the user's."""
        checked_in, started = self.now(), time.monotonic()
        return lambda: checked_in + (time.monotonic() - started)

    def wall_seconds_until(self, sim_time: float) -> float:
        return max(0.0, (sim_time - self.now()) / self.speedup)
