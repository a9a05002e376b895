"""Request dependencies: the database session, the calling device, the admin check, the clock."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request
from sqlalchemy.orm import Session, sessionmaker
from starlette.applications import Starlette

from orchestrator.devices import UNAUTHENTICATED as UNAUTHENTICATED
from orchestrator.devices import authenticate
from orchestrator.service.database import DATABASE_UNAVAILABLE as DATABASE_UNAVAILABLE
from orchestrator.service.database import run_db as run_db
from orchestrator.settings import Settings


# The trivial dependencies are `async def`: FastAPI runs a plain `def` dependency in the
# threadpool, and those thread hops cost more than the database work of a check-in.
async def get_sessionmaker(request: Request) -> sessionmaker[Session]:
    factory: sessionmaker[Session] = request.app.state.sessionmaker
    return factory


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_clock(request: Request) -> Callable[[], float]:
    clock: Callable[[], float] = request.app.state.clock
    return clock


def token_of(authorization: str | None) -> str:
    """The token of an `Authorization: Bearer <token>` header; 401 without one."""
    if not authorization or not authorization.startswith("Bearer "):
        raise HTTPException(
            401, "missing 'Authorization: Bearer <token>' header", headers={"WWW-Authenticate": "Bearer"}
        )
    return authorization.removeprefix("Bearer ").strip()


async def bearer_token(authorization: Annotated[str | None, Header()] = None) -> str:
    return token_of(authorization)


def is_admin(app: Starlette, token: str) -> bool:
    """Whether `token` is the admin token: digests compared in constant time, so neither the
    token's content nor its length shows in the timing; an empty token never matches."""
    digest: bytes = app.state.admin_token_digest
    return bool(token) and hmac.compare_digest(hashlib.sha256(token.encode()).digest(), digest)


ADMIN_REQUIRED = "admin token required"


async def require_admin(request: Request, token: Annotated[str, Depends(bearer_token)]) -> None:
    if not is_admin(request.app, token):
        raise HTTPException(403, ADMIN_REQUIRED)


def require_device(session: Session, token: str) -> str:
    """The calling device's id, or 401 for an unknown device or a wrong token."""
    device_id = authenticate(session, token)
    if device_id is None:
        raise HTTPException(401, UNAUTHENTICATED, headers={"WWW-Authenticate": "Bearer"})
    return device_id


SessionFactoryDep = Annotated[sessionmaker[Session], Depends(get_sessionmaker)]
ClockDep = Annotated[Callable[[], float], Depends(get_clock)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
TokenDep = Annotated[str, Depends(bearer_token)]
AdminDep = Annotated[None, Depends(require_admin)]
