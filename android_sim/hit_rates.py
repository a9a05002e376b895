"""Held-out hit rates@10 that can resolve a difference: intervals, ground truth, history sizes.

Each scored device has a top-10 per method (the model's, the baselines', the ceilings') and is
scored two ways:
- **expected hit rate**: the probability mass the generator's true share probabilities put on the
  top-10, i.e. the chance that the device's next share lands in it. It needs the ground truth
  (synthetic data only) and no held-out share, so every held-out device counts, and the draw's
  noise is gone: only the choice of devices remains.
- **hit rate over the newest shares**: the fraction of the device's kept-aside newest shares
  that land in its top-10 (devices with at least one kept aside).
- **NDCG@10 over the newest shares**: each kept-aside share scores 1 / log2(1 + its rank) when
  it is in the top-10 (1 at the top, 0 outside), averaged over the device's shares: a hit near
  the top counts more.

Each figure is a mean over devices (each device weighs the same) with a 95% percentile
bootstrap interval over devices; one set of resamples serves every method, so paired
differences between methods get their own, narrower interval.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from android_sim.intervals import INTERVAL, Interval, bootstrap_means, resample_rows

K = 10
HISTORY_BUCKETS = ("1", "2-4", "5+")


def history_bucket(examples: int) -> str:
    """The breakdown a device falls in by the examples it holds (its reconstruction's data)."""
    if examples < 1:
        raise ValueError(f"a scored device holds at least one example, got {examples}")
    return "1" if examples == 1 else "2-4" if examples <= 4 else "5+"


def expected_hit_rate(top: np.ndarray, probabilities: np.ndarray) -> float:
    """The probability that the next share, drawn from `probabilities`, is one of `top`."""
    return float(probabilities[np.unique(np.asarray(top, np.int64))].sum())


def future_hit_rate(top: np.ndarray, future: np.ndarray) -> float:
    """The fraction of the kept-aside shares `future` (non-empty) that are in `top`."""
    if len(future) == 0:
        raise ValueError("no kept-aside share to score")
    return float(np.isin(future, top).mean())


def future_ndcg(top: np.ndarray, future: np.ndarray) -> float:
    """The mean over the kept-aside shares `future` (non-empty) of 1 / log2(1 + rank in `top`),
    0 for a share outside it: NDCG@k with one relevant item per share."""
    if len(future) == 0:
        raise ValueError("no kept-aside share to score")
    gains = {int(item): 1.0 / np.log2(rank + 2) for rank, item in reversed(list(enumerate(np.asarray(top))))}
    return float(np.mean([gains.get(int(item), 0.0) for item in future]))


@dataclass(frozen=True)
class ScoredDevice:
    """A held-out device as scored: its data's index, the examples it holds, the items of its
    kept-aside newest shares (possibly none), its true share probabilities (None without
    ground truth) and each method's top-10."""

    index: int
    history: int
    future: np.ndarray
    probabilities: np.ndarray | None
    tops: Mapping[str, np.ndarray]

    def to_json(self) -> dict[str, object]:
        return {
            "device": self.index,
            "examples": self.history,
            "next": self.future.tolist(),
            "top10": {name: np.asarray(top).tolist() for name, top in self.tops.items()},
        }


@dataclass(frozen=True)
class MethodScore:
    """One method's figures: over every device and per history size (None: nothing to score)."""

    expected: Interval | None
    newest: Interval | None
    by_history: dict[str, dict[str, Interval | None]] = field(default_factory=dict)
    ndcg: Interval | None = None  # NDCG@10 over the newest shares


@dataclass(frozen=True)
class Evaluation:
    methods: dict[str, MethodScore]
    # Paired differences between the model and each other method ("personalized - X"), same resamples.
    differences: dict[str, dict[str, Interval | None]]
    devices: int
    devices_with_future: int
    interval: str = INTERVAL


def evaluate(devices: Sequence[ScoredDevice], reference: str = "personalized", seed: int = 0) -> Evaluation:
    """Every method's expected hit rate and hit rate over the newest shares, with intervals, over
    all `devices` and per history size, and its NDCG@10 over the newest shares; and `reference`
    minus each other method in each, paired."""
    if not devices:
        raise ValueError("no device to evaluate")
    names = list(devices[0].tops)
    rng = np.random.default_rng(seed)
    # NDCG's own resamples: the hit rates' intervals stay those they were before it was added.
    rngs = {"expected": rng, "newest": rng, "ndcg": np.random.default_rng((seed, 1))}
    truth = [d for d in devices if d.probabilities is not None]
    future = [d for d in devices if len(d.future)]

    def per_device(kind: str, chosen: Sequence[ScoredDevice], name: str) -> np.ndarray:
        if kind == "expected":
            return np.array([expected_hit_rate(d.tops[name], _truth(d)) for d in chosen])
        if kind == "ndcg":
            return np.array([future_ndcg(d.tops[name], d.future) for d in chosen])
        return np.array([future_hit_rate(d.tops[name], d.future) for d in chosen])

    def scores(chosen: Sequence[ScoredDevice], kind: str) -> dict[str, np.ndarray]:
        return {name: per_device(kind, chosen, name) for name in names} if chosen else {}

    def intervals(chosen: Sequence[ScoredDevice], kind: str) -> dict[str, Interval | None]:
        values = scores(chosen, kind)
        rows = resample_rows(len(chosen), rngs[kind]) if chosen else None
        return {name: bootstrap_means(values[name], rows) if rows is not None else None for name in names}

    kinds = (("expected", truth), ("newest", future))
    overall = {kind: intervals(chosen, kind) for kind, chosen in kinds}
    buckets: dict[str, dict[str, dict[str, Interval | None]]] = {}
    for bucket in HISTORY_BUCKETS:
        inside = [d for d in devices if history_bucket(d.history) == bucket]
        buckets[bucket] = {
            "expected": intervals([d for d in inside if d.probabilities is not None], "expected"),
            "newest": intervals([d for d in inside if len(d.future)], "newest"),
        }
    ndcg = intervals(future, "ndcg")
    methods = {
        name: MethodScore(
            overall["expected"][name],
            overall["newest"][name],
            {b: {kind: buckets[b][kind][name] for kind in ("expected", "newest")} for b in HISTORY_BUCKETS},
            ndcg[name],
        )
        for name in names
    }
    differences: dict[str, dict[str, Interval | None]] = {}
    if reference in names:
        for kind, chosen in (*kinds, ("ndcg", future)):
            values = scores(chosen, kind)
            rows = resample_rows(len(chosen), rngs[kind]) if chosen else None
            for name in names:
                if name != reference:
                    diff = values[reference] - values[name] if rows is not None else None
                    differences.setdefault(name, {})[kind] = (
                        bootstrap_means(diff, rows) if diff is not None and rows is not None else None
                    )
    return Evaluation(methods, differences, len(devices), len(future))


def _truth(device: ScoredDevice) -> np.ndarray:
    assert device.probabilities is not None, "only devices with ground truth get an expected hit rate"
    return device.probabilities
