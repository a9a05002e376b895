"""95% intervals for an evaluation round's figures, released without any one device's sums.

An evaluation round releases example-weighted means (`loss`, `accuracy`, `rmse`, ...) of its
devices' metric sums, and only sums of at least `min_evaluation_reports` devices
(`round_release`). An interval needs the spread between devices, which per-device figures would
show; so the spread is taken between **groups** of devices instead (the random-groups method,
Wolter, *Introduction to Variance Estimation*, ch. 2). Each report is also added into one of
`target // floor` group sums (at least 2, at most `MAX_GROUPS`): the k-th report counted into the
group k mod that number, so that a round that reaches its target has groups of about its floor's
devices, each with early and late reporters alike. At the commit, groups are merged in order
until each holds at least the floor's devices (a round that closed short of its target has fewer
reports a group), and the interval comes from the merged groups' spread around the round's mean
(a ratio estimator, linearized), with Student's t for their number less one. So every figure
released is still a function of sums of at least the floor's devices. The groups' own sums are
never released, and a round keeps them only while it is open (as it keeps its running sums): its
commit replaces them with the intervals (`settled`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

MAX_GROUPS = 32
_PREFIX = "interval_group_"
_REPORTS = "reports"
# Student's t, 97.5% quantile, for 1-30 degrees of freedom; beyond, its Cornish-Fisher expansion.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
_Z975 = 1.959964


def is_group_sum(name: str) -> bool:
    """A group's sum: kept on the round to compute intervals, never released."""
    return name.startswith(_PREFIX)


def groups_of(target: int, floor: int) -> int:
    """How many groups a round's reports are spread over: about its floor's devices each."""
    return max(2, min(MAX_GROUPS, target // max(floor, 1)))


def grouped(arrival: int, target: int, floor: int, sums: Mapping[str, float]) -> dict[str, float]:
    """The `arrival`-th (1, 2, ...) evaluation report's metric sums, plus the same sums (and a
    count) for its group."""
    prefix = f"{_PREFIX}{(arrival - 1) % groups_of(target, floor)}/"
    return {**sums, **{prefix + k: v for k, v in sums.items()}, prefix + _REPORTS: 1.0}


def t975(degrees_of_freedom: int) -> float:
    if degrees_of_freedom <= len(_T975):
        return _T975[degrees_of_freedom - 1]
    z, n = _Z975, degrees_of_freedom
    return z + (z**3 + z) / (4 * n) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * n**2)


def merged_groups(metrics: Mapping[str, float], floor: int) -> list[dict[str, float]]:
    """The groups' sums merged in order until each holds at least `floor` devices (a remainder
    joins the last); empty groups are skipped."""
    groups: list[dict[str, float]] = []
    current: dict[str, float] = {}
    for g in range(MAX_GROUPS):
        prefix = f"{_PREFIX}{g}/"
        part = {k.removeprefix(prefix): v for k, v in metrics.items() if k.startswith(prefix)}
        for k, v in part.items():
            current[k] = current.get(k, 0.0) + v
        if current.get(_REPORTS, 0.0) >= max(floor, 1):
            groups.append(current)
            current = {}
    if current and groups:
        last = groups[-1]
        for k, v in current.items():
            last[k] = last.get(k, 0.0) + v
    return groups


def intervals(metrics: Mapping[str, float], floor: int) -> dict[str, float]:
    """`<name>_low` and `<name>_high` for each example-weighted mean `<name>` of the round's sums
    (`rmse` from `squared_error`, `accuracy` from `correct`; `<x>_accuracy` for a `correct_<x>_sum`
    over an `<x>_sum`), and `interval_groups`; nothing when fewer than two groups of at least
    `floor` devices can be formed."""
    groups = merged_groups(metrics, floor)
    if len(groups) < 2 or sum(g.get("weight_sum", 0.0) for g in groups) <= 0:
        return {}
    out: dict[str, float] = {"interval_groups": float(len(groups))}
    for key in groups[0]:
        if not key.endswith("_sum") or key == "weight_sum":
            continue
        name = key.removesuffix("_sum")
        low, high = _ratio_interval(groups, key, "weight_sum")
        out[f"{name}_low"], out[f"{name}_high"] = low, high
        if name == "squared_error":
            out["rmse_low"], out["rmse_high"] = math.sqrt(low), math.sqrt(high)
        if name == "correct":
            out["accuracy_low"], out["accuracy_high"] = low, min(high, 1.0)
        # `correct_<x>` counted per `<x>` (next-word's correct tokens per token): `<x>_accuracy`.
        per = key.removeprefix("correct_")
        if per != key and per in groups[0] and per != "weight_sum":
            low, high = _ratio_interval(groups, key, per)
            accuracy = per.removesuffix("_sum") + "_accuracy"
            out[f"{accuracy}_low"], out[f"{accuracy}_high"] = low, min(high, 1.0)
    return out


def _ratio_interval(groups: list[dict[str, float]], numerator: str, denominator: str) -> tuple[float, float]:
    """sum(numerator) / sum(denominator) over the groups, +- t times its random-groups standard
    error (the ratio's linearized residuals; n / (n - 1) for the groups' degrees of freedom).
    Never below 0: evaluation sums are never negative (`report_checks`)."""
    total = sum(g.get(denominator, 0.0) for g in groups)
    if total <= 0:
        return math.nan, math.nan
    mean = sum(g.get(numerator, 0.0) for g in groups) / total
    residuals = [g.get(numerator, 0.0) - mean * g.get(denominator, 0.0) for g in groups]
    n = len(groups)
    half = t975(n - 1) * math.sqrt(n / (n - 1) * sum(r * r for r in residuals)) / total
    return max(mean - half, 0.0), mean + half


def settled(metrics: Mapping[str, float], floor: int) -> dict[str, float]:
    """A committing evaluation round's metrics: its sums and their intervals, without the groups'."""
    return {**{k: v for k, v in metrics.items() if not is_group_sum(k)}, **intervals(metrics, floor)}
