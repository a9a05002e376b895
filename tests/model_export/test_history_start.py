"""`history_start`: the reconstruction starts the user vector at the scaled mean of the shared
items' vectors (`model_export.local_start`), under both device interpreters and in the numpy
reference; without shares it starts where `reset_local` puts it. A bad `LocalStart` is an
export error (`export_cases`, `test_keras_export`)."""

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
from tests.conftest import BIASED, IMPLICIT, perturbed_globals

GROUPS = tuple(int(g) for g in np.random.default_rng(1).integers(0, 4, 90))
GROUPED = replace(
    IMPLICIT,
    num_items=90,
    user_bias=False,
    item_groups=GROUPS,
    group_embeddings=True,
    group_bias=True,
    group_rate=0.3,
    history_start=1.5,
)
TOPICS_ONLY = replace(GROUPED, history_start=2.0, history_start_groups=True)
ITEMS_ONLY = replace(IMPLICIT, num_items=90, history_start=0.8)  # no groups; a user bias beside
CONTRAST = replace(GROUPED, history_start_contrast=True)  # minus the negatives' mean
CONFIGS = {"grouped": GROUPED, "topics_only": TOPICS_ONLY, "items_only": ITEMS_ONLY, "contrast": CONTRAST}


def examples(config: ModelConfig, count: int, seed: int) -> Examples:
    rng = np.random.default_rng(seed)
    items = rng.integers(0, config.num_items, count)
    labels = (rng.random(count) < 0.3).astype(np.float32)  # a few shares among negatives
    return Examples({"item": items, "label": labels})


def pair(model_dir: Path, backend: str, config: ModelConfig) -> tuple[TFLiteModel, ReferenceModel]:
    model = TFLiteModel(model_dir, backend=backend)
    globals_ = perturbed_globals(model.get_global(), 3)
    model.set_global(globals_)
    model.reset_local()
    groups = np.asarray(config.item_groups) if config.item_groups else None
    ref = ReferenceModel(
        "implicit",
        globals_,
        model.get_local(),
        item_groups=groups,
        group_rate=config.group_rate,
        history_start=config.history_start,
        history_start_groups=config.history_start_groups,
        history_start_contrast=config.history_start_contrast,
    )
    return model, ref


def batches_of(config: ModelConfig, found: Examples) -> list[Examples]:
    return split_batches(found, config.batch_size)[: config.max_batches]


def reference_batches(batches: list[Examples]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    return [(b["item"], b["label"].astype(np.float64), np.ones(b.num_examples)) for b in batches]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_start_is_the_scaled_mean_of_the_shared_items_vectors(
    export: Callable[[ModelConfig], Path], backend: str, name: str
) -> None:
    config = CONFIGS[name]
    model, _ = pair(export(config), backend, config)
    found = examples(config, 29, seed=4)
    model.reconstruct(TaskBatches.pack(batches_of(config, found), model.manifest), 0, 0.1, 0.0)

    g = model.get_global()
    shared = found["item"][found["label"] > 0]
    scale = np.sqrt(config.group_rate)
    if config.history_start_groups:
        vectors = scale * g["group_embeddings"][np.asarray(GROUPS)[shared]]
    else:
        vectors = g["item_embeddings"][shared]
        if config.group_embeddings:
            vectors = vectors + scale * g["group_embeddings"][np.asarray(GROUPS)[shared]]
    expected = vectors.mean(axis=0)
    if config.history_start_contrast:
        others = found["item"][found["label"] == 0]
        expected = expected - (
            g["item_embeddings"][others] + scale * g["group_embeddings"][np.asarray(GROUPS)[others]]
        ).mean(axis=0)
    local = model.get_local()
    np.testing.assert_allclose(local["user_embedding"], config.history_start * expected, rtol=1e-5, atol=1e-6)
    if "user_bias" in local:  # only the named local starts from the history
        np.testing.assert_array_equal(local["user_bias"], [0.0])


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("count", [6, 37])  # one partial batch; more batches than steps cycle
def test_reconstruction_from_the_start_matches_the_reference(
    export: Callable[[ModelConfig], Path], backend: str, name: str, count: int
) -> None:
    config = CONFIGS[name]
    model, ref = pair(export(config), backend, config)
    batches = batches_of(config, examples(config, count, seed=count))
    if not any(b["label"].any() for b in batches):
        batches[0] = Examples(
            {"item": batches[0]["item"], "label": np.ones(batches[0].num_examples, np.float32)}
        )

    loss = model.reconstruct(TaskBatches.pack(batches, model.manifest), 13, 0.07, 0.01)
    ref_loss = ref.reconstruct(reference_batches(batches), 13, 0.07, 0.01)

    np.testing.assert_allclose(loss, ref_loss, atol=2e-5, rtol=2e-4)
    for k, v in model.get_local().items():
        np.testing.assert_allclose(v, ref.local_params[k], atol=2e-5, rtol=2e-4)


def test_without_shares_the_start_is_the_reset_value(
    export: Callable[[ModelConfig], Path], backend: str
) -> None:
    model, _ = pair(export(GROUPED), backend, GROUPED)
    negatives = Examples({"item": np.arange(10), "label": np.zeros(10, np.float32)})
    model.reconstruct(TaskBatches.pack(batches_of(GROUPED, negatives), model.manifest), 0, 0.1, 0.0)
    np.testing.assert_array_equal(model.get_local()["user_embedding"], np.zeros(GROUPED.embedding_dim))


def test_off_the_reconstruction_starts_from_the_reset_value(
    export: Callable[[ModelConfig], Path], backend: str
) -> None:
    plain = replace(GROUPED, history_start=0.0)
    model, _ = pair(export(plain), backend, plain)
    found = examples(plain, 29, seed=4)
    model.reconstruct(TaskBatches.pack(batches_of(plain, found), model.manifest), 0, 0.1, 0.0)
    np.testing.assert_array_equal(model.get_local()["user_embedding"], np.zeros(plain.embedding_dim))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"history_start": -1.0}, "history_start must be finite and >= 0"),
        ({"history_start": float("inf")}, "history_start must be finite and >= 0"),
        (
            {"history_start": 0.0, "history_start_contrast": True},
            "history_start_contrast needs history_start > 0",
        ),
        (
            {"history_start_groups": True, "group_embeddings": False},
            "history_start_groups needs group_embeddings",
        ),
    ],
)
def test_bad_history_start_is_refused(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match="invalid model config") as raised:
        ModelConfig(**{**GROUPED.__dict__, **change})
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_history_start_needs_implicit_feedback() -> None:
    with pytest.raises(ValueError, match="history_start applies to implicit feedback only"):
        replace(BIASED, history_start=1.0)
