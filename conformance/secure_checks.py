"""Checks of secure aggregation answers that carry a random nonce: what they decrypt to."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

NONCE_BYTES = 12


def decrypts(spec: dict[str, str], actual: Any, where: str) -> str | None:
    """A base64 `nonce || AES-256-GCM(ciphertext and tag)` that opens under `key` with associated
    data `aad` to exactly `plaintext` (all three base64 in the spec)."""
    try:
        sealed = base64.b64decode(actual, validate=True) if isinstance(actual, str) else b""
    except (binascii.Error, ValueError):
        sealed = b""
    if len(sealed) < NONCE_BYTES + 16:
        return f"{where}: expected a base64 ciphertext (nonce, ciphertext, tag), got {str(actual)[:60]!r}"
    key, aad, plaintext = (base64.b64decode(spec[k]) for k in ("key", "aad", "plaintext"))
    try:
        opened = AESGCM(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], aad)
    except InvalidTag:
        return f"{where}: does not decrypt under the recipient's agreed key and this round's associated data"
    if opened != plaintext:
        return f"{where}: decrypts to other bytes than the expected (owner, holder, seed share, key share)"
    return None


SECURE_CHECKS: dict[str, Callable[[Any, Any, str], str | None]] = {"$decrypts": decrypts}
