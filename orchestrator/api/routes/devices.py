from __future__ import annotations

from fastapi import APIRouter

from orchestrator.api.deps import ClockDep, SessionFactoryDep
from orchestrator.api.schemas import Enrolled
from orchestrator.devices import enroll

router = APIRouter(prefix="/v1/devices", tags=["devices"])


@router.post("", response_model=Enrolled, status_code=201, summary="Enroll a device")
def enroll_device(factory: SessionFactoryDep, clock: ClockDep) -> Enrolled:
    with factory.begin() as session:
        device_id, token = enroll(session, clock())
    return Enrolled(device_id=device_id, token=token)
