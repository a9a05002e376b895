"""Kept local parameters survive a hostile server (issue 46, part 5).

A server over real HTTP hands a stateful device one task within its allowed ranges (the largest
local learning rate, or globals a thousand times too large) between honest ones. Without the
device's bounds its kept user vector went from norm 0.24 to 7.4e9 (every honest task after it
diverged; serving loss 5.4e19), or to 9,072 (serving loss 1.0e6 ten honest tasks later, against
0.86 never attacked); with them it serves as well as a device that was never attacked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save

from contracts.manifest import Manifest
from contracts.params import decode_params
from contracts.task_config import TaskConfig
from device_runtime.agent import DeviceAgent, Participation
from device_runtime.client_task import Outcome, Task, run_evaluation_task
from device_runtime.example_store import Event, ExampleStore
from device_runtime.kept_locals_guard import params_norm
from device_runtime.local_state import LocalStateStore
from device_runtime.orchestrator_client import OrchestratorClient
from device_runtime.task_environment import Environment
from device_runtime.task_runner import TaskRunner
from model_export.config import ModelConfig
from model_runtime.tflite_model import TFLiteModel
from tests.conftest import BIASED, DEVICE_POLICY
from tests.device_runtime.hostile_orchestrator import (
    POPULATION,
    TOKEN,
    Answer,
    HostileOrchestrator,
    json_answer,
)

HONEST = {"local_state": "keep", "local_learning_rate": 0.1, "shuffle_seed": None}
# Within TASK_CONFIG_MAXIMA: the largest local rate, the globals frozen, three steps (ten diverge
# into a non-finite update, which the device already refused).
FAST_LOCALS = {**HONEST, "local_learning_rate": 1_000.0, "update_learning_rate": 0.0, "update_max_steps": 3}
HUGE_GLOBALS = {**HONEST, "local_learning_rate": 1.0, "update_learning_rate": 0.0, "update_max_steps": 1}


@pytest.fixture(scope="module")
def server(export: Callable[[ModelConfig], Path]) -> Iterator[HostileOrchestrator]:
    with HostileOrchestrator(export(BIASED)) as running:
        yield running


@pytest.fixture(scope="module")
def runner() -> Iterator[TaskRunner]:
    with TaskRunner(1) as running:
        yield running


def generous_user(path: Path) -> ExampleStore:
    """40 ratings of 4 and 5: what kept locals learn (a user bias) whatever the globals."""
    rng = np.random.default_rng(0)
    store = ExampleStore(path, BIASED.features())
    items = rng.choice(BIASED.num_items, size=40, replace=False)
    store.add(
        Event({"item": int(i), "label": float(rng.integers(4, 6))}, float(t)) for t, i in enumerate(items)
    )
    return store


def task(server: HostileOrchestrator, settings: dict[str, Any]) -> Answer:
    config = TaskConfig.from_manifest(Manifest.from_json(server.manifest), **settings)
    return json_answer(server.assignment(task_config=config.to_json()))


def huge_globals(server: HostileOrchestrator) -> Answer:
    params = decode_params(
        server.global_params, Manifest.from_json(server.manifest).global_params, "global parameters"
    )
    params["item_embeddings"] = params["item_embeddings"] * np.float32(1_000)
    return Answer(save(params), content_type="application/octet-stream")


def participate(
    server: HostileOrchestrator, store: ExampleStore, runner: TaskRunner, cache: Path
) -> Participation:
    async def once() -> Participation:
        client = OrchestratorClient(server.url, TOKEN, attempts=2, backoff_seconds=0.01, timeout_seconds=5.0)
        try:
            return await DeviceAgent(
                client, store, cache, POPULATION, runner=runner, policy=DEVICE_POLICY
            ).participate()
        finally:
            await client.aclose()

    return asyncio.run(once())


def honest_tasks(
    server: HostileOrchestrator, store: ExampleStore, runner: TaskRunner, cache: Path, count: int
) -> None:
    server.reset()
    server.craft("checkin", task(server, HONEST))
    for _ in range(count):
        done = participate(server, store, runner, cache)
        assert done.status == "reported", done.detail


def serving(model: TFLiteModel, server: HostileOrchestrator, store: ExampleStore) -> tuple[float, float]:
    """(kept locals' norm, StandardEval loss with the honest globals on the held-out newest)."""
    kept = LocalStateStore(store, POPULATION)
    globals_ = decode_params(server.global_params, model.manifest.global_params, "global parameters")
    config = TaskConfig.from_manifest(model.manifest, **HONEST)
    result = run_evaluation_task(
        model, Environment.of(store), globals_, Task(config, population=kept.population)
    )
    assert result.outcome is Outcome.COMPLETED, result.message
    return params_norm(kept.load(model).params), result.metrics["loss_sum"] / result.metrics["weight_sum"]


@pytest.mark.parametrize("attack", ["fast_locals", "huge_globals"])
def test_one_hostile_task_does_not_ruin_a_devices_kept_locals(
    attack: str,
    server: HostileOrchestrator,
    runner: TaskRunner,
    export: Callable[[ModelConfig], Path],
    tmp_path: Path,
) -> None:
    model = TFLiteModel(export(BIASED))
    attacked, untouched = (
        generous_user(tmp_path / "attacked.sqlite"),
        generous_user(tmp_path / "untouched.sqlite"),
    )
    honest_tasks(server, untouched, runner, tmp_path / "cache-untouched", 13)
    honest_tasks(server, attacked, runner, tmp_path / "cache-attacked", 3)
    norm_before, _ = serving(model, server, attacked)

    server.reset()
    server.craft("checkin", task(server, FAST_LOCALS if attack == "fast_locals" else HUGE_GLOBALS))
    if attack == "huge_globals":
        server.craft("global", huge_globals(server))
    hostile = participate(server, attacked, runner, tmp_path / "cache-attacked")
    norm_attacked, _ = serving(model, server, attacked)
    honest_tasks(server, attacked, runner, tmp_path / "cache-attacked", 10)

    norm_after, loss_after = serving(model, server, attacked)
    norm_untouched, loss_untouched = serving(model, server, untouched)
    # The hostile task itself completes (its globals' delta goes back); what it did to the
    # locals is bounded: at most the change the device allows (the kept norm, or 1).
    assert hostile.status == "reported", hostile.detail
    assert norm_attacked <= 2 * max(norm_before, 1.0) + 1e-4
    assert norm_after < 2 * norm_untouched
    assert loss_after < 1.5 * loss_untouched
