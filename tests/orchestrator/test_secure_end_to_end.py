"""Secure aggregation end to end: real devices (real TFLite) against a real orchestrator process."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
from sqlalchemy import create_engine, text

from contracts.manifest import load_manifest
from contracts.params import decode_params
from device_runtime.agent import Participation
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
}


def leaving_at(phase: str | None) -> Callable[[str], bool]:
    """A device that stays until `phase` (None: to the end)."""
    return lambda current: current != phase


def test_a_secure_round_with_dropouts_at_every_phase_commits_the_survivors_mean(
    server: Server, export: Callable[[ModelConfig], Path], movielens_users: UserData, tmp_path: Path
) -> None:
    # Prepare: 12 devices; one leaves before sharing keys, two before masking, one before unmasking
    model_dir = export(MOVIELENS)
    population = settings(
        target_reports=12, oversampling=1.0, min_reports=6, aggregation="secure", secure=SECURE
    )
    created = admin_create_population(server.url, model_dir, "movies", population)
    assert created.status_code == 201, created.text
    leaves = {0: "share_keys", 1: "masked_input", 2: "masked_input", 3: "unmasking"}

    async def scenario() -> tuple[list[Participation], bytes]:
        async with httpx.AsyncClient(timeout=60) as http:
            fleet = await Fleet(server.url, tmp_path, movielens_users, list(range(12)), http).enroll()
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

    # Assert: the round committed with the 9 devices that sent a masked input ...
    # (the last one to leave may find the round committed before it could: its input is in it)
    statuses = [p.status for p in participations]
    assert statuses[:3] == ["aborted"] * 3 and statuses[3] in ("aborted", "reported"), statuses
    assert statuses[4:] == ["reported"] * 8, [p.detail for p in participations]
    history = admin(server.url, "/v1/admin/populations/movies/rounds?kind=training&limit=10")
    first = history[-1]
    assert first["status"] == "committed" and first["counters"]["reported"] == 9
    # ... and its model is the base plus the mean of their clipped deltas (server SGD, rate 1)
    manifest = load_manifest(model_dir)
    layout = Layout.of(manifest.global_params)
    survivors = [p for i, p in enumerate(participations) if leaves.get(i) in (None, "unmasking")]
    deltas = [p.task.delta for p in survivors if p.task is not None and p.task.delta is not None]
    mean = np.mean([clip(layout.flatten(d), CLIP_NORM) for d in deltas], axis=0)
    assert len(deltas) == 9
    base = decode_params(
        (model_dir / "global_params.safetensors").read_bytes(), manifest.global_params, "base"
    )
    new = decode_params(blob, manifest.global_params, "version 1")
    assert np.allclose(layout.flatten(new), layout.flatten(base) + mean, atol=2e-6)
    # The server kept no masked input once the round closed, and never an unmasked one.
    engine = create_engine(server.database_url)
    with engine.connect() as conn:
        kept = conn.execute(text("SELECT count(*) FROM secure_participants WHERE masked_input IS NOT NULL"))
        assert kept.scalar() == 0
    engine.dispose()
