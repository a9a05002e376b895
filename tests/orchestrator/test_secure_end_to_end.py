"""Secure aggregation end to end: real devices (real TFLite) against a real orchestrator process."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from sqlalchemy import create_engine, text

from contracts.manifest import load_manifest
from contracts.params import decode_params
from device_runtime.agent import DeviceAgent, Participation
from enrollment_authority.authority import EnrollmentAuthority
from model_export.config import ModelConfig
from secure_aggregation.quantization import Layout, clip
from tests.conftest import MOVIELENS
from tests.orchestrator.conftest import Server, admin_create_population
from tests.orchestrator.test_end_to_end import Fleet, UserData, admin, settings

CLIP_NORM = 2.0
SECURE = {
    "clip_norm": CLIP_NORM,
    "neighbours": 0,
    "threshold": 0.4,
    "advertise_seconds": 60,
    "share_keys_seconds": 3,
    "masked_input_seconds": 3,
    "unmasking_seconds": 3,
    "straggler_wait": None,  # the tests' devices train at this machine's pace, not a fleet's
}


class CheckInsRewritten(httpx.AsyncBaseTransport):
    """A real connection whose accepted check-ins' answers pass through `rewrite(n, answer)` (n
    counts them from 0): an orchestrator that answers differently, or one that answers wrongly."""

    def __init__(self, rewrite: Callable[[int, dict[str, Any]], dict[str, Any]]) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.rewrite = rewrite
        self.checkins = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if not request.url.path.endswith("/checkin") or response.status_code != 200:
            return response
        answer = self.rewrite(self.checkins, json.loads(await response.aread()))
        self.checkins += 1
        return httpx.Response(200, json=answer)

    async def aclose(self) -> None:
        await self.inner.aclose()


def without_parameters_every_other(n: int, answer: dict[str, Any]) -> dict[str, Any]:
    """As an orchestrator of before the round's parameters were part of the answer: the device
    asks for the round's state instead."""
    return {k: v for k, v in answer.items() if k != "secure_parameters"} if n % 2 else answer


def leaving_at(phase: str | None) -> Callable[[str], bool]:
    """A device that stays until `phase` (None: to the end)."""
    return lambda current: current != phase


def test_a_secure_round_with_dropouts_at_every_phase_commits_the_survivors_mean(
    server: Server, export: Callable[[ModelConfig], Path], movielens_users: UserData, tmp_path: Path
) -> None:
    # Prepare: 12 devices; one leaves before sharing keys, two before masking, one before unmasking;
    # every other one gets its round's parameters from the round's state, not with its assignment
    model_dir = export(MOVIELENS)
    population = settings(
        target_reports=12, oversampling=1.0, min_reports=6, aggregation="secure", secure=SECURE
    )
    created = admin_create_population(server.url, model_dir, "movies", population)
    assert created.status_code == 201, created.text
    leaves = {0: "share_keys", 1: "masked_input", 2: "masked_input", 3: "unmasking"}
    transport = CheckInsRewritten(without_parameters_every_other)

    async def scenario() -> tuple[list[Participation], bytes]:
        async with httpx.AsyncClient(timeout=60, transport=transport) as http:
            # Certified devices: each checks every roster entry's certificate and signature
            fleet = await Fleet(
                server.url, tmp_path, movielens_users, list(range(12)), http, authority=EnrollmentAuthority()
            ).enroll()
            runs = [
                agent.participate(phase_continues=leaving_at(leaves.get(i)))
                for i, agent in enumerate(fleet.agents)
            ]
            done = list(await asyncio.gather(*runs))
            for _ in range(100):  # the last phase closes as soon as enough shares are in
                if admin(server.url, "/v1/admin/populations/movies")["current_version"] == 1:
                    break
                await asyncio.sleep(0.1)
            return done, await fleet.agents[4].client.global_params_at("movies", 1)

    # Execute
    participations, blob = asyncio.run(scenario())

    # Assert: the round committed with the 9 survivors: the 8 that confirmed and the one that left
    # after its masked input, before confirming (a survivor's input stays in the sum: its
    # neighbours reveal its self-mask seed against its signed partner statement) ...
    assert transport.checkins == 12
    statuses = [p.status for p in participations]
    assert statuses[:4] == ["aborted"] * 4, statuses
    assert statuses[4:] == ["reported"] * 8, [p.detail for p in participations]
    history = admin(server.url, "/v1/admin/populations/movies/rounds?kind=training&limit=10")
    first = history[-1]
    assert first["status"] == "committed" and first["counters"]["reported"] == 9
    # ... and its model is the base plus the mean of their clipped deltas (server SGD, rate 1)
    survivors = [p for i, p in enumerate(participations) if leaves.get(i) in (None, "unmasking")]
    assert_base_plus_mean_of_clipped_deltas(model_dir, blob, survivors, 9)
    # The server kept no masked input once the round closed, and never an unmasked one.
    engine = create_engine(server.database_url)
    with engine.connect() as conn:
        kept = conn.execute(text("SELECT count(*) FROM secure_masked_inputs"))
        assert kept.scalar() == 0
    engine.dispose()


