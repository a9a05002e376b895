"""What devices and the server send each other in a secure round, and its JSON wire form.

Keys, ciphertexts, shares and commitments travel as base64 strings; the masked input travels as
raw little-endian unsigned integers (`encode_vector`). Every decoder checks sizes before use and
raises `ProtocolError` saying what was expected.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from secure_aggregation.config import ProtocolError, RoundParameters
from secure_aggregation.crypto import KEY_BYTES, NONCE_BYTES
from secure_aggregation.shamir import SHARE_BYTES

COMMITMENT_BYTES = 32
INDEX_BYTES = 4
# owner index, holder index, self-mask seed share, mask key share
SHARES_PLAINTEXT_BYTES = 2 * INDEX_BYTES + 2 * SHARE_BYTES
SHARES_CIPHERTEXT_BYTES = NONCE_BYTES + SHARES_PLAINTEXT_BYTES + 16  # + the GCM tag


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(value: Any, size: int, what: str) -> bytes:
    if not isinstance(value, str) or len(value) > 4 * (size // 3 + 2):
        raise ProtocolError(f"{what} must be a base64 string of {size} bytes")
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError(f"{what} is not valid base64") from None
    if len(data) != size:
        raise ProtocolError(f"{what} must be {size} bytes, got {len(data)}")
    return data


def _index(value: Any, what: str) -> int:
    """A device's index in the round's roster, from a JSON key or number."""
    try:
        index = int(value)
    except (TypeError, ValueError):
        raise ProtocolError(f"{what} must be a device index (an integer >= 1), got {value!r}") from None
    if isinstance(value, bool) or not 1 <= index < 2**31 or str(index) != str(value):
        raise ProtocolError(f"{what} must be a device index (an integer >= 1), got {value!r}")
    return index


def _object(data: Any, keys: set[str], what: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping) or set(data) != keys:
        got = sorted(data) if isinstance(data, Mapping) else type(data).__name__
        raise ProtocolError(f"{what} must be an object with exactly {sorted(keys)}, got {got}")
    return data


@dataclass(frozen=True)
class AdvertisedKeys:
    """Phase 1: a device's two public keys and its commitment to its self-mask seed."""

    encryption_key: bytes  # X25519, to which neighbours encrypt shares
    mask_key: bytes  # X25519, from which pairwise masks are agreed
    self_mask_commitment: bytes

    def to_json(self) -> dict[str, str]:
        return {
            "encryption_key": b64(self.encryption_key),
            "mask_key": b64(self.mask_key),
            "self_mask_commitment": b64(self.self_mask_commitment),
        }

    @classmethod
    def from_json(cls, data: Any) -> AdvertisedKeys:
        data = _object(data, {"encryption_key", "mask_key", "self_mask_commitment"}, "advertised keys")
        return cls(
            unb64(data["encryption_key"], KEY_BYTES, "encryption_key"),
            unb64(data["mask_key"], KEY_BYTES, "mask_key"),
            unb64(data["self_mask_commitment"], COMMITMENT_BYTES, "self_mask_commitment"),
        )


@dataclass(frozen=True)
class EncryptedShares:
    """Phase 2: one device's shares for one neighbour, encrypted to it, with commitments to each
    share that the server keeps to check the shares it is later given in the clear."""

    ciphertext: bytes
    self_mask_share_commitment: bytes
    mask_key_share_commitment: bytes

    def to_json(self) -> dict[str, str]:
        return {
            "ciphertext": b64(self.ciphertext),
            "self_mask_share_commitment": b64(self.self_mask_share_commitment),
            "mask_key_share_commitment": b64(self.mask_key_share_commitment),
        }

    @classmethod
    def from_json(cls, data: Any) -> EncryptedShares:
        keys = {"ciphertext", "self_mask_share_commitment", "mask_key_share_commitment"}
        data = _object(data, keys, "encrypted shares")
        return cls(
            unb64(data["ciphertext"], SHARES_CIPHERTEXT_BYTES, "ciphertext"),
            unb64(data["self_mask_share_commitment"], COMMITMENT_BYTES, "self_mask_share_commitment"),
            unb64(data["mask_key_share_commitment"], COMMITMENT_BYTES, "mask_key_share_commitment"),
        )


def shares_to_json(shares: Mapping[int, EncryptedShares]) -> dict[str, dict[str, str]]:
    return {str(holder): message.to_json() for holder, message in sorted(shares.items())}


def shares_from_json(data: Any, max_entries: int) -> dict[int, EncryptedShares]:
    if not isinstance(data, Mapping) or len(data) > max_entries:
        raise ProtocolError(f"shares must be an object of at most {max_entries} neighbour index -> shares")
    return {_index(k, "a neighbour index"): EncryptedShares.from_json(v) for k, v in data.items()}


def ciphertexts_to_json(ciphertexts: Mapping[int, bytes]) -> dict[str, str]:
    return {str(owner): b64(c) for owner, c in sorted(ciphertexts.items())}


def ciphertexts_from_json(data: Any, max_entries: int) -> dict[int, bytes]:
    if not isinstance(data, Mapping) or len(data) > max_entries:
        raise ProtocolError(f"ciphertexts must be an object of at most {max_entries} entries")
    return {
        _index(k, "a sender index"): unb64(v, SHARES_CIPHERTEXT_BYTES, "ciphertext") for k, v in data.items()
    }


@dataclass(frozen=True)
class UnmaskingShares:
    """Phase 4: a survivor's shares of its surviving neighbours' self-mask seeds and of its dropped
    neighbours' mask keys, by owner index."""

    self_mask_shares: dict[int, bytes]
    mask_key_shares: dict[int, bytes]

    def to_json(self) -> dict[str, dict[str, str]]:
        return {
            "self_mask_shares": {str(k): b64(v) for k, v in sorted(self.self_mask_shares.items())},
            "mask_key_shares": {str(k): b64(v) for k, v in sorted(self.mask_key_shares.items())},
        }

    @classmethod
    def from_json(cls, data: Any, max_entries: int) -> UnmaskingShares:
        data = _object(data, {"self_mask_shares", "mask_key_shares"}, "unmasking shares")
        parts = []
        for key in ("self_mask_shares", "mask_key_shares"):
            entries = data[key]
            if not isinstance(entries, Mapping) or len(entries) > max_entries:
                raise ProtocolError(f"{key} must be an object of at most {max_entries} owner index -> share")
            parts.append(
                {
                    _index(k, f"an owner index in {key}"): unb64(v, SHARE_BYTES, key)
                    for k, v in entries.items()
                }
            )
        return cls(parts[0], parts[1])


def encode_vector(vector: np.ndarray, params: RoundParameters) -> bytes:
    return np.asarray(vector, dtype=np.uint64).astype(params.wire_dtype).tobytes()


def decode_vector(body: bytes, params: RoundParameters) -> np.ndarray:
    """A masked input from the wire: exactly vector_length integers below 2^bits, as uint64."""
    itemsize = np.dtype(params.wire_dtype).itemsize
    expected = params.vector_length * itemsize
    if len(body) != expected:
        raise ProtocolError(
            f"a masked input is {params.vector_length} integers of {itemsize} bytes "
            f"({expected} bytes), got {len(body)} bytes"
        )
    vector = np.frombuffer(body, dtype=params.wire_dtype).astype(np.uint64)
    if params.bits not in (32, 64) and int(vector.max(initial=0)) > params.modulus_mask:
        raise ProtocolError(f"a masked input's integers must be below 2^{params.bits}")
    return vector
