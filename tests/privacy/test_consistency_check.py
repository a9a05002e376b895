"""A malicious server at the consistency check, against certified devices on the real wire.

The server tries to get both of one device's secrets, or a sum that is that device's input alone:
it sends one device different globals (Pasquini et al. 2022) and counts it among the survivors
anyway; it tells some devices that a device survived and the others that it dropped; it tells a
device that none of its neighbours shared keys. Each device reveals only for a survivor set that a
quorum of the roster signed over the same roster and inputs, with every survivor's signed partner
statement naming the same inputs (secure_aggregation.view). No device's self-mask seed reaches the
server together with its mask key, and the refusing devices name why.
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


class PlaysTheUnmasking(MaliciousTransport):
    """Shows each device the survivor set `shown` picks at the consistency check, then plays the
    unmasking itself: it accepts every confirmation and unmasking answer, and relays to every
    device every confirmation and partner statement it was sent, to collect what they reveal.
    With `tripled_for_one`, the first device to fetch the globals gets other ones (every value
    tripled)."""

    def __init__(
        self, shown: Callable[[list[int], int, list[int]], list[int]], tripled_for_one: bool
    ) -> None:
        super().__init__(self.split)
        self.shown = shown
        self.tripled_for_one = tripled_for_one
        self.victim_token: str | None = None
        self.told: dict[str, list[int]] = {}  # assignment -> the survivor set it was shown
        self.base: dict[str, dict[str, Any]] = {}  # assignment -> its consistency-phase state

    def split(self, path: str, answer: dict[str, Any], index: dict[str, int]) -> dict[str, Any]:
        if not (path.endswith("/secure") and answer["phase"] == "consistency" and "survivors" in answer):
            return answer
        assignment = path.split("/")[3]
        senders = sorted(index[s.path.split("/")[3]] for s in self.posted("/masked-input"))
        shown = self.shown(senders, index[assignment], sorted(index.values()))
        self.told[assignment], self.base[assignment] = shown, answer
        return {**answer, "survivors": shown}

    def _relayed(self, suffix: str) -> dict[str, Any]:
        return {str(self.index[s.path.split("/")[3]]): json.loads(s.body) for s in self.posted(suffix)}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if "/global" in path and self.tripled_for_one:
            response = await super().handle_async_request(request)
            token = request.headers.get("authorization", "")
            self.victim_token = self.victim_token or token
            if token == self.victim_token and response.status_code == 200:
                return httpx.Response(200, content=_tripled(await response.aread()), headers=response.headers)
            return response
        if request.method == "POST" and path.endswith(("/secure/consistency", "/secure/unmasking")):
            self.sent.append(Sent(request.method, path, await request.aread()))
            return httpx.Response(200, json={"accepted": True})
        if path.endswith("/secure") and request.url.params.get("until") == "unmasking":
            # Every device's confirmation first (a device that refused to confirm leaves the wait
            # to its end: the attacker relays what it has then)
            waited = 0.0
            while len(self.posted("/secure/consistency")) < DEVICES and waited < 30:
                await asyncio.sleep(0.05)
                waited += 0.05
            assignment = path.split("/")[3]
            confirmations = self._relayed("/secure/consistency")
            shown = self.told[assignment]
            fabricated = {**self.base[assignment], "phase": "unmasking", "survivors": shown}
            return httpx.Response(
                200,
                json={
                    **fabricated,
                    "confirmed": sorted(int(i) for i in confirmations),
                    "confirmations": confirmations,
                    "statements": self._relayed("/secure/partners"),
                },
            )
        return await super().handle_async_request(request)


def test_different_globals_for_one_device_get_its_seed_from_no_neighbour(
    server: Server, export: Callable[[ModelConfig], Path], movielens_users: UserData, tmp_path: Path
) -> None:
    # Prepare: one device trains on other globals; the server counts it among the survivors anyway
    # (the others' updates would then say what the victim's is), and relays everything
    attacker = PlaysTheUnmasking(lambda senders, me, everyone: senders, tripled_for_one=True)

    # Execute
    participations, transport = run_devices(
        server, export, movielens_users, tmp_path, DEVICES, lambda p, a, i: a, attacker
    )

    # Assert: the others found that the victim's partner statement names other inputs, and the
    # victim that no quorum signed its inputs: every device refused, naming why, and revealed nothing
    details = [p.detail for p in participations]
    assert [p.status for p in participations] == ["refused"] * DEVICES, details
    other_inputs = [p for p in participations if "trained on other inputs" in p.detail]
    no_quorum = [p for p in participations if "signed this survivor set, roster and inputs" in p.detail]
    assert len(other_inputs) == DEVICES - 1 and len(no_quorum) == 1, details
    assert revealed(transport) == []


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


def test_inconsistent_survivor_lists_never_get_both_secrets_of_one_device(
    server: Server, export: Callable[[ModelConfig], Path], movielens_users: UserData, tmp_path: Path
) -> None:
    # Prepare: the victim (the lowest index) and two others are told that all five survived, the
    # other two that the victim dropped (to collect its seed from the first group and its mask key
    # from the second)
    def split(senders: list[int], me: int, everyone: list[int]) -> list[int]:
        victim = senders[0]
        return [i for i in senders if i != victim] if me in senders[3:] else senders

    # Execute
    participations, transport = run_devices(
        server, export, movielens_users, tmp_path, DEVICES, lambda p, a, i: a, PlaysTheUnmasking(split, False)
    )

    # Assert: the two shown the smaller set found 2 confirmations of it, not a quorum (3 of the
    # roster of 5), and refused, naming why; the three others revealed self-mask seeds only. Of no
    # device did the attacker get a threshold of seed shares and one of mask-key shares
    details = [p.detail for p in participations]
    refusing = [
        p for p in participations if "2 devices of the roster of 5 signed this survivor set" in p.detail
    ]
    assert len(refusing) == 2 and all(p.status == "refused" for p in refusing), details
    answers = revealed(transport)
    assert len(answers) == 3 and all(a.mask_key_shares == {} for a in answers), answers
    threshold = 2  # 0.4 of the 4 neighbours, and at least 2
    for owner in sorted(transport.index.values()):
        seeds = sum(owner in a.self_mask_shares for a in answers)
        keys = sum(owner in a.mask_key_shares for a in answers)
        assert seeds < threshold or keys < threshold, (owner, seeds, keys)
