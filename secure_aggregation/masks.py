"""The mask generator: a 32-byte seed expanded into a vector of integers modulo 2^bits.

ChaCha20 (from `cryptography`) in counter mode over zeros is the pseudorandom generator; 4 bytes
per coordinate when bits <= 32, else 8, reduced modulo 2^bits (2^bits divides 2^32 or 2^64, so the
residues are uniform). A device
and the server expand the same seed to the same mask, so a mask added by a device can be removed
from the sum by the server once it knows the seed.
"""

from __future__ import annotations

import functools

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from secure_aggregation.config import RoundParameters
from secure_aggregation.crypto import KEY_BYTES

_NONCE = bytes(16)  # each seed is used for one stream only (keys are derived per round and purpose)


def expand(seed: bytes, params: RoundParameters) -> np.ndarray:
    """`params.vector_length` pseudorandom integers from `seed` whose residues modulo 2^bits are the
    mask (uint32 or uint64, not yet reduced: sums are reduced once, at the end)."""
    if len(seed) != KEY_BYTES:
        raise ValueError(f"a mask seed is {KEY_BYTES} bytes, got {len(seed)}")
    dtype = np.dtype(params.wire_dtype)
    encryptor = Cipher(algorithms.ChaCha20(seed, _NONCE), mode=None).encryptor()
    stream = encryptor.update(_zeros(dtype.itemsize * params.vector_length))
    return np.frombuffer(stream, dtype=dtype)


@functools.lru_cache(maxsize=4)
def _zeros(size: int) -> bytes:
    """The plaintext of the keystream, allocated once per size (allocating it took half the time)."""
    return bytes(size)


def sum_dtype(params: RoundParameters) -> np.dtype[np.unsignedinteger]:
    """The integers a sum of masks is kept in: the masks' own (uint32 when bits <= 32). It wraps
    modulo 2^32 or 2^64, a multiple of 2^bits, so its residues are the same as a uint64 sum's, and
    adding uint32 into uint32 takes a third of the time of casting each into a uint64 total."""
    return np.dtype(params.wire_dtype).newbyteorder("=")


def add_into(total: np.ndarray, mask: np.ndarray, sign: int) -> None:
    """total += sign * mask, modulo 2^32 or 2^64 as the total's dtype wraps (in place; reduce modulo
    2^bits when done). A uint32 mask into a uint64 total casts element by element, no temporary."""
    if sign > 0:
        np.add(total, mask, out=total)
    else:
        np.subtract(total, mask, out=total)
