"""Request dependencies: the database session, the calling device, the admin check, the clock."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Header, HTTPException, Request
from sqlalchemy.orm import Session, sessionmaker
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool

from orchestrator.devices import authenticate
from orchestrator.settings import Settings

T = TypeVar("T")


# The trivial dependencies are `async def`: FastAPI runs a plain `def` dependency in the
# threadpool, and those thread hops cost more than the database work of a check-in.
async def get_sessionmaker(request: Request) -> sessionmaker[Session]:
    factory: sessionmaker[Session] = request.app.state.sessionmaker
    return factory


async def get_clock(request: Request) -> Callable[[], float]:
    clock: Callable[[], float] = request.app.state.clock
    return clock


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def token_of(authorization: str | None) -> str:
    """The token of an `Authorization: Bearer <token>` header; 401 without one."""
    if not authorization or not authorization.startswith("Bearer "):
        raise HTTPException(
            401, "missing 'Authorization: Bearer <token>' header", headers={"WWW-Authenticate": "Bearer"}
        )
    return authorization.removeprefix("Bearer ").strip()


async def bearer_token(authorization: Annotated[str | None, Header()] = None) -> str:
    return token_of(authorization)


async def require_admin(
    token: Annotated[str, Depends(bearer_token)], settings: Annotated[Settings, Depends(get_settings)]
) -> None:
    if not hmac.compare_digest(token.encode(), settings.admin_token.encode()):
        raise HTTPException(403, "admin token required")


UNAUTHENTICATED = "unknown device or wrong token"


def require_device(session: Session, token: str) -> str:
    """The calling device's id, or 401 for an unknown device or a wrong token."""
    device_id = authenticate(session, token)
    if device_id is None:
        raise HTTPException(401, UNAUTHENTICATED, headers={"WWW-Authenticate": "Bearer"})
    return device_id


async def run_db(app: Starlette, fn: Callable[..., T], *args: Any) -> T:
    """Run a blocking database transaction: inline on the event loop for SQLite, where a
    transaction takes about a millisecond and writes are serialized anyway (thread hand-offs
    and GIL convoys cost more than the work), in the threadpool for a networked database."""
    if app.state.db_inline:
        return fn(*args)
    return await run_in_threadpool(fn, *args)


SessionFactoryDep = Annotated[sessionmaker[Session], Depends(get_sessionmaker)]
ClockDep = Annotated[Callable[[], float], Depends(get_clock)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
TokenDep = Annotated[str, Depends(bearer_token)]
AdminDep = Annotated[None, Depends(require_admin)]
