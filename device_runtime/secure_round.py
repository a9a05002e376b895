"""The device's side of a secure round: drive the phases of `secure_aggregation` over HTTP.

After training, the device flattens its dense delta, clips and quantizes it, and then, phase by
phase (polling the round's state until the server opens the next phase): advertises its keys,
sends Shamir shares encrypted to its neighbours, sends its masked input, and sends the shares that
let the server unmask the survivors' sum. Its secrets live in one `DeviceSession` and go with it.
The cryptography runs on a worker thread, so many simulated devices share one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from contracts.manifest import Manifest
from contracts.params import Params
from contracts.protocol import Assignment
from device_runtime.orchestrator_client import (
    InvalidAnswer,
    OrchestratorClient,
    ProtocolError,
    ServerUnavailable,
)
from secure_aggregation.config import ProtocolError as SecureProtocolError
from secure_aggregation.config import RoundParameters
from secure_aggregation.device import DeviceSession
from secure_aggregation.messages import (
    AdvertisedKeys,
    ciphertexts_from_json,
    encode_vector,
    shares_to_json,
)
from secure_aggregation.quantization import Layout, quantize

PHASES = ("advertise", "share_keys", "masked_input", "unmasking")


@dataclass(frozen=True)
class SecureParticipation:
    # reported (sent its unmasking shares) | refused | aborted | vanished
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
    """One device in one secure round: `run` takes it through the phases."""

    def __init__(
        self,
        client: OrchestratorClient,
        assignment: Assignment,
        manifest: Manifest,
        *,
        stays: Callable[[str], bool] = lambda phase: True,
        abort_when_leaving: bool = True,
        poll_seconds: float = 0.5,
    ) -> None:
        self.client = client
        self.assignment = assignment
        self.manifest = manifest
        self.stays = stays
        self.abort_when_leaving = abort_when_leaving
        self.poll_seconds = poll_seconds
        self.phase = PHASES[0]
        self.bytes_up = 0
        self.bytes_down = 0

    async def run(self, delta: Params) -> SecureParticipation:
        try:
            await self._phases(delta)
        except _Left as e:
            if e.status == "aborted" and self.abort_when_leaving:
                with contextlib.suppress(ProtocolError):  # the round may already have dropped it
                    await self.client.abort(self.assignment)
            status = e.status if e.status != "aborted" or self.abort_when_leaving else "vanished"
            return self._result(status, e.detail)
        except (ProtocolError, SecureProtocolError) as e:
            return self._result("refused", str(e))
        except (KeyError, TypeError, ValueError) as e:  # a state answer that lacks or mistypes a field
            with contextlib.suppress(ProtocolError, InvalidAnswer, ServerUnavailable):
                await self.client.abort(self.assignment)
            return self._result(
                "invalid_answer",
                f"the secure round's state broke the protocol ({type(e).__name__}: {e}); expected the "
                "phase, its deadline and what this device needs for it",
            )
        return self._result("reported")

    def _result(self, status: str, detail: str = "") -> SecureParticipation:
        return SecureParticipation(status, self.phase, detail, self.bytes_up, self.bytes_down)

    def _enter(self, phase: str) -> None:
        self.phase = phase
        if not self.stays(phase):
            raise _Left("aborted", f"conditions changed before the {phase} phase")

    async def _state(self, phase: str, needs: str | None) -> dict[str, Any]:
        """Poll until the server is at `phase` (with the `needs` entry for this device)."""
        while True:
            state = await self.client.secure_state(self.assignment)
            self.bytes_down += len(json.dumps(state))
            if state["phase"] == phase and (needs is None or needs in state):
                return state
            current = state["phase"]
            if phase == "unmasking" and current == "done" and state["round_status"] == "committed":
                raise _Left("reported", "the round committed without needing this device's shares")
            if current == "done" or PHASES.index(current) > PHASES.index(phase):
                raise _Left(
                    "refused", f"the round moved on without this device ({state.get('outcome') or current})"
                )
            if state["phase"] == phase:
                raise _Left("refused", f"the server did not include this device in the {phase} phase")
            # Jittered, so that a round's devices do not poll the server in step.
            wait = self.poll_seconds * (0.5 + random.random())
            await asyncio.sleep(min(wait, max(0.01, float(state["seconds_left"]))))

    async def _phases(self, delta: Params) -> None:
        state = await self._state("advertise", None)
        params = RoundParameters.from_json(state["parameters"])
        self._enter("advertise")
        session = DeviceSession(params)
        quantized = await asyncio.to_thread(quantized_update, self.manifest, delta, params)
        keys = session.advertise().to_json()
        index = int((await self._post("keys", keys))["index"])

        state = await self._state("share_keys", "roster")
        self._enter("share_keys")
        roster = {int(i): AdvertisedKeys.from_json(k) for i, k in state["roster"].items()}
        shares = await asyncio.to_thread(session.share_keys, index, roster)
        await self._post("shares", shares_to_json(shares))

        state = await self._state("masked_input", "ciphertexts")
        self._enter("masked_input")
        ciphertexts = ciphertexts_from_json(state["ciphertexts"], len(roster))
        masked = await asyncio.to_thread(session.masked_input, quantized, ciphertexts)
        body = encode_vector(masked, params)
        self.bytes_up += len(body)
        await self.client.secure_masked_input(self.assignment, body)

        state = await self._state("unmasking", "survivors")
        self._enter("unmasking")
        answer = session.unmask([int(i) for i in state["survivors"]])
        try:
            await self._post("unmasking", answer.to_json())
        except ProtocolError:
            # The server closes the phase as soon as it can unmask; a survivor whose shares were
            # not needed any more still has its input in the committed sum.
            state = await self.client.secure_state(self.assignment)
            if not (state["phase"] == "done" and state["round_status"] == "committed"):
                raise

    async def _post(self, phase: str, body: Any) -> dict[str, Any]:
        self.bytes_up += len(json.dumps(body))
        return await self.client.secure_message(self.assignment, phase, body)
