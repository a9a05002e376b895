"""What every request passes before a route sees it, in this order:

1. Its credential, on the routes that take a body from a known caller: the admin token on
   `/v1/admin/...`, a device token on check-ins, reports and aborts. A missing or bogus token
   is refused before a byte of the body is read.
2. Rate limits: check-ins per device, enrollments per client address (429 with Retry-After).
3. Its body, under the route's size limit: a declared Content-Length over the limit is a 413
   at once, and a body that streams past it is cut off with a 413; nothing is read whole first.
4. A failure that escapes a route: 503 with Retry-After when the database is unavailable (locked,
   down, out of connections), else 500. Answered here rather than by uvicorn, which closes the
   connection when an exception reaches it: a keep-alive connection stays usable after a 5xx.
   A client that went away while its body was being read is not a failure of the server: routes
   read the whole body before they touch the database, so nothing of it was stored; it is
   logged at INFO and counted as 499 (nginx's "client closed request"), an answer nobody reads.

Routes still check their own credentials; this is the cheap gate in front of them.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import HTTPException
from sqlalchemy.orm import Session, sessionmaker
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchestrator.api.deps import (
    ADMIN_REQUIRED,
    DATABASE_UNAVAILABLE,
    UNAUTHENTICATED,
    is_admin,
    run_db,
)
from orchestrator.api.rate_limits import TokenBuckets
from orchestrator.devices import authenticate
from orchestrator.settings import Settings

log = logging.getLogger("orchestrator")

NONE, DEVICE, ADMIN = "none", "device", "admin"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request whose client went away


class BodyTooLarge(HTTPException):
    """A body that streamed past its route's limit. An HTTPException so that FastAPI's body
    parsing passes it on as it is (it turns any other exception into a 400)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds this route's limit of {limit} bytes")


@dataclass(frozen=True)
class Gate:
    """What a route asks of a request before it runs."""

    credential: str  # NONE | DEVICE | ADMIN
    max_body_bytes: int
    rate_limit: TokenBuckets | None = None  # keyed by device (DEVICE) or client address (NONE)


