"""A malicious server against the device runtime's own secure-round code, on the bytes it sends.

The server is the real orchestrator on loopback, made malicious by rewriting its answers at the
devices' HTTP transport (as an operator who changed its code would answer), and everything the
devices send is recorded there: what the attacker holds is exactly those bytes. Each attack is one
that the device's privacy policy (set by the app, never by the server) defeats: a switch to
plaintext, a cohort or a threshold below the device's floors, a survivor list of one. Each time the
device names why it refused, and the attacker recovers nothing of its update.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from android_sim.small_cohorts import simulation_policy
from contracts.manifest import load_manifest
from device_runtime.agent import DeviceAgent, Participation
from device_runtime.device_identity import DeviceIdentity
from device_runtime.orchestrator_client import OrchestratorClient
from enrollment_authority.authority import EnrollmentAuthority
from model_export.config import ModelConfig
from secure_aggregation.config import RoundParameters
from secure_aggregation.messages import decode_vector
from secure_aggregation.quantization import Layout, decode_signed
from tests.conftest import MOVIELENS
from tests.orchestrator.conftest import Server, admin_create_population
from tests.orchestrator.test_end_to_end import UserData, admin, fill_store, settings
from tests.orchestrator.test_secure_end_to_end import SECURE
from tests.privacy.test_attacks import cosine, recover_embedding

# The devices' floors: sums of at least 4 inputs, a threshold of at least 0.4 of the neighbours;
# rosters of keys certified by the enrollment authority they trust (which the server is not).
POLICY = simulation_policy("secure", min_summands=4, min_threshold=0.4, certified_roster=True)
AUTHORITY = EnrollmentAuthority()
DEVICES = 5
# (path, answer, each assignment's index in its secure round) -> the answer the device gets
Rewrite = Callable[[str, dict[str, Any], dict[str, int]], dict[str, Any]]


@dataclass(frozen=True)
class Sent:
    method: str
    path: str
    body: bytes


class MaliciousTransport(httpx.AsyncBaseTransport):
    """A real connection to the orchestrator whose JSON answers pass through `rewrite` (the round's
    state wherever it comes: a `GET .../secure` answer or a message's answer), recording
    every request the devices send (the attacker's view) and the secure round's parameters."""

    def __init__(self, rewrite: Rewrite) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.rewrite = rewrite
        self.sent: list[Sent] = []
        self.index: dict[str, int] = {}  # assignment id -> the device's index in its secure round
        self.parameters: dict[str, Any] | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(Sent(request.method, request.url.path, await request.aread()))
        response = await self.inner.handle_async_request(request)
        if response.status_code != 200 or not response.headers.get("content-type", "").startswith(
            "application/json"
        ):
            return response
        answer = json.loads(await response.aread())
        path = request.url.path
        if path.endswith("/secure/keys"):
            self.index[path.split("/")[3]] = int(answer["index"])
        self.parameters = answer.get("secure_parameters") or self.parameters
        rewritten = self.rewrite(path, answer, self.index)
        if isinstance(answer.get("state"), dict):
            # A message's answer that holds the round's state (`?until=`): rewritten as that state.
            state_path = path[: path.rindex("/secure") + len("/secure")]
            rewritten = {**rewritten, "state": self.rewrite(state_path, answer["state"], self.index)}
        return httpx.Response(200, json=rewritten)

    def posted(self, suffix: str) -> list[Sent]:
        return [s for s in self.sent if s.method == "POST" and s.path.endswith(suffix)]

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    running = Server(tmp_path / "orchestrator.sqlite").start()
    try:
        yield running
    finally:
        running.stop()


def run_devices(
    server: Server,
    export: Callable[[ModelConfig], Path],
    users: UserData,
    tmp_path: Path,
    devices: int,
    rewrite: Rewrite,
    transport: MaliciousTransport | None = None,
    mixing: Callable[[Path], None] | None = None,
) -> tuple[list[Participation], MaliciousTransport]:
    """`devices` certified devices take part in one secure round of a new population 'movies'
    (`mixing` attaches its centralized data first, given the model's directory)."""
    population = settings(
        target_reports=DEVICES, oversampling=1.0, min_reports=4, aggregation="secure", secure=SECURE
    )
    model_dir = export(MOVIELENS)
    created = admin_create_population(server.url, model_dir, "movies", population)
    assert created.status_code == 201, created.text
    if mixing is not None:
        mixing(model_dir)
    transport = transport or MaliciousTransport(rewrite)

    async def scenario() -> list[Participation]:
        async with httpx.AsyncClient(timeout=60, transport=transport) as http:
            agents = []
            for u in range(devices):
                client = OrchestratorClient(server.url, http=http)
                await client.enroll()
                store = fill_store(tmp_path / f"device-{u}.sqlite", users[u])
                identity = DeviceIdentity.enroll(AUTHORITY.certify, AUTHORITY.public_key)
                agents.append(
                    DeviceAgent(client, store, tmp_path / "cache", "movies", policy=POLICY, identity=identity)
                )
            return list(await asyncio.gather(*(a.participate() for a in agents)))

    return asyncio.run(scenario()), transport


def checkin(change: Callable[[dict[str, Any]], dict[str, Any]]) -> Rewrite:
    return lambda path, answer, _: (
        change(answer) if path.endswith("/checkin") and answer.get("accepted") else answer
    )


def to_plaintext(answer: dict[str, Any]) -> dict[str, Any]:
    return {**answer, "aggregation": "plaintext", "secure_url": None, "secure_parameters": None}


def with_parameters(**changes: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda answer: {**answer, "secure_parameters": {**answer["secure_parameters"], **changes}}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (
            to_plaintext,
            "the assignment asks for 'plaintext' aggregation; this device accepts only ['secure']",
        ),
        (
            with_parameters(min_survivors=2),
            "the round would unmask a sum of 2 devices' inputs; this device joins only sums of at least 4",
        ),
        (
            with_parameters(threshold=0.2),
            "a secret-sharing threshold of 0.2 of the neighbours is below this device's floor of 0.4",
        ),
    ],
    ids=["switch to plaintext", "cohort below the floor", "threshold below the floor"],
)
def test_a_round_below_the_devices_floors_gets_nothing_from_it(
    server: Server,
    export: Callable[[ModelConfig], Path],
    movielens_users: UserData,
    tmp_path: Path,
    change: Callable[[dict[str, Any]], dict[str, Any]],
    reason: str,
) -> None:
    # Execute: the server's check-in answer is changed for every device
    participations, transport = run_devices(server, export, movielens_users, tmp_path, 1, checkin(change))

    # Assert: the device names the floor, and what it sent after the check-in is its abort alone
    # (no report, no keys, no shares, no input: nothing to attack)
    assert [p.status for p in participations] == ["declined"], participations
    assert f"privacy policy: {reason}" in participations[0].detail
    sent = [(s.method, s.path.rsplit("/", 1)[-1]) for s in transport.sent if s.method == "POST"]
    assert sent == [("POST", "devices"), ("POST", "checkin"), ("POST", "abort")], sent


def test_a_roster_cut_below_the_floor_gets_no_shares_and_no_input(
    server: Server, export: Callable[[ModelConfig], Path], movielens_users: UserData, tmp_path: Path
) -> None:
    # Prepare: the server announces parameters at the floor, then shows each device a roster of
    # itself and two others (a small group whose sum would say more about each)
    def roster_of_three(path: str, answer: dict[str, Any], index: dict[str, int]) -> dict[str, Any]:
        if path.endswith("/secure") and "roster" in answer:
            own = str(index[path.split("/")[3]])
            kept = [own, *[i for i in sorted(answer["roster"]) if i != own][:2]]
            return {**answer, "roster": {i: answer["roster"][i] for i in kept}}
        return answer

    # Execute
    participations, transport = run_devices(
        server, export, movielens_users, tmp_path, DEVICES, roster_of_three
    )

    # Assert: each device named the floor after its keys and before its shares; nothing followed
    assert [p.status for p in participations] == ["declined"] * DEVICES, [p.detail for p in participations]
    for p in participations:
        assert (
            "share_keys: privacy policy: the roster holds 3 devices; "
            "this device joins only rounds of at least 4" in p.detail
        )
    assert len(transport.posted("/secure/keys")) == DEVICES
    assert transport.posted("/secure/shares") == [] and transport.posted("/masked-input") == []


def test_a_survivor_list_of_one_unmasks_nothing_and_the_masked_inputs_hide_each_update(
    server: Server, export: Callable[[ModelConfig], Path], movielens_users: UserData, tmp_path: Path
) -> None:
    # Prepare: the server plays the round honestly to the unmasking phase, then tells each device
    # that it alone survived (to get its self-mask seed back and read its input)
    def survivor_list_of_one(path: str, answer: dict[str, Any], index: dict[str, int]) -> dict[str, Any]:
        if path.endswith("/secure") and "survivors" in answer:
            return {**answer, "survivors": [index[path.split("/")[3]]]}
        return answer

    # Execute
    participations, transport = run_devices(
        server, export, movielens_users, tmp_path, DEVICES, survivor_list_of_one
    )

    # Assert: every device sent its masked input, then refused to unmask a sum of one, naming why
    assert [p.status for p in participations] == ["declined"] * DEVICES, [p.detail for p in participations]
    for p in participations:
        assert "unmasking: privacy policy: the server asks to unmask a sum of 1 devices' inputs" in p.detail
    assert len(transport.posted("/masked-input")) == DEVICES and transport.posted("/unmasking") == []
    history = admin(server.url, "/v1/admin/populations/movies/rounds?kind=training&limit=1")
    assert history[0]["status"] != "committed"
    # What the attacker holds of each device, its masked input as sent, read as the update it hides
    manifest = load_manifest(export(MOVIELENS))
    layout = Layout.of(manifest.global_params)
    assert transport.parameters is not None
    offered = RoundParameters.from_json(transport.parameters)
    by_assignment = {s.path.split("/")[3]: s.body for s in transport.posted("/masked-input")}
    correlations, cosines = [], []
    for p in participations:
        assert p.assignment is not None and p.task is not None and p.task.delta is not None
        words = decode_vector(by_assignment[p.assignment.assignment_id], offered)
        read = layout.unflatten(decode_signed(words, offered) * (offered.clip_norm / offered.levels))
        correlations.append(np.corrcoef(layout.flatten(read), layout.flatten(p.task.delta))[0, 1])
        recovered = recover_embedding(read["item_embeddings"], read["item_bias"])
        plain = recover_embedding(p.task.delta["item_embeddings"], p.task.delta["item_bias"])
        cosines.append(cosine(recovered, plain))
    # Chance for 28,594 coordinates is about +-0.006; the embedding is no closer than a random
    # direction in 16 dimensions
    assert max(abs(c) for c in correlations) < 0.03, correlations
    assert abs(float(np.mean(cosines))) < 0.4 and max(abs(c) for c in cosines) < 0.8, cosines
