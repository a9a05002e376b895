"""Serving with few examples: the reconstructed locals pulled toward the initial ones by k / (n + k)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from contracts.task_config import TaskConfig
from device_runtime.example_store import Event, ExampleStore
from device_runtime.recommender import Recommender
from device_runtime.serving_shrinkage import shrunk_locals
from model_export.config import ModelConfig
from model_runtime.tflite_model import TFLiteModel
from tests.conftest import IMPLICIT, perturbed_globals

SHARED = [3, 7, 12, 40]


def test_the_pull_is_strength_over_examples_plus_strength() -> None:
    initial = {"u": np.array([1.0, -1.0]), "b": np.array([0.0])}
    fitted = {"u": np.array([3.0, 1.0]), "b": np.array([4.0])}
    half = shrunk_locals(fitted, initial, examples=2, strength=2.0)
    np.testing.assert_allclose(half["u"], [2.0, 0.0])
    np.testing.assert_allclose(half["b"], [2.0])
    assert shrunk_locals(fitted, initial, 5, 0.0) is fitted  # 0: serving as it always did
    many = shrunk_locals(fitted, initial, 10_000, 2.0)
    np.testing.assert_allclose(many["u"], fitted["u"], atol=1e-3)  # a heavy user keeps its own


def test_a_device_serves_its_reconstruction_shrunk_and_trains_as_before(
    export: Callable[[ModelConfig], Path], backend: str, tmp_path: Path
) -> None:
    model = TFLiteModel(export(IMPLICIT), backend=backend)
    store = ExampleStore(tmp_path / "device.sqlite", model.manifest.features)
    store.add(Event({"item": i, "label": 1.0}, float(t)) for t, i in enumerate(SHARED))
    globals_ = perturbed_globals(model.get_global(), seed=5)
    model.reset_local()
    initial = model.get_local()

    def served(config: TaskConfig) -> dict[str, np.ndarray]:
        top = Recommender(model, store, globals_, config).recommend(5)
        assert top.local_params == "reconstructed"
        return model.get_local()  # what it ranked with

    plain = served(TaskConfig(shuffle_seed=None))
    shrunk = served(TaskConfig(shuffle_seed=None, serving_shrinkage=4.0))
    for name, value in plain.items():
        assert not np.allclose(value, initial[name])  # the reconstruction moved
        # Half way: 4 shares against a strength of 4 (the same reconstruction, the same negatives).
        np.testing.assert_allclose(shrunk[name], initial[name] + 0.5 * (value - initial[name]), atol=1e-5)


@pytest.mark.parametrize("bad", [-1.0, 2e6, True])
def test_a_bad_serving_shrinkage_is_refused_in_one_line(bad: object) -> None:
    with pytest.raises(ValueError, match="serving_shrinkage must be") as raised:
        TaskConfig.from_json({"serving_shrinkage": bad})
    assert "\n" not in str(raised.value)
    assert TaskConfig.from_json(TaskConfig(serving_shrinkage=2.0).to_json()).serving_shrinkage == 2.0
