"""Device enrollment and authentication: a per-device secret, stored only as its hash."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from sqlalchemy.orm import Session

from orchestrator.db import Device


def _hash(secret: str) -> str:
    # The secret is 256 random bits, so a fast hash is enough; no password stretching needed.
    return hashlib.sha256(secret.encode()).hexdigest()


def enroll(session: Session, now: float) -> tuple[str, str]:
    """A new device; returns (device id, token). The token is shown once and never stored."""
    device_id, secret = secrets.token_hex(16), secrets.token_urlsafe(32)
    session.add(Device(id=device_id, token_hash=_hash(secret), created_at=now))
    return device_id, f"{device_id}.{secret}"


def authenticate(session: Session, token: str) -> Device | None:
    device_id, _, secret = token.partition(".")
    if not device_id or not secret or len(device_id) > 32:
        return None
    device = session.get(Device, device_id)
    if device is None or not hmac.compare_digest(device.token_hash, _hash(secret)):
        return None
    return device
