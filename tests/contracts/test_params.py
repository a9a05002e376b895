"""Sparse deltas: the encoding a device uploads and the server stores, and its checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
from safetensors.numpy import save

from contracts.manifest import TensorSpec
from contracts.params import (
    ParamsError,
    SparseTensor,
    check_sparse_delta,
    decode_sparse_delta,
    encode_sparse_delta,
    read_metadata,
)


def f32(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def test_sparse_round_trip_of_0d_1d_and_2d_tensors() -> None:
    matrix = np.zeros((3, 2), np.float32)
    matrix[1] = [0.5, -7]
    delta = {
        "scalar": np.float32(2.5).reshape(()),
        "zero_scalar": np.zeros((), np.float32),
        "one": f32(-1.25),
        "vector": f32(0, 1.5, 0, -2),
        "matrix": matrix,
    }

    decoded = decode_sparse_delta(encode_sparse_delta(delta))

    assert sorted(decoded) == sorted(delta)
    assert decoded["scalar"].shape == ()
    assert decoded["scalar"].rows.tolist() == [0]
    assert decoded["zero_scalar"].rows.tolist() == []
    assert decoded["one"].rows.tolist() == [0]
    assert decoded["vector"].rows.tolist() == [1, 3]
    assert decoded["vector"].values.tolist() == [1.5, -2.0]
    assert decoded["matrix"].rows.tolist() == [1]
    assert decoded["matrix"].values.tolist() == [[0.5, -7.0]]
    for name, value in delta.items():
        dense = decoded[name].dense()
        assert dense.dtype == np.float32
        assert dense.shape == value.shape
        np.testing.assert_array_equal(dense, value)


def test_sparse_encoding_stores_only_touched_rows() -> None:
    delta = np.zeros((1000, 8), np.float32)
    delta[5] = 1.0
    delta[900, 2] = 3.0

    blob = encode_sparse_delta({"items": delta})
    decoded = decode_sparse_delta(blob)["items"]

    assert delta.nbytes == 32_000
    assert len(blob) < 1_000  # 2 rows of 8 float32 + 2 indices + the shape + the header
    assert decoded.rows.tolist() == [5, 900]
    assert decoded.values.shape == (2, 8)
    np.testing.assert_array_equal(decoded.dense(), delta)


def test_sparse_encoding_keeps_nan_rows() -> None:
    # A NaN is not zero: dropping its row would hide a broken update from validation.
    blob = encode_sparse_delta({"v": f32(0, math.nan)})

    decoded = decode_sparse_delta(blob)["v"]

    assert decoded.rows.tolist() == [1]
    assert math.isnan(float(decoded.values[0]))


def valid_parts() -> dict[str, np.ndarray]:
    return {
        "v/rows": np.array([1, 3], np.int32),
        "v/values": f32(1.5, -2),
        "v/shape": np.array([4], np.int64),
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"v/rows": np.array([1, 3], np.int64)}, r"v/rows must be int32"),
        ({"v/values": np.array([1.5, -2], np.float64)}, r"v/values must be float32"),
        ({"v/shape": np.array([4], np.int32)}, r"v/shape must be int64"),
        ({"v/shape": np.array([-4], np.int64)}, r"sizes >= 0"),
        ({"v/rows": np.array([1, 4], np.int32)}, r"rows must lie in \[0, 4\)"),
        ({"v/rows": np.array([3, 1], np.int32)}, r"strictly increasing"),
        ({"v/rows": np.array([1, 1], np.int32)}, r"strictly increasing"),
        ({"v/values": f32(1.5)}, r"needs values of shape \(2,\), got \(1,\)"),
        ({"v": f32(1, 2)}, r"unexpected tensor 'v'"),
        ({"v/other": f32(1)}, r"unexpected tensor 'v/other'"),
    ],
)
def test_decode_refuses_a_malformed_blob(change: dict[str, np.ndarray], message: str) -> None:
    blob = save({**valid_parts(), **change})

    with pytest.raises(ValueError, match=message):
        decode_sparse_delta(blob)


def test_decode_refuses_a_tensor_with_a_missing_part() -> None:
    parts = valid_parts()
    del parts["v/values"]

    with pytest.raises(ValueError, match=r"'v' lacks \['v/values'\]"):
        decode_sparse_delta(save(parts))


@pytest.mark.parametrize("blob", [b"", b"not safetensors at all", encode_sparse_delta({"v": f32(1, 0)})[:-2]])
def test_decode_refuses_bytes_that_are_not_safetensors(blob: bytes) -> None:
    with pytest.raises(ValueError, match="not a valid safetensors blob"):
        decode_sparse_delta(blob)


def test_sparse_tensor_refuses_repeated_rows() -> None:
    # Repeated rows would be added once, not twice, by WeightedMean.add_sparse's fancy indexing.
    with pytest.raises(ValueError, match="strictly increasing"):
        SparseTensor(shape=(4,), rows=np.array([2, 2]), values=f32(1, 1))


def test_metadata_travels_with_the_sparse_delta() -> None:
    blob = encode_sparse_delta({"v": f32(0, 2)}, {"num_examples": "7"})

    assert read_metadata(blob) == {"num_examples": "7"}
    assert decode_sparse_delta(blob)["v"].rows.tolist() == [1]


SPECS = [TensorSpec("items", (4, 2), "float32"), TensorSpec("bias", (), "float32")]


def test_check_accepts_exactly_the_declared_tensors() -> None:
    items = np.zeros((4, 2), np.float32)
    items[2] = [1, -1]
    delta = decode_sparse_delta(encode_sparse_delta({"items": items, "bias": np.float32(0.5).reshape(())}))

    checked = check_sparse_delta(delta, SPECS, "report")

    np.testing.assert_array_equal(checked["items"].dense(), items)


@pytest.mark.parametrize(
    ("delta", "message"),
    [
        ({"items": np.zeros((4, 2), np.float32)}, r"missing \['bias'\]"),
        ({"items": np.zeros((5, 2), np.float32), "bias": f32(0)[0].reshape(())}, r"shape \[5, 2\], expected"),
        (
            {"items": np.zeros((4, 2), np.float32), "bias": f32(0)[0].reshape(()), "user": f32(1)},
            r"unexpected \['user'\]",
        ),
        ({"items": np.full((4, 2), np.inf, np.float32), "bias": f32(0)[0].reshape(())}, "8 non-finite"),
    ],
)
def test_check_refuses_what_the_manifest_does_not_declare(delta: dict[str, np.ndarray], message: str) -> None:
    decoded = decode_sparse_delta(encode_sparse_delta(delta))

    with pytest.raises(ParamsError, match=message):
        check_sparse_delta(decoded, SPECS, "report")
