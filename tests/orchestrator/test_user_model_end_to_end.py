"""A user's own Keras model (tests/model_export/genre_rating.py) in a real round: real devices
(device_runtime, real TFLite) against a real orchestrator process on loopback."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from contracts.manifest import load_manifest
from contracts.params import decode_params
from device_runtime.agent import DeviceAgent, Participation
from device_runtime.example_store import Event, ExampleStore
from device_runtime.orchestrator_client import OrchestratorClient
from tests.conftest import DEVICE_POLICY
from tests.orchestrator.conftest import Server, admin_create_population
from tests.orchestrator.test_end_to_end import admin

SETTINGS = {
    "target_reports": 4,
    "oversampling": 1.0,
    "min_reports": 4,
    "round_duration_seconds": 60,
    "min_examples": 5,
    "task_config": {"update_learning_rate": 0.2, "reconstruction_learning_rate": 0.2},
    "evaluation_target_reports": 2,
    "min_evaluation_reports": 2,
}


def test_one_round_trains_only_the_rows_devices_used_and_evaluation_adds_up(
    server: Server, genre_rating_model: Path, tmp_path: Path
) -> None:
    # Prepare: a population of the user's model; six devices, each rating a few of movies 0-19
    created = admin_create_population(server.url, genre_rating_model, "genres", json.dumps(SETTINGS))
    assert created.status_code == 201, created.text
    manifest = load_manifest(genre_rating_model)
    rng = np.random.default_rng(0)
    stores, movies_by_device = [], []
    for d in range(6):
        movies = rng.choice(20, 12)
        store = ExampleStore(tmp_path / f"device-{d}.sqlite", manifest.features)
        store.add(
            Event({"movie": int(m), "genre": int(m % 5), "rating": float(1 + (m + d) % 5)}, float(t))
            for t, m in enumerate(movies)
        )
        stores.append(store)
        movies_by_device.append(set(movies.tolist()))

    async def scenario() -> tuple[list[Participation], list[Participation], bytes, bytes]:
        async with httpx.AsyncClient(timeout=60) as http:
            agents = []
            for store in stores:
                client = OrchestratorClient(server.url, http=http)
                await client.enroll()
                agents.append(DeviceAgent(client, store, tmp_path / "cache", "genres", policy=DEVICE_POLICY))
            # Execute: four devices train one round; two held-out devices evaluate the new model
            trained = list(await asyncio.gather(*(a.participate("training") for a in agents[:4])))
            admin(server.url, "/v1/admin/populations/genres/evaluations", "POST")
            evaluated = list(await asyncio.gather(*(a.participate("evaluation") for a in agents[4:])))
            before = await agents[0].client.global_params_at("genres", 0)
            after = await agents[0].client.global_params_at("genres", 1)
            return trained, evaluated, before, after

    trained, evaluated, before_blob, after_blob = asyncio.run(scenario())

    # Assert: the round committed, and only table rows the trainers' examples use moved (those of
    # their query sets: FedRecon's update trains on the query set only)
    assert [p.status for p in trained] == ["reported"] * 4, [p.detail for p in trained]
    assert [p.status for p in evaluated] == ["reported"] * 2, [p.detail for p in evaluated]
    assert admin(server.url, "/v1/admin/populations/genres")["current_version"] == 1
    before = decode_params(before_blob, manifest.global_params, "v0")
    after = decode_params(after_blob, manifest.global_params, "v1")
    moved = np.flatnonzero(np.any(after["movie_embeddings"] != before["movie_embeddings"], axis=1))
    assert len(moved) > 0 and set(moved.tolist()) <= set().union(*movies_by_device[:4])
    assert np.any(after["hidden_kernel"] != before["hidden_kernel"])  # dense globals train as a whole
    evaluation = admin(server.url, "/v1/admin/populations/genres/rounds?kind=evaluation&limit=1")[0]
    assert evaluation["status"] == "committed"
    metrics = evaluation["metrics"]
    assert metrics["weight_sum"] == sum(p.task.num_examples for p in evaluated if p.task)
    assert metrics["rmse"] == pytest.approx(np.sqrt(metrics["squared_error_sum"] / metrics["weight_sum"]))


def test_a_model_without_local_variables_trains_with_plain_fedavg_over_http(
    server: Server, next_word_fedavg_model: Path, tmp_path: Path
) -> None:
    # Prepare: a population of the next-word model whose OOV rows are global; four devices
    created = admin_create_population(server.url, next_word_fedavg_model, "fedavg", json.dumps(SETTINGS))
    assert created.status_code == 201, created.text
    manifest = load_manifest(next_word_fedavg_model)
    tokens = manifest.task.num_classes
    assert tokens is not None
    rng = np.random.default_rng(1)
    stores = []
    for d in range(4):
        store = ExampleStore(tmp_path / f"device-{d}.sqlite", manifest.features)
        store.add(
            Event({"tokens": rng.integers(1, tokens, 8), "targets": rng.integers(1, tokens, 8)}, float(t))
            for t in range(6)
        )
        stores.append(store)

    async def scenario() -> tuple[list[Participation], bytes, bytes]:
        async with httpx.AsyncClient(timeout=60) as http:
            agents = []
            for store in stores:
                client = OrchestratorClient(server.url, http=http)
                await client.enroll()
                agents.append(DeviceAgent(client, store, tmp_path / "cache", "fedavg", policy=DEVICE_POLICY))
            trained = list(await asyncio.gather(*(a.participate("training") for a in agents)))
            return (
                trained,
                await agents[0].client.global_params_at("fedavg", 0),
                await agents[0].client.global_params_at("fedavg", 1),
            )

    # Execute
    trained, before_blob, after_blob = asyncio.run(scenario())

    # Assert: the round committed from every device's whole data, and the OOV rows moved with the rest
    assert [p.status for p in trained] == ["reported"] * 4, [p.detail for p in trained]
    assert all(p.task is not None and p.task.num_examples == 6 for p in trained)
    before = decode_params(before_blob, manifest.global_params, "v0")
    after = decode_params(after_blob, manifest.global_params, "v1")
    assert np.any(after["embedding_oov_embeddings"] != before["embedding_oov_embeddings"])
    assert np.any(after["lstm_lstm_cell_kernel"] != before["lstm_lstm_cell_kernel"])
