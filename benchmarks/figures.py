"""The MovieLens benchmarks' test figures from per-user evaluation sums, each with its 95% interval.

One method for the whole project (`android_sim.intervals`): a percentile bootstrap over the
evaluated users, the figure recomputed from the resampled users' sums. Figures that combine runs
evaluated on the same users (a ratio of accuracies, a difference) resample the same users in both
runs, so the interval is of the paired difference; a mean over runs on different users resamples
each run's users on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from android_sim.intervals import RESAMPLES, per_device_sums_interval, resample_rows
from model_runtime.tflite_model import EvaluationSums

# metric -> (the evaluation sums' name, whether the figure is the square root of their mean)
METRICS = {"rmse": ("squared_error", True), "accuracy": ("correct", False)}


def total(sums: Sequence[EvaluationSums]) -> EvaluationSums:
    return sum(sums, EvaluationSums.zero())


def user_intervals(sums: Sequence[EvaluationSums]) -> dict[str, list[float]]:
    """RMSE and accuracy over the users' evaluation sums: [low, high] of a 95% bootstrap over users."""
    per_user = [s.as_dict() for s in sums]
    out = {}
    for metric, (name, root) in METRICS.items():
        if per_user and f"{name}_sum" in per_user[0]:
            found = per_device_sums_interval(per_user, name, root=root)
            out[metric] = [found.low, found.high]
    return out


def with_intervals(sums: Sequence[EvaluationSums]) -> dict[str, Any]:
    """The example-weighted metrics of `sums` added up, the number of users, and `intervals`."""
    return {**total(sums).metrics(), "users": len(sums), "intervals": user_intervals(sums)}


def draws(sums: Sequence[EvaluationSums], metric: str, rows: np.ndarray) -> np.ndarray:
    """`metric` over each resample of the users (`rows`: positions into `sums`, one resample a row)."""
    name, root = METRICS[metric]
    numerators = np.array([s.sums.get(f"{name}_sum", 0.0) for s in sums])
    weights = np.array([s.weight_sum for s in sums])
    means: np.ndarray = numerators[rows].sum(axis=1) / np.maximum(weights[rows].sum(axis=1), 1e-12)
    return np.sqrt(means) if root else means


def _percentiles(values: np.ndarray) -> list[float]:
    low, high = np.percentile(values, [2.5, 97.5])
    return [float(low), float(high)]


def paired_interval(
    a: Sequence[EvaluationSums],
    b: Sequence[EvaluationSums],
    metric: str,
    combine: Callable[[np.ndarray, np.ndarray], np.ndarray],
    seed: int = 0,
) -> list[float]:
    """The interval of `combine(metric of a, metric of b)` for two runs scored on the same users
    in the same order (a ratio, a difference): the same users resampled in both."""
    if len(a) != len(b):
        raise ValueError(f"paired runs must score the same users, got {len(a)} and {len(b)}")
    rows = resample_rows(len(a), np.random.default_rng(seed))
    return _percentiles(combine(draws(a, metric, rows), draws(b, metric, rows)))


def mean_over_runs_interval(
    runs: Sequence[Sequence[EvaluationSums]], metric: str, seed: int = 0
) -> list[float]:
    """The interval of the mean of `metric` over runs scored on different users (user splits):
    each run's users resampled on their own, the mean taken resample by resample."""
    rng = np.random.default_rng(seed)
    per_run = [draws(sums, metric, resample_rows(len(sums), rng, RESAMPLES)) for sums in runs]
    return _percentiles(np.mean(per_run, axis=0))