class VerifiedTokens:
    """Device tokens already checked against the database, by their sha256: a device's token
    never changes and devices are never deleted, so a verified token stays valid. Unknown or
    wrong tokens are never remembered. Bounded: the oldest half goes when it is full. Filled at
    enrollment too, so a device's first check-in costs no extra query either."""

    def __init__(self, max_tokens: int = 200_000) -> None:
        self.max_tokens = max_tokens
        self._known: dict[bytes, str] = {}

    def get(self, token: str) -> str | None:
        return self._known.get(hashlib.sha256(token.encode()).digest())

    def add(self, token: str, device_id: str) -> None:
        if len(self._known) >= self.max_tokens:
            for key in list(self._known)[: self.max_tokens // 2]:
                del self._known[key]
        self._known[hashlib.sha256(token.encode()).digest()] = device_id


def _device_of(factory: sessionmaker[Session], token: str) -> str | None:
    with factory() as session:
        return authenticate(session, token)


def _error(status: int, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def _retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


class Edge:
    """The ASGI middleware that applies each route's `Gate` (see the module docstring)."""

    def __init__(self, app: ASGIApp, settings: Settings, clock: Callable[[], float] = time.monotonic) -> None:
        self.app = app
        self.clock = clock
        self.checkins = Gate(
            DEVICE,
            settings.max_request_bytes,
            TokenBuckets(settings.checkins_per_second, settings.checkin_burst),
        )
        self.reports = Gate(DEVICE, settings.max_report_bytes)
        self.aborts = Gate(DEVICE, settings.max_request_bytes)
        self.uploads = Gate(ADMIN, settings.max_upload_bytes)
        self.admin = Gate(ADMIN, settings.max_request_bytes)
        self.enrollments = Gate(
            NONE,
            settings.max_request_bytes,
            TokenBuckets(settings.enrollments_per_second, settings.enrollment_burst),
        )
        self.other = Gate(NONE, settings.max_request_bytes)

    def gate(self, method: str, path: str) -> Gate:
        # String tests, not regular expressions: this runs for every request. A path that
        # merely looks like a device route gets its gate too, which only asks more of it.
        if path.startswith("/v1/admin/"):
            uploads = (method == "POST" and path == "/v1/admin/populations") or (
                method == "PUT" and path.endswith("/mixing")  # a centralized dataset
            )
            return self.uploads if uploads else self.admin
        if method == "POST":
            if path.startswith("/v1/populations/") and path.endswith("/checkin"):
                return self.checkins
            if path.startswith("/v1/assignments/"):
                # A secure round's messages go up to a dense masked update, a report's size.
                if path.endswith("/report") or "/secure/" in path:
                    return self.reports
                if path.endswith("/abort"):
                    return self.aborts
            if path == "/v1/devices":
                return self.enrollments
        return self.other

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            gate = self.gate(scope["method"], scope["path"])
            authorization, declared, chunked = b"", None, False
            for name, value in scope["headers"]:
                if name == b"authorization":
                    authorization = value
                elif name == b"content-length":
                    declared = value
                elif name == b"transfer-encoding":
                    chunked = True
            refusal = await self._admit(scope, gate, authorization.decode("latin-1"), declared)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
            # A declared length frames the body (the server never reads past it) and was checked;
            # only a chunked body needs counting as it streams.
            framed = declared is not None and not chunked
            await self.app(scope, receive if framed else _limited(receive, gate.max_body_bytes), tracked_send)
        except ClientDisconnect:
            log.info(
                "client went away before its request was read",
                extra={"method": scope["method"], "path": scope["path"]},
            )
            if not started:  # uvicorn drops it (the connection is gone); the metrics count a 499
                await _error(CLIENT_CLOSED_REQUEST, "client closed the request")(scope, receive, send)
        except Exception as error:
            if started:  # too late for an answer of our own; uvicorn closes the connection
                raise
            if isinstance(error, DATABASE_UNAVAILABLE):
                log.warning("database unavailable: %s", type(error).__name__)
                answer = _error(
                    503,
                    "the database is busy or unavailable; retry after the Retry-After seconds",
                    _retry_after(1),
                )
            else:
                log.exception("unhandled error in %s %s", scope["method"], scope["path"])
                answer = _error(500, "internal server error")
            await answer(scope, receive, send)

    async def _admit(
        self, scope: Scope, gate: Gate, authorization: str, declared: bytes | None
    ) -> JSONResponse | None:
        """A refusal of this request, or None; decided on its headers alone."""
        key: object = None
        if gate.credential != NONE:
            bearer = authorization.startswith("Bearer ")
            token = authorization.removeprefix("Bearer ").strip() if bearer else ""
            if not token:
                return _error(
                    401, "missing 'Authorization: Bearer <token>' header", {"WWW-Authenticate": "Bearer"}
                )
            if gate.credential == ADMIN:
                if not is_admin(scope["app"], token):
                    return _error(403, ADMIN_REQUIRED)
            else:
                tokens: VerifiedTokens = scope["app"].state.verified_tokens
                key = tokens.get(token)
                if key is None:
                    key = await self._verify(scope, tokens, token)
                if key is None:
                    return _error(401, UNAUTHENTICATED, {"WWW-Authenticate": "Bearer"})
        elif gate.rate_limit is not None:
            client = scope.get("client")
            key = client[0] if client else ""
        if gate.rate_limit is not None:
            wait = gate.rate_limit.take(key, self.clock())
            if wait > 0:
                limit = gate.rate_limit
                what = (
                    "check-ins from this device"
                    if gate.credential == DEVICE
                    else "enrollments from this address"
                )
                return _error(
                    429,
                    f"too many {what}: at most {limit.burst:.0f} at once, then {limit.rate:g} per second; "
                    f"retry in {wait:.1f} s",
                    _retry_after(wait),
                )
        if declared is None:
            return None
        if not declared.isdigit():
            return _error(400, "Content-Length must be a non-negative integer")
        if int(declared) > gate.max_body_bytes:
            return _error(
                413,
                f"request body of {int(declared)} bytes exceeds this route's limit of {gate.max_body_bytes}",
            )
        return None

    async def _verify(self, scope: Scope, tokens: VerifiedTokens, token: str) -> str | None:
        """The device of a token not seen yet, from the database (remembered when valid)."""
        app = scope["app"]
        device_id = await run_db(app, _device_of, app.state.sessionmaker, token)
        if device_id is not None:
            tokens.add(token, device_id)
        return device_id


def _limited(receive: Receive, limit: int) -> Receive:
    """`receive`, raising BodyTooLarge once more than `limit` body bytes have come in."""
    received = 0

    async def limited() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise BodyTooLarge(limit)
        return message

    return limited
