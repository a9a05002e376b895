"""The server's own check of key advertisements' certificates (ORCHESTRATOR_ENROLLMENT_AUTHORITY_KEY),
over real HTTP: real devices (real TFLite) against a real orchestrator process on loopback.

Devices refuse a whole roster with one uncertified entry. Without the server's check, one device
with a key the authority never certified (a rogue, or one enrolled by another authority) gets
every honest device of its round to refuse it; with it, the rogue's advertisement is refused
(422) and the round goes on for the others."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from device_runtime.agent import DeviceAgent, Participation
from device_runtime.device_identity import DeviceIdentity
from device_runtime.orchestrator_client import OrchestratorClient
from enrollment_authority.authority import EnrollmentAuthority
from model_export.config import ModelConfig
from orchestrator.settings import Settings
from tests.conftest import DEVICE_POLICY, MOVIELENS
from tests.orchestrator.conftest import BACKENDS, Server, admin_create_population, fresh_postgres_database
from tests.orchestrator.test_end_to_end import Fleet, UserData, admin, fill_store, settings
from tests.orchestrator.test_secure_end_to_end import SECURE

AUTHORITY = EnrollmentAuthority()
SECURE_PHASES = {
    **SECURE,
    # The roster waits for every device that checked in, the refused ones too, till its deadline:
    # long enough for a loaded machine's honest devices to check in and advertise.
    "advertise_seconds": 15,
    "straggler_wait": None,
    "share_keys_seconds": 20,
    "masked_input_seconds": 20,
    "unmasking_seconds": 20,
}


@pytest.fixture(params=BACKENDS)
def checking_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Server]:
    """A server given the authority's public key, as the app's devices are."""
    key = base64.b64encode(AUTHORITY.public_key).decode()
    with contextlib.ExitStack() as stack:
        if request.param == "sqlite":
            database: Path | str = tmp_path / "orchestrator.sqlite"
        else:
            database = stack.enter_context(fresh_postgres_database())
        running = Server(database, settings={"enrollment_authority_key": key}).start()
        try:
            yield running
        finally:
            running.stop()


def test_an_uncertified_advertisement_is_refused_by_the_server_and_the_round_goes_on(
    checking_server: Server, export: Callable[[ModelConfig], Path], movielens_users: UserData, tmp_path: Path
) -> None:
    # Prepare: four devices certified by the authority, and a rogue whose key another authority
    # certified (it trusts that one, so its own checks pass); a secure round of up to six
    server = checking_server
    population = settings(
        target_reports=4, oversampling=1.5, min_reports=3, aggregation="secure", secure=SECURE_PHASES
    )
    created = admin_create_population(server.url, export(MOVIELENS), "movies", population)
    assert created.status_code == 201, created.text
    rogue_authority = EnrollmentAuthority()

    async def scenario() -> tuple[list[Participation], Participation, httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as http:
            honest = await Fleet(
                server.url, tmp_path, movielens_users, list(range(4)), http, authority=AUTHORITY
            ).enroll()
            client = OrchestratorClient(server.url, http=http)
            await client.enroll()
            rogue = DeviceAgent(
                client,
                fill_store(tmp_path / "rogue.sqlite", movielens_users[4]),
                honest.cache,
                "movies",
                policy=dataclasses.replace(DEVICE_POLICY, certified_roster=True),
                identity=DeviceIdentity.enroll(rogue_authority.certify, rogue_authority.public_key),
            )
            # A device without any identity sends bare keys: refused too.
            bare = await bare_advertisement(server.url, http)
            runs = [agent.participate() for agent in [rogue, *honest.agents]]
            rogue_run, *honest_runs = await asyncio.gather(*runs)
            return honest_runs, rogue_run, bare

    # Execute
    honest, rogue, bare = asyncio.run(scenario())

    # Assert: the honest devices' round committed with all four of them; the rogue (and the bare
    # advertisement) was refused at its advertisement, and named why
    assert [p.status for p in honest] == ["reported"] * 4, [p.detail for p in honest]
    first = admin(server.url, "/v1/admin/populations/movies/rounds?kind=training&limit=10")[-1]
    assert first["status"] == "committed" and first["counters"]["reported"] == 4
    assert rogue.status == "refused", rogue.detail
    assert "not signed by the enrollment authority" in rogue.detail
    assert bare.status_code == 422 and "only key advertisements signed" in bare.json()["detail"]


async def bare_advertisement(url: str, http: httpx.AsyncClient) -> httpx.Response:
    """A device checks in and advertises keys without a certificate."""
    token = (await http.post(f"{url}/v1/devices")).json()["token"]
    headers = {"Authorization": f"Bearer {token}"}
    answer = (
        await http.post(f"{url}/v1/populations/movies/checkin", json={"example_count": 40}, headers=headers)
    ).json()
    assert answer["accepted"], answer
    key = base64.b64encode(bytes(range(32))).decode()
    keys = {
        "encryption_key": key,
        "mask_key": base64.b64encode(bytes(range(1, 33))).decode(),
        "self_mask_commitment": key,
    }
    return await http.post(
        f"{url}/v1/assignments/{answer['assignment_id']}/secure/keys",
        content=json.dumps(keys),
        headers={**headers, "Content-Type": "application/json"},
    )


def test_a_bad_authority_key_at_start_up_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "ORCHESTRATOR_ENROLLMENT_AUTHORITY_KEY": "not-a-key",
        "ORCHESTRATOR_DATABASE_URL": f"sqlite:///{tmp_path / 'o.sqlite'}",
    }
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "serve"], capture_output=True, text=True, env=env, timeout=60
    )

    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: ORCHESTRATOR_ENROLLMENT_AUTHORITY_KEY: must be the base64 of the enrollment authority's "
        "raw 32-byte Ed25519 public key"
    ]
    assert (
        Settings(enrollment_authority_key=base64.b64encode(AUTHORITY.public_key).decode()).authority_key()
        == AUTHORITY.public_key
    )
