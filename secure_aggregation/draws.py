"""A device's random draws in a secure round, given instead of drawn.

A device draws its secrets at random: two X25519 private keys, the self-mask seed, the higher
coefficients of the two Shamir polynomials, and quantization's uniform draws. The conformance kit
fixes them from labels, so that the requests of a recorded round are the same bytes when a port
makes them (`conformance/generate_http.py`); a device in use never passes them (its session draws
from the operating system)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from secure_aggregation import crypto, shamir
from secure_aggregation.config import ProtocolError


class GivenUniforms:
    """Quantization's uniform draws in [0, 1), given: the `random` that `quantize` asks of its
    generator."""

    def __init__(self, uniforms: Sequence[float]) -> None:
        self.uniforms = np.asarray(uniforms, dtype=np.float64)

    def random(self, shape: tuple[int, ...]) -> np.ndarray:
        if self.uniforms.size != int(np.prod(shape)):
            raise ProtocolError(f"{self.uniforms.size} uniform draws given, quantizing needs {shape}")
        return self.uniforms.reshape(shape)


@dataclass(frozen=True)
class SessionDraws:
    encryption_private: bytes  # X25519, 32 bytes
    mask_private: bytes  # X25519, 32 bytes
    self_mask_seed: bytes  # 32 bytes
    # The Shamir polynomials' coefficients c1..c(t-1) (field elements), for the seed and the mask key.
    self_mask_coefficients: tuple[int, ...]
    mask_key_coefficients: tuple[int, ...]
    quantization_uniforms: tuple[float, ...]

    def __post_init__(self) -> None:
        for name in ("encryption_private", "mask_private", "self_mask_seed"):
            if len(getattr(self, name)) != crypto.KEY_BYTES:
                raise ProtocolError(f"{name} must be {crypto.KEY_BYTES} bytes")
        for name in ("self_mask_coefficients", "mask_key_coefficients"):
            if not all(0 <= c < shamir.PRIME for c in getattr(self, name)):
                raise ProtocolError(f"{name} must be field elements in [0, 2^521 - 1)")

    def coefficients(self, kind: str, count: int) -> list[int]:
        """`count` coefficients of the polynomial sharing `kind` ("self_mask" or "mask_key")."""
        given = self.self_mask_coefficients if kind == "self_mask" else self.mask_key_coefficients
        if len(given) != count:
            raise ProtocolError(
                f"{len(given)} {kind} coefficients given, the round's threshold needs {count}"
            )
        return list(given)

    def uniforms(self) -> np.random.Generator:
        """Quantization's generator (duck-typed: `quantize` asks only for `random(shape)`)."""
        return cast(np.random.Generator, GivenUniforms(self.quantization_uniforms))
