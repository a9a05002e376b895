"""Device enrollment and authentication: a per-device secret, stored only as its hash."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence

from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from orchestrator.db import Assignment, Device, Round

# Built once (building a statement costs more than running it); columns, not Device objects.
_TOKEN_HASHES = select(Device.id, Device.token_hash).where(Device.id.in_(bindparam("ids", expanding=True)))


def _hash(secret: str) -> str:
    # The secret is 256 random bits, so a fast hash is enough; no password stretching needed.
    return hashlib.sha256(secret.encode()).hexdigest()


def enroll(session: Session, now: float) -> tuple[str, str]:
    """A new device; returns (device id, token). The token is shown once and never stored."""
    device_id, secret = secrets.token_hex(16), secrets.token_urlsafe(32)
    session.add(Device(id=device_id, token_hash=_hash(secret), created_at=now))
    return device_id, f"{device_id}.{secret}"


def authenticate_all(session: Session, tokens: Sequence[str]) -> list[str | None]:
    """Each token's device id, or None for an unknown device or a wrong secret; one query for all."""
    claimed = [token.partition(".") for token in tokens]
    ids = {device_id for device_id, _, secret in claimed if device_id and secret and len(device_id) <= 32}
    hashes: dict[str, str] = {}
    if ids:
        for device_id, token_hash in session.connection().execute(_TOKEN_HASHES, {"ids": list(ids)}):
            hashes[device_id] = token_hash
    return [
        device_id if device_id in hashes and hmac.compare_digest(hashes[device_id], _hash(secret)) else None
        for device_id, _, secret in claimed
    ]


def authenticate(session: Session, token: str) -> str | None:
    """The token's device id, or None."""
    return authenticate_all(session, [token])[0]


DAY_SECONDS = 86_400.0


def seen(session: Session, population_id: int, now: float) -> tuple[int, int, float | None]:
    """The devices that took part in a population's rounds (had an assignment): how many in all,
    how many in the last day, and the latest assignment's time. Counts only: which devices took
    part is nobody's business on an operator's screen."""
    assigned = (
        select(Assignment.device_id, Assignment.created_at)
        .join(Round, Round.id == Assignment.round_id)
        .where(Round.population_id == population_id)
        .subquery()
    )
    total, latest = session.execute(
        select(func.count(func.distinct(assigned.c.device_id)), func.max(assigned.c.created_at))
    ).one()
    recent = session.scalar(
        select(func.count(func.distinct(assigned.c.device_id))).where(
            assigned.c.created_at >= now - DAY_SECONDS
        )
    )
    return int(total or 0), int(recent or 0), latest
