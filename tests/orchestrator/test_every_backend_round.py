"""One training round over HTTP against the real orchestrator on each interpreter backend: the
devices run `ai_edge_litert`'s Interpreter, `tflite_runtime`'s, or LiteRT's CompiledModel, and the
three populations, trained by the same devices' examples, end at the same model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

from contracts.params import Params, decode_params
from device_runtime.agent import DeviceAgent
from device_runtime.example_store import Event, ExampleStore
from device_runtime.orchestrator_client import OrchestratorClient
from model_export.config import ModelConfig
from model_runtime.interpreter import BACKENDS
from model_runtime.tflite_model import TFLiteModel
from tests.conftest import BIASED, DEVICE_POLICY
from tests.orchestrator.conftest import Server, admin_create_population

SETTINGS = {
    "target_reports": 4,
    "min_reports": 4,
    "round_duration_seconds": 60,
    "min_examples": 10,
    "task_config": {"update_learning_rate": 0.5, "reconstruction_learning_rate": 0.1},
}


def fill_store(path: Path, model: TFLiteModel, device: int) -> ExampleStore:
    store = ExampleStore(path, model.manifest.features)
    rng = np.random.default_rng(device)
    items = rng.choice(BIASED.num_items, 24, replace=False)
    store.add(
        Event({"item": int(item), "label": float(rng.integers(1, 6))}, float(t))
        for t, item in enumerate(items)
    )
    return store


async def one_round(url: str, population: str, backend: str, tmp: Path, model: TFLiteModel) -> Params:
    async with httpx.AsyncClient(timeout=60) as http:
        agents = []
        for device in range(4):
            client = OrchestratorClient(url, http=http)
            await client.enroll()
            store = fill_store(tmp / f"{population}-{device}.sqlite", model, device)
            agents.append(
                DeviceAgent(
                    client, store, tmp / f"cache-{backend}", population, backend=backend, policy=DEVICE_POLICY
                )
            )
        results = await asyncio.gather(*(agent.participate() for agent in agents))
        assert [r.status for r in results] == ["reported"] * 4, [r.detail for r in results]
        payload = await agents[0].client.global_params_at(population, 1)
    return decode_params(payload, model.manifest.global_params, "the round's globals")


def test_one_round_over_http_on_every_backend_gives_the_same_model(
    server: Server, export: Callable[[ModelConfig], Path], tmp_path: Path
) -> None:
    model_dir = export(BIASED)
    model = TFLiteModel(model_dir)
    trained: dict[str, Params] = {}
    for backend in BACKENDS:
        created = admin_create_population(server.url, model_dir, backend, json.dumps(SETTINGS))
        assert created.status_code == 201, created.text
        trained[backend] = asyncio.run(one_round(server.url, backend, backend, tmp_path, model))

    initial = model.get_global()
    for backend, params in trained.items():
        assert any(not np.array_equal(params[k], initial[k]) for k in initial), backend
        for name, value in params.items():
            np.testing.assert_allclose(
                value, trained["ai_edge_litert"][name], rtol=1e-5, atol=1e-6, err_msg=f"{backend} {name}"
            )
