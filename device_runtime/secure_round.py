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
from typing import Any, TypeVar

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
from secure_aggregation.device import DeviceSession, round_graph
from secure_aggregation.draws import SessionDraws
from secure_aggregation.identity import SignedAdvertisement, keys_of, parse_advertisement, verified_roster
from secure_aggregation.messages import (
    AdvertisedKeys,
    ciphertexts_from_json,
    encode_vector,
    shares_to_json,
)
from secure_aggregation.quantization import Layout, quantize
from secure_aggregation.view import Confirmation, PartnerStatement, TaskInputs, View, check_view

T = TypeVar("T")
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


def _parsed(entries: Any, parse: Callable[[Any], T], limit: int) -> dict[int, T]:
    """Index -> message, from the state's JSON object (entries that do not parse are left out: a
    device decides on what verifies)."""
    if not isinstance(entries, dict) or len(entries) > limit:
        raise TypeError(f"expected an object of at most {limit} device index -> message")
    out: dict[int, T] = {}
    for index, data in entries.items():
        with contextlib.suppress(SecureProtocolError, ValueError):
            out[int(index)] = parse(data)
    return out


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
        draws: SessionDraws | None = None,
    ) -> None:
        """`draws`: the round's secrets given instead of drawn (the conformance kit only)."""
        self.client = client
        self.draws = draws
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
        self,
        manifest: Manifest,
        delta: Params,
        globals_blob: bytes = b"",
        *,
        central_examples: bytes | None = None,
        central_gradient: bytes | None = None,
    ) -> SecureParticipation:
        """After `share` returned None: the masked input of `delta` (trained from `globals_blob`, the
        globals as downloaded, and the central data it mixed in, if any), the consistency check,
        then the unmasking answer."""
        inputs = self.task_inputs(globals_blob, central_examples, central_gradient, manifest)
        vector = Layout.of(manifest.global_params).flatten(delta)
        return await self.finish_vector(vector, inputs)

    async def finish_vector(self, vector: np.ndarray, inputs: TaskInputs) -> SecureParticipation:
        """`finish` for an update already flattened in the manifest's order (float), trained on
        `inputs`: it is clipped and quantized here."""
        return await self._guarded(self._finish(vector, inputs)) or self._result("reported")

    def task_inputs(
        self,
        globals_blob: bytes,
        central_examples: bytes | None,
        central_gradient: bytes | None,
        manifest: Manifest | None = None,
    ) -> TaskInputs:
        """Everything that shaped this device's update, by content (what its neighbours sign)."""

        def sha256(blob: bytes | None) -> bytes | None:
            return None if blob is None else hashlib.sha256(blob).digest()

        a = self.assignment
        return TaskInputs(
            artifact_sha256=a.artifact_sha256,
            task_config=a.task_config,
            model_version=a.model_version,
            globals_sha256=hashlib.sha256(globals_blob).digest(),
            central_examples_sha256=sha256(central_examples),
            central_gradient_sha256=sha256(central_gradient),
            central_gradient_weight=a.central_gradient_weight if central_gradient is not None else None,
            parameters=None if self._session is None else self._session.params.to_json(),
            manifest_sha256=None
            if manifest is None
            else hashlib.sha256(json.dumps(manifest.to_json(), sort_keys=True).encode()).digest(),
        )

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
        session = self._session = DeviceSession(params, self.draws)
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

    async def _finish(self, vector: np.ndarray, inputs: TaskInputs) -> None:
        session = self._session
        if session is None:
            raise RuntimeError("finish() before share() had the device ready for its masked input")
        self._enter("masked_input")
        params, context = session.params, session.params.context
        rng = np.random.default_rng(secrets.randbits(128)) if self.draws is None else self.draws.uniforms()
        quantized = quantize(vector, params, rng)
        masked = session.masked_input(quantized, self._ciphertexts)
        digest = inputs.digest()
        # What it masked with and what it trained on, signed once: neighbours reveal its self-mask
        # seed only against this statement (secure_aggregation.view).
        if self.identity is None:
            statement = PartnerStatement(digest, session.missing, None)
        else:
            key = self.identity.signing_key
            statement = PartnerStatement.sign(key, context, session.roster_digest, digest, session.missing)
        await self._post("partners", statement.to_json())
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
        if self.identity is None:
            mine = Confirmation(digest, None)
        else:
            mine = Confirmation.sign(
                self.identity.signing_key, context, session.roster_digest, survivors, digest
            )
        answer = await self._post("consistency", mine.to_json(), until="unmasking")

        state = await self._state("unmasking", "confirmed", answer.get("state"))
        if sorted({int(i) for i in state["survivors"]}) != survivors:
            raise SecureProtocolError("the survivor set changed after this device confirmed it")
        self._check_view(session, frozenset(survivors), state, digest)
        # Which of each neighbour's two secrets goes out follows from the signed survivor set
        # alone: a self-mask seed share for a survivor, a mask-key share for any other.
        unmasking = session.unmask(survivors)
        try:
            await self._post("unmasking", unmasking.to_json())
        except ProtocolError:
            # The server closes the phase as soon as it can unmask; a survivor whose shares were
            # not needed any more still has its input in the committed sum.
            state = await self.client.secure_state(self.assignment)
            if not (state["phase"] == "done" and state["round_status"] == "committed"):
                raise

    def _check_view(
        self, session: DeviceSession, survivors: frozenset[int], state: dict[str, Any], digest: bytes
    ) -> None:
        """With an identity: the rules of secure_aggregation.view on the confirmations and partner
        statements the server relayed (SecureProtocolError naming the rule broken); without one,
        the server's word that it counted this device's confirmation."""
        if self.identity is None:
            if session.index not in {int(i) for i in state["confirmed"]}:
                raise SecureProtocolError("the server did not count this device's confirmation")
            return
        roster_size = len(self._signing_keys)
        confirmations = _parsed(state["confirmations"], Confirmation.from_json, roster_size)
        statements = _parsed(state["statements"], PartnerStatement.from_json, roster_size)
        view = View(
            params=session.params,
            graph=round_graph(session.params, sorted(self._signing_keys)),
            roster=session.roster_digest,
            signing_keys=self._signing_keys,
            index=session.index,
            holds=session.holds,
            inputs_sha256=digest,
            survivors=survivors,
        )
        check_view(view, confirmations, statements)

    async def _post(self, phase: str, body: Any, until: str | None = None) -> dict[str, Any]:
        self.bytes_up += len(json.dumps(body))
        received = self.client.received_json_bytes
        answer = await self.client.secure_message(self.assignment, phase, body, until)
        self.bytes_down += self.client.received_json_bytes - received
        return answer
