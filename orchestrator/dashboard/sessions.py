"""Dashboard sessions: the admin token is exchanged once for a session cookie.

The cookie holds a random 256-bit secret; the database keeps only its sha256 with the session's
expiry (table `dashboard_sessions`), so every server process knows a session, a restart keeps
it, and signing out ends it everywhere. The cookie is HttpOnly (no script reads it), SameSite=
Strict (no other site's page sends it), Secure when the page came over HTTPS, and expires with
the session. Each form that changes something carries a CSRF token derived from the session's
secret with a key only the server holds (HMAC keyed by the admin token's digest), checked in
constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from orchestrator.db import DashboardSession

COOKIE = "fedrecon_dashboard"
SECRET_CHARS = 43  # secrets.token_urlsafe(32)
MAX_ADDRESS = 100


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def start(session: Session, now: float, lifetime_seconds: float, address: str) -> str:
    """A new session's secret (for the cookie), valid for `lifetime_seconds`; expired sessions go."""
    session.execute(delete(DashboardSession).where(DashboardSession.expires_at <= now))
    secret = secrets.token_urlsafe(32)
    session.add(
        DashboardSession(
            id_hash=_hash(secret),
            created_at=now,
            expires_at=now + lifetime_seconds,
            address=address[:MAX_ADDRESS],
        )
    )
    return secret


def expires_at(session: Session, secret: str | None, now: float) -> float | None:
    """When the session of a cookie's `secret` expires, or None: no cookie, an unknown or ended
    session, or one past its expiry."""
    if not secret or len(secret) != SECRET_CHARS:
        return None
    found = session.scalar(
        select(DashboardSession.expires_at).where(DashboardSession.id_hash == _hash(secret))
    )
    return found if found is not None and found > now else None


def end(session: Session, secret: str | None) -> None:
    """Sign out: the session is gone for every server process."""
    if secret:
        session.execute(delete(DashboardSession).where(DashboardSession.id_hash == _hash(secret)))


def csrf_token(key: bytes, secret: str) -> str:
    """The CSRF token of a session: what its forms carry. Only the server can derive it (`key`
    is the admin token's digest), and it tells nothing about the cookie's secret."""
    return hmac.new(key, b"dashboard-csrf:" + secret.encode(), hashlib.sha256).hexdigest()


def csrf_ok(key: bytes, secret: str, given: str | None) -> bool:
    return bool(given) and hmac.compare_digest(csrf_token(key, secret), given or "")
