"""Secure aggregation's phases for one assignment: the device's state, then one message per phase.

`GET /v1/assignments/{id}/secure` tells the device the phase and what it needs for it; with
`?until=<phase>` the answer waits (long-polling, `LONG_POLL_SECONDS` or the `wait` the device asks
for, at most `MAX_WAIT_SECONDS`) until the round has reached that phase or a later one, so a device
learns of a phase as soon as it opens (an answer that comes earlier says only the phase: not what
it hands out). The `POST`s carry its keys, its encrypted shares, its partner statement, its
masked input (raw little-endian integers), its confirmation of the survivors and its unmasking
shares. A message posted with `?until=<phase>` is answered with that state as well
(`state`, held as the `GET` holds it, and read first in the message's own transaction): a device
saves a request a phase, and the server a transaction. A message sent twice, out of phase, by a
device that skipped the phase before, or that fails its checks is a 409 or 422 that changes
nothing for the other devices.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request
from sqlalchemy.orm import Session, sessionmaker

from contracts.protocol import MAX_WAIT_SECONDS
from orchestrator.api import schemas
from orchestrator.api.deps import SessionFactoryDep, SettingsDep, TokenDep
from orchestrator.rounds.refusals import Refused
from orchestrator.rounds.secure import messages
from orchestrator.rounds.secure.phase_changes import PHASE_CHANGES
from orchestrator.service.secure_messages import Handler, MessageCall, send_message
from orchestrator.service.secure_states import StateCall, open_phases, read_state

router = APIRouter(prefix="/v1/assignments", tags=["devices"])

# A held state request answers within this, whatever happens: below the devices' HTTP timeouts
# (30 s by default, 60 s in the fleet). Each device waiting for a phase asks again after it, so a
# phase costs the server (waiting devices x the phase's length / this) state reads: at 1,000
# devices and 10 s, those reads alone had the server busy.
LONG_POLL_SECONDS = 20.0
# A device whose HTTP timeout allows asks for a longer hold (`wait`): each waiting device asks
# again after each hold, so a phase costs (waiting devices x its length / the hold) requests,
# which grows as n^2 when phases grow with the round (at most `MAX_WAIT_SECONDS`, contracts.protocol).
# Phase changes made by another server process are not announced here: one watcher per process
# reads the open rounds' phases this often while devices wait (phase_changes).
RECHECK_SECONDS = 1.0
ORDER = (*messages.PHASES, messages.DONE)

SECURE_REFUSALS = {
    403: "the assignment belongs to another device",
    404: "no such assignment",
    409: "the round does not use secure aggregation, the message is out of phase (Retry-After: until "
    "the phase's deadline) or repeated, or the assignment or its round is closed",
    422: "the message fails its checks (the detail says which; with ORCHESTRATOR_ENROLLMENT_AUTHORITY_KEY "
    "set, a key advertisement without that authority's valid certificate); nothing changed for other "
    "devices",
}


def _refusal(refused: Refused) -> HTTPException:
    headers = {"WWW-Authenticate": "Bearer"} if refused.status == 401 else None
    if refused.retry_after is not None:
        headers = {"Retry-After": str(int(refused.retry_after + 0.999))}
    return HTTPException(refused.status, refused.message, headers=headers)


def _answered(answer: dict[str, Any] | Refused) -> dict[str, Any]:
    if isinstance(answer, Refused):
        raise _refusal(answer)
    return answer


async def _body(request: Request, limit: int) -> bytes:
    declared = int(request.headers.get("content-length") or 0)
    if declared > limit:
        raise HTTPException(413, f"body of {declared} bytes exceeds the limit of {limit}")
    body = await request.body()
    if len(body) > limit:
        raise HTTPException(413, f"body of {len(body)} bytes exceeds the limit of {limit}")
    return body


async def _post_json(
    request: Request,
    handler: Handler,
    assignment_id: str,
    token: str,
    limit: int,
    until: str | None,
    wait: float | None,
) -> Any:
    parsed = messages.json_body(await _body(request, limit))
    if isinstance(parsed, Refused):
        raise _refusal(parsed)
    return await _answer(request, handler, assignment_id, token, parsed, until, wait)


async def _answer(
    request: Request,
    handler: Handler,
    assignment_id: str,
    token: str,
    body: Any,
    until: str | None,
    wait: float | None,
) -> Any:
    """The message's answer; with `until`, also the state once the round has reached that phase."""
    _check_until(until)
    app = request.app
    factory = app.state.sessionmaker
    hold = _Hold(request, factory, assignment_id, token, until, wait)
    answer = _answered(await send_message(app, MessageCall(handler, assignment_id, token, body, until)))
    if until is None:
        return answer
    return {**answer, "state": await hold.until_reached(answer["state"])}


