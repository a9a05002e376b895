"""Quantization: clipped, unbiased, and a full round's sum never wraps."""

from __future__ import annotations

import numpy as np
import pytest

from secure_aggregation.config import ProtocolError, RoundParameters
from secure_aggregation.quantization import Layout, clip, dequantize_sum, quantize


def _params(length: int, *, bits: int = 32, summands: int = 100, clip_norm: float = 1.0) -> RoundParameters:
    return RoundParameters("test", length, bits, clip_norm, summands, 0, 0.5, 1)


def test_a_full_round_of_extreme_inputs_sums_without_wrapping():
    # Prepare: every device sends the largest value allowed, with the same sign, in every coordinate
    params = _params(4, summands=100)
    rng = np.random.default_rng(0)
    extreme = np.array([1.0, 0.0, 0.0, 0.0])  # norm 1 = clip_norm: the first coordinate is at the edge

    # Execute
    for sign in (1.0, -1.0):
        total = np.zeros(4, dtype=np.uint64)
        for _ in range(100):
            total += quantize(sign * extreme, params, rng)

        # Assert: the sum decodes to exactly 100 x the input
        assert dequantize_sum(total, params)[0] == pytest.approx(100 * sign, rel=1e-6)


def test_stochastic_rounding_is_unbiased_and_within_one_step():
    # Prepare: values between two quantization levels, 8 bits of precision per device
    params = _params(20_000, bits=16, summands=1, clip_norm=1.0)
    step = params.clip_norm / params.levels
    value = np.full(20_000, 0.3 * step)  # a third of a step; the norm stays under the bound

    # Execute
    decoded = dequantize_sum(quantize(value, params, np.random.default_rng(1)), params)

    # Assert: every coordinate is one of the two neighbouring levels, and the mean is the value
    assert set(np.round(decoded / step).astype(int)) <= {0, 1}
    assert decoded.mean() == pytest.approx(value.mean(), abs=0.02 * step)


def test_updates_longer_than_the_bound_are_clipped_to_it():
    vector = np.array([3.0, 4.0])
    assert np.linalg.norm(clip(vector, 1.0)) == pytest.approx(1.0)
    assert np.array_equal(clip(vector, 10.0), vector)
    with pytest.raises(ProtocolError, match="non-finite"):
        clip(np.array([np.nan, 1.0]), 1.0)


def test_layout_flattens_every_tensor_and_back():
    layout = Layout([("item_embeddings", (3, 2)), ("item_bias", (3,)), ("global_mean", ())])
    tensors = {
        "item_embeddings": np.arange(6, dtype=np.float32).reshape(3, 2),
        "item_bias": np.array([7, 8, 9], dtype=np.float32),
        "global_mean": np.array(10, dtype=np.float32),
    }
    back = layout.unflatten(layout.flatten(tensors))
    assert layout.length == 10
    assert all(np.array_equal(back[k], v) for k, v in tensors.items())
    with pytest.raises(ProtocolError, match="shape"):
        layout.flatten({**tensors, "item_bias": np.zeros(4)})


def test_too_few_bits_for_the_round_are_refused():
    with pytest.raises(ProtocolError, match="quantization levels"):
        _params(10, bits=16, summands=1000)
