"""Who takes part in a secure round: devices' Ed25519 signing keys, certified by an enrollment authority.

Against a server that follows the protocol, a roster of key advertisements is enough. Against one
that does not, it is not: the server can put keys it made itself in place of other devices' (and
then decrypt the shares sent to "them"), or fill a roster with its own keys so that a large sum
holds one real device. So each device has a long-lived Ed25519 signing key whose public half an
enrollment authority (not the aggregation server: in production the app platform's attestation
service) certified once, and it signs its advertisement for each round. A device accepts a roster
only if every entry carries a certificate from the authority it trusts and a signature over that
round's context and keys, and no device key, encryption key or mask key appears twice.

The server only relays certificates and signatures: it cannot make a certificate, and a signature
does not replay into another round (the round's context is in what is signed).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from secure_aggregation.config import ProtocolError
from secure_aggregation.messages import AdvertisedKeys, _object, b64, unb64

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
DIGEST_BYTES = 32
CERTIFICATE_PURPOSE = b"secure-aggregation/device-certificate/v1"
ADVERTISEMENT_PURPOSE = b"secure-aggregation/key-advertisement/v1"


def public_bytes(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _framed(*parts: bytes) -> bytes:
    """Each part behind its length, so that no two different lists of parts sign alike."""
    return b"".join(struct.pack(">I", len(p)) + p for p in parts)


# Memoized: verification is a pure function of these bytes. A phone sees the same certificates
# round after round; a simulation of many phones in one process checks each roster once per phone
# (52 phones x 104 signatures a round, ~15 ms of the fleet's event loop each, held the share-keys
# phase to its deadline). Benchmarks of one phone's cost clear it (`verify.cache_clear()`).
@functools.lru_cache(maxsize=16_384)
def verify(public_key: bytes, signature: bytes, message: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


@dataclass(frozen=True)
class Certificate:
    """The authority's statement that `device_key` is an enrolled device's, until `not_after`."""

    device_key: bytes  # Ed25519 public key
    not_after: int  # Unix seconds
    signature: bytes  # the authority's, over CERTIFICATE_PURPOSE, the device key and not_after

    @staticmethod
    def message(device_key: bytes, not_after: int) -> bytes:
        return _framed(CERTIFICATE_PURPOSE, device_key, str(not_after).encode())

    def problem(self, authority_key: bytes, now: float) -> str | None:
        """Why this certificate is not valid from `authority_key` at `now`; None when it is."""
        if not verify(authority_key, self.signature, self.message(self.device_key, self.not_after)):
            return "its certificate is not signed by the enrollment authority this device trusts"
        if now > self.not_after:
            return f"its certificate expired at {self.not_after}"
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "device_key": b64(self.device_key),
            "not_after": self.not_after,
            "signature": b64(self.signature),
        }

    @classmethod
    def from_json(cls, data: Any) -> Certificate:
        data = _object(data, {"device_key", "not_after", "signature"}, "a device certificate")
        not_after = data["not_after"]
        if not isinstance(not_after, int) or isinstance(not_after, bool):
            raise ProtocolError(f"a device certificate's not_after must be an integer, got {not_after!r}")
        return cls(
            unb64(data["device_key"], PUBLIC_KEY_BYTES, "device_key"),
            not_after,
            unb64(data["signature"], SIGNATURE_BYTES, "signature"),
        )


class SigningKey:
    """A device's long-lived identity: an Ed25519 key that never leaves it."""

    def __init__(self, private: Ed25519PrivateKey | None = None) -> None:
        self._private = private or Ed25519PrivateKey.generate()
        self.public = public_bytes(self._private)

    def sign(self, message: bytes) -> bytes:
        return self._private.sign(message)

    def __getstate__(self) -> bytes:
        return self.private_bytes()

    def __setstate__(self, raw: bytes) -> None:
        self.__init__(Ed25519PrivateKey.from_private_bytes(raw))  # type: ignore[misc]

    def private_bytes(self) -> bytes:
        """The raw private key, for the device's own storage only."""
        return self._private.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )


def advertisement_message(context: str, keys: AdvertisedKeys) -> bytes:
    return _framed(
        ADVERTISEMENT_PURPOSE, context.encode(), keys.encryption_key, keys.mask_key, keys.self_mask_commitment
    )


