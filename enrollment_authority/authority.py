"""An enrollment authority with its own Ed25519 key, which devices trust and the server only relays.

It certifies a device's public signing key once, at enrollment: devices then accept in a secure
round's roster only keys it certified (`secure_aggregation.identity.verified_roster`). Here it
certifies any well-formed key it is given; in production that step is the platform's attestation
(the request comes from a genuine install of the app on a genuine device), which is what makes a
roster of a thousand certified keys a thousand devices rather than one server's inventions.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from secure_aggregation.identity import PUBLIC_KEY_BYTES, Certificate, public_bytes

# A certificate outlives an app install's usual life between re-enrollments; a stolen device key
# stops being accepted at its expiry.
DEFAULT_VALIDITY_SECONDS = 90 * 86_400


class EnrollmentError(ValueError):
    """A request the authority refuses: what was wrong and what was expected."""


class EnrollmentAuthority:
    def __init__(
        self, key: Ed25519PrivateKey | None = None, validity_seconds: int = DEFAULT_VALIDITY_SECONDS
    ) -> None:
        if validity_seconds < 1:
            raise EnrollmentError(f"validity_seconds must be >= 1, got {validity_seconds}")
        self._key = key or Ed25519PrivateKey.generate()
        self.validity_seconds = validity_seconds
        self.public_key = public_bytes(self._key)  # what devices are built to trust

    def __getstate__(self) -> dict[str, object]:
        """Pickled with its key (a simulation's shards certify as one authority)."""
        raw = self._key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        return {"key": raw, "validity_seconds": self.validity_seconds}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(Ed25519PrivateKey.from_private_bytes(state["key"]), state["validity_seconds"])  # type: ignore[misc]

    @classmethod
    def load_or_create(
        cls, path: Path, validity_seconds: int = DEFAULT_VALIDITY_SECONDS
    ) -> EnrollmentAuthority:
        """The authority whose private key is at `path` (PEM, PKCS8), made there (mode 0600) if absent."""
        if path.exists():
            loaded = serialization.load_pem_private_key(path.read_bytes(), password=None)
            if not isinstance(loaded, Ed25519PrivateKey):
                raise EnrollmentError(
                    f"{path} holds a {type(loaded).__name__}; expected an Ed25519 private key"
                )
            return cls(loaded, validity_seconds)
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(pem)
        return cls(key, validity_seconds)

    def certify(self, device_key: bytes, now: float | None = None) -> Certificate:
        """A certificate for `device_key` (a raw 32-byte Ed25519 public key)."""
        if len(device_key) != PUBLIC_KEY_BYTES:
            raise EnrollmentError(
                f"a device key is a raw Ed25519 public key of 32 bytes, got {len(device_key)}"
            )
        try:
            Ed25519PublicKey.from_public_bytes(device_key)
        except ValueError as e:
            raise EnrollmentError(f"not an Ed25519 public key: {e}") from None
        not_after = int(time.time() if now is None else now) + self.validity_seconds
        return Certificate(device_key, not_after, self._key.sign(Certificate.message(device_key, not_after)))
