"""Request dependencies: the database session, the calling device, the admin check, the clock."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.devices import authenticate
from orchestrator.settings import Settings


def get_sessionmaker(request: Request) -> sessionmaker[Session]:
    factory: sessionmaker[Session] = request.app.state.sessionmaker
    return factory


def get_clock(request: Request) -> Callable[[], float]:
    clock: Callable[[], float] = request.app.state.clock
    return clock


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_session(factory: Annotated[sessionmaker[Session], Depends(get_sessionmaker)]) -> Iterator[Session]:
    with factory() as session:
        yield session


def bearer_token(authorization: Annotated[str | None, Header()] = None) -> str:
    if not authorization or not authorization.startswith("Bearer "):
        raise HTTPException(
            401, "missing 'Authorization: Bearer <token>' header", headers={"WWW-Authenticate": "Bearer"}
        )
    return authorization.removeprefix("Bearer ").strip()


def require_admin(
    token: Annotated[str, Depends(bearer_token)], settings: Annotated[Settings, Depends(get_settings)]
) -> None:
    if not hmac.compare_digest(token.encode(), settings.admin_token.encode()):
        raise HTTPException(403, "admin token required")


def device_id_for(factory: sessionmaker[Session], token: str) -> str:
    with factory() as session:
        device = authenticate(session, token)
        if device is None:
            raise HTTPException(401, "unknown device or wrong token", headers={"WWW-Authenticate": "Bearer"})
        return device.id


SessionDep = Annotated[Session, Depends(get_session)]
SessionFactoryDep = Annotated[sessionmaker[Session], Depends(get_sessionmaker)]
ClockDep = Annotated[Callable[[], float], Depends(get_clock)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
TokenDep = Annotated[str, Depends(bearer_token)]
AdminDep = Annotated[None, Depends(require_admin)]
