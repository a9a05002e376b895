"""A device's participation loop: check in, fetch the model and globals, run the task, report.

The interpreter work runs on a `TaskRunner` (worker threads), so one process can drive many
devices' network traffic on its event loop while a small pool does the maths.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from device_runtime.client_task import Outcome, TaskConfig, TaskResult
from device_runtime.example_store import ExampleStore
from device_runtime.local_state import LocalStateStore
from device_runtime.orchestrator_client import Assignment, OrchestratorClient, ProtocolError, Rejection
from device_runtime.task_runner import TaskRunner


@dataclass
class Participation:
    """What happened when the device tried to take part once."""

    # reported | refused (report not taken) | rejected (check-in) | aborted | vanished (stopped
    # without telling the server, as a phone that loses power or network does)
    status: str
    assignment: Assignment | None = None
    task: TaskResult | None = None
    retry_after_seconds: float = 0.0
    detail: str = ""
    server_answer: dict[str, Any] = field(default_factory=dict)
    task_seconds: float = 0.0  # compute time, including a slow device's extra time


class DeviceAgent:
    def __init__(
        self,
        client: OrchestratorClient,
        store: ExampleStore,
        cache_dir: Path,
        population: str,
        *,
        backend: str | None = None,
        runner: TaskRunner | None = None,
    ) -> None:
        self.client = client
        self.store = store
        self.cache_dir = Path(cache_dir)
        self.population = population
        self.runner = runner or TaskRunner(1, backend=backend)

    async def participate(
        self,
        task: str = "training",
        conditions: Mapping[str, bool] | None = None,
        should_continue: Callable[[], bool] = lambda: True,
        seed: int = 0,
        *,
        compute_slowdown: float = 1.0,
        abort_when_interrupted: bool = True,
    ) -> Participation:
        """One attempt. `compute_slowdown` > 1 stretches the task's time as a slower phone would;
        `should_continue` is asked during and after the task, and a False answer aborts (or, with
        `abort_when_interrupted=False`, the device vanishes and the server finds out at the deadline)."""
        answer = await self.client.checkin(self.population, self.store.count(), task, conditions)
        if isinstance(answer, Rejection):
            return Participation(
                "rejected", retry_after_seconds=answer.retry_after_seconds, detail=answer.reason
            )
        model_dir = await self.client.model_dir(answer, self.cache_dir)
        blob = await self.client.global_params(answer)
        config = TaskConfig.from_json(answer.task_config)
        timed = await self.runner.run(
            answer.kind,
            model_dir,
            self.store,
            blob,
            config,
            should_continue=should_continue,
            seed=seed,
            kept=LocalStateStore(self.store, self.population),
        )
        result, seconds = timed.result, timed.seconds
        if compute_slowdown > 1.0:
            await asyncio.sleep((compute_slowdown - 1.0) * seconds)
            seconds *= compute_slowdown
        if result.outcome is Outcome.COMPLETED and not should_continue():
            result = TaskResult(Outcome.INTERRUPTED, message="conditions changed before reporting")
        if result.outcome is not Outcome.COMPLETED:
            detail = f"{result.outcome.value}: {result.message}"
            if result.outcome is Outcome.INTERRUPTED and not abort_when_interrupted:
                return Participation("vanished", answer, result, detail=detail, task_seconds=seconds)
            await self.client.abort(answer)
            return Participation("aborted", answer, result, detail=detail, task_seconds=seconds)
        try:
            if answer.kind == "training":
                assert result.delta is not None
                reply = await self.client.report_training(
                    answer, result.delta, result.num_examples, result.metrics
                )
            else:
                reply = await self.client.report_evaluation(answer, result.num_examples, result.metrics)
        except ProtocolError as e:  # e.g. 409: the round closed (target reached, or deadline) first
            return Participation("refused", answer, result, detail=str(e), task_seconds=seconds)
        return Participation("reported", answer, result, server_answer=reply, task_seconds=seconds)
