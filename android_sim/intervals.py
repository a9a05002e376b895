"""95% intervals for figures averaged over devices (or users): a percentile bootstrap over them.

Resampling devices, not examples, because devices are the unit that was drawn (which users were
held out) and a device's examples are not independent of each other. One matrix of resamples can
serve several figures over the same devices, which makes their differences paired.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

RESAMPLES = 2000
INTERVAL = f"95% percentile bootstrap over devices ({RESAMPLES:,} resamples)"


@dataclass(frozen=True)
class Interval:
    """A figure over `devices` devices and its 95% interval."""

    value: float
    low: float
    high: float
    devices: int

    def __str__(self) -> str:
        return f"{self.value:.1%} [{100 * self.low:.1f}, {100 * self.high:.1f}]"


def resample_rows(devices: int, rng: np.random.Generator, resamples: int = RESAMPLES) -> np.ndarray:
    """(resamples, devices) positions drawn with replacement."""
    return rng.integers(0, devices, size=(resamples, devices))


def bootstrap_means(values: np.ndarray, resamples: np.ndarray) -> Interval:
    """The mean of `values` (one per device) and the 2.5th-97.5th percentiles of its means over
    `resamples` (rows of device positions)."""
    if len(values) == 0:
        raise ValueError("no device to average")
    means = values[resamples].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return Interval(float(values.mean()), float(low), float(high), len(values))


def bootstrap_ratio(
    numerators: np.ndarray,
    denominators: np.ndarray,
    resamples: np.ndarray,
    transform: Callable[[np.ndarray], np.ndarray] = lambda x: x,
) -> Interval:
    """transform(sum of numerators / sum of denominators), one pair per device (an
    example-weighted mean such as accuracy, or RMSE with `np.sqrt`), and its interval."""
    if len(numerators) == 0 or denominators.sum() <= 0:
        raise ValueError("no device with examples to average")
    value = float(transform(np.asarray(numerators.sum() / denominators.sum())))
    ratios = numerators[resamples].sum(axis=1) / np.maximum(denominators[resamples].sum(axis=1), 1e-12)
    low, high = np.percentile(transform(ratios), [2.5, 97.5])
    return Interval(value, float(low), float(high), len(numerators))


def per_device_sums_interval(
    sums: list[dict[str, float]], name: str, seed: int = 0, root: bool = False
) -> Interval:
    """The example-weighted mean of metric `name` over devices' evaluation sums (`<name>_sum`,
    `weight_sum`), with its interval; `root`: its square root (RMSE from squared errors)."""
    numerators = np.array([s.get(f"{name}_sum", 0.0) for s in sums])
    weights = np.array([s.get("weight_sum", 0.0) for s in sums])
    rows = resample_rows(len(sums), np.random.default_rng(seed))
    return bootstrap_ratio(numerators, weights, rows, np.sqrt if root else lambda x: x)


def metric_intervals(per_device: Sequence[Mapping[str, float]], seed: int = 0) -> dict[str, float]:
    """`<name>_low` and `<name>_high` for each example-weighted mean of the devices' evaluation
    sums (`<name>_sum` over `weight_sum`; `rmse` from `squared_error`, `accuracy` from
    `correct`), by one bootstrap over the devices; nothing for fewer than two devices."""
    kept = [d for d in per_device if d.get("weight_sum", 0.0) > 0]
    if len(kept) < 2:
        return {}
    rows = resample_rows(len(kept), np.random.default_rng(seed))
    weights = np.array([d["weight_sum"] for d in kept])
    out: dict[str, float] = {}
    for key in sorted({k for d in kept for k in d if k.endswith("_sum") and k != "weight_sum"}):
        name = key.removesuffix("_sum")
        found = bootstrap_ratio(np.array([d.get(key, 0.0) for d in kept]), weights, rows)
        out[f"{name}_low"], out[f"{name}_high"] = found.low, found.high
        if name == "squared_error":
            rmse = bootstrap_ratio(np.array([d.get(key, 0.0) for d in kept]), weights, rows, np.sqrt)
            out["rmse_low"], out["rmse_high"] = rmse.low, rmse.high
        if name == "correct":
            out["accuracy_low"], out["accuracy_high"] = found.low, found.high
    return out