def _check_until(until: str | None) -> None:
    if until is not None and until not in ORDER:
        raise HTTPException(422, f"until must be one of the phases {list(ORDER)}, got {until!r}")


class _Hold:
    """An answer held until the round reaches `until` (long-polling), at most `wait` seconds
    (`LONG_POLL_SECONDS` by default) from the request's start. Made before the first read: a phase
    change after it wakes the wait at once."""

    def __init__(
        self,
        request: Request,
        factory: sessionmaker[Session],
        assignment_id: str,
        token: str,
        until: str | None,
        wait: float | None,
    ) -> None:
        self.app, self.factory, self.until = request.app, factory, until
        self.assignment_id, self.token = assignment_id, token
        self.loop = asyncio.get_running_loop()
        self.give_up = self.loop.time() + (LONG_POLL_SECONDS if wait is None else wait)
        self.seen = PHASE_CHANGES.generation

    async def until_reached(self, answer: dict[str, Any]) -> dict[str, Any]:
        app, until, clock = self.app, self.until, self.app.state.clock
        while True:
            left = self.give_up - self.loop.time()
            if until is None or ORDER.index(answer["phase"]) >= ORDER.index(until) or left <= 0:
                return answer
            PHASE_CHANGES.watch(lambda: open_phases(app), RECHECK_SECONDS)
            await PHASE_CHANGES.wait(self.seen, left)
            if PHASE_CHANGES.generation == self.seen:
                # Held to the end with no phase changed anywhere: the answer read before stands (a
                # second read per wait would double the reads of a thousand waiting devices).
                return {**answer, "seconds_left": max(0.0, answer["phase_deadline"] - clock())}
            self.seen = PHASE_CHANGES.generation  # before reading: a change in between is not missed
            # Every device held for this phase wakes now: their reads share a transaction.
            answer = _answered(await read_state(app, StateCall(self.assignment_id, self.token, until)))


_UNTIL_DOC = f"hold the answer until the round reaches this phase or a later one: {ORDER}"
UntilQuery = Annotated[str | None, Query(description=_UNTIL_DOC)]
_WAIT_DOC = f"with `until`: hold the answer at most this many seconds (default {LONG_POLL_SECONDS:g})"
WaitQuery = Annotated[float | None, Query(gt=0, le=MAX_WAIT_SECONDS, description=_WAIT_DOC)]


@router.get(
    "/{assignment_id}/secure",
    summary="The secure round's phase and what this device needs for it",
    responses={
        200: {"model": schemas.SecureState},
        **schemas.refusals({**SECURE_REFUSALS, 422: "`until` is not a phase"}, retry_after=(409,)),
    },
)
async def state(
    assignment_id: str,
    request: Request,
    token: TokenDep,
    factory: SessionFactoryDep,
    until: UntilQuery = None,
    wait: WaitQuery = None,
) -> dict[str, Any]:
    _check_until(until)
    hold = _Hold(request, factory, assignment_id, token, until, wait)
    return await hold.until_reached(
        _answered(await read_state(request.app, StateCall(assignment_id, token, until)))
    )


@router.post(
    "/{assignment_id}/secure/keys",
    summary="Phase 1: advertise two X25519 public keys (signed, with the device's certificate)",
    openapi_extra=schemas.json_body(
        "the device's keys, signed with its certified key (or bare, from a device without an identity)",
        {
            "oneOf": [
                {"$ref": "#/components/schemas/SignedAdvertisement"},
                {"$ref": "#/components/schemas/AdvertisedKeys"},
            ]
        },
    ),
    responses={
        200: {"model": schemas.Advertised},
        **schemas.refusals({**SECURE_REFUSALS, 413: "the body exceeds 4096 bytes"}, retry_after=(409,)),
    },
)
async def keys(
    assignment_id: str,
    request: Request,
    token: TokenDep,
    settings: SettingsDep,
    until: UntilQuery = None,
    wait: WaitQuery = None,
) -> Any:
    advertise = functools.partial(messages.advertise, authority_key=settings.authority_key())
    return await _post_json(request, advertise, assignment_id, token, 4096, until, wait)


