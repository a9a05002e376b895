"""A malicious server at the consistency check, against certified devices on the real wire.

The server tries to get both of one device's secrets, or a sum that is that device's input alone:
it sends one device different globals (Pasquini et al. 2022) and counts it among the survivors
anyway; it tells some devices that a device survived and the others that it dropped; it tells a
device that none of its neighbours shared keys. Each device checks its neighbours' signatures on
the survivor set and the globals and task before it reveals anything, and reveals a self-mask seed
only for a neighbour that signed the same ones. No device's self-mask seed reaches the server
together with its mask key, and the refusing devices name why.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from safetensors.numpy import load, save

from model_export.config import ModelConfig
from secure_aggregation.messages import UnmaskingShares
from tests.orchestrator.conftest import Server
from tests.orchestrator.test_end_to_end import UserData
from tests.privacy.test_malicious_server import DEVICES, MaliciousTransport, Sent, run_devices
from tests.privacy.test_malicious_server import server as server  # the fixture


def revealed(transport: MaliciousTransport) -> list[UnmaskingShares]:
    """The unmasking answers the devices sent, as the attacker holds them."""
    return [UnmaskingShares.from_json(json.loads(s.body), 64) for s in transport.posted("/secure/unmasking")]


class OtherGlobalsForOne(MaliciousTransport):
    """The first device to fetch the globals gets other ones (every value tripled); at the
    unmasking every device is told that all survivors confirmed, with the victim's confirmation
    relayed as it sent it."""

    def __init__(self) -> None:
        super().__init__(self.count_the_victim)
        self.victim_token: str | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if "/global" in request.url.path and response.status_code == 200:
            token = request.headers.get("authorization", "")
            self.victim_token = self.victim_token or token
            if token == self.victim_token:
                body = await response.aread()
                return httpx.Response(200, content=_tripled(body), headers=response.headers)
        return response

    def count_the_victim(self, path: str, answer: dict[str, Any], index: dict[str, int]) -> dict[str, Any]:
        assignment = path.split("/")[-2] if path.endswith("/secure") else ""
        confirmed_it = any(assignment in s.path for s in self.posted("/secure/consistency"))
        # (the victim is held in the unmasking phase even if the others' round already committed)
        if not (path.endswith("/secure") and confirmed_it and answer["phase"] in ("unmasking", "done")):
            return answer
        confirmations = {
            str(index[sent.path.split("/")[3]]): json.loads(sent.body)
            for sent in self.posted("/secure/consistency")
        }
        survivors = sorted(index.values())
        fabricated = {**answer, "phase": "unmasking", "round_status": "open", "survivors": survivors}
        return {**fabricated, "confirmed": survivors, "confirmations": confirmations}


def test_different_globals_for_one_device_get_its_seed_from_no_neighbour(
    server: Server, export: Callable[[ModelConfig], Path], movielens_users: UserData, tmp_path: Path
) -> None:
    # Execute
    participations, transport = run_devices(
        server, export, movielens_users, tmp_path, DEVICES, lambda p, a, i: a, OtherGlobalsForOne()
    )

    # Assert: the victim found no neighbour that signed its globals and refused, naming why; no
    # other device revealed a share of its self-mask seed (so its masked input stays masked)
    details = [p.detail for p in participations]
    assert len(transport.posted("/secure/consistency")) == DEVICES, details
    refused = [p for p in participations if "signed the same survivors, globals and task" in p.detail]
    assert len(refused) == 1 and refused[0].status == "refused", details
    assert refused[0].assignment is not None
    victim_at = transport.index[refused[0].assignment.assignment_id]
    answers = revealed(transport)
    assert len(answers) == DEVICES - 1, details
    assert all(victim_at not in a.self_mask_shares for a in answers), answers
    assert all(victim_at in a.mask_key_shares for a in answers), answers


def _tripled(blob: bytes) -> bytes:
    tensors = load(blob)
    return save({name: (np.asarray(value) * 3).astype(value.dtype) for name, value in tensors.items()})


def test_a_device_told_that_none_of_its_neighbours_shared_sends_no_masked_input(
    server: Server, export: Callable[[ModelConfig], Path], movielens_users: UserData, tmp_path: Path
) -> None:
    # Prepare: the server withholds the shares addressed to one device (its masked input would
    # then carry only its self mask, which the others' seed shares remove)
    first: dict[str, str] = {}

    def none_shared(path: str, answer: dict[str, Any], index: dict[str, int]) -> dict[str, Any]:
        if path.endswith("/secure") and "ciphertexts" in answer:
            assignment = path.split("/")[3]
            first.setdefault("victim", assignment)
            if first["victim"] == assignment:
                return {**answer, "ciphertexts": {}}
        return answer

    # Execute
    participations, transport = run_devices(server, export, movielens_users, tmp_path, DEVICES, none_shared)

    # Assert: the victim refused before masking, naming why; it sent no masked input
    victim = [p for p in participations if p.assignment and p.assignment.assignment_id == first["victim"]]
    assert len(victim) == 1 and victim[0].status == "refused", victim
    assert "neighbours shared keys" in victim[0].detail, victim[0].detail
    assert all(first["victim"] not in s.path for s in transport.posted("/masked-input"))


class InconsistentSurvivors(MaliciousTransport):
    """Tells two devices and the victim (the lowest index) that all five survived, and the other
    two that the victim dropped; then plays the unmasking phase itself, accepting every message
    and relaying every confirmation, to collect the victim's seed from the first group and its
    mask key from the second."""

    def __init__(self) -> None:
        super().__init__(self.split)
        self.told: dict[str, list[int]] = {}  # assignment -> the survivor set it was shown
        self.base: dict[str, dict[str, Any]] = {}  # assignment -> its consistency-phase state

    def split(self, path: str, answer: dict[str, Any], index: dict[str, int]) -> dict[str, Any]:
        if not (path.endswith("/secure") and answer["phase"] == "consistency" and "survivors" in answer):
            return answer
        assignment = path.split("/")[3]
        survivors = sorted(answer["survivors"])
        victim, others = survivors[0], survivors[1:]
        shown = [i for i in survivors if i != victim] if index[assignment] in others[2:] else survivors
        self.told[assignment], self.base[assignment] = shown, answer
        return {**answer, "survivors": shown}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "POST" and path.endswith(("/secure/consistency", "/secure/unmasking")):
            self.sent.append(Sent(request.method, path, await request.aread()))
            return httpx.Response(200, json={"accepted": True})
        if path.endswith("/secure") and request.url.params.get("until") == "unmasking":
            while len(self.posted("/secure/consistency")) < DEVICES:
                await asyncio.sleep(0.05)
            assignment = path.split("/")[3]
            confirmations = {
                str(self.index[s.path.split("/")[3]]): json.loads(s.body)
                for s in self.posted("/secure/consistency")
            }
            shown = self.told[assignment]
            fabricated = {**self.base[assignment], "phase": "unmasking", "survivors": shown}
            return httpx.Response(
                200, json={**fabricated, "confirmed": shown, "confirmations": confirmations}
            )
        return await super().handle_async_request(request)


def test_inconsistent_survivor_lists_never_get_both_secrets_of_one_device(
    server: Server, export: Callable[[ModelConfig], Path], movielens_users: UserData, tmp_path: Path
) -> None:
    # Execute
    participations, transport = run_devices(
        server, export, movielens_users, tmp_path, DEVICES, lambda p, a, i: a, InconsistentSurvivors()
    )

    # Assert: the two devices shown the smaller set found one neighbour (not their threshold of
    # two) that signed it, and refused; the three others found that the two had not signed their
    # set, so that the sum they would unmask holds 3 inputs, below their floor of 4: all named why.
    # Of no device did the attacker get a threshold of seed shares and one of mask-key shares
    details = [p.detail for p in participations]
    refusing = [p for p in participations if "1 of this device's neighbours signed the same" in p.detail]
    assert len(refusing) == 2 and all(p.status == "refused" for p in refusing), details
    floor = [p for p in participations if "asks to unmask a sum of 3 devices' inputs" in p.detail]
    assert len(floor) == 3 and all(p.status == "declined" for p in floor), details
    answers = revealed(transport)
    threshold = 2  # 0.4 of the 4 neighbours, and at least 2
    for owner in sorted(transport.index.values()):
        seeds = sum(owner in a.self_mask_shares for a in answers)
        keys = sum(owner in a.mask_key_shares for a in answers)
        assert seeds < threshold or keys < threshold, (owner, seeds, keys)
