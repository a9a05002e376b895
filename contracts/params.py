"""Parameter tensors on the wire and on disk: safetensors, checked against the manifest.

Used by the device runtime (downloads, uploads) and the orchestrator (reports, versions).
Global parameters travel dense; a client's delta travels sparse, as the rows it changed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load, save

from contracts.manifest import TensorSpec

Params = dict[str, np.ndarray]


class ParamsError(ValueError):
    """Tensors that do not match what the manifest declares."""


def encode_params(params: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> bytes:
    # metadata=None, never {}: safetensors 0.8 writes an unreadable header for save({}, metadata={}).
    return save(
        {k: np.ascontiguousarray(v) for k, v in params.items()}, metadata=dict(metadata) if metadata else None
    )


def read_metadata(blob: bytes) -> dict[str, str]:
    """The string metadata of a safetensors payload (its header's `__metadata__`)."""
    if len(blob) < 8:
        raise ParamsError("not a valid safetensors payload (shorter than its 8-byte header length)")
    size = int.from_bytes(blob[:8], "little")
    if size > len(blob) - 8:
        raise ParamsError(
            f"not a valid safetensors payload (header of {size} bytes, body of {len(blob) - 8})"
        )
    try:
        header = json.loads(blob[8 : 8 + size])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ParamsError("not a valid safetensors payload (header is not JSON)") from None
    metadata = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ParamsError("safetensors metadata must map strings to strings")
    return metadata


def _check_names(tensors: Mapping[str, object], specs: list[TensorSpec], what: str) -> None:
    """Exactly the declared tensor names, or a ParamsError naming what is missing and extra."""
    expected = {s.name for s in specs}
    missing, extra = expected - set(tensors), set(tensors) - expected
    if missing or extra:
        raise ParamsError(
            f"{what}: expected tensors {sorted(expected)}"
            + (f"; missing {sorted(missing)}" if missing else "")
            + (f"; unexpected {sorted(extra)}" if extra else "")
        )


def check_params(params: Mapping[str, np.ndarray], specs: Iterable[TensorSpec], what: str) -> Params:
    """Exactly the declared tensors, with the declared shapes and dtypes, all finite."""
    specs = list(specs)
    _check_names(params, specs, what)
    checked: Params = {}
    for spec in specs:
        value = params[spec.name]
        if value.dtype != np.dtype(spec.dtype) or value.shape != spec.shape:
            raise ParamsError(
                f"{what}: tensor {spec.name!r} is {value.dtype}{list(value.shape)}, "
                f"expected {spec.dtype}{list(spec.shape)}"
            )
        if not np.all(np.isfinite(value)):
            bad = int(np.size(value) - np.count_nonzero(np.isfinite(value)))
            raise ParamsError(f"{what}: tensor {spec.name!r} has {bad} non-finite values (NaN or inf)")
        checked[spec.name] = value
    return checked


def decode_params(blob: bytes, specs: Iterable[TensorSpec], what: str) -> Params:
    """Parse safetensors bytes and check them; a `ParamsError` says what was wrong."""
    try:
        params = load(blob)
    except (SafetensorError, ValueError, TypeError) as e:
        raise ParamsError(f"{what}: not a valid safetensors payload ({e})") from None
    return check_params(params, specs, what)


# ---- sparse deltas: the rows a client changed -------------------------------------------

# Suffixes of the three tensors that encode one sparse tensor in a safetensors blob.
_ROWS, _VALUES, _SHAPE = "rows", "values", "shape"


def row_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape seen as rows along axis 0; a 0-D tensor is one row of one element."""
    return shape if shape else (1,)


@dataclass(frozen=True, eq=False)  # eq=False: comparing numpy arrays with == is not a bool
class SparseTensor:
    """A tensor stored as the rows (along axis 0) that are not all zero; every other row is zero.

    A 0-D tensor is one row of one element (`values` has shape (k,) with k in {0, 1}).
    """

    shape: tuple[int, ...]
    rows: np.ndarray  # 1-D, integer, strictly increasing, each in [0, number of rows)
    values: np.ndarray  # shape (len(rows),) + row shape[1:]

    def __post_init__(self) -> None:
        # Checked here, not only in decode, so that `WeightedMean.add_sparse` can use plain fancy-index
        # addition (which silently drops repeated rows) on any SparseTensor it is given.
        if any(not isinstance(n, int) or n < 0 for n in self.shape):
            raise ValueError(f"sparse tensor shape must be non-negative integers, got {self.shape}")
        if self.rows.ndim != 1 or self.rows.dtype.kind not in "iu":
            raise ValueError(
                f"sparse tensor rows must be a 1-D integer array, got {self.rows.dtype} {self.rows.shape}"
            )
        by_row = row_shape(self.shape)
        expected_values = (len(self.rows), *by_row[1:])
        if self.values.shape != expected_values:
            raise ValueError(
                f"sparse tensor of shape {self.shape} with {len(self.rows)} rows needs values of shape "
                f"{expected_values}, got {self.values.shape}"
            )
        if np.any(np.diff(self.rows) <= 0):
            raise ValueError(f"sparse tensor rows must be strictly increasing, got {self.rows.tolist()}")
        # Sorted, so the first and last rows bound them all.
        if len(self.rows) and (self.rows[0] < 0 or self.rows[-1] >= by_row[0]):
            raise ValueError(f"sparse tensor rows must lie in [0, {by_row[0]}), got {self.rows.tolist()}")

    def dense(self) -> np.ndarray:
        """The full float32 tensor."""
        out = np.zeros(row_shape(self.shape), dtype=np.float32)
        out[self.rows] = self.values
        return out.reshape(self.shape)


def sparse_rows(value: np.ndarray) -> SparseTensor:
    """The rows of a dense tensor that are not all zero, as float32.

    Lossless for float32 (up to the sign of zero). A row is dropped only when all its values
    compare equal to 0, so rows holding a NaN are kept for validation to see.
    """
    array = np.asarray(value, dtype=np.float32)
    by_row = array.reshape(row_shape(array.shape))
    # any() over every axis but the first; for a 1-D tensor axis=() keeps each element's own test.
    nonzero = np.any(by_row != 0, axis=tuple(range(1, by_row.ndim)))
    rows = np.flatnonzero(nonzero).astype(np.int32)
    return SparseTensor(tuple(array.shape), rows, np.ascontiguousarray(by_row[rows]))


def encode_sparse_delta(
    delta: Mapping[str, np.ndarray | SparseTensor], metadata: Mapping[str, str] | None = None
) -> bytes:
    """One safetensors blob holding, per tensor, its changed rows (`<name>/rows`, int32, strictly
    increasing), their values (`<name>/values`, float32) and its shape (`<name>/shape`, int64).
    Dense tensors are reduced to their nonzero rows (`sparse_rows`)."""
    tensors: dict[str, np.ndarray] = {}
    for name, value in delta.items():
        sparse = value if isinstance(value, SparseTensor) else sparse_rows(value)
        tensors[f"{name}/{_ROWS}"] = np.asarray(sparse.rows, dtype=np.int32)
        tensors[f"{name}/{_VALUES}"] = np.ascontiguousarray(sparse.values, dtype=np.float32)
        tensors[f"{name}/{_SHAPE}"] = np.asarray(sparse.shape, dtype=np.int64)
    # metadata=None, never {}: see encode_params.
    return save(tensors, metadata=dict(metadata) if metadata else None)


def check_sparse_delta(
    delta: Mapping[str, SparseTensor], specs: Iterable[TensorSpec], what: str
) -> dict[str, SparseTensor]:
    """Exactly the declared tensors, float32 with the declared shapes, all values finite."""
    specs = list(specs)
    _check_names(delta, specs, what)
    for spec in specs:
        tensor = delta[spec.name]
        if spec.dtype != "float32" or tensor.shape != spec.shape:
            raise ParamsError(
                f"{what}: tensor {spec.name!r} has shape {list(tensor.shape)}, "
                f"expected {spec.dtype}{list(spec.shape)}"
            )
        if not np.all(np.isfinite(tensor.values)):
            bad = int(np.size(tensor.values) - np.count_nonzero(np.isfinite(tensor.values)))
            raise ParamsError(f"{what}: tensor {spec.name!r} has {bad} non-finite values (NaN or inf)")
    return dict(delta)


def decode_sparse_delta(blob: bytes) -> dict[str, SparseTensor]:
    """The tensors of a blob written by `encode_sparse_delta`; ParamsError if it is not one."""
    try:
        stored = load(blob)
    except (SafetensorError, ValueError, TypeError) as error:
        raise ParamsError(f"sparse delta is not a valid safetensors blob: {error}") from None
    parts: dict[str, dict[str, np.ndarray]] = {}
    for key, array in stored.items():
        name, _, part = key.rpartition("/")
        if not name or part not in (_ROWS, _VALUES, _SHAPE):
            raise ParamsError(f"sparse delta has an unexpected tensor {key!r}")
        parts.setdefault(name, {})[part] = array
    expected_dtypes = {_ROWS: np.dtype(np.int32), _VALUES: np.dtype(np.float32), _SHAPE: np.dtype(np.int64)}
    decoded: dict[str, SparseTensor] = {}
    for name, found in sorted(parts.items()):
        missing = sorted(set(expected_dtypes) - set(found))
        if missing:
            raise ParamsError(f"sparse delta tensor {name!r} lacks {[f'{name}/{p}' for p in missing]}")
        for part, dtype in expected_dtypes.items():
            if found[part].dtype != dtype:
                raise ParamsError(f"sparse delta {name}/{part} must be {dtype}, got {found[part].dtype}")
        shape = found[_SHAPE]
        if shape.ndim != 1 or np.any(shape < 0):
            raise ParamsError(
                f"sparse delta {name}/shape must be a 1-D list of sizes >= 0, got {shape.tolist()}"
            )
        try:
            decoded[name] = SparseTensor(tuple(int(n) for n in shape), found[_ROWS], found[_VALUES])
        except ValueError as error:
            raise ParamsError(f"sparse delta tensor {name!r}: {error}") from None
    return decoded
