"""A device's participation loop: check in, fetch the model and globals, run the task, report.

The interpreter work runs off the event loop (`run_blocking`), so one process can drive
many devices' network traffic while a small pool does the maths.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from device_runtime.client_task import Outcome, TaskConfig, TaskResult, run_evaluation_task, run_training_task
from device_runtime.example_store import ExampleStore
from device_runtime.model import DeviceModel
from device_runtime.orchestrator_client import Assignment, OrchestratorClient, ProtocolError, Rejection
from model_export.params import decode_params

T = TypeVar("T")
RunBlocking = Callable[..., Awaitable[Any]]


@dataclass
class Participation:
    """What happened when the device tried to take part once."""

    status: str  # reported | refused (report not taken) | rejected (check-in) | aborted
    assignment: Assignment | None = None
    task: TaskResult | None = None
    retry_after_seconds: float = 0.0
    detail: str = ""
    server_answer: dict[str, Any] = field(default_factory=dict)


class DeviceAgent:
    def __init__(
        self,
        client: OrchestratorClient,
        store: ExampleStore,
        cache_dir: Path,
        population: str,
        *,
        backend: str | None = None,
        run_blocking: RunBlocking = asyncio.to_thread,
    ) -> None:
        self.client = client
        self.store = store
        self.cache_dir = Path(cache_dir)
        self.population = population
        self.backend = backend
        self.run_blocking = run_blocking
        self._models: dict[str, DeviceModel] = {}

    def _model(self, model_dir: Path) -> DeviceModel:
        key = model_dir.name
        if key not in self._models:
            self._models[key] = DeviceModel(model_dir, backend=self.backend)
        return self._models[key]

    async def participate(
        self,
        task: str = "training",
        conditions: Mapping[str, bool] | None = None,
        should_continue: Callable[[], bool] = lambda: True,
        seed: int = 0,
    ) -> Participation:
        answer = await self.client.checkin(self.population, self.store.count(), task, conditions)
        if isinstance(answer, Rejection):
            return Participation(
                "rejected", retry_after_seconds=answer.retry_after_seconds, detail=answer.reason
            )
        model = self._model(await self.client.model_dir(answer, self.cache_dir))
        params = decode_params(
            await self.client.global_params(answer), model.manifest.global_params, "global parameters"
        )
        config = TaskConfig.from_json(answer.task_config)
        if answer.kind == "training":
            result: TaskResult = await self.run_blocking(
                run_training_task,
                model,
                self.store,
                params,
                config,
                should_continue=should_continue,
                seed=seed,
            )
        else:
            result = await self.run_blocking(
                run_evaluation_task, model, self.store, params, config, seed=seed
            )
        if result.outcome is not Outcome.COMPLETED:
            await self.client.abort(answer)
            return Participation(
                "aborted", answer, result, detail=f"{result.outcome.value}: {result.message}"
            )
        try:
            if answer.kind == "training":
                assert result.delta is not None
                reply = await self.client.report_training(
                    answer, result.delta, result.num_examples, result.metrics
                )
            else:
                reply = await self.client.report_evaluation(answer, result.num_examples, result.metrics)
        except ProtocolError as e:  # e.g. 409: the round closed (target reached, or deadline) first
            return Participation("refused", answer, result, detail=str(e))
        return Participation("reported", answer, result, server_answer=reply)