def assert_base_plus_mean_of_clipped_deltas(
    model_dir: Path, blob: bytes, survivors: list[Participation], count: int
) -> None:
    """Version 1 is the base plus the mean of the survivors' clipped deltas (server SGD, rate 1)."""
    manifest = load_manifest(model_dir)
    layout = Layout.of(manifest.global_params)
    deltas = [p.task.delta for p in survivors if p.task is not None and p.task.delta is not None]
    mean = np.mean([clip(layout.flatten(d), CLIP_NORM) for d in deltas], axis=0)
    assert len(deltas) == count
    base = decode_params(
        (model_dir / "global_params.safetensors").read_bytes(), manifest.global_params, "base"
    )
    new = decode_params(blob, manifest.global_params, "version 1")
    assert np.allclose(layout.flatten(new), layout.flatten(base) + mean, atol=2e-6)


def test_devices_share_keys_while_they_train_and_one_that_stops_after_sharing_is_masked_out(
    server: Server, export: Callable[[ModelConfig], Path], movielens_users: UserData, tmp_path: Path
) -> None:
    # Prepare: 5 devices whose training cannot end before the server holds their shares (the
    # first check during training waits for them, at most 30 s); device 0 then stops training
    model_dir = export(MOVIELENS)
    population = settings(
        target_reports=5,
        oversampling=1.0,
        min_reports=3,
        aggregation="secure",
        secure=SECURE,
    )
    created = admin_create_population(server.url, model_dir, "movies", population)
    assert created.status_code == 201, created.text
    engine = create_engine(server.database_url)

    def shared(assignment_id: str) -> bool:
        with engine.connect() as conn:
            sent = conn.execute(
                text("SELECT sent_shares FROM secure_participants WHERE assignment_id = :a"),
                {"a": assignment_id},
            )
            return bool(sent.scalar())

    shared_while_training: dict[int, bool] = {}

    def training(i: int, agent: DeviceAgent) -> Callable[[], bool]:
        def should_continue() -> bool:  # called on the training thread
            if i not in shared_while_training:
                assert agent.assignment is not None
                give_up = time.monotonic() + 30
                while not shared(agent.assignment.assignment_id) and time.monotonic() < give_up:
                    time.sleep(0.05)
                shared_while_training[i] = shared(agent.assignment.assignment_id)
            return i != 0

        return should_continue

    async def scenario() -> tuple[list[Participation], bytes]:
        async with httpx.AsyncClient(timeout=60) as http:
            fleet = await Fleet(server.url, tmp_path, movielens_users, list(range(5)), http).enroll()
            runs = [
                agent.participate(should_continue=training(i, agent), phase_continues=leaving_at(None))
                for i, agent in enumerate(fleet.agents)
            ]
            done = list(await asyncio.gather(*runs))
            return done, await fleet.agents[1].client.global_params_at("movies", 1)

    # Execute
    participations, blob = asyncio.run(scenario())
    engine.dispose()

    # Assert: every device's shares reached the server while it was training; the one that
    # stopped after sharing is masked out of the committed sum of the other four
    assert shared_while_training == {i: True for i in range(5)}
    assert [p.status for p in participations] == ["aborted"] + ["reported"] * 4, [
        p.detail for p in participations
    ]
    first = admin(server.url, "/v1/admin/populations/movies/rounds?kind=training&limit=10")[-1]
    assert first["status"] == "committed" and first["counters"]["reported"] == 4
    assert_base_plus_mean_of_clipped_deltas(model_dir, blob, participations[1:], 4)


