"""Client tasks off the event loop, on a small pool of worker threads.

A phone runs one task at a time; a simulator runs thousands of phones on a few cores. The
runner lets many devices' network traffic share one event loop while the interpreter work
runs on `workers` threads. Each worker thread keeps its own `TFLiteModel` per model file (an
interpreter is not thread-safe), so a thousand devices on one model hold `workers`
interpreters, not a thousand. The interpreter releases the GIL while it computes.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from contracts.features import Examples
from contracts.params import decode_params
from contracts.task_config import TaskConfig
from device_runtime.client_task import TaskResult, run_evaluation_task, run_training_task
from device_runtime.example_store import ExampleStore
from device_runtime.local_state import LocalStateStore
from model_runtime.tflite_model import SparseGradient, TFLiteModel


@dataclass(frozen=True)
class TimedResult:
    result: TaskResult
    seconds: float  # wall time of the task on the worker (what a compute tier scales)


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
        self,
        kind: str,
        model_dir: Path,
        store: ExampleStore,
        global_blob: bytes,
        config: TaskConfig,
        should_continue: Callable[[], bool],
        seed: int,
        kept: LocalStateStore | None,
        central: Examples | None,
        central_gradient: SparseGradient | None,
        central_gradient_weight: float,
    ) -> TimedResult:
        started = time.perf_counter()
        model = self._model(model_dir)
        params = decode_params(global_blob, model.manifest.global_params, "global parameters")
        if kind == "training":
            result = run_training_task(
                model,
                store,
                params,
                config,
                should_continue=should_continue,
                seed=seed,
                kept=kept,
                central=central,
                central_gradient=central_gradient,
                weight=central_gradient_weight,
            )
        else:
            result = run_evaluation_task(model, store, params, config, seed=seed, kept=kept)
        return TimedResult(result, time.perf_counter() - started)

    async def run(
        self,
        kind: str,
        model_dir: Path,
        store: ExampleStore,
        global_blob: bytes,
        config: TaskConfig,
        *,
        should_continue: Callable[[], bool] = lambda: True,
        seed: int = 0,
        kept: LocalStateStore | None = None,
        central: Examples | None = None,
        central_gradient: SparseGradient | None = None,
        central_gradient_weight: float = 0.0,
    ) -> TimedResult:
        """A training or evaluation task; `global_blob` is the downloaded safetensors; `kept` is the
        device's local state storage, which a population with `local_state: keep` needs; `central`
        the centralized examples of example transfer (mixed into the update steps only);
        `central_gradient` gradient transfer's, added times `central_gradient_weight` to each step.

        A model that does not load or agree with its manifest raises `ModelLoadError` or
        `ManifestError`, and globals that do not fit it raise `ParamsError`: inputs that came from
        the server, which the caller answers for, not outcomes of the task."""
        if kind not in ("training", "evaluation"):
            raise ValueError(f"task kind must be 'training' or 'evaluation', got {kind!r}")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool,
            self._run,
            kind,
            model_dir,
            store,
            global_blob,
            config,
            should_continue,
            seed,
            kept,
            central,
            central_gradient,
            central_gradient_weight,
        )
