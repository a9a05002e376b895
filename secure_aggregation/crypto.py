"""Key agreement, authenticated encryption and commitments, all from `cryptography`.

- X25519 for key agreement; HKDF-SHA256 turns the shared secret into a key bound to the round's
  context and its purpose (share encryption, or the pairwise mask of one pair), so a key is never
  reused across rounds or purposes.
- AES-256-GCM encrypts a device's shares to one neighbour, with the round, sender and recipient as
  associated data: a ciphertext replayed into another round or to another pair fails to decrypt.
- SHA-256 commitments let the server check a share (or a reconstructed seed) against what its
  owner committed to earlier, without learning anything from the commitment.
"""

from __future__ import annotations

import hashlib
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from secure_aggregation.config import ProtocolError

KEY_BYTES = 32
NONCE_BYTES = 12


def new_private_key() -> X25519PrivateKey:
    return X25519PrivateKey.generate()


def private_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )


def public_bytes(key: X25519PrivateKey | X25519PublicKey) -> bytes:
    public = key.public_key() if isinstance(key, X25519PrivateKey) else key
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def private_from_bytes(data: bytes) -> X25519PrivateKey:
    if len(data) != KEY_BYTES:
        raise ProtocolError(f"an X25519 private key is {KEY_BYTES} bytes, got {len(data)}")
    return X25519PrivateKey.from_private_bytes(data)


def public_from_bytes(data: bytes) -> X25519PublicKey:
    if len(data) != KEY_BYTES:
        raise ProtocolError(f"an X25519 public key is {KEY_BYTES} bytes, got {len(data)}")
    return X25519PublicKey.from_public_bytes(data)


def derive_key(secret: bytes, purpose: bytes, context: str) -> bytes:
    """A 32-byte key from a secret, bound to what it is for and to the round."""
    return HKDF(
        algorithm=hashes.SHA256(),
        length=KEY_BYTES,
        salt=None,
        info=b"secure-aggregation/" + purpose + b"/" + context.encode(),
    ).derive(secret)


def agree(private: X25519PrivateKey, peer_public: bytes, purpose: bytes, context: str) -> bytes:
    """The key two devices derive alike from one's private key and the other's public key."""
    try:
        shared = private.exchange(public_from_bytes(peer_public))
    except ValueError as e:  # a low-order point gives an all-zero secret, which X25519 refuses
        raise ProtocolError(f"unusable public key: {e}") from None
    return derive_key(shared, purpose, context)


def encrypt(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """nonce || AES-256-GCM ciphertext and tag."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, associated)


def decrypt(key: bytes, ciphertext: bytes, associated: bytes) -> bytes:
    if len(ciphertext) < NONCE_BYTES + 16:
        raise ProtocolError(f"ciphertext of {len(ciphertext)} bytes is shorter than nonce and tag")
    try:
        return AESGCM(key).decrypt(ciphertext[:NONCE_BYTES], ciphertext[NONCE_BYTES:], associated)
    except InvalidTag:
        raise ProtocolError(
            "a ciphertext failed authentication: not encrypted to this device for this round and sender"
        ) from None


def commitment(*parts: bytes) -> bytes:
    """SHA-256 over length-prefixed parts (so no two different part lists hash alike)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.digest()
