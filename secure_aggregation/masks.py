"""The mask generator: a 32-byte seed expanded into a vector of integers modulo 2^bits.

ChaCha20 (from `cryptography`) in counter mode over zeros is the pseudorandom generator; 8 bytes
per coordinate, reduced modulo 2^bits (2^bits divides 2^64, so the residues are uniform). A device
and the server expand the same seed to the same mask, so a mask added by a device can be removed
from the sum by the server once it knows the seed.
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from secure_aggregation.config import RoundParameters
from secure_aggregation.crypto import KEY_BYTES

_NONCE = bytes(16)  # each seed is used for one stream only (keys are derived per round and purpose)


def expand(seed: bytes, params: RoundParameters) -> np.ndarray:
    """`params.vector_length` pseudorandom integers modulo 2^bits (uint64) from `seed`."""
    if len(seed) != KEY_BYTES:
        raise ValueError(f"a mask seed is {KEY_BYTES} bytes, got {len(seed)}")
    encryptor = Cipher(algorithms.ChaCha20(seed, _NONCE), mode=None).encryptor()
    stream = encryptor.update(bytes(8 * params.vector_length))
    return np.frombuffer(stream, dtype="<u8").astype(np.uint64) & np.uint64(params.modulus_mask)


def add_into(total: np.ndarray, mask: np.ndarray, sign: int) -> None:
    """total += sign * mask, modulo 2^64 (in place; reduce modulo 2^bits when done)."""
    if sign > 0:
        np.add(total, mask, out=total)
    else:
        np.subtract(total, mask, out=total)
