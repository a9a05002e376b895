"""Request dependencies: the database session, the calling device, the admin check, the clock."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Callable
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.devices import authenticate
from orchestrator.settings import Settings


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


async def get_session(factory: Annotated[sessionmaker[Session], Depends(get_sessionmaker)]) -> AsyncIterator[Session]:
    with factory() as session:
        yield session


async def bearer_token(authorization: Annotated[str | None, Header()] = None) -> str:
    if not authorization or not authorization.startswith("Bearer "):
        raise HTTPException(
            401, "missing 'Authorization: Bearer <token>' header", headers={"WWW-Authenticate": "Bearer"}
        )
    return authorization.removeprefix("Bearer ").strip()


async def require_admin(
    token: Annotated[str, Depends(bearer_token)], settings: Annotated[Settings, Depends(get_settings)]
) -> None:
    if not hmac.compare_digest(token.encode(), settings.admin_token.encode()):
        raise HTTPException(403, "admin token required")


SessionDep = Annotated[Session, Depends(get_session)]
SessionFactoryDep = Annotated[sessionmaker[Session], Depends(get_sessionmaker)]
ClockDep = Annotated[Callable[[], float], Depends(get_clock)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
TokenDep = Annotated[str, Depends(bearer_token)]
AdminDep = Annotated[None, Depends(require_admin)]
