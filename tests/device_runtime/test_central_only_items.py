"""`task_config.central_only_items`: catalog rows only the centralized data holds. A device never
draws them as negatives for its own shares (support, query, serving's reconstruction); example
transfer's centralized examples still contrast against them; bad lists are refused in one line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from contracts.features import Examples
from contracts.task_config import MAX_CENTRAL_ONLY_ITEMS, SplitPolicy, TaskConfig
from device_runtime.example_store import Event, ExampleStore
from device_runtime.task_examples import prepare, with_central
from model_export.config import ModelConfig
from model_runtime.support_query import not_negatives
from model_runtime.tflite_model import TFLiteModel
from tests.conftest import IMPLICIT

SHARED = [3, 10, 11, 40, 90]
# Half the catalog: a sampler that ignored the list would draw from it in almost every batch.
CENTRAL_ONLY = tuple(range(50, 125))


def test_the_list_round_trips_sorted_and_distinct_and_bad_lists_are_refused_in_one_line() -> None:
    task = TaskConfig.from_json({"central_only_items": [7, 2, 7]})
    assert task.central_only_items == (2, 7)
    assert TaskConfig.from_json(task.to_json()) == task
    assert task.to_json()["central_only_items"] == [2, 7]
    assert TaskConfig().central_only_items == () and not_negatives(TaskConfig()) is None
    for bad in ([-1], [1.5], ["3"], [True], 3, [2**40], list(range(MAX_CENTRAL_ONLY_ITEMS + 1))):
        with pytest.raises(ValueError, match="central_only_items") as refused:
            TaskConfig.from_json({"central_only_items": bad})
        assert "\n" not in str(refused.value)


def test_the_device_never_draws_them_for_its_own_shares(
    export: Callable[[ModelConfig], Path], tmp_path: Path
) -> None:
    model = TFLiteModel(export(IMPLICIT))
    manifest = model.manifest
    task = TaskConfig(
        negatives_per_positive=8,
        reconstruction_negatives=4,
        split=SplitPolicy.REUSE,
        central_only_items=CENTRAL_ONLY,
    )
    store = ExampleStore(tmp_path / "device.sqlite", manifest.features)
    store.add(Event({"item": i, "label": 1.0}, float(t)) for t, i in enumerate(SHARED))

    drawn: set[int] = set()
    for seed in range(20):
        data = prepare(store, manifest, task, seed=seed)
        for batches in (data.support, data.query):
            mixed = Examples.concat(batches, manifest.features)
            drawn |= set(mixed["item"][mixed["label"] == 0].tolist())
    assert drawn and not drawn & set(CENTRAL_ONLY)
    assert not drawn & set(SHARED)
    # Without the list the same device draws them (the test would catch a sampler that ignores it).
    plain = prepare(store, manifest, TaskConfig(negatives_per_positive=8, split=SplitPolicy.REUSE), seed=0)
    joined = Examples.concat(plain.query, manifest.features)
    assert set(joined["item"][joined["label"] == 0].tolist()) & set(CENTRAL_ONLY)


def test_transferred_centralized_examples_still_contrast_against_them(
    export: Callable[[ModelConfig], Path], tmp_path: Path
) -> None:
    model = TFLiteModel(export(IMPLICIT))
    manifest = model.manifest
    task = TaskConfig(negatives_per_positive=8, split=SplitPolicy.REUSE, central_only_items=CENTRAL_ONLY)
    store = ExampleStore(tmp_path / "device.sqlite", manifest.features)
    store.add(Event({"item": i, "label": 1.0}, float(t)) for t, i in enumerate(SHARED))
    own = prepare(store, manifest, task, seed=0)
    central = Examples({"item": np.array([60, 61, 62], np.int32), "label": np.ones(3, np.float32)})

    mixed = Examples.concat(with_central(own.query, central, manifest, task, seed=0), manifest.features)

    negatives = mixed["item"][mixed["label"] == 0]
    own_negatives = Examples.concat(own.query, manifest.features)
    assert len(negatives) == int((own_negatives["label"] == 0).sum()) + 8 * 3
    assert set(negatives.tolist()) & set(CENTRAL_ONLY)  # drawn for the centralized shares
    assert not set(negatives.tolist()) & set(SHARED)


def test_a_device_whose_own_examples_fill_the_call_still_mixes_in_half_a_call(
    export: Callable[[ModelConfig], Path], tmp_path: Path
) -> None:
    model = TFLiteModel(export(IMPLICIT))
    manifest = model.manifest
    task = TaskConfig(negatives_per_positive=4, split=SplitPolicy.REUSE, max_examples=1000)
    store = ExampleStore(tmp_path / "device.sqlite", manifest.features)
    store.add(Event({"item": i, "label": 1.0}, float(i)) for i in range(60))
    own = prepare(store, manifest, task, seed=0)
    assert sum(b.num_examples for b in own.query) == manifest.max_examples  # the call is full
    central = Examples({"item": np.arange(100, 140, dtype=np.int32), "label": np.ones(40, np.float32)})

    mixed = Examples.concat(with_central(own.query, central, manifest, task, seed=0), manifest.features)

    assert mixed.num_examples == manifest.max_examples
    from_central = np.isin(mixed["item"], central["item"]) & (mixed["label"] > 0)
    assert from_central.sum() == manifest.max_examples // 2 // 5
