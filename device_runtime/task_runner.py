"""Client tasks off the event loop, on a small pool of worker threads.

A phone runs one task at a time; a process that drives many devices runs them on a few cores.
The runner lets many devices' network traffic share one event loop while the interpreter work
runs on `workers` threads. Each worker thread keeps its own `TFLiteModel` per model file (an
interpreter is not thread-safe), so a thousand devices on one model hold `workers`
interpreters, not a thousand. The interpreter releases the GIL while it computes.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from contracts.params import decode_params
from device_runtime.client_task import Task, TaskResult, run_evaluation_task, run_training_task
from device_runtime.task_environment import TaskEnvironment
from model_runtime.tflite_model import TFLiteModel


@dataclass(frozen=True)
class TimedResult:
    result: TaskResult
    seconds: float  # wall time of the task on the worker


class TaskRunner:
    def __init__(self, workers: int = 1, *, backend: str | None = None) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        self.backend = backend
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="client-task")
        self._local = threading.local()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> TaskRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _model(self, model_dir: Path) -> TFLiteModel:
        models: dict[Path, TFLiteModel] | None = getattr(self._local, "models", None)
        if models is None:
            models = self._local.models = {}
        if model_dir not in models:
            models[model_dir] = TFLiteModel(model_dir, backend=self.backend)
        return models[model_dir]

    def _run(
        self, kind: str, model_dir: Path, environment: TaskEnvironment, global_blob: bytes, task: Task
    ) -> TimedResult:
        started = time.perf_counter()
        model = self._model(model_dir)
        params = decode_params(global_blob, model.manifest.global_params, "global parameters")
        if kind == "training":
            result = run_training_task(model, environment, params, task)
        else:
            result = run_evaluation_task(model, environment, params, task)
        return TimedResult(result, time.perf_counter() - started)

    async def run(
        self, kind: str, model_dir: Path, environment: TaskEnvironment, global_blob: bytes, task: Task
    ) -> TimedResult:
        """A training or evaluation task; `global_blob` is the downloaded safetensors.

        A model that does not load or agree with its manifest raises `ModelLoadError` or
        `ManifestError`, and globals that do not fit it raise `ParamsError`: inputs that came from
        the server, which the caller answers for, not outcomes of the task."""
        if kind not in ("training", "evaluation"):
            raise ValueError(f"task kind must be 'training' or 'evaluation', got {kind!r}")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, self._run, kind, model_dir, environment, global_blob, task
        )


class RunsTasks(Protocol):
    """What the device's agent runs its tasks on: a `TaskRunner`, or one a harness wraps."""

    async def run(
        self, kind: str, model_dir: Path, environment: TaskEnvironment, global_blob: bytes, task: Task
    ) -> TimedResult: ...
