"""Negatives drawn by popularity (task setting `negative_popularity`): the drawn distribution is
exp(p x item bias) among the items the user never shared, the device's task and the server's
central training draw them so, and ranking adds p x item bias back (the logQ correction)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from contracts.features import Examples
from contracts.task_config import SplitPolicy, TaskConfig
from device_runtime.example_store import Event, ExampleStore
from device_runtime.recommender import Recommender
from device_runtime.task_examples import prepare
from model_export.config import ModelConfig
from model_runtime.support_query import add_negatives, logq_correction, negative_weights
from model_runtime.tflite_model import TFLiteModel
from orchestrator.populations.central_training import pseudo_user_batches
from tests.conftest import BIASED, IMPLICIT

SHARED = [3, 10, 11, 40]


def biased_globals(model: TFLiteModel, seed: int = 0) -> dict[str, np.ndarray]:
    params = {k: v.copy() for k, v in model.get_global().items()}
    params["item_bias"] = (
        np.random.default_rng(seed).normal(0.0, 1.0, params["item_bias"].shape).astype(np.float32)
    )
    return params


def shares_of(items: list[int]) -> Examples:
    return Examples({"item": np.asarray(items, np.int32), "label": np.ones(len(items), np.float32)})


def test_weights_are_exp_of_p_times_the_bias_and_uniform_at_zero(
    export: Callable[[ModelConfig], Path],
) -> None:
    model = TFLiteModel(export(IMPLICIT))
    params = biased_globals(model)
    task = TaskConfig(negative_popularity=2.0)

    weights = negative_weights(model.manifest, task, params)

    assert weights is not None
    expected = np.exp(2.0 * params["item_bias"].astype(np.float64))
    np.testing.assert_allclose(weights, expected / expected.sum(), rtol=1e-9)
    correction = logq_correction(model.manifest, task, params)
    assert correction is not None
    np.testing.assert_allclose(correction, 2.0 * params["item_bias"])
    assert negative_weights(model.manifest, TaskConfig(), params) is None
    assert logq_correction(model.manifest, TaskConfig(), params) is None
    # The largest p on biases far apart: no overflow, every weight finite, the top item almost all.
    params["item_bias"][7] = 30.0
    extreme = negative_weights(model.manifest, TaskConfig(negative_popularity=10.0), params)
    assert extreme is not None and np.all(np.isfinite(extreme)) and extreme[7] > 0.999


def test_drawn_negatives_follow_the_weights_and_avoid_the_shares(
    export: Callable[[ModelConfig], Path],
) -> None:
    model = TFLiteModel(export(IMPLICIT))
    manifest = model.manifest
    params = biased_globals(model, seed=1)
    weights = negative_weights(manifest, TaskConfig(negative_popularity=1.5), params)
    assert weights is not None
    rng = np.random.default_rng(0)
    counts = np.zeros(manifest.catalog_size)
    draws = 0
    for _ in range(400):
        mixed = add_negatives(shares_of(SHARED), manifest, 8, rng, also_shared=np.array([5]), weights=weights)
        negatives = mixed["item"][mixed["label"] == 0]
        assert len(negatives) == 8 * len(SHARED)
        np.add.at(counts, negatives, 1)
        draws += len(negatives)
    never = [*SHARED, 5]
    assert counts[never].sum() == 0
    expected = weights.copy()
    expected[never] = 0.0
    expected = expected / expected.sum() * draws
    # Pearson's chi-square over the items expected at least 5 times: far below the 0.1% critical
    # value for a correct sampler, far above it for a uniform one.
    enough = expected >= 5
    chi2 = float(((counts[enough] - expected[enough]) ** 2 / expected[enough]).sum())
    dof = int(enough.sum()) - 1
    assert chi2 < dof + 4.0 * np.sqrt(2 * dof), (chi2, dof)
    uniform = np.where(
        np.isin(np.arange(manifest.catalog_size), never), 0.0, draws / (manifest.catalog_size - 5)
    )
    assert float((((counts - uniform) ** 2 / np.maximum(uniform, 1e-9))[enough]).sum()) > 5 * dof


def test_the_device_task_and_the_server_draw_by_the_globals(
    export: Callable[[ModelConfig], Path], tmp_path: Path
) -> None:
    model = TFLiteModel(export(IMPLICIT))
    manifest = model.manifest
    params = {k: v.copy() for k, v in model.get_global().items()}
    params["item_bias"][:] = 0.0
    params["item_bias"][77] = 3.0  # e^30 times likelier than any other item at p = 10
    task = TaskConfig(negative_popularity=10.0, negatives_per_positive=4, split=SplitPolicy.REUSE)
    weights = negative_weights(manifest, task, params)
    store = ExampleStore(tmp_path / "device.sqlite", manifest.features)
    store.add(Event({"item": i, "label": 1.0}, float(t)) for t, i in enumerate(SHARED))

    device = prepare(store, manifest, task, seed=0, weights=weights)
    server_support, _ = pseudo_user_batches(
        manifest, shares_of(SHARED), task, np.random.default_rng(0), weights
    )
    uniform = prepare(store, manifest, replace(task, negative_popularity=0.0), seed=0)

    for batches in (device.support, server_support):
        mixed = Examples.concat(batches, manifest.features)
        assert set(mixed["item"][mixed["label"] == 0].tolist()) == {77}
    plain = Examples.concat(uniform.support, manifest.features)
    assert len(set(plain["item"][plain["label"] == 0].tolist())) == 4 * len(SHARED)


def test_ranking_adds_p_times_the_bias_back(
    export: Callable[[ModelConfig], Path], backend: str, tmp_path: Path
) -> None:
    model = TFLiteModel(export(IMPLICIT), backend=backend)
    params = biased_globals(model, seed=2)
    store = ExampleStore(tmp_path / "device.sqlite", model.manifest.features)
    store.add(Event({"item": i, "label": 1.0}, float(t)) for t, i in enumerate(SHARED))
    task = TaskConfig.from_manifest(model.manifest, shuffle_seed=None, negative_popularity=3.0)

    top = Recommender(model, store, params, task).recommend(10)

    # The same locals, the model's own logits, then + 3 x bias: what the ranking must be.
    logits = model.infer().scores.astype(np.float64) + 3.0 * params["item_bias"]
    logits[SHARED] = -np.inf
    assert top.items.tolist() == np.argsort(-logits, kind="stable")[:10].tolist()
    np.testing.assert_allclose(top.scores, logits[top.items], rtol=1e-5)
    plain = model.infer(np.isin(np.arange(model.manifest.catalog_size), SHARED))
    assert not np.allclose(top.scores, plain.top_scores[:10])  # the correction is there


def test_a_model_without_popularity_draws_uniformly(export: Callable[[ModelConfig], Path]) -> None:
    model = TFLiteModel(export(BIASED))  # ratings: no negatives at all
    assert negative_weights(model.manifest, TaskConfig(negative_popularity=2.0), model.get_global()) is None


@pytest.mark.parametrize("value", [-0.5, 10.5, float("nan")])
def test_out_of_range_values_are_refused(value: float) -> None:
    with pytest.raises(ValueError, match="negative_popularity"):
        TaskConfig(negative_popularity=value)
