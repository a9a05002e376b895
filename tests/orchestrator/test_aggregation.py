"""Aggregation: the streaming weighted mean (dense and sparse deltas), the server optimizers.

Expected values are worked out by hand and written literally; the arithmetic is in the comments.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from numpy.typing import ArrayLike

from contracts.params import Params, SparseTensor, decode_sparse_delta, encode_sparse_delta
from orchestrator.aggregation.assemble import Pipeline, RoundInputs
from orchestrator.aggregation.coordinate_wise import robust_mean
from orchestrator.aggregation.registry import RobustAggregation
from orchestrator.aggregation.robust import cap_weights, clip_by_norm, plan_round
from orchestrator.aggregation.server_optimizer import ServerOptimizerConfig, apply_update, init_state
from orchestrator.aggregation.weighted_mean import WeightedMean


def f32(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def assert_close(actual: np.ndarray, expected: ArrayLike) -> None:
    assert actual.dtype == np.float32
    np.testing.assert_allclose(actual, np.array(expected, dtype=np.float64), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------------------
# Weighted mean


def test_weighted_mean_of_three_deltas_weighs_each_by_its_weight() -> None:
    mean = WeightedMean({"w": (2,), "b": ()})

    mean.add({"w": f32(1, 2), "b": np.array(3, np.float32)}, weight=1)
    mean.add({"w": f32(4, -1), "b": np.array(0, np.float32)}, weight=2)
    mean.add({"w": f32(0, 0), "b": np.array(6, np.float32)}, weight=1)
    result = mean.mean()

    # w: (1*1 + 2*4 + 1*0) / 4 = 2.25 and (1*2 + 2*-1 + 1*0) / 4 = 0; b: (3 + 0 + 6) / 4 = 2.25
    assert_close(result["w"], [2.25, 0.0])
    assert_close(result["b"], 2.25)
    assert result["b"].shape == ()
    assert mean.total_weight == 4.0
    assert mean.count == 3


def test_weights_need_not_be_integers() -> None:
    mean = WeightedMean({"w": (1,)})

    mean.add({"w": f32(1.0)}, weight=0.5)
    mean.add({"w": f32(4.0)}, weight=np.float32(1.5))  # type: ignore[arg-type]  # numpy scalars work too
    result = mean.mean()

    # (0.5*1 + 1.5*4) / 2 = 3.25; an unweighted mean would be 2.5
    assert_close(result["w"], [3.25])
    assert mean.total_weight == 2.0


def two_clients_dense() -> tuple[Params, Params]:
    """Client A trained item row 1, client B rows 1 and 3; the other rows of their deltas are zero."""
    a = {"items": np.zeros((4, 2), np.float32), "bias": np.zeros(4, np.float32)}
    a["items"][1] = [2, 4]
    a["bias"][1] = 1
    b = {"items": np.zeros((4, 2), np.float32), "bias": np.zeros(4, np.float32)}
    b["items"][1] = [2, 0]
    b["items"][3] = [-4, 8]
    b["bias"][3] = 2
    return a, b


# Weights 1 (A) and 3 (B), total 4:
#   items row 1: (1*[2, 4] + 3*[2, 0]) / 4 = [2, 1]; row 3: 3*[-4, 8] / 4 = [-3, 6]; rows 0 and 2: 0
#   bias: [0, 1*1/4, 0, 3*2/4] = [0, 0.25, 0, 1.5]
EXPECTED_ITEMS = [[0.0, 0.0], [2.0, 1.0], [0.0, 0.0], [-3.0, 6.0]]
EXPECTED_BIAS = [0, 0.25, 0, 1.5]
SHAPES = {"items": (4, 2), "bias": (4,)}


def test_dense_adds_give_the_hand_computed_mean() -> None:
    a, b = two_clients_dense()
    mean = WeightedMean(SHAPES)

    mean.add(a, weight=1)
    mean.add(b, weight=3)
    result = mean.mean()

    assert_close(result["items"], EXPECTED_ITEMS)
    assert_close(result["bias"], EXPECTED_BIAS)


def test_sparse_adds_give_the_same_mean_as_dense_adds() -> None:
    a, b = two_clients_dense()
    sparse_a = decode_sparse_delta(encode_sparse_delta(a))
    sparse_b = decode_sparse_delta(encode_sparse_delta(b))
    all_sparse, mixed = WeightedMean(SHAPES), WeightedMean(SHAPES)

    all_sparse.add_sparse(sparse_a, weight=1)
    all_sparse.add_sparse(sparse_b, weight=3)
    mixed.add(a, weight=1)
    mixed.add_sparse(sparse_b, weight=3)

    for mean in (all_sparse, mixed):
        result = mean.mean()
        assert_close(result["items"], EXPECTED_ITEMS)
        assert_close(result["bias"], EXPECTED_BIAS)
        assert mean.count == 2
        assert mean.total_weight == 4.0


def test_add_does_not_modify_the_delta() -> None:
    a, _ = two_clients_dense()
    before = {k: v.copy() for k, v in a.items()}
    mean = WeightedMean(SHAPES)

    mean.add(a, weight=2)
    mean.mean()["items"][:] = 99  # the caller owns the result; changing it changes nothing inside

    for name in a:
        np.testing.assert_array_equal(a[name], before[name])
    assert_close(mean.mean()["items"], [[0, 0], [2, 4], [0, 0], [0, 0]])


def test_add_refuses_wrong_names_and_says_what_was_expected() -> None:
    mean = WeightedMean({"w": (2,), "b": ()})

    with pytest.raises(ValueError, match=r"expected tensors \['b', 'w'\]; missing \['b'\]"):
        mean.add({"w": f32(1, 2)}, weight=1)
    with pytest.raises(ValueError, match=r"unexpected \['extra'\]"):
        mean.add({"w": f32(1, 2), "b": np.array(0, np.float32), "extra": f32(1)}, weight=1)

    assert mean.count == 0


def test_add_refuses_a_wrong_shape_and_leaves_the_sum_untouched() -> None:
    mean = WeightedMean({"w": (2,), "b": ()})

    with pytest.raises(ValueError, match=r"w has shape \(3,\), expected \(2,\)"):
        mean.add({"w": f32(1, 2, 3), "b": np.array(100, np.float32)}, weight=1)
    mean.add({"w": f32(1, 2), "b": np.array(3, np.float32)}, weight=1)

    # b would be (100 + 3) / 2 if the refused delta had been partly added
    assert_close(mean.mean()["b"], 3.0)
    assert mean.count == 1
    assert mean.total_weight == 1.0


def test_add_sparse_refuses_a_wrong_shape() -> None:
    mean = WeightedMean({"items": (4, 2)})
    wrong = SparseTensor(shape=(5, 2), rows=np.array([4], np.int32), values=f32(1, 1).reshape(1, 2))

    with pytest.raises(ValueError, match=r"items has shape \(5, 2\), expected \(4, 2\)"):
        mean.add_sparse({"items": wrong}, weight=1)

    assert mean.count == 0


@pytest.mark.parametrize("weight", [0.0, -1.0, math.nan, math.inf, True])
def test_add_refuses_a_weight_that_is_not_finite_and_positive(weight: float) -> None:
    mean = WeightedMean({"w": (1,)})

    with pytest.raises(ValueError, match="weight must be a finite number > 0"):
        mean.add({"w": f32(1)}, weight=weight)
    with pytest.raises(ValueError, match="weight must be a finite number > 0"):
        mean.add_sparse(decode_sparse_delta(encode_sparse_delta({"w": f32(1)})), weight=weight)

    assert mean.count == 0
    assert mean.total_weight == 0.0


def test_mean_of_nothing_is_refused() -> None:
    mean = WeightedMean({"w": (1,)})

    with pytest.raises(ValueError, match="no deltas"):
        mean.mean()


# ---------------------------------------------------------------------------------------------------------
# Robust aggregation


def sparse(shape: tuple[int, ...], rows: list[int], values: list[float]) -> SparseTensor:
    return SparseTensor(shape, np.array(rows, np.int32), f32(*values))


def test_weights_are_capped_at_a_multiple_of_the_median() -> None:
    # median(1, 2, 3, 100) = 2.5, cap 2 x 2.5 = 5
    assert cap_weights([1, 2, 3, 100], 2.0) == [1.0, 2.0, 3.0, 5.0]


def test_clip_by_norm_scales_a_tensor_down_to_its_bound_and_leaves_the_rest() -> None:
    delta = {"w": sparse((2,), [0, 1], [3.0, 4.0]), "b": sparse((3,), [2], [0.5])}

    clipped = clip_by_norm(delta, {"w": 2.5, "b": 1.0})

    assert_close(clipped["w"].values, [1.5, 2.0])  # norm 5 -> 2.5: halved
    assert clipped["b"] is delta["b"]  # norm 0.5 <= 1
    assert_close(delta["w"].values, [3.0, 4.0])  # the input is untouched


def test_the_first_round_clips_at_a_multiple_of_its_own_median_norm() -> None:
    rule = RobustAggregation(norm_clip_multiple=3.0, reference_growth=1.25)

    plan = plan_round([1, 1, 1], [{"g": 1.0}, {"g": 2.0}, {"g": 10.0}], None, rule)

    assert plan.bounds == {"g": 6.0}  # 3 x median(1, 2, 10)
    assert plan.next_reference.reference == {"g": 2.0}  # min(median 2, 1.25 x 2)


def test_a_round_of_large_deltas_is_clipped_to_the_reference_and_raises_it_only_slowly() -> None:
    rule = RobustAggregation(norm_clip_multiple=3.0, reference_growth=1.25)

    hostile = plan_round([1, 1], [{"g": 100.0}, {"g": 100.0}], {"g": 1.0}, rule)
    quiet = plan_round([1], [{"g": 0.2}], {"g": 1.0}, rule)
    untouched = plan_round([1], [{"g": 0.0}], {"g": 1.0}, rule)

    assert hostile.bounds == {"g": 3.0} and hostile.next_reference.reference == {"g": 1.25}
    assert quiet.next_reference.reference == {"g": 0.2}  # one round of history: follows it down
    assert untouched.next_reference.reference == {"g": 1.0}  # no report changed it: nothing learnt


def test_coordinate_median_over_the_reports_that_changed_each_row() -> None:
    deltas = [
        {"v": sparse((4,), [0, 1], [1.0, 10.0])},
        {"v": sparse((4,), [0], [2.0])},
        {"v": sparse((4,), [0, 2], [3.0, 7.0])},
    ]

    result = robust_mean(deltas, [1.0, 1.0, 2.0], {"v": (4,)}, "median")

    # row 0: median(1, 2, 3) = 2, all the weight; row 1: 10 x 1/4; row 2: 7 x 2/4; row 3: unchanged
    assert_close(result["v"], [2.0, 2.5, 3.5, 0.0])


def test_trimmed_mean_drops_the_extremes_of_each_coordinate() -> None:
    deltas = [{"m": sparse((1,), [0], [v])} for v in (1.0, 2.0, 3.0, 10.0, 100.0)]
    weights = [1.0] * 5

    trimmed = robust_mean(deltas, weights, {"m": (1,)}, "trimmed_mean", trim_fraction=0.2)
    median = robust_mean(deltas, weights, {"m": (1,)}, "median")

    assert_close(trimmed["m"], [5.0])  # one dropped at each end: (2 + 3 + 10) / 3
    assert_close(median["m"], [3.0])


def test_the_pipeline_clips_caps_and_averages() -> None:
    # Three honest deltas of norm 1 and weight 10; one of norm 100 and weight 1000.
    deltas = [{"g": sparse((1,), [0], [v])} for v in (1.0, 1.0, 1.0, 100.0)]
    weights = [10.0, 10.0, 10.0, 1000.0]
    rule = RobustAggregation(norm_clip_multiple=2.0, max_weight_multiple=3.0)

    result = Pipeline({"g": (1,)}, rule).aggregate(
        RoundInputs(0, weights=weights), zip(deltas, weights, strict=True)
    )

    # bound 2 x median(1, 1, 1, 100) = 2; weight cap 3 x median(10, 10, 10, 1000) = 30:
    # (10 + 10 + 10 + 30 x 2) / (10 + 10 + 10 + 30) = 90 / 60
    assert_close(result.mean_delta["g"], [1.5])
    assert result.norm_reference is not None and result.norm_reference.reference == {"g": 1.0}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"method": "mean"}, "unknown robust aggregation 'mean'"),
        ({"trim_fraction": 0.5}, "trim_fraction must be in \\[0, 0.5\\)"),
        ({"norm_clip_multiple": 0.5}, "norm_clip_multiple must be in \\[1, 1e6\\]"),
    ],
)
def test_robust_aggregation_refuses_bad_settings(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RobustAggregation(**changes)


# ---------------------------------------------------------------------------------------------------------
# Server optimizers

X0 = (1.0, -2.0)


def two_steps(
    config: ServerOptimizerConfig, d1: tuple[float, float], d2: tuple[float, float]
) -> list[Params]:
    """params after step 1, state after step 1, params after step 2, state after step 2."""
    params = {"w": f32(*X0)}
    state = init_state(config, params)
    params1, state1 = apply_update(config, params, {"w": f32(*d1)}, state)
    params2, state2 = apply_update(config, params1, {"w": f32(*d2)}, state1)
    return [params1, state1, params2, state2]


def test_sgd_moves_params_along_the_mean_delta() -> None:
    config = ServerOptimizerConfig("sgd", learning_rate=0.5)

    params1, state1, params2, state2 = two_steps(config, (0.2, -0.4), (0.6, 0.2))

    # x1 = [1, -2] + 0.5*[0.2, -0.4] = [1.1, -2.2]; x2 = x1 + 0.5*[0.6, 0.2] = [1.4, -2.1]
    assert_close(params1["w"], [1.1, -2.2])
    assert_close(params2["w"], [1.4, -2.1])
    assert state1 == {} and state2 == {}


def test_sgd_with_learning_rate_one_is_fedavg() -> None:
    config = ServerOptimizerConfig("sgd")

    params, _ = apply_update(config, {"w": f32(1, -2)}, {"w": f32(0.25, 3)}, {})

    # the new model is the mean client model: x + (x_client - x) = [1.25, 1]
    assert_close(params["w"], [1.25, 1.0])


def test_momentum_accumulates_deltas() -> None:
    config = ServerOptimizerConfig("momentum", learning_rate=0.5, momentum=0.9)

    params1, state1, params2, state2 = two_steps(config, (0.2, -0.4), (0.6, 0.2))

    # m1 = d1 = [0.2, -0.4]; x1 = [1, -2] + 0.5*m1 = [1.1, -2.2]
    # m2 = 0.9*[0.2, -0.4] + [0.6, 0.2] = [0.78, -0.16]; x2 = x1 + 0.5*m2 = [1.49, -2.28]
    assert_close(state1["momentum/w"], [0.2, -0.4])
    assert_close(params1["w"], [1.1, -2.2])
    assert_close(state2["momentum/w"], [0.78, -0.16])
    assert_close(params2["w"], [1.49, -2.28])


def test_adam_two_steps() -> None:
    config = ServerOptimizerConfig("adam", learning_rate=0.5, beta1=0.5, beta2=0.8, tau=0.1)

    params1, state1, params2, state2 = two_steps(config, (0.4, -1.1), (0.8, 2.0))

    # v0 = tau^2 = 0.01, m0 = 0
    # m1 = 0.5*d1 = [0.2, -0.55]
    # v1 = 0.8*0.01 + 0.2*[0.16, 1.21] = [0.04, 0.25]; sqrt = [0.2, 0.5]
    # x1 = [1 + 0.5*0.2/0.3, -2 + 0.5*-0.55/0.6] = [1 + 1/3, -2 - 0.458333] = [1.333333, -2.458333]
    assert_close(state1["m/w"], [0.2, -0.55])
    assert_close(state1["v/w"], [0.04, 0.25])
    assert_close(params1["w"], [1.3333333, -2.4583333])
    # m2 = 0.5*[0.2, -0.55] + 0.5*[0.8, 2.0] = [0.5, 0.725]
    # v2 = 0.8*[0.04, 0.25] + 0.2*[0.64, 4.0] = [0.16, 1.0]; sqrt = [0.4, 1.0]
    # x2 = [1.333333 + 0.5*0.5/0.5, -2.458333 + 0.5*0.725/1.1] = [1.833333, -2.458333 + 0.329545]
    assert_close(state2["m/w"], [0.5, 0.725])
    assert_close(state2["v/w"], [0.16, 1.0])
    assert_close(params2["w"], [1.8333333, -2.1287879])


def test_yogi_two_steps_moves_v_by_a_multiple_of_delta_squared() -> None:
    config = ServerOptimizerConfig("yogi", learning_rate=0.5, beta1=0.5, beta2=0.5, tau=0.9)

    params1, state1, params2, state2 = two_steps(config, (0.8, -0.8), (1.2, 0.8))

    # v0 = tau^2 = 0.81, m0 = 0
    # m1 = 0.5*d1 = [0.4, -0.4]
    # d1^2 = 0.64 < v0, so v falls: v1 = 0.81 - 0.5*0.64 = 0.49 (Adam would give 0.5*0.81 + 0.5*0.64 = 0.725)
    # x1 = [1, -2] + 0.5*[0.4, -0.4]/(0.7 + 0.9) = [1.125, -2.125]
    assert_close(state1["m/w"], [0.4, -0.4])
    assert_close(state1["v/w"], [0.49, 0.49])
    assert_close(params1["w"], [1.125, -2.125])
    # m2 = 0.5*[0.4, -0.4] + 0.5*[1.2, 0.8] = [0.8, 0.2]
    # d2^2 = [1.44, 0.64] > 0.49, so v rises: v2 = 0.49 + 0.5*[1.44, 0.64] = [1.21, 0.81]; sqrt = [1.1, 0.9]
    # x2 = [1.125 + 0.5*0.8/2.0, -2.125 + 0.5*0.2/1.8] = [1.325, -2.125 + 0.055556]
    assert_close(state2["m/w"], [0.8, 0.2])
    assert_close(state2["v/w"], [1.21, 0.81])
    assert_close(params2["w"], [1.325, -2.0694444])


def test_init_state_names_and_values() -> None:
    params = {"w": f32(1, 2), "b": np.zeros((), np.float32)}

    sgd = init_state(ServerOptimizerConfig("sgd"), params)
    momentum = init_state(ServerOptimizerConfig("momentum"), params)
    adam = init_state(ServerOptimizerConfig("adam", tau=0.1), params)
    yogi = init_state(ServerOptimizerConfig("yogi", tau=0.5), params)

    assert sgd == {}
    assert sorted(momentum) == ["momentum/b", "momentum/w"]
    assert_close(momentum["momentum/w"], [0.0, 0.0])
    assert sorted(adam) == ["m/b", "m/w", "v/b", "v/w"]
    assert_close(adam["m/w"], [0.0, 0.0])
    assert_close(adam["v/w"], [0.01, 0.01])
    assert adam["v/b"].shape == ()
    assert_close(yogi["v/b"], 0.25)


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "yogi"])
def test_apply_update_does_not_modify_its_inputs(name: str) -> None:
    config = ServerOptimizerConfig(name, learning_rate=0.5)
    params = {"w": f32(1, -2)}
    delta = {"w": f32(0.5, 0.25)}
    state = {k: v + 0.5 for k, v in init_state(config, params).items()}
    copies = [{k: v.copy() for k, v in d.items()} for d in (params, delta, state)]

    new_params, new_state = apply_update(config, params, delta, state)
    new_params["w"][:] = 0
    for value in new_state.values():
        value[...] = 0

    for original, copy in zip((params, delta, state), copies, strict=True):
        assert original.keys() == copy.keys()
        for key in original:
            np.testing.assert_array_equal(original[key], copy[key])


def test_apply_update_refuses_a_mean_delta_that_does_not_match_the_params() -> None:
    config = ServerOptimizerConfig("sgd")
    params = {"w": f32(1, 2)}

    with pytest.raises(ValueError, match=r"mean delta: expected tensors \['w'\]; missing \['w'\]"):
        apply_update(config, params, {"v": f32(1, 2)}, {})
    with pytest.raises(ValueError, match=r"mean delta: w has shape \(3,\), expected \(2,\)"):
        apply_update(config, params, {"w": f32(1, 2, 3)}, {})


def test_apply_update_refuses_state_of_another_optimizer_or_shape() -> None:
    params = {"w": f32(1, 2)}
    delta = {"w": f32(0, 0)}
    adam = ServerOptimizerConfig("adam")
    momentum_state = init_state(ServerOptimizerConfig("momentum"), params)
    short_state = {"m/w": f32(0), "v/w": f32(1)}

    with pytest.raises(ValueError, match=r"adam optimizer state: .*missing \['m/w', 'v/w'\]"):
        apply_update(adam, params, delta, momentum_state)
    with pytest.raises(ValueError, match=r"adam optimizer state: m/w has shape \(1,\), expected \(2,\)"):
        apply_update(adam, params, delta, short_state)
    with pytest.raises(ValueError, match=r"unexpected \['momentum/w'\]"):
        apply_update(ServerOptimizerConfig("sgd"), params, delta, momentum_state)


# ---------------------------------------------------------------------------------------------------------
# Config


def test_config_json_round_trip() -> None:
    config = ServerOptimizerConfig("yogi", learning_rate=0.1, beta1=0.8, beta2=0.95, tau=0.01)

    data = config.to_json()
    again = ServerOptimizerConfig.from_json(data)

    assert data == {
        "name": "yogi",
        "learning_rate": 0.1,
        "momentum": 0.9,
        "beta1": 0.8,
        "beta2": 0.95,
        "tau": 0.01,
    }
    assert again == config


def test_config_defaults() -> None:
    config = ServerOptimizerConfig.from_json({"name": "adam"})

    assert (config.learning_rate, config.momentum, config.beta1, config.beta2, config.tau) == (
        1.0,
        0.9,
        0.9,
        0.99,
        1e-3,
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"name": "adagrad"},
            r"unknown server optimizer 'adagrad'; known: \['sgd', 'momentum', 'adam', 'yogi'\]",
        ),
        ({"name": "sgd", "lr": 0.1}, r"unknown server optimizer fields \['lr'\]"),
        ({"learning_rate": 0.1}, r"needs a 'name'"),
        ({"name": "sgd", "learning_rate": -0.1}, r"learning_rate must be a finite number in \(0, 1e\+06\]"),
        ({"name": "sgd", "learning_rate": 0}, r"learning_rate must be a finite number in \(0, 1e\+06\]"),
        ({"name": "sgd", "learning_rate": 1e7}, r"learning_rate must be a finite number in \(0, 1e\+06\]"),
        ({"name": "sgd", "learning_rate": math.inf}, r"learning_rate must be a finite number in \(0"),
        ({"name": "sgd", "learning_rate": "0.1"}, r"learning_rate must be a finite number"),
        ({"name": "momentum", "momentum": 1.0}, r"momentum must be a finite number in \[0, 1\)"),
        ({"name": "adam", "beta1": -0.1}, r"beta1 must be a finite number in \[0, 1\)"),
        ({"name": "adam", "beta2": math.nan}, r"beta2 must be a finite number in \[0, 1\)"),
        ({"name": "yogi", "tau": 0.0}, r"tau must be a finite number in \(0, 1e\+06\]"),
        ({"name": "yogi", "tau": True}, r"tau must be a finite number in \(0"),
    ],
)
def test_config_refuses_bad_values(data: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerOptimizerConfig.from_json(data)
