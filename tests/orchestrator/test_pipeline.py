"""The aggregation pipeline's stages, each alone and assembled from settings, without a database.

Expected values are worked out by hand and written literally; the arithmetic is in the comments.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from numpy.typing import ArrayLike

from contracts.params import SparseTensor
from orchestrator.aggregation.assemble import CentralPart, Pipeline, RoundInputs
from orchestrator.aggregation.central_merge import CentralMerge, CentralUpdate
from orchestrator.aggregation.coordinate_wise import CoordinateWiseStage
from orchestrator.aggregation.differential_privacy import DPConfig
from orchestrator.aggregation.pipeline import Aggregate, apply_measurements
from orchestrator.aggregation.private import CLIP_NORM, NEXT_CLIP_NORM, WITHIN_CLIP, GaussianNoise
from orchestrator.aggregation.registry import RobustAggregation
from orchestrator.aggregation.robust import ClipAndCap
from orchestrator.aggregation.secure_sum import SecureSum
from orchestrator.aggregation.weighted_mean import PartialSum, WeightedMean, WeightedMeanStage
from orchestrator.populations.config import pipeline_of
from orchestrator.populations.settings import PopulationSettings

G = {"g": (2,)}


def sparse(shape: tuple[int, ...], rows: list[int], values: list[float]) -> SparseTensor:
    return SparseTensor(shape, np.array(rows, np.int32), np.array(values, np.float32))


def g(first: float, second: float) -> dict[str, SparseTensor]:
    return {"g": sparse((2,), [0, 1], [first, second])}


def assert_close(actual: np.ndarray, expected: ArrayLike) -> None:
    assert actual.dtype == np.float32
    np.testing.assert_allclose(actual, np.array(expected, dtype=np.float64), rtol=1e-6, atol=1e-7)


def test_weighted_mean_weighs_each_contribution_by_its_weight() -> None:
    stage = WeightedMeanStage(G)
    stage.accept(g(1.0, 0.0), 1.0)
    stage.accept(g(4.0, 3.0), 3.0)

    result = stage.finish()

    # (1 x 1 + 3 x 4) / 4 = 3.25; (0 + 3 x 3) / 4 = 2.25
    assert_close(result.mean_delta["g"], [3.25, 2.25])
    assert result.count == 2 and result.total is None and dict(result.metrics) == {}


def test_weighted_mean_with_equal_weights_ignores_the_weights_and_keeps_the_sum() -> None:
    stage = WeightedMeanStage(G, equal_weights=True)
    stage.accept(g(1.0, 0.0), 1.0)
    stage.accept(g(4.0, 3.0), 1000.0)

    result = stage.finish()

    assert_close(result.mean_delta["g"], [2.5, 1.5])
    assert result.total is not None
    np.testing.assert_array_equal(result.total["g"], [5.0, 3.0])


def test_coordinate_wise_median_and_trimmed_mean() -> None:
    median = CoordinateWiseStage({"m": (1,)}, "median", 0.0)
    trimmed = CoordinateWiseStage({"m": (1,)}, "trimmed_mean", 0.2)
    for value in (1.0, 2.0, 3.0, 10.0, 100.0):
        for stage in (median, trimmed):
            stage.accept({"m": sparse((1,), [0], [value])}, 1.0)

    assert_close(median.finish().mean_delta["m"], [3.0])
    assert_close(trimmed.finish().mean_delta["m"], [5.0])  # (2 + 3 + 10) / 3
    with pytest.raises(ValueError, match="'trimmed_mean' or 'median'"):
        CoordinateWiseStage({"m": (1,)}, "mean", 0.0)


@pytest.mark.parametrize("reference", [None, {"g": 1.0}])
def test_clip_and_cap_clips_each_contribution_caps_its_weight_and_learns_the_reference(
    reference: dict[str, float] | None,
) -> None:
    # Three honest contributions of norm 1 (weight 10) and one of norm 100 (weight 1000).
    rule = RobustAggregation(norm_clip_multiple=2.0, max_weight_multiple=3.0)
    weights = [10.0, 10.0, 10.0, 1000.0]
    stage = ClipAndCap(WeightedMeanStage(G), rule, G, weights, reference)
    for delta, weight in zip([g(1, 0), g(0, 1), g(1, 0), g(0, 100)], weights, strict=True):
        stage.accept(delta, weight)

    result = stage.finish()

    # The bound is 2 x 1 either way (the first round's own median norm is 1 too); the weight cap
    # 3 x median(10, 10, 10, 1000) = 30: g0 = (10 + 10) / 60, g1 = (10 + 30 x 2) / 60.
    assert_close(result.mean_delta["g"], [20 / 60, 70 / 60])
    assert result.norm_reference is not None
    assert result.norm_reference.reference == {"g": 1.0}
    assert result.count == 4


def test_clip_and_cap_refuses_contributions_out_of_the_announced_order() -> None:
    stage = ClipAndCap(WeightedMeanStage(G), RobustAggregation(), G, [1.0, 2.0], None)
    with pytest.raises(ValueError, match=r"contribution 0 has weight 2\.0"):
        stage.accept(g(1, 1), 2.0)
    stage.accept(g(1, 1), 1.0)
    with pytest.raises(ValueError, match="1 contributions accepted of the round's 2"):
        stage.finish()


def dp_config(**changes: Any) -> DPConfig:
    return DPConfig(**{"clip_norm": 2.0, "noise_multiplier": 0.0, "population_size": 100, **changes})


def test_gaussian_noise_without_noise_is_the_equally_weighted_mean_and_measures_the_noise() -> None:
    inner = WeightedMeanStage(G, equal_weights=True)
    stage = GaussianNoise(inner, dp_config(), {WITHIN_CLIP: 1.0}, math.inf, np.random.default_rng(0))
    stage.accept(g(1, 0), 5.0)
    stage.accept(g(3, 2), 7.0)

    result = stage.finish()

    assert_close(result.mean_delta["g"], [2.0, 1.0])
    # No noise, no epsilon; the raw count of unclipped devices is consumed, not released.
    assert dict(result.metrics) == {"dp_noise_stddev": 0.0}
    assert result.consumed == {WITHIN_CLIP}
    assert apply_measurements({WITHIN_CLIP: 1.0, "loss": 2.0}, result) == {
        "loss": 2.0,
        "dp_noise_stddev": 0.0,
    }


def test_gaussian_noise_noises_the_sum_at_the_round_clip_norm_and_adapts_it() -> None:
    dp = dp_config(
        noise_multiplier=1.0, target_unclipped_quantile=0.5, clip_learning_rate=0.2, clipped_count_stddev=1.0
    )
    round_metrics = {CLIP_NORM: 4.0, WITHIN_CLIP: 2.0}
    mean = {"g": np.array([1.0, 1.0], np.float32)}
    stage = GaussianNoise(SecureSum(mean, 2), dp, round_metrics, 3.5, np.random.default_rng(7))

    result = stage.finish()

    # The deltas' noise multiplier leaves room for the count's: (1 - (2 x 1)^-2)^-1/2 = 2 / sqrt(3).
    # Sum (2, 2) plus N(0, (z C)^2) with C = 4 (the round's) over 2 devices, then the count's
    # noise N(0, 1): the same draws as a generator seeded alike.
    z = 2 / math.sqrt(3)
    same = np.random.default_rng(7)
    noise = same.normal(0.0, z * 4.0, size=2)
    count_noise = same.normal(0.0, 1.0)
    assert_close(result.mean_delta["g"], (np.array([2.0, 2.0]) + noise) / 2)
    assert result.metrics["dp_noise_stddev"] == pytest.approx(z * 4.0 / 2)
    # Share (2 - 1 + noise) / 2 + 0.5; the clip norm moves as C exp(-0.2 (share - 0.5)).
    share = (2 - 1 + count_noise) / 2 + 0.5
    assert result.metrics["dp_unclipped_share"] == pytest.approx(share)
    assert result.metrics[NEXT_CLIP_NORM] == pytest.approx(4.0 * math.exp(-0.2 * (share - 0.5)))
    assert result.metrics["dp_epsilon"] == 3.5


def test_secure_sum_accepts_no_single_contribution() -> None:
    stage = SecureSum({"g": np.array([0.5, -0.5], np.float32)}, 3)
    with pytest.raises(ValueError, match="never sees a device's delta"):
        stage.accept(g(1, 1), 1.0)
    result = stage.finish()
    assert result.count == 3
    assert_close(result.mean_delta["g"], [0.5, -0.5])
    with pytest.raises(ValueError, match="at least one survivor"):
        SecureSum({}, 0)


def test_central_merge_mixes_the_central_delta_in_or_says_it_diverged() -> None:
    central = CentralUpdate(delta={"g": np.array([4.0, 0.0], np.float32)}, loss=0.5, steps=3)
    merged = CentralMerge(WeightedMeanStage(G), central, 0.25)
    diverged = CentralMerge(WeightedMeanStage(G), None, 0.25)
    for stage in (merged, diverged):
        stage.accept(g(0, 2), 1.0)

    result, federated_only = merged.finish(), diverged.finish()

    # 0.75 x (0, 2) + 0.25 x (4, 0)
    assert_close(result.mean_delta["g"], [1.0, 1.5])
    assert dict(result.metrics) == {"central_loss": 0.5, "central_steps": 3.0}
    assert_close(federated_only.mean_delta["g"], [0.0, 2.0])
    assert dict(federated_only.metrics) == {"central_diverged": 1.0}


def settings(**values: Any) -> PopulationSettings:
    return PopulationSettings.model_validate(values)


def run(stage: Any, contributions: list[tuple[dict[str, SparseTensor], float]]) -> Aggregate:
    for delta, weight in contributions:
        stage.accept(delta, weight)
    result: Aggregate = stage.finish()
    return result


def test_a_plaintext_population_clips_caps_and_averages_by_its_robust_rule() -> None:
    contributions = [(g(1, 0), 1.0), (g(0, 1), 1.0), (g(2, 0), 1.0)]
    pipeline = pipeline_of(settings(robust_aggregation="median"), G)

    result = run(pipeline.plaintext_round(RoundInputs(0, weights=[1.0, 1.0, 1.0])), contributions)

    # Norms 1, 1, 2: bound 3 x 1, nothing clipped; medians (1, 0, 2) -> 1 and (0, 1, 0) -> 0.
    assert_close(result.mean_delta["g"], [1.0, 0.0])
    assert result.norm_reference is not None
    assert result.norm_reference.reference == {"g": 1.0}


def test_a_private_population_weighs_every_report_the_same_and_merges_the_central_delta() -> None:
    dp = {"clip_norm": 5.0, "noise_multiplier": 0.0, "population_size": 100}
    pipeline = pipeline_of(settings(differential_privacy=dp), G)
    central = CentralPart(CentralUpdate({"g": np.array([2.0, 2.0], np.float32)}, 0.1, 1), 0.5)

    result = run(pipeline.plaintext_round(RoundInputs(0, central=central)), [(g(1, 0), 1.0), (g(3, 0), 9.0)])

    # Equal weights: (2, 0); merged half and half with (2, 2): (2, 1). No robust clipping under DP.
    assert pipeline.private
    assert_close(result.mean_delta["g"], [2.0, 1.0])
    assert result.norm_reference is None
    assert result.metrics["central_loss"] == pytest.approx(0.1)


def test_a_secure_population_without_dp_commits_the_unmasked_mean_as_it_is() -> None:
    pipeline = pipeline_of(settings(aggregation="secure", min_reports=3), G)
    mean = {"g": np.array([0.25, 0.5], np.float32)}

    result = pipeline.secure_round(mean, 3, RoundInputs(0)).finish()

    assert result.mean_delta is mean and dict(result.metrics) == {}


def test_aggregate_runs_a_rounds_whole_stack_in_one_call() -> None:
    contributions = [(g(1, 0), 1.0), (g(0, 1), 1.0), (g(2, 0), 1.0)]
    pipeline = pipeline_of(settings(robust_aggregation="median"), G)

    result = pipeline.aggregate(RoundInputs(0, weights=[1.0, 1.0, 1.0]), iter(contributions))

    # As its stages one by one (the robust test above): medians (1, 0), reference norm 1.
    assert_close(result.mean_delta["g"], [1.0, 0.0])
    assert result.count == 3
    assert result.norm_reference is not None and result.norm_reference.reference == {"g": 1.0}


def test_aggregate_of_a_secure_round_takes_the_unmasked_mean_and_no_contributions() -> None:
    pipeline = pipeline_of(settings(aggregation="secure", min_reports=3), G)
    mean = {"g": np.array([0.25, 0.5], np.float32)}

    result = pipeline.aggregate(RoundInputs(0), secure=(mean, 3))

    assert result.mean_delta is mean and result.count == 3


def test_partial_sums_added_where_they_were_made_give_the_weighted_mean() -> None:
    # Two workers' shares of one round: (1, 0) x 1 + (4, 3) x 3 on one, (0, 2) x 4 on the other.
    first, second = WeightedMean(G), WeightedMean(G)
    first.add_sparse(g(1, 0), 1.0)
    first.add_sparse(g(4, 3), 3.0)
    second.add_sparse(g(0, 2), 4.0)
    pipeline = Pipeline(G)

    result = pipeline.aggregate(RoundInputs(0), partials=[first.partial(), second.partial()])

    # (1 + 12 + 0) / 8 = 1.625; (0 + 9 + 8) / 8 = 2.125: what the three accepted one by one give.
    assert pipeline.sums_in_parts
    assert_close(result.mean_delta["g"], [1.625, 2.125])
    assert result.count == 3


def test_a_pipeline_that_needs_each_contribution_refuses_partial_sums() -> None:
    part = WeightedMean(G)
    part.add_sparse(g(1, 0), 1.0)
    dp = DPConfig(clip_norm=5.0, noise_multiplier=0.0, population_size=100)

    for pipeline in (Pipeline(G, RobustAggregation()), Pipeline(G, dp=dp)):
        assert not pipeline.sums_in_parts
        with pytest.raises(ValueError, match="takes contributions one by one"):
            pipeline.aggregate(RoundInputs(0), partials=[part.partial()])


def test_a_partial_sum_of_the_wrong_shape_or_of_nothing_is_refused_and_adds_nothing() -> None:
    mean = WeightedMean(G)
    mean.add_sparse(g(1, 1), 1.0)
    wrong = WeightedMean({"g": (3,)})
    wrong.add_sparse({"g": sparse((3,), [0], [1.0])}, 1.0)

    with pytest.raises(ValueError, match=r"partial sum: g has shape \(3,\), expected \(2,\)"):
        mean.add_partial(wrong.partial())
    with pytest.raises(ValueError, match="expected at least one delta"):
        mean.add_partial(WeightedMean(G).partial())

    assert mean.count == 1
    assert_close(mean.mean()["g"], [1.0, 1.0])


def test_a_partial_sum_holds_only_the_rows_its_deltas_touched() -> None:
    items = {"items": (5, 2)}
    mean = WeightedMean(items)
    mean.add_sparse({"items": SparseTensor((5, 2), np.array([1, 3]), np.ones((2, 2), np.float32))}, 2.0)

    part = mean.partial()

    # Rows 1 and 3 only, each 2 x (1, 1); added elsewhere they land on the same rows.
    assert part.rows["items"].tolist() == [1, 3]
    np.testing.assert_array_equal(part.sums["items"], [[2.0, 2.0], [2.0, 2.0]])
    other = WeightedMean(items)
    other.add_partial(part)
    np.testing.assert_array_equal(other.mean()["items"], [[0, 0], [1, 1], [0, 0], [1, 1], [0, 0]])
    bad = PartialSum(part.shapes, {"items": np.array([3, 1])}, part.sums, 2.0, 1)
    with pytest.raises(ValueError, match=r"items must hold increasing rows of 0\.\.4"):
        other.add_partial(bad)
    assert other.count == 1