def test_round_parameters_the_device_cannot_use_are_an_invalid_answer_and_it_aborts(
    server: Server, export: Callable[[ModelConfig], Path], movielens_users: UserData, tmp_path: Path
) -> None:
    # Prepare: a secure round of 4 whose first check-in answer carries parameters without a context
    population = settings(
        target_reports=4, oversampling=1.0, min_reports=3, aggregation="secure", secure=SECURE
    )
    created = admin_create_population(server.url, export(MOVIELENS), "movies", population)
    assert created.status_code == 201, created.text

    def broken_first(n: int, answer: dict[str, Any]) -> dict[str, Any]:
        if n == 0:
            answer["secure_parameters"] = {
                k: v for k, v in answer["secure_parameters"].items() if k != "context"
            }
        return answer

    async def scenario() -> Participation:
        async with httpx.AsyncClient(timeout=60, transport=CheckInsRewritten(broken_first)) as http:
            fleet = await Fleet(server.url, tmp_path, movielens_users, [0], http).enroll()
            return await fleet.agents[0].participate(phase_continues=leaving_at(None))

    # Execute
    participation = asyncio.run(scenario())

    # Assert: the device says what was wrong and what it expected, and told the server it left
    assert participation.status == "invalid_answer", participation.detail
    assert "secure round parameters must have exactly" in participation.detail
    rounds = admin(server.url, "/v1/admin/populations/movies/rounds?kind=training&limit=10")
    assert rounds[-1]["counters"]["aborted"] == 1, rounds[-1]


class GarbageShares(httpx.AsyncBaseTransport):
    """A real connection on which the device holding `token` sends random ciphertexts of the right
    length in place of its shares (an enrolled device that tries to stop every round it joins)."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.token: str | None = None
        self.garbage_from: str | None = None  # the path of its shares

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        sender = request.headers.get("authorization")
        if request.url.path.endswith("/secure/shares") and sender == f"Bearer {self.token}":
            self.garbage_from = request.url.path
            shares = json.loads(await request.aread())
            for message in shares.values():
                size = len(base64.b64decode(message["ciphertext"]))
                message["ciphertext"] = base64.b64encode(os.urandom(size)).decode()
            headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
            request = httpx.Request(request.method, request.url, headers=headers, json=shares)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_a_secure_round_with_dropouts_and_a_device_sending_garbage_shares_commits(
    server: Server, export: Callable[[ModelConfig], Path], movielens_users: UserData, tmp_path: Path
) -> None:
    # Prepare: 10 certified devices; one leaves before sharing keys, one before masking; one sends
    # random ciphertexts as its shares
    model_dir = export(MOVIELENS)
    # (deadlines that a loaded machine's training and a confirmation round trip do not outrun)
    secure = {**SECURE, "share_keys_seconds": 20, "masked_input_seconds": 20, "unmasking_seconds": 20}
    population = settings(
        target_reports=10, oversampling=1.0, min_reports=5, aggregation="secure", secure=secure
    )
    created = admin_create_population(server.url, model_dir, "movies", population)
    assert created.status_code == 201, created.text
    leaves = {0: "share_keys", 1: "masked_input"}
    transport = GarbageShares()
    GARBAGE = 9

    async def scenario() -> tuple[list[Participation], bytes]:
        async with httpx.AsyncClient(timeout=60, transport=transport) as http:
            fleet = await Fleet(
                server.url, tmp_path, movielens_users, list(range(10)), http, authority=EnrollmentAuthority()
            ).enroll()
            transport.token = fleet.agents[GARBAGE].client.token  # a device that stays throughout
            runs = [
                agent.participate(phase_continues=leaving_at(leaves.get(i)))
                for i, agent in enumerate(fleet.agents)
            ]
            done = list(await asyncio.gather(*runs))
            for _ in range(100):
                if admin(server.url, "/v1/admin/populations/movies")["current_version"] == 1:
                    break
                await asyncio.sleep(0.1)
            return done, await fleet.agents[5].client.global_params_at("movies", 1)

    # Execute
    participations, blob = asyncio.run(scenario())

    # Assert: the garbage sender was reported by its neighbours and dropped, and the round
    # committed with the seven others that sent their masked input: base + mean of their deltas
    garbage = participations[GARBAGE]
    assert garbage.assignment is not None and transport.garbage_from is not None
    assert garbage.assignment.assignment_id in transport.garbage_from
    statuses = [p.status for p in participations]
    honest = [i for i in range(10) if i not in leaves and i != GARBAGE]
    assert [statuses[i] for i in honest] == ["reported"] * 7, [p.detail for p in participations]
    assert garbage.status == "refused", garbage.detail
    history = admin(server.url, "/v1/admin/populations/movies/rounds?kind=training&limit=10")
    assert history[-1]["status"] == "committed" and history[-1]["counters"]["reported"] == 7
    assert_base_plus_mean_of_clipped_deltas(model_dir, blob, [participations[i] for i in honest], 7)
