"""Server configuration, from the environment (ORCHESTRATOR_*) or a .env file."""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
from typing import Literal

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MIN_ADMIN_TOKEN_CHARS = 32
# Values seen in examples, defaults and tutorials: never a secret, however long.
WELL_KNOWN_ADMIN_TOKENS = frozenset(
    {"change-me", "changeme", "admin", "secret", "password", "token", "test", "test-admin-token"}
)
NEW_TOKEN_HINT = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


class AdminTokenError(ValueError):
    """The configured admin token is missing or not a secret."""


class Settings(BaseSettings):
    # Every number has both ends (orchestrator.setting_ranges): rates, bursts and sizes beyond
    # these are no deployment's, and within them every derived number stays finite.
    model_config = SettingsConfigDict(
        env_prefix="ORCHESTRATOR_", env_file=".env", extra="ignore", allow_inf_nan=False
    )

    database_url: str = "sqlite:///orchestrator.sqlite"
    # No default: a server never starts with a token someone else knows (see admin_token_digest).
    admin_token: SecretStr | None = None
    # A bearer token that opens GET /metrics and nothing else (for the Prometheus scraper); the
    # admin token opens it too. Empty: only the admin token.
    metrics_token: str = ""
    # Level of the JSON log lines on stderr; "debug" adds one line per request.
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    host: str = "127.0.0.1"
    port: int = Field(default=8700, ge=0, le=65535)
    # The proxies whose X-Forwarded-For / X-Forwarded-Proto the server believes: addresses or
    # networks, comma-separated ("10.0.0.5,10.1.0.0/16"). Empty (the default): none, so every
    # client is the address it connects from (uvicorn itself would trust 127.0.0.1, and any
    # process on the host that passes the header through would name the client it likes).
    forwarded_allow_ips: str = ""
    # How often the server looks for rounds past their deadline (devices also trigger it).
    tick_seconds: float = Field(default=0.5, gt=0, le=60)
    # Check-ins (per population) and reports that arrive together share one transaction; this is
    # the longest a request waits for others to join it (api/group_commit.py).
    group_commit_seconds: float = Field(default=0.001, ge=0, le=1)
    # Threads for blocking work (database, report validation).
    worker_threads: int = Field(default=4, ge=1, le=256)
    # Largest request bodies, enforced while they stream in (api/edge.py): a report (a dense
    # 20,000 x 50 float32 delta is 4 MB), a population upload (model, manifest, parameters),
    # and any other request (JSON control messages).
    max_report_bytes: int = Field(default=64 * 1024 * 1024, ge=1024, le=2**31)
    max_upload_bytes: int = Field(default=512 * 1024 * 1024, ge=1024, le=2**34)
    max_request_bytes: int = Field(default=64 * 1024, ge=1024, le=2**26)
    # Check-ins per device: a burst, then a steady rate (a device honours its retry windows,
    # so an honest one checks in a few times a round at most). Per server process.
    checkin_burst: int = Field(default=10, ge=1, le=10**6)
    checkins_per_second: float = Field(default=1.0, gt=0, le=1e6)
    # Enrollments per client address: a burst, then a steady rate. Per server process.
    enrollment_burst: int = Field(default=1000, ge=1, le=10**9)
    enrollments_per_second: float = Field(default=10.0, gt=0, le=1e6)
    # How long a database operation waits for a lock before the request is answered 503.
    # SQLite work runs on the event loop, so this also bounds how long a stuck lock can stall
    # every other request.
    database_busy_seconds: float = Field(default=0.5, gt=0, le=60)
    # How long a dashboard sign-in lasts before the operator signs in again (orchestrator/dashboard).
    dashboard_session_seconds: float = Field(default=8 * 3600, ge=1, le=30 * 86400)
    # Dashboard sign-ins per client address: a burst, then one per this many seconds, so that
    # the admin token cannot be guessed through the sign-in form. Per server process.
    dashboard_sign_in_burst: int = Field(default=5, ge=1, le=1000)
    dashboard_sign_in_interval_seconds: float = Field(default=10.0, ge=0.001, le=3600)
    # The enrollment authority's Ed25519 public key (base64 of its 32 raw bytes), the one the app's
    # devices trust. Set, the server refuses a key advertisement whose certificate that authority did
    # not sign, so that one uncertified device cannot make every certified device of its round
    # refuse the roster. Empty: the server relays certificates unchecked (the devices check them).
    enrollment_authority_key: str = ""

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _proxies(cls, value: str) -> str:
        entries = [entry.strip() for entry in value.split(",") if entry.strip()]
        for entry in entries:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(
                    f"{entry!r} is not an IP address or network; expected e.g. 10.0.0.5,10.1.0.0/16 "
                    "(empty: trust no proxy)"
                ) from None
        return ",".join(entries)

    @field_validator("enrollment_authority_key")
    @classmethod
    def _authority_key(cls, value: str) -> str:
        value = value.strip()
        if value:
            try:
                raw = base64.b64decode(value, validate=True)
                Ed25519PublicKey.from_public_bytes(raw)
            except (binascii.Error, ValueError):
                raise ValueError(
                    "must be the base64 of the enrollment authority's raw 32-byte Ed25519 public key"
                ) from None
        return value

    def authority_key(self) -> bytes | None:
        """The enrollment authority's public key, or None when none is configured."""
        return base64.b64decode(self.enrollment_authority_key) if self.enrollment_authority_key else None

    def admin_token_digest(self) -> bytes:
        """The sha256 of the admin token, compared in constant time with a caller's. Raises
        AdminTokenError when no real secret is configured: a server must not start then."""
        token = self.admin_token.get_secret_value() if self.admin_token else ""
        problem = admin_token_problem(token)
        if problem:
            raise AdminTokenError(problem)
        return hashlib.sha256(token.encode()).digest()


def admin_token_problem(token: str, name: str = "ORCHESTRATOR_ADMIN_TOKEN") -> str | None:
    """What is wrong with `token` as an admin token (`name` says where it was set), or None."""
    if not token.strip():
        return (
            f"no admin token: set {name} to a secret of at least "
            f"{MIN_ADMIN_TOKEN_CHARS} characters, e.g. the output of {NEW_TOKEN_HINT}"
        )
    if token.strip().lower() in WELL_KNOWN_ADMIN_TOKENS or len(token) < MIN_ADMIN_TOKEN_CHARS:
        return (
            f"{name} is well known or shorter than {MIN_ADMIN_TOKEN_CHARS} "
            f"characters; use a random secret, e.g. the output of {NEW_TOKEN_HINT}"
        )
    return None


def server_settings_problem(error: ValidationError) -> str:
    """A ValidationError of `Settings` as one line: each bad ORCHESTRATOR_* value and what it must be
    (never the value itself: it may be a secret)."""
    return "; ".join(
        f"ORCHESTRATOR_{'_'.join(str(p) for p in e['loc']).upper()}: "
        + e["msg"].removeprefix("Value error, ")
        for e in error.errors()
    )
