"""The label baselines `simulate` puts beside a classification or regression model."""

from __future__ import annotations

import numpy as np
import pytest

from android_sim.simulation.label_baselines import baseline_sums
from android_sim.simulation.predictions import compare
from model_runtime.tflite_model import EvaluationSums


def test_classification_baselines_count_the_majority_classes_hits() -> None:
    train = np.array([2, 2, 2, 1, 0])  # the majority class is 2
    held = [
        (np.array([1, 1, 0]), np.array([1, 1, 2, 0])),  # own majority 1: 2 of 4; class 2: 1 of 4
        (np.array([], np.int64), np.array([2, 0])),  # no support: its own is the majority class
    ]
    found = baseline_sums("classification", train, held)
    assert [s.sums for s in found["majority class"]] == [
        {"correct_sum": 1.0, "weight_sum": 4.0},
        {"correct_sum": 1.0, "weight_sum": 2.0},
    ]
    assert [s.sums["correct_sum"] for s in found["per-user majority"]] == [2.0, 1.0]


def test_regression_baselines_sum_squared_errors_from_the_means() -> None:
    found = baseline_sums("regression", np.array([1.0, 3.0]), [(np.array([4.0, 5.0]), np.array([5.0, 3.0]))])
    assert found["global mean"][0].sums == {"squared_error_sum": 9.0 + 1.0, "weight_sum": 2.0}
    assert found["per-user mean"][0].sums["squared_error_sum"] == pytest.approx(0.25 + 2.25)


def test_a_model_is_compared_with_a_baseline_on_the_metrics_both_have() -> None:
    rng = np.random.default_rng(0)
    queries = [rng.integers(0, 3, 20) for _ in range(30)]
    held = [(q[:5], q) for q in queries]
    baselines = baseline_sums("classification", np.concatenate(queries), held)
    # A "model" that gets every query right, with a loss the baselines do not have.
    perfect = [
        EvaluationSums({"loss_sum": 1.0, "correct_sum": len(q), "weight_sum": len(q)}) for q in queries
    ]
    found = compare(perfect, baselines["majority class"])
    assert set(found) == {"accuracy"}
    accuracy = found["accuracy"]
    assert accuracy["model"] == 1.0 and accuracy["without_locals"] < 0.5
    assert 0 < accuracy["difference_low"] <= accuracy["difference"] <= accuracy["difference_high"]


def test_a_ranking_task_has_no_label_baselines() -> None:
    with pytest.raises(ValueError, match="classification and regression"):
        baseline_sums("ranking", np.zeros(1), [])
