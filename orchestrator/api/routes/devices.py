from __future__ import annotations

from fastapi import APIRouter, Request
from sqlalchemy.orm import Session, sessionmaker

from contracts.protocol import Enrolled
from orchestrator.api import schemas
from orchestrator.api.deps import ClockDep, SessionFactoryDep, run_db
from orchestrator.api.edge import VerifiedTokens
from orchestrator.devices import enroll

router = APIRouter(prefix="/v1/devices", tags=["devices"])


@router.post("", response_model=schemas.Enrolled, status_code=201, summary="Enroll a device")
async def enroll_device(factory: SessionFactoryDep, clock: ClockDep, request: Request) -> Enrolled:
    enrolled = await run_db(request.app, _enroll, factory, clock())
    tokens: VerifiedTokens = request.app.state.verified_tokens
    tokens.add(enrolled.token, enrolled.device_id)  # committed: the token is valid
    return enrolled


def _enroll(factory: sessionmaker[Session], now: float) -> Enrolled:
    with factory.begin() as session:
        device_id, token = enroll(session, now)
    return Enrolled(device_id=device_id, token=token)
