"""Gradient transfer (Augenstein et al., Algorithm 4), the model side: the exported MF model's
`gradient` signature and an `update` with a central gradient match the numpy reference on both
interpreters; weight 0 is exactly the plain update; rows only the central gradient touches move
by -learning_rate * weight * g per step, also beyond one call's row capacity.

Tolerance as in test_reference_equality: |a - b| <= 2e-5 + 2e-4 |b|.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from contracts.features import Examples
from contracts.manifest import Manifest, load_manifest
from contracts.params import ParamsError, SparseTensor, sparse_rows
from model_export.config import ModelConfig
from model_runtime.task_batches import TaskBatches, split_batches
from tests.conftest import BIASED, IMPLICIT
from tests.model_export.test_reference_equality import (
    assert_close,
    random_examples,
    reference_batches,
    setup_pair,
)

CONFIGS = {"biased": BIASED, "implicit": IMPLICIT}


def central_gradient(config: ModelConfig, rows: list[int], seed: int) -> dict[str, np.ndarray]:
    """A dense central gradient, nonzero on `rows` of the per-item globals and on the rest whole."""
    rng = np.random.default_rng(seed)
    dense = {"item_embeddings": np.zeros((config.num_items, config.embedding_dim))}
    dense["item_embeddings"][rows] = rng.normal(0, 1, (len(rows), config.embedding_dim))
    if config.item_bias:
        dense["item_bias"] = np.zeros(config.num_items)
        dense["item_bias"][rows] = rng.normal(0, 1, len(rows))
    if config.global_mean:
        dense["global_mean"] = rng.normal(0, 1, 1)
    return dense


def as_sent(dense: dict[str, np.ndarray]) -> dict[str, SparseTensor]:
    return {k: sparse_rows(v.astype(np.float32)) for k, v in dense.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gradient_matches_reference(export: Callable[[ModelConfig], Path], backend: str, name: str) -> None:
    config = CONFIGS[name]
    model, ref = setup_pair(export(config), backend, seed=3)
    batches = split_batches(random_examples(config, 2 * config.batch_size + 3, seed=4), config.batch_size)

    result = model.gradient(TaskBatches.pack(batches, model.manifest))
    expected, loss = ref.gradient(reference_batches(batches))

    assert_close(result.loss, loss)
    assert result.weight_sum == 2 * config.batch_size + 3  # padding carries no weight
    for k, g in result.gradient.items():
        assert_close(g.dense(), expected[k])
    used = np.unique(np.concatenate([b["item"] for b in batches]))
    np.testing.assert_array_equal(result.gradient["item_embeddings"].rows, used)  # the batches' rows only


@pytest.mark.parametrize("name", list(CONFIGS))
def test_update_with_a_central_gradient_matches_reference(
    export: Callable[[ModelConfig], Path], backend: str, name: str
) -> None:
    config = CONFIGS[name]
    model, ref = setup_pair(export(config), backend, seed=5)
    batches = split_batches(random_examples(config, 19, seed=6), config.batch_size)
    # Rows 0-2 are likely the examples' own; the last two no example uses.
    central = central_gradient(config, [0, 1, 2, config.num_items - 2, config.num_items - 1], seed=7)

    update = model.update_rows(
        TaskBatches.pack(batches, model.manifest),
        11,
        0.05,
        l2_global=0.02,
        central_gradient=as_sent(central),
        central_gradient_weight=0.8,
    )
    expected, loss = ref.update(
        reference_batches(batches),
        11,
        0.05,
        0.0,
        0.02,
        0.0,
        central_gradient=central,
        central_gradient_weight=0.8,
    )

    assert_close(update.loss, loss)
    used = np.unique(np.concatenate([b["item"] for b in batches]))
    rows = np.union1d(used, [0, 1, 2, config.num_items - 2, config.num_items - 1])
    np.testing.assert_array_equal(update.rows["item_embeddings"], rows)  # the union of both row sets
    for k, delta in update.delta.items():
        assert_close(delta, expected[k][update.rows[k]] if k in update.rows else expected[k])


def test_weight_zero_is_exactly_the_plain_update(export: Callable[[ModelConfig], Path], backend: str) -> None:
    model, _ = setup_pair(export(BIASED), backend, seed=8)
    packed = TaskBatches.pack(
        split_batches(random_examples(BIASED, 23, seed=9), BIASED.batch_size), model.manifest
    )
    central = as_sent(central_gradient(BIASED, [3, 150, 199], seed=10))

    plain = model.update_rows(packed, 13, 0.1, l2_global=0.01)
    zero = model.update_rows(
        packed, 13, 0.1, l2_global=0.01, central_gradient=central, central_gradient_weight=0.0
    )

    assert plain.loss == zero.loss
    for k in plain.delta:
        np.testing.assert_array_equal(zero.delta[k], plain.delta[k])
    for k in plain.rows:
        np.testing.assert_array_equal(zero.rows[k], plain.rows[k])  # no rows added either


@pytest.mark.parametrize("overflow", [False, True])
def test_rows_only_the_central_gradient_touches_move_by_rate_times_weight_times_g(
    export: Callable[[ModelConfig], Path], backend: str, overflow: bool
) -> None:
    config = BIASED
    model, _ = setup_pair(export(config), backend, seed=11)
    examples = Examples({"item": np.arange(10), "label": np.full(10, 4.0, np.float32)})
    packed = TaskBatches.pack(split_batches(examples, config.batch_size), model.manifest)
    # Beyond one call's capacity (max_rows = 40 here), the rows no example uses are moved outside it.
    new_items = list(range(100, 100 + (60 if overflow else 12)))
    dense = central_gradient(config, new_items, seed=12)
    steps, rate, weight = 7, 0.05, 0.6

    update = model.update_rows(
        packed, steps, rate, central_gradient=as_sent(dense), central_gradient_weight=weight
    )

    rows = update.rows["item_embeddings"]
    np.testing.assert_array_equal(rows, np.concatenate([np.arange(10), new_items]))
    moved = update.delta["item_embeddings"][10:]
    assert_close(moved, -steps * rate * weight * dense["item_embeddings"][new_items])
    assert_close(update.delta["item_bias"][10:], -steps * rate * weight * dense["item_bias"][new_items])
    assert np.all(np.abs(update.delta["item_embeddings"][:10]).sum(axis=1) > 0)  # the device's own rows train


def test_a_central_gradient_that_does_not_fit_the_model_is_refused(
    export: Callable[[ModelConfig], Path],
) -> None:
    model, _ = setup_pair(export(BIASED), "ai_edge_litert", seed=13)
    packed = TaskBatches.pack(
        split_batches(random_examples(BIASED, 9, seed=14), BIASED.batch_size), model.manifest
    )
    good = as_sent(central_gradient(BIASED, [1, 2], seed=15))
    wrong_shape = {"item_bias": SparseTensor((7,), np.array([1]), np.ones(1, np.float32))}
    not_finite = {**good, "global_mean": SparseTensor((1,), np.array([0]), np.array([np.nan], np.float32))}

    with pytest.raises(ParamsError, match=r"unknown globals \['user_embedding'\]"):
        model.update_rows(
            packed,
            3,
            0.1,
            central_gradient={**good, "user_embedding": good["item_bias"]},
            central_gradient_weight=1.0,
        )
    with pytest.raises(ParamsError, match=r"'item_bias' has shape \[7\], the global is \[200\]"):
        model.update_rows(packed, 3, 0.1, central_gradient=wrong_shape, central_gradient_weight=1.0)
    with pytest.raises(ParamsError, match="'global_mean' has non-finite values"):
        model.update_rows(packed, 3, 0.1, central_gradient=not_finite, central_gradient_weight=1.0)
    with pytest.raises(ValueError, match="central_gradient_weight must be a finite number"):
        model.update_rows(packed, 3, 0.1, central_gradient=good, central_gradient_weight=float("inf"))


def test_widening_the_task_rows_keeps_each_example_on_its_row(export: Callable[[ModelConfig], Path]) -> None:
    manifest = load_manifest(export(BIASED))
    examples = Examples({"item": np.array([7, 3, 7, 50, 3, 9]), "label": np.ones(6, np.float32)})
    packed = TaskBatches.pack(split_batches(examples, BIASED.batch_size), manifest)

    widened = packed.with_rows({"item": np.array([1, 8, 60])}, manifest)

    np.testing.assert_array_equal(widened.used_rows("item"), [1, 3, 7, 8, 9, 50, 60])
    real = widened.weights > 0
    np.testing.assert_array_equal(widened.rows["item"][widened.features["item"][real]], examples["item"])
    with pytest.raises(ValueError, match=r"41 task rows of 'item' .* at most 40"):
        packed.with_rows({"item": np.arange(100, 137)}, manifest)


def test_a_manifest_exported_before_gradient_transfer_still_loads(
    export: Callable[[ModelConfig], Path],
) -> None:
    data = json.loads((export(BIASED) / "manifest.json").read_text())
    del data["signatures"]["gradient"]
    data["signatures"]["update"]["inputs"] = [
        s
        for s in data["signatures"]["update"]["inputs"]
        if not s["name"].endswith("_central_gradient") and s["name"] != "central_gradient_weight"
    ]

    old = Manifest.from_json(data)

    assert not old.takes_central_gradient
    assert "item_embeddings_central_gradient" not in old.training_inputs("update")


def test_a_curious_server_still_finds_the_devices_own_rows_in_a_report_with_a_central_gradient(
    export: Callable[[ModelConfig], Path],
) -> None:
    # Attack: the server knows what it sent (g, weight) and the task (steps, rate). Every report row
    # the device's examples do not use moved by exactly -steps * rate * weight * g; the others are
    # the device's items. Gradient transfer hides nothing of the row set (and adds nothing: the
    # extra rows are the server's own numbers).
    model, _ = setup_pair(export(BIASED), "ai_edge_litert", seed=16)
    own = np.array([4, 17, 23, 61, 62])
    examples = Examples({"item": np.repeat(own, 2), "label": np.full(10, 3.0, np.float32)})
    packed = TaskBatches.pack(split_batches(examples, BIASED.batch_size), model.manifest)
    sent = as_sent(central_gradient(BIASED, [4, 23, 90, 120, 121, 180], seed=17))
    steps, rate, weight = 9, 0.05, 0.5

    report = model.update_rows(packed, steps, rate, central_gradient=sent, central_gradient_weight=weight)

    rows = report.rows["item_embeddings"]
    server_side = -steps * rate * weight * sent["item_embeddings"].dense()[rows]
    differs = np.abs(report.delta["item_embeddings"] - server_side).max(axis=1) > 1e-5
    np.testing.assert_array_equal(rows[differs], own)
