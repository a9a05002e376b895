"""Every signature of the exported model matches the numpy reference, on both interpreters.

Tolerance: float32 TFLite vs float64 reference, after up to 40 SGD steps: |a - b| <= 2e-5 + 2e-4 |b|.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from contracts.features import Examples
from model_export.config import ModelConfig
from model_export.reference import ReferenceModel
from model_runtime.task_batches import TaskBatches, split_batches
from model_runtime.tflite_model import TFLiteModel
from tests.conftest import BIASED, IMPLICIT, ROBUST, SMALL, perturbed_globals

ATOL, RTOL = 2e-5, 2e-4
# Clipped: a mean near the top of the scale puts predictions above rating_max.
CLIPPED = replace(ROBUST, num_items=110, global_mean_init=4.9, clip_predictions=True)
# Group tables: the item's group is looked up inside the signatures at the task rows' catalog ids
# (groups out of id order, so that a slot taken for an id gives another group).
GROUPED = replace(
    IMPLICIT,
    num_items=140,
    item_groups=tuple(int(g) for g in np.random.default_rng(0).integers(0, 5, 140)),
    group_embeddings=True,
    group_bias=True,
    group_rate=0.3,
)
CONFIGS = {
    "small": SMALL,
    "biased": BIASED,
    "robust": ROBUST,
    "clipped": CLIPPED,
    "implicit": IMPLICIT,
    "grouped": GROUPED,
}


def random_examples(config: ModelConfig, count: int, seed: int) -> Examples:
    rng = np.random.default_rng(seed)
    # Repeated items inside a batch exercise gradient accumulation on one row.
    items = rng.integers(0, min(config.num_items, 3 * count // 2 + 1), count)
    if config.feedback.value == "implicit":
        labels = rng.integers(0, 2, count).astype(np.float32)
    else:
        labels = rng.integers(1, 6, count).astype(np.float32)
    return Examples({"item": items, "label": labels})


def reference_batches(batches: list[Examples]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    return [(b["item"], b["label"].astype(np.float64), np.ones(b.num_examples)) for b in batches]


def setup_pair(model_dir: Path, backend: str, seed: int) -> tuple[TFLiteModel, ReferenceModel]:
    model = TFLiteModel(model_dir, backend=backend)
    rng = np.random.default_rng(seed)
    globals_ = perturbed_globals(model.get_global(), seed)
    locals_ = {k: rng.normal(0, 0.2, v.shape).astype(np.float32) for k, v in model.get_local().items()}
    model.set_global(globals_)
    model.set_local(locals_)
    config = model.manifest.config
    huber_delta = float(config.get("huber_delta", 0.0))
    clip = None
    if config.get("clip_predictions"):
        clip = (float(config["rating_min"]), float(config["rating_max"]))
    groups = np.asarray(config["item_groups"]) if config.get("item_groups") else None
    return model, ReferenceModel(
        config["feedback"], globals_, locals_, huber_delta, clip, groups, float(config.get("group_rate", 1.0))
    )


def assert_close(actual: np.ndarray | float, expected: np.ndarray | float) -> None:
    np.testing.assert_allclose(actual, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", list(CONFIGS))
# counts: a partial last batch; all batches full; fewer batches than steps (cycling)
@pytest.mark.parametrize("count", [7, 24, 37])
def test_reconstruct_matches_reference(
    export: Callable[[ModelConfig], Path], backend: str, name: str, count: int
) -> None:
    config = CONFIGS[name]
    model, ref = setup_pair(export(config), backend, seed=count)
    batches = split_batches(random_examples(config, count, seed=count), config.batch_size)[
        : config.max_batches
    ]

    loss = model.reconstruct(TaskBatches.pack(batches, model.manifest), 23, 0.07, 0.01)
    ref_loss = ref.reconstruct(reference_batches(batches), 23, 0.07, 0.01)

    assert_close(loss, ref_loss)
    for k, v in model.get_local().items():
        assert_close(v, ref.local_params[k])
    for k, v in model.get_global().items():  # frozen during reconstruction
        assert_close(v, ref.global_params[k])


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize(
    ("local_lr", "l2_global", "l2_local"), [(0.0, 0.0, 0.0), (0.0, 0.05, 0.0), (0.03, 0.02, 0.01)]
)
def test_update_matches_reference(
    export: Callable[[ModelConfig], Path],
    backend: str,
    name: str,
    local_lr: float,
    l2_global: float,
    l2_local: float,
) -> None:
    config = CONFIGS[name]
    model, ref = setup_pair(export(config), backend, seed=5)
    batches = split_batches(random_examples(config, 19, seed=6), config.batch_size)
    before = model.get_global()

    update = model.update(
        TaskBatches.pack(batches, model.manifest),
        11,
        0.05,
        local_learning_rate=local_lr,
        l2_global=l2_global,
        l2_local=l2_local,
    )
    delta, loss = update.delta, update.loss
    ref_delta, ref_loss = ref.update(reference_batches(batches), 11, 0.05, local_lr, l2_global, l2_local)

    assert_close(loss, ref_loss)
    assert set(delta) == set(ref_delta)
    for k in delta:
        assert delta[k].shape == ref_delta[k].shape
        assert_close(delta[k], ref_delta[k])
    assert_close(update.max_abs_change, max(np.abs(v).max() for v in ref_delta.values()))
    for k, v in model.get_local().items():  # frozen unless local_lr > 0
        assert_close(v, ref.local_params[k])
    for k, v in model.get_global().items():  # the signature returns the delta, the model is unchanged
        np.testing.assert_array_equal(v, before[k])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_evaluate_matches_reference(export: Callable[[ModelConfig], Path], backend: str, name: str) -> None:
    config = CONFIGS[name]
    model, ref = setup_pair(export(config), backend, seed=9)
    batches = split_batches(random_examples(config, 3 * config.batch_size - 1, seed=10), config.batch_size)

    sums = model.evaluate(TaskBatches.pack(batches, model.manifest)).as_dict()
    ref_sums = ref.evaluate(reference_batches(batches))

    for k in ref_sums:
        assert_close(sums[k], ref_sums[k])
    if config.clip_predictions:  # the case clips something: unclipped, the error would be larger
        unclipped = replace(ref, prediction_range=None).evaluate(reference_batches(batches))
        assert unclipped["squared_error_sum"] > ref_sums["squared_error_sum"] + 1e-3
    assert sums["weight_sum"] == 3 * config.batch_size - 1  # padding carries no weight


@pytest.mark.parametrize("name", list(CONFIGS))
def test_infer_matches_reference_and_honours_exclusions(
    export: Callable[[ModelConfig], Path], backend: str, name: str
) -> None:
    config = CONFIGS[name]
    model, ref = setup_pair(export(config), backend, seed=11)
    expected = ref.all_scores()
    best = np.argsort(-expected)
    exclude = np.zeros(config.num_items, dtype=bool)
    exclude[best[:3]] = True

    ranking = model.infer(exclude)

    assert_close(ranking.scores, expected)
    np.testing.assert_array_equal(ranking.top_items[:5], best[3:8])
    assert_close(ranking.top_scores[:5], expected[best[3:8]])


def test_zero_steps_and_empty_batches_change_nothing(
    export: Callable[[ModelConfig], Path], backend: str
) -> None:
    model, _ = setup_pair(export(BIASED), backend, seed=12)
    local = model.get_local()
    empty = TaskBatches.pack([], model.manifest)

    assert model.reconstruct(empty, 50, 0.1) == 0.0
    update = model.update(empty, 50, 0.5)

    assert update.loss == 0.0
    assert all(not np.any(v) for v in update.delta.values())
    for k, v in model.get_local().items():
        np.testing.assert_array_equal(v, local[k])


def test_reset_local_zeroes_the_local_parameters(export: Callable[[ModelConfig], Path], backend: str) -> None:
    model, _ = setup_pair(export(BIASED), backend, seed=13)
    assert any(np.any(v) for v in model.get_local().values())

    model.reset_local()

    assert all(not np.any(v) for v in model.get_local().values())