@dataclass(frozen=True)
class SignedAdvertisement:
    """Phase 1 with an identity: the keys, the device's certificate, and its signature over the
    round's context and the keys."""

    keys: AdvertisedKeys
    certificate: Certificate
    signature: bytes

    @classmethod
    def sign(
        cls, key: SigningKey, certificate: Certificate, context: str, keys: AdvertisedKeys
    ) -> SignedAdvertisement:
        if certificate.device_key != key.public:
            raise ProtocolError("the certificate is for another signing key than this device's")
        return cls(keys, certificate, key.sign(advertisement_message(context, keys)))

    def to_json(self) -> dict[str, Any]:
        return {
            "keys": self.keys.to_json(),
            "certificate": self.certificate.to_json(),
            "signature": b64(self.signature),
        }

    @classmethod
    def from_json(cls, data: Any) -> SignedAdvertisement:
        data = _object(data, {"keys", "certificate", "signature"}, "a signed key advertisement")
        return cls(
            AdvertisedKeys.from_json(data["keys"]),
            Certificate.from_json(data["certificate"]),
            unb64(data["signature"], SIGNATURE_BYTES, "signature"),
        )


def verified_roster(
    roster: Mapping[int, SignedAdvertisement], authority_key: bytes, context: str, now: float
) -> dict[int, AdvertisedKeys]:
    """The roster's keys once every entry is certified by `authority_key`, signed for this round,
    and unique; else ProtocolError naming the first entry that is not and why."""
    problems = []
    device_keys: dict[bytes, int] = {}
    agreement_keys: dict[bytes, int] = {}
    for index in sorted(roster):
        entry = roster[index]
        problem = entry.certificate.problem(authority_key, now)
        if problem is None and not verify(
            entry.certificate.device_key, entry.signature, advertisement_message(context, entry.keys)
        ):
            problem = "its advertisement is not signed by its certified key for this round"
        if problem is None and entry.keys.encryption_key == entry.keys.mask_key:
            problem = "it advertises one key for both encryption and masks"
        if problem is None and entry.certificate.device_key in device_keys:
            problem = f"its device key is also device {device_keys[entry.certificate.device_key]}'s"
        for key in (entry.keys.encryption_key, entry.keys.mask_key):
            if problem is None and key in agreement_keys:
                problem = f"it reuses a key that device {agreement_keys[key]} advertised"
        if problem is not None:
            problems.append(f"device {index}: {problem}")
            continue
        device_keys[entry.certificate.device_key] = index
        agreement_keys[entry.keys.encryption_key] = agreement_keys[entry.keys.mask_key] = index
    if problems:
        raise ProtocolError("the roster is refused: " + "; ".join(problems))
    return {index: entry.keys for index, entry in roster.items()}


def parse_advertisement(data: Any) -> AdvertisedKeys | SignedAdvertisement:
    """Phase 1 as a device sends it: signed (with its certificate), or the bare keys of a device
    without an identity (which a device that requires certified rosters refuses)."""
    if isinstance(data, Mapping) and "certificate" in data:
        return SignedAdvertisement.from_json(data)
    return AdvertisedKeys.from_json(data)


def keys_of(advertisement: AdvertisedKeys | SignedAdvertisement) -> AdvertisedKeys:
    return advertisement.keys if isinstance(advertisement, SignedAdvertisement) else advertisement


def check_signed_advertisement(
    advertisement: SignedAdvertisement, context: str, others: Iterable[AdvertisedKeys | SignedAdvertisement]
) -> None:
    """The server's check of a signed advertisement: signed by its certified key for this round,
    and no other device of the round shows the same device key. (Whether the certificate is the
    authority's is the devices' check: they trust the authority, not the server.)"""
    if not verify(
        advertisement.certificate.device_key,
        advertisement.signature,
        advertisement_message(context, advertisement.keys),
    ):
        raise ProtocolError("the advertisement is not signed by its certificate's key for this round")
    for other in others:
        if (
            isinstance(other, SignedAdvertisement)
            and other.certificate.device_key == advertisement.certificate.device_key
        ):
            raise ProtocolError("this device key already advertised keys in this round")
