"""Example transfer on the device: centralized examples train the update, never the weight."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from contracts.features import Examples
from contracts.task_config import TaskConfig
from device_runtime.client_task import Outcome, Task, run_training_task
from device_runtime.example_store import Event, ExampleStore
from device_runtime.task_environment import Environment
from model_export.config import ModelConfig
from model_runtime.tflite_model import TFLiteModel
from tests.conftest import BIASED, IMPLICIT, perturbed_globals


@pytest.mark.parametrize("config", [BIASED, IMPLICIT], ids=["explicit", "implicit"])
def test_central_examples_change_the_update_and_not_the_reported_weight(
    export: Callable[[ModelConfig], Path], tmp_path: Path, config: ModelConfig
) -> None:
    # Prepare: a device whose examples use items 0-19; centralized examples of items 100-109
    # (e.g. new expressions no device holds yet).
    model = TFLiteModel(export(config))
    label = model.manifest.label_features[0]
    assert label.value_range is not None
    high = float(label.value_range[1])
    store = ExampleStore(tmp_path / "device.sqlite", model.manifest.features)
    rng = np.random.default_rng(0)
    store.add(Event({"item": int(i), "label": high}, float(t)) for t, i in enumerate(rng.integers(0, 20, 24)))
    new_items = np.arange(100, 110, dtype=np.int32)
    central = Examples({"item": new_items, "label": np.full(10, high, np.float32)})
    globals_ = perturbed_globals(model.get_global(), seed=1)
    task = TaskConfig.from_manifest(model.manifest)

    # Execute
    plain = run_training_task(model, Environment.of(store), globals_, Task(task, seed=5))
    mixed = run_training_task(model, Environment.of(store), globals_, Task(task, seed=5, central=central))

    # Assert
    assert plain.outcome is mixed.outcome is Outcome.COMPLETED, (plain.message, mixed.message)
    assert mixed.num_examples == plain.num_examples  # the weight counts the device's own examples
    assert mixed.metrics.keys() == plain.metrics.keys()
    assert mixed.metrics["num_examples"] == plain.metrics["num_examples"] == 24
    items = mixed.delta["item_embeddings"]  # type: ignore[index]
    before = plain.delta["item_embeddings"]  # type: ignore[index]
    if not model.manifest.task.negative_sampling:  # (sampled negatives may touch any item)
        assert not np.any(before[new_items])
    changed = np.any(items[new_items] != before[new_items], axis=1)
    # Every transferred item trains, as far as one update call has room for them (with implicit
    # labels each brings its sampled negatives).
    assert changed.all() if not model.manifest.task.negative_sampling else changed.sum() >= 3
    assert store.count() == 24  # nothing was written to the store


def test_example_transfer_is_refused_with_kept_local_state(
    export: Callable[[ModelConfig], Path], tmp_path: Path
) -> None:
    model = TFLiteModel(export(BIASED))
    store = ExampleStore(tmp_path / "device.sqlite", model.manifest.features)
    store.add(Event({"item": i, "label": 4.0}, float(i)) for i in range(10))
    task = TaskConfig.from_json(
        {
            **TaskConfig.from_manifest(model.manifest).to_json(),
            "local_state": "keep",
            "local_learning_rate": 0.1,
        }
    )
    central = Examples({"item": np.arange(3, dtype=np.int32), "label": np.full(3, 4.0, np.float32)})

    result = run_training_task(model, Environment.of(store), model.get_global(), Task(task, central=central))

    assert result.outcome is Outcome.ERROR and "example transfer" in result.message
