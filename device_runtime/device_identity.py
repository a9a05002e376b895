"""The device's identity in secure rounds: its Ed25519 signing key, the enrollment authority's
certificate for it, and the authority's public key that the app ships with.

The private key never leaves the device: it is kept in the device's key store (`KeyStore`, apart
from its examples: `key_store.KeyDirectory`, or the platform's), and only its certificate and
signatures travel. A device with an identity signs
its key advertisement for each round and accepts a roster only when every entry is certified by the
authority it trusts (`secure_aggregation.identity.verified_roster`); with the signing keys in that
roster it checks its neighbours' signatures on the survivor set before it unmasks anything.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from device_runtime.task_environment import KeyStore
from secure_aggregation.config import ProtocolError
from secure_aggregation.identity import PUBLIC_KEY_BYTES, Certificate, SigningKey

_KEY_NAME = "secure-aggregation-identity"
# A certificate this close to its expiry is renewed before the device takes part again.
RENEW_SECONDS = 86_400


@dataclass(frozen=True)
class DeviceIdentity:
    signing_key: SigningKey
    certificate: Certificate
    authority_key: bytes  # the enrollment authority's Ed25519 public key, built into the app

    def __post_init__(self) -> None:
        if self.certificate.device_key != self.signing_key.public:
            raise ProtocolError("the certificate is for another signing key than this device's")
        if len(self.authority_key) != PUBLIC_KEY_BYTES:
            raise ProtocolError(f"the authority's key must be {PUBLIC_KEY_BYTES} bytes")

    @classmethod
    def enroll(cls, certify: Callable[[bytes], Certificate], authority_key: bytes) -> DeviceIdentity:
        """A new signing key, certified by `certify` (the authority's client: in production the
        platform's attestation service; the fleet calls its own authority)."""
        key = SigningKey()
        certificate = certify(key.public)
        problem = certificate.problem(authority_key, 0.0)
        if problem is not None:
            raise ProtocolError(f"the enrollment authority's answer is unusable: {problem}")
        return cls(key, certificate, authority_key)

    @classmethod
    def load_or_enroll(
        cls,
        keys: KeyStore,
        certify: Callable[[bytes], Certificate],
        authority_key: bytes,
        now: float,
    ) -> DeviceIdentity:
        """The identity kept in `keys`, or a new one (kept there) when there is none, it is for
        another authority, or its certificate expires within RENEW_SECONDS."""
        blob = keys.load_key(_KEY_NAME)
        if blob is not None:
            try:
                data = json.loads(blob)
                private = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(data["private_key"]))
                identity = cls(SigningKey(private), Certificate.from_json(data["certificate"]), authority_key)
                if identity.certificate.problem(authority_key, now + RENEW_SECONDS) is None:
                    return identity
            except (ValueError, KeyError, TypeError, ProtocolError):
                pass  # unreadable or stale: enroll afresh
        identity = cls.enroll(certify, authority_key)
        private_bytes = identity.signing_key.private_bytes()
        record = {"private_key": private_bytes.hex(), "certificate": identity.certificate.to_json()}
        keys.save_key(_KEY_NAME, json.dumps(record).encode())
        return identity
