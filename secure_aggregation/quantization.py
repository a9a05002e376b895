"""A device's update as one fixed-size integer vector, and the round's sum back as floats.

Secure aggregation sums integers modulo 2^bits, so the dense delta of every global tensor is
flattened in a fixed order, clipped to the round's L2 bound, scaled so that a coordinate of
magnitude `clip_norm` maps to `levels`, and rounded stochastically (up with probability equal to
the fraction), which keeps each coordinate unbiased. Every coordinate of a clipped vector lies in
[-clip_norm, clip_norm], so each integer lies in [-levels, levels], and `levels` is chosen so that
`max_summands` of them cannot wrap: the signed sum decodes exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import numpy as np

from secure_aggregation.config import ProtocolError, RoundParameters


class TensorShape(Protocol):
    """A named tensor's shape, as a manifest's tensor specs have it."""

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


class Layout:
    """The order in which named tensors are flattened into one vector (e.g. the manifest's globals)."""

    def __init__(self, shapes: Sequence[tuple[str, tuple[int, ...]]]) -> None:
        self.shapes = [(name, tuple(int(n) for n in shape)) for name, shape in shapes]
        self.sizes = [int(np.prod(shape, dtype=np.int64)) for _, shape in self.shapes]
        self.length = sum(self.sizes)

    @classmethod
    def of(cls, specs: Iterable[TensorShape]) -> Layout:
        """The layout of tensors in the given order (device and server pass the manifest's globals)."""
        return cls([(spec.name, tuple(spec.shape)) for spec in specs])

    def flatten(self, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        expected = {name for name, _ in self.shapes}
        if set(tensors) != expected:
            raise ProtocolError(f"expected tensors {sorted(expected)}, got {sorted(tensors)}")
        parts = []
        for name, shape in self.shapes:
            value = np.asarray(tensors[name])
            if value.shape != shape:
                raise ProtocolError(f"tensor {name!r} has shape {value.shape}, expected {shape}")
            parts.append(value.astype(np.float64).ravel())
        return np.concatenate(parts) if parts else np.zeros(0)

    def unflatten(self, vector: np.ndarray) -> dict[str, np.ndarray]:
        if vector.shape != (self.length,):
            raise ProtocolError(f"vector has shape {vector.shape}, expected ({self.length},)")
        out, start = {}, 0
        for (name, shape), size in zip(self.shapes, self.sizes, strict=True):
            out[name] = vector[start : start + size].reshape(shape)
            start += size
        return out


def clip(vector: np.ndarray, clip_norm: float) -> np.ndarray:
    """The vector scaled down to L2 norm `clip_norm` when longer; unchanged otherwise."""
    norm = float(np.linalg.norm(vector))
    if not np.isfinite(norm):
        raise ProtocolError("the update has non-finite values and cannot be clipped")
    return vector * (clip_norm / norm) if norm > clip_norm else vector


def quantize(vector: np.ndarray, params: RoundParameters, rng: np.random.Generator) -> np.ndarray:
    """Clipped, stochastically rounded integers in [-levels, levels], as uint64 modulo 2^bits."""
    if vector.shape != (params.vector_length,):
        raise ProtocolError(f"update has shape {vector.shape}, expected ({params.vector_length},)")
    scaled = clip(np.asarray(vector, dtype=np.float64), params.clip_norm) * (params.levels / params.clip_norm)
    integers = np.floor(scaled + rng.random(scaled.shape)).astype(np.int64)
    # Two's complement modulo 2^64, then modulo 2^bits: the same residues as modulo 2^bits directly.
    return integers.astype(np.uint64) & np.uint64(params.modulus_mask)


def decode_signed(total: np.ndarray, params: RoundParameters) -> np.ndarray:
    """A sum modulo 2^bits as signed integers (the sum of at most max_summands inputs never wraps)."""
    residues = np.asarray(total, dtype=np.uint64) & np.uint64(params.modulus_mask)
    signed = residues.astype(np.int64)
    signed[residues >= np.uint64(1 << (params.bits - 1))] -= np.int64(1 << params.bits)
    return signed


def dequantize_sum(total: np.ndarray, params: RoundParameters) -> np.ndarray:
    """The float sum of the inputs whose quantized sum (modulo 2^bits) is `total`."""
    return decode_signed(total, params).astype(np.float64) * (params.clip_norm / params.levels)