@router.post(
    "/{assignment_id}/secure/shares",
    summary="Phase 2: Shamir shares encrypted to each neighbour",
    openapi_extra=schemas.json_body(
        "neighbour index -> its shares",
        {"type": "object", "additionalProperties": {"$ref": "#/components/schemas/EncryptedShares"}},
    ),
    responses={200: {"model": schemas.Shared}, **schemas.refusals(SECURE_REFUSALS, retry_after=(409,))},
)
async def shares(
    assignment_id: str,
    request: Request,
    token: TokenDep,
    settings: SettingsDep,
    until: UntilQuery = None,
    wait: WaitQuery = None,
) -> Any:
    return await _post_json(
        request, messages.share_keys, assignment_id, token, settings.max_report_bytes, until, wait
    )


@router.post(
    "/{assignment_id}/secure/partners",
    summary="Phase 3, first: what the device trained on and the neighbours it masked nothing with, signed",
    openapi_extra=schemas.json_body(
        "the device's partner statement", {"$ref": "#/components/schemas/PartnerStatement"}
    ),
    responses={
        200: {"model": schemas.StatementAccepted},
        **schemas.refusals(SECURE_REFUSALS, retry_after=(409,)),
    },
)
async def partners(
    assignment_id: str,
    request: Request,
    token: TokenDep,
    settings: SettingsDep,
    until: UntilQuery = None,
    wait: WaitQuery = None,
) -> Any:
    return await _post_json(
        request, messages.partners, assignment_id, token, settings.max_report_bytes, until, wait
    )


@router.post(
    "/{assignment_id}/secure/masked-input",
    summary="Phase 3: the masked, quantized update (little-endian unsigned integers)",
    openapi_extra=schemas.binary_body(
        "vector_length little-endian unsigned integers (4 bytes each when bits <= 32, else 8)"
    ),
    responses={
        200: {"model": schemas.MaskedInputReceived},
        **schemas.refusals(SECURE_REFUSALS, retry_after=(409,)),
    },
)
async def masked_input(
    assignment_id: str,
    request: Request,
    token: TokenDep,
    settings: SettingsDep,
    until: UntilQuery = None,
    wait: WaitQuery = None,
) -> Any:
    body = await _body(request, settings.max_report_bytes)
    return await _answer(request, messages.masked_input, assignment_id, token, body, until, wait)


@router.post(
    "/{assignment_id}/secure/consistency",
    summary="The consistency check: the survivor set and the hashes of what it trained on, signed",
    openapi_extra=schemas.json_body(
        "the survivor's confirmation", {"$ref": "#/components/schemas/SurvivorConfirmation"}
    ),
    responses={
        200: {"model": schemas.ConfirmationAccepted},
        **schemas.refusals(SECURE_REFUSALS, retry_after=(409,)),
    },
)
async def consistency(
    assignment_id: str, request: Request, token: TokenDep, until: UntilQuery = None, wait: WaitQuery = None
) -> Any:
    return await _post_json(request, messages.consistency, assignment_id, token, 4096, until, wait)


@router.post(
    "/{assignment_id}/secure/unmasking",
    summary="Phase 4: shares that unmask the survivors' sum",
    openapi_extra=schemas.json_body(
        "the survivor's shares", {"$ref": "#/components/schemas/UnmaskingShares"}
    ),
    responses={
        200: {"model": schemas.UnmaskingAccepted},
        **schemas.refusals(SECURE_REFUSALS, retry_after=(409,)),
    },
)
async def unmasking(
    assignment_id: str,
    request: Request,
    token: TokenDep,
    settings: SettingsDep,
    until: UntilQuery = None,
    wait: WaitQuery = None,
) -> Any:
    return await _post_json(
        request, messages.unmasking, assignment_id, token, settings.max_report_bytes, until, wait
    )
