"""An evaluation round's 95% intervals from groups of devices (`orchestrator.rounds.evaluation_intervals`)."""

from __future__ import annotations

import math

import numpy as np
from orchestrator.rounds.evaluation_intervals import (
    grouped,
    intervals,
    is_group_sum,
    merged_groups,
    settled,
    t975,
)
from orchestrator.rounds.state import add_metric_sums


def round_sums(
    reports: list[dict[str, float]], target: int | None = None, floor: int = 5
) -> dict[str, float]:
    """The round's running sums as the server counts them: each report added with its group's."""
    total: dict[str, float] = {}
    for arrival, sums in enumerate(reports, start=1):
        total = add_metric_sums(total, grouped(arrival, target or len(reports), floor, sums))
    return total


def device_reports(rng: np.random.Generator, devices: int, accuracy: float) -> list[dict[str, float]]:
    """Devices with 5-60 examples each whose own accuracy varies around `accuracy`."""
    reports = []
    for _ in range(devices):
        weight = float(rng.integers(5, 61))
        own = float(np.clip(rng.normal(accuracy, 0.15), 0.0, 1.0))
        correct = float(rng.binomial(int(weight), own))
        reports.append({"loss_sum": weight * (1 - own), "correct_sum": correct, "weight_sum": weight})
    return reports


def test_the_interval_covers_the_true_accuracy_about_95_times_in_100() -> None:
    # Prepare: 400 evaluation rounds of 60 devices from one population of devices (true mean 0.7)
    rng = np.random.default_rng(0)
    covered, widths = 0, []

    # Execute: each round's accuracy interval, with a floor of 5 devices a group
    for _ in range(400):
        found = intervals(round_sums(device_reports(rng, 60, 0.7)), floor=5)
        covered += found["accuracy_low"] <= 0.7 <= found["accuracy_high"]
        widths.append(found["accuracy_high"] - found["accuracy_low"])

    # Assert: close to 95% coverage (the groups' spread estimates the devices'), and the
    # interval is neither degenerate nor useless
    assert 0.90 <= covered / 400 <= 0.99
    assert 0.02 < float(np.median(widths)) < 0.2


def test_the_interval_is_the_mean_plus_minus_t_times_the_groups_spread() -> None:
    # Prepare: four groups of five devices each, equal weights, known accuracies
    metrics: dict[str, float] = {}
    for group, accuracy in enumerate([0.6, 0.7, 0.8, 0.9]):
        prefix = f"interval_group_{group}/"
        metrics.update(
            {prefix + "correct_sum": 10 * accuracy, prefix + "weight_sum": 10.0, prefix + "reports": 5.0}
        )
    metrics.update({"correct_sum": 30.0, "weight_sum": 40.0})

    # Execute
    found = intervals(metrics, floor=5)

    # Assert: the textbook random-groups estimate, 0.75 +- t(3) * sd(group means) / sqrt(4)
    half = t975(3) * float(np.std([0.6, 0.7, 0.8, 0.9], ddof=1)) / 2
    assert found["interval_groups"] == 4
    assert math.isclose(found["accuracy_low"], 0.75 - half) and math.isclose(
        found["accuracy_high"], 0.75 + half
    )


def test_groups_are_merged_until_each_holds_the_floor_and_none_below_two_gives_no_interval() -> None:
    # Prepare: 23 devices with a floor of 5
    reports = device_reports(np.random.default_rng(1), 23, 0.5)
    metrics = round_sums(reports)

    # Execute
    groups = merged_groups(metrics, floor=5)
    too_few = intervals(round_sums(reports[:9]), floor=5)

    # Assert: every merged group has at least 5 devices and together all 23; 9 devices cannot make
    # two groups of 5, so no interval is released
    assert all(g["reports"] >= 5 for g in groups) and sum(g["reports"] for g in groups) == 23
    assert len(groups) == 4  # 23 // 5 groups of 6, 6, 6 and 5 devices
    assert too_few == {}


def test_a_round_that_reaches_its_target_has_groups_of_its_floor_and_a_short_one_fewer() -> None:
    reports = device_reports(np.random.default_rng(5), 40, 0.5)

    full = merged_groups(round_sums(reports, target=40), floor=5)
    short = merged_groups(round_sums(reports[:22], target=40), floor=5)

    assert [g["reports"] for g in full] == [5.0] * 8
    assert (
        len(short) == 3 and all(g["reports"] >= 5 for g in short) and sum(g["reports"] for g in short) == 22
    )


def test_a_committed_round_keeps_its_sums_and_intervals_but_no_groups_sums() -> None:
    # Prepare: 40 devices' running sums, groups included (one device alone in a group shows its sums)
    metrics = round_sums(device_reports(np.random.default_rng(2), 40, 0.6))
    assert sum(is_group_sum(k) for k in metrics) == 8 * 4  # 8 groups of 5: 3 sums and a count each

    # Execute
    kept = settled(metrics, floor=5)

    # Assert: the round's own sums unchanged, the intervals added, no group's sum left
    assert not any(is_group_sum(k) for k in kept)
    assert {k: kept[k] for k in ("loss_sum", "correct_sum", "weight_sum")} == {
        k: metrics[k] for k in ("loss_sum", "correct_sum", "weight_sum")
    }
    mean = metrics["correct_sum"] / metrics["weight_sum"]
    assert kept["accuracy_low"] < mean < kept["accuracy_high"]
    assert kept["loss_low"] < metrics["loss_sum"] / metrics["weight_sum"] < kept["loss_high"]


def test_rmse_interval_is_the_square_root_of_the_squared_errors_interval() -> None:
    rng = np.random.default_rng(3)
    reports = [
        {"squared_error_sum": float(rng.uniform(0.5, 2.0)) * w, "loss_sum": 1.0 * w, "weight_sum": w}
        for w in rng.integers(5, 30, size=50).astype(float)
    ]

    found = intervals(round_sums(reports), floor=5)

    assert math.isclose(found["rmse_low"], math.sqrt(found["squared_error_low"]))
    assert math.isclose(found["rmse_high"], math.sqrt(found["squared_error_high"]))


def test_students_t_beyond_the_table_follows_its_expansion() -> None:
    assert t975(1) == 12.706 and t975(30) == 2.042
    assert abs(t975(31) - 2.040) < 0.002 and abs(t975(120) - 1.980) < 0.002 and t975(10_000) > 1.959


def test_correct_tokens_per_token_get_their_own_accuracy_interval() -> None:
    # Prepare: next-word reports count correct tokens and tokens (windows are the weight)
    rng = np.random.default_rng(4)
    reports = []
    for _ in range(40):
        tokens = float(rng.integers(50, 400))
        reports.append(
            {
                "correct_tokens_sum": float(rng.binomial(int(tokens), 0.12)),
                "tokens_sum": tokens,
                "loss_sum": 3.0,
                "weight_sum": 10.0,
            }
        )
    metrics = round_sums(reports)

    # Execute
    found = intervals(metrics, floor=5)

    # Assert: correct tokens over tokens, not over windows
    accuracy = metrics["correct_tokens_sum"] / metrics["tokens_sum"]
    assert found["tokens_accuracy_low"] < accuracy < found["tokens_accuracy_high"] < 0.25
