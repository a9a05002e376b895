"""The device's side of a secure round: drive the phases of `secure_aggregation` over HTTP.

Only the masked input needs the device's update, so the phases come in two parts. `share` runs
from check-in on, while the device trains: it advertises the device's keys, sends Shamir shares
encrypted to its neighbours once the server announces the roster, and fetches the shares its
neighbours encrypted to it once every device has shared. `finish` runs after training: it clips
and quantizes the dense delta, sends the masked input, and then the shares that let the server
unmask the survivors' sum. Each message asks for the next phase's state with `until`, and the
server answers it as soon as that phase opens (long-polling); a server that answers without it
is asked with `GET`. Its secrets live in one
`DeviceSession` and go with it. The cryptography runs on the event loop: it takes a few
milliseconds a phase (shares ~2.4 ms, masks ~2.6 ms for 36 neighbours and 33,000 coordinates), and
with many simulated devices in one process a worker thread made each such call wait for the GIL
after every call into OpenSSL or numpy that released it (a cProfile of the fleet: 13 and 26 ms a
call on a worker thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from contracts.manifest import Manifest
from contracts.params import Params
from contracts.protocol import Assignment
from device_runtime.device_identity import DeviceIdentity
from device_runtime.orchestrator_client import OrchestratorClient
from device_runtime.privacy_policy import PolicyRefusal, PrivacyPolicy
from device_runtime.protocol_errors import InvalidAnswer, ProtocolError, ServerUnavailable
from secure_aggregation.config import ProtocolError as SecureProtocolError
from secure_aggregation.config import RoundParameters
from secure_aggregation.device import DeviceSession
from secure_aggregation.identity import (
    Confirmation,
    SignedAdvertisement,
    keys_of,
    parse_advertisement,
    task_digest,
    verified_roster,
)
from secure_aggregation.messages import (
    AdvertisedKeys,
    ciphertexts_from_json,
    encode_vector,
    shares_to_json,
)
from secure_aggregation.quantization import Layout, quantize

PHASES = ("advertise", "share_keys", "masked_input", "consistency", "unmasking")
# Between two questions about the state when the server answers without holding the answer.
MIN_POLL_SECONDS = 0.2


@dataclass(frozen=True)
class SecureParticipation:
    # reported (sent its unmasking shares) | refused | declined (below the device's privacy
    # policy: the detail names the floor) | aborted | vanished
    status: str
    phase: str  # the last phase the device reached
    detail: str = ""
    bytes_up: int = 0
    bytes_down: int = 0


class _Left(Exception):
    """The device stopped taking part (conditions changed, or the round went on without it)."""

    def __init__(self, status: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


def quantized_update(manifest: Manifest, delta: Params, params: RoundParameters) -> np.ndarray:
    """The dense delta of every global tensor, flattened in the manifest's order, clipped and
    quantized with fresh randomness (stochastic rounding)."""
    vector = Layout.of(manifest.global_params).flatten(delta)
    return quantize(vector, params, np.random.default_rng(secrets.randbits(128)))


class SecureRoundDriver:
    """One device in one secure round: `share` (from check-in, while training), then `finish`
    with the trained delta; or `run` for both in a row."""

    def __init__(
        self,
        client: OrchestratorClient,
        assignment: Assignment,
        policy: PrivacyPolicy,
        *,
        stays: Callable[[str], bool] = lambda phase: True,
        abort_when_leaving: bool = True,
        identity: DeviceIdentity | None = None,
    ) -> None:
        self.client = client
        self.identity = identity
        self.assignment = assignment
        self.policy = policy
        self.stays = stays
        self.abort_when_leaving = abort_when_leaving
        self.phase = PHASES[0]
        self.bytes_up = 0
        self.bytes_down = 0
        # Set once the device is out of the round (read by the training loop on its thread).
        self.left = False
        self._session: DeviceSession | None = None
        self._ciphertexts: dict[int, bytes] = {}
        # Each roster index's certified signing key (a device with an identity only).
        self._signing_keys: dict[int, bytes] = {}

    async def share(self) -> SecureParticipation | None:
        """Advertise keys, send shares, receive the neighbours' shares. None when the device is
        ready for its masked input, else how it left the round (it then trains no further)."""
        return await self._guarded(self._share())

    async def finish(
        self, manifest: Manifest, delta: Params, globals_blob: bytes = b""
    ) -> SecureParticipation:
        """After `share` returned None: the masked input of `delta` (trained from `globals_blob`, the
        globals as downloaded), the consistency check, then the unmasking answer."""
        globals_sha256 = hashlib.sha256(globals_blob).digest()
        return await self._guarded(self._finish(manifest, delta, globals_sha256)) or self._result("reported")

    async def run(self, manifest: Manifest, delta: Params, globals_blob: bytes = b"") -> SecureParticipation:
        return await self.share() or await self.finish(manifest, delta, globals_blob)

    async def _guarded(self, phases: Awaitable[None]) -> SecureParticipation | None:
        try:
            await phases
            return None
        except _Left as e:
            self.left = True
            if e.status == "aborted" and self.abort_when_leaving:
                with contextlib.suppress(ProtocolError):  # the round may already have dropped it
                    await self.client.abort(self.assignment)
            status = e.status if e.status != "aborted" or self.abort_when_leaving else "vanished"
            return self._result(status, e.detail)
        except PolicyRefusal as e:
            # The device tells the server it is out (it sent nothing of what the floor protects).
            self.left = True
            with contextlib.suppress(ProtocolError, InvalidAnswer, ServerUnavailable):
                await self.client.abort(self.assignment)
            return self._result("declined", str(e))
        except (ProtocolError, SecureProtocolError) as e:
            self.left = True
            return self._result("refused", str(e))
        except (KeyError, TypeError, ValueError) as e:  # a state answer that lacks or mistypes a field
            self.left = True
            with contextlib.suppress(ProtocolError, InvalidAnswer, ServerUnavailable):
                await self.client.abort(self.assignment)
            return self._result(
                "invalid_answer",
                f"the secure round's state broke the protocol ({type(e).__name__}: {e}); expected the "
                "phase, its deadline and what this device needs for it",
            )

    def _result(self, status: str, detail: str = "") -> SecureParticipation:
        return SecureParticipation(status, self.phase, detail, self.bytes_up, self.bytes_down)

    def _enter(self, phase: str) -> None:
        self.phase = phase
        if not self.stays(phase):
            raise _Left("aborted", f"conditions changed before the {phase} phase")

    async def _state(self, phase: str, needs: str | None, held: Any = None) -> dict[str, Any]:
        """The state once the server is at `phase` (with the `needs` entry for this device): `held`,
        the state a message's answer brought, else asked for."""
        while True:
            if held is not None:
                if not isinstance(held, dict):
                    raise TypeError(
                        f"the state in a message's answer is a {type(held).__name__}, not an object"
                    )
                asked, state, held = -MIN_POLL_SECONDS, held, None  # the server held it: ask again at once
            else:
                asked, received = time.monotonic(), self.client.received_json_bytes
                state = await self.client.secure_state(self.assignment, until=phase)
                self.bytes_down += self.client.received_json_bytes - received
            if state["phase"] == phase and (needs is None or needs in state):
                return state
            current = state["phase"]
            if phase == "unmasking" and current == "done" and state["round_status"] == "committed":
                if state.get("assignment_status") == "reported":
                    raise _Left("reported", "the round committed without needing this device's shares")
                raise _Left("refused", "the round committed without this device's input (counted as dropped)")
            if current == "done" or PHASES.index(current) > PHASES.index(phase):
                raise _Left(
                    "refused", f"the round moved on without this device ({state.get('outcome') or current})"
                )
            if state["phase"] == phase:
                raise _Left("refused", f"the server did not include this device in the {phase} phase")
            # The server held the answer as long as it would; ask again at once, unless it did not
            # hold it at all (then pace the questions, jittered so devices do not ask in step).
            if time.monotonic() - asked < MIN_POLL_SECONDS:
                await asyncio.sleep(MIN_POLL_SECONDS * (0.5 + random.random()))

    async def _share(self) -> None:
        sent = self.assignment.secure_parameters
        # A server that does not send the round's parameters with the assignment has them in its state.
        if sent is None:
            sent = (await self._state("advertise", None))["parameters"]
        try:
            params = RoundParameters.from_json(sent)
        except SecureProtocolError as e:  # the server's answer, not this device's message: abort
            raise ValueError(str(e)) from None
        self.policy.check_parameters(params)
        self.policy.check_identity(self.identity is not None)
        self._enter("advertise")
        session = self._session = DeviceSession(params)
        keys = session.advertise()
        if self.identity is None:
            advertisement = keys.to_json()
        else:
            identity = self.identity
            signed = SignedAdvertisement.sign(
                identity.signing_key, identity.certificate, params.context, keys
            )
            advertisement = signed.to_json()
        answer = await self._post("keys", advertisement, until="share_keys")
        index = int(answer["index"])

        state = await self._state("share_keys", "roster", answer.get("state"))
        self._enter("share_keys")
        roster = self._verified_roster(state["roster"], params)
        self.policy.check_roster(len(roster))
        shares = session.share_keys(index, roster)
        posting = asyncio.ensure_future(self._post("shares", shares_to_json(shares), until="masked_input"))
        try:
            await asyncio.sleep(0)  # the message on its way first
            # The masks do not depend on the update: summed now, while the device trains and the
            # others share, the masked input after training has only the neighbours who did not
            # share to take out.
            session.prepare_masks()
        except BaseException:
            posting.cancel()
            raise
        answer = await posting

        state = await self._state("masked_input", "ciphertexts", answer.get("state"))
        self._ciphertexts = ciphertexts_from_json(state["ciphertexts"], len(roster))

    def _verified_roster(self, entries: dict[str, Any], params: RoundParameters) -> dict[int, AdvertisedKeys]:
        """The roster's keys; with an identity, only once every entry is certified by the authority
        this device trusts, signed for this round, and unique (else SecureProtocolError, naming it)."""
        if self.identity is None:
            return {int(i): keys_of(parse_advertisement(a)) for i, a in entries.items()}
        uncertified = sorted(
            int(i) for i, a in entries.items() if not (isinstance(a, dict) and "certificate" in a)
        )
        if uncertified:
            raise SecureProtocolError(
                f"the roster is refused: devices {uncertified} advertise keys without a certificate"
            )
        signed = {int(i): SignedAdvertisement.from_json(a) for i, a in entries.items()}
        roster = verified_roster(signed, self.identity.authority_key, params.context, time.time())
        self._signing_keys = {i: a.certificate.device_key for i, a in signed.items()}
        return roster

    async def _finish(self, manifest: Manifest, delta: Params, globals_sha256: bytes) -> None:
        session = self._session
        if session is None:
            raise RuntimeError("finish() before share() had the device ready for its masked input")
        self._enter("masked_input")
        params = session.params
        masked = session.masked_input(quantized_update(manifest, delta, params), self._ciphertexts)
        body = encode_vector(masked, params)
        self.bytes_up += len(body)
        received = self.client.received_json_bytes
        answer = await self.client.secure_masked_input(self.assignment, body, until="consistency")
        self.bytes_down += self.client.received_json_bytes - received

        state = await self._state("consistency", "survivors", answer.get("state"))
        self._enter("unmasking")
        survivors = sorted({int(i) for i in state["survivors"]})
        self.policy.check_survivors(len(survivors))
        if session.index not in survivors:
            raise SecureProtocolError("this device sent its masked input but is not among the survivors")
        task_sha256 = task_digest(self.assignment.artifact_sha256, self.assignment.task_config)
        context = params.context
        if self.identity is None:
            mine = Confirmation(globals_sha256, task_sha256, None, tuple(session.refused))
        else:
            key = self.identity.signing_key
            mine = Confirmation.sign(key, context, survivors, globals_sha256, task_sha256, session.refused)
        answer = await self._post("consistency", mine.to_json(), until="unmasking")

        state = await self._state("unmasking", "confirmed", answer.get("state"))
        if sorted({int(i) for i in state["survivors"]}) != survivors:
            raise SecureProtocolError("the survivor set changed after this device confirmed it")
        alive = self._checked_survivors(session, survivors, state, mine)
        self.policy.check_survivors(len(alive))
        unmasking = session.unmask(sorted(alive))
        try:
            await self._post("unmasking", unmasking.to_json())
        except ProtocolError:
            # The server closes the phase as soon as it can unmask; a survivor whose shares were
            # not needed any more still has its input in the committed sum.
            state = await self.client.secure_state(self.assignment)
            if not (state["phase"] == "done" and state["round_status"] == "committed"):
                raise

    def _checked_survivors(
        self, session: DeviceSession, survivors: list[int], state: dict[str, Any], mine: Confirmation
    ) -> set[int]:
        """The survivors whose inputs this device helps unmask. With an identity: the neighbours
        whose certified keys signed the same survivor set, globals and task as this device (at
        least its threshold of them, else it refuses), and not the other neighbours, whatever the
        server says (it reveals their mask keys, never their self-mask seeds); without one, the
        server's list."""
        if self.identity is None:
            confirmed = {int(i) for i in state["confirmed"]}
            if session.index not in confirmed:
                raise SecureProtocolError("the server did not count this device's confirmation")
            return confirmed & set(survivors)
        context = session.params.context
        verified: set[int] = set()
        for index, data in state["confirmations"].items():
            v = int(index)
            if v not in session.neighbours or v not in survivors or v not in self._signing_keys:
                continue
            try:
                theirs = Confirmation.from_json(data)
            except SecureProtocolError:
                continue  # treated as a neighbour that did not confirm
            same = (theirs.globals_sha256, theirs.task_sha256) == (mine.globals_sha256, mine.task_sha256)
            if same and theirs.verifies(self._signing_keys[v], context, survivors):
                verified.add(v)
        needed = session.params.shamir_threshold(len(session.neighbours))
        if len(verified) < needed:
            raise SecureProtocolError(
                f"{len(verified)} of this device's neighbours signed the same survivors, globals and task; "
                f"it unmasks only when at least {needed} did"
            )
        unconfirmed = (set(session.neighbours) & set(survivors)) - verified
        return set(survivors) - unconfirmed

    async def _post(self, phase: str, body: Any, until: str | None = None) -> dict[str, Any]:
        self.bytes_up += len(json.dumps(body))
        received = self.client.received_json_bytes
        answer = await self.client.secure_message(self.assignment, phase, body, until)
        self.bytes_down += self.client.received_json_bytes - received
        return answer
