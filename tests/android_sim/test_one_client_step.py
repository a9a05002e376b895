"""The device and the fast simulation run one FedRecon client step: the same delta, bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from android_sim.simulation.protocol import PROTOCOL_SEED, support_query
from android_sim.simulation.rounds import fedrecon_task, per_item_names
from contracts.task_config import TaskConfig
from device_runtime.client_task import Outcome, Task, TaskResult, run_training_task
from device_runtime.example_store import Event, ExampleStore
from device_runtime.fedrecon_step import delta_norm
from device_runtime.task_environment import Environment, Selection
from device_runtime.task_examples import prepare
from model_export.config import ModelConfig
from model_runtime.task_batches import TaskBatches
from model_runtime.tflite_model import TFLiteModel
from tests.conftest import BIASED, IMPLICIT, perturbed_globals


def _device(
    export: Callable[[ModelConfig], Path], config: ModelConfig, tmp_path: Path
) -> tuple[TFLiteModel, ExampleStore]:
    model = TFLiteModel(export(config))
    store = ExampleStore(tmp_path / "device.sqlite", model.manifest.features)
    rng = np.random.default_rng(3)
    implicit = config.feedback.value == "implicit"
    items = rng.choice(config.num_items, 60, replace=False)
    labels = np.ones(60) if implicit else rng.integers(1, 6, 60)
    store.add(
        Event({"item": int(i), "label": float(r)}, float(t))
        for t, (i, r) in enumerate(zip(items, labels, strict=True))
    )
    return model, store


def _sim_delta(
    model: TFLiteModel,
    params: dict[str, np.ndarray],
    support: TaskBatches,
    query: TaskBatches,
    task: TaskConfig,
) -> tuple[dict[str, np.ndarray], float]:
    """The simulation's report of the step, as dense tensors, and its weight."""
    model.set_global(params)  # what the simulation's thread does once a round
    report = fedrecon_task(model, params, support, query, task, per_item_names(model.manifest))
    assert report is not None
    sparse, weight = report
    return {name: tensor.dense() for name, tensor in sparse.items()}, weight


def _assert_same(device: TaskResult, sim: tuple[dict[str, np.ndarray], float]) -> None:
    assert device.outcome is Outcome.COMPLETED, device.message
    assert device.delta is not None
    delta, weight = sim
    assert device.num_examples == weight
    assert set(device.delta) == set(delta)
    for name, value in device.delta.items():
        assert value.dtype == delta[name].dtype and np.array_equal(value, delta[name]), name
    assert any(np.any(v) for v in delta.values())


@pytest.mark.parametrize("clipped", [False, True])
def test_the_device_and_the_simulation_report_the_same_delta_from_the_same_examples(
    export: Callable[[ModelConfig], Path], tmp_path: Path, clipped: bool
) -> None:
    model, store = _device(export, BIASED, tmp_path)
    params = perturbed_globals(model.get_global(), seed=1)
    task = TaskConfig.from_manifest(model.manifest, shuffle_seed=PROTOCOL_SEED)
    if clipped:
        unclipped = run_training_task(model, Environment.of(store), params, Task(task)).delta
        assert unclipped is not None
        task = TaskConfig.from_manifest(
            model.manifest, shuffle_seed=PROTOCOL_SEED, clip_norm=delta_norm(unclipped) / 3
        )

    on_device = run_training_task(model, Environment.of(store), params, Task(task))
    # The simulation packs a user's newest-first examples by the protocol, once.
    packed = support_query(store.examples(Selection()), model.manifest, task)
    in_simulation = _sim_delta(model, params, packed.support, packed.query, task)

    _assert_same(on_device, in_simulation)
    if clipped:
        assert delta_norm(in_simulation[0]) <= task.clip_norm  # type: ignore[operator]


def test_with_sampled_negatives_the_same_batches_give_the_same_delta(
    export: Callable[[ModelConfig], Path], tmp_path: Path
) -> None:
    model, store = _device(export, IMPLICIT, tmp_path)
    params = perturbed_globals(model.get_global(), seed=2)
    unclipped = run_training_task(
        model, Environment.of(store), params, Task(TaskConfig.from_manifest(model.manifest), seed=5)
    ).delta
    assert unclipped is not None
    task = TaskConfig.from_manifest(model.manifest, clip_norm=delta_norm(unclipped) / 3)

    on_device = run_training_task(model, Environment.of(store), params, Task(task, seed=5))
    data = prepare(store, model.manifest, task, seed=5)
    support, query = (TaskBatches.pack(part, model.manifest) for part in (data.support, data.query))
    in_simulation = _sim_delta(model, params, support, query, task)

    _assert_same(on_device, in_simulation)
