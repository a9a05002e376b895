"""Task setting `reconstruction_negatives`: the support set (reconstruction, in training rounds and
in serving) gets its own count of sampled negatives a share; the query (the update) keeps
`negatives_per_positive`; unset, both use `negatives_per_positive` as before."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from contracts.features import Examples
from contracts.task_config import SplitPolicy, TaskConfig
from device_runtime.example_store import Event, ExampleStore
from device_runtime.task_examples import prepare
from model_export.config import ModelConfig
from model_runtime.tflite_model import TFLiteModel
from tests.conftest import IMPLICIT

SHARED = [3, 10, 11, 40, 41]


def labels(batches: list[Examples], features: object) -> tuple[int, int, set[int]]:
    mixed = Examples.concat(batches, features)  # type: ignore[arg-type]
    positive = mixed["label"] > 0
    return int(positive.sum()), int((~positive).sum()), set(mixed["item"][~positive].tolist())


@pytest.mark.parametrize("split", [SplitPolicy.REUSE, SplitPolicy.ALTERNATE])
def test_support_and_query_get_their_own_counts(
    export: Callable[[ModelConfig], Path], tmp_path: Path, split: SplitPolicy
) -> None:
    manifest = TFLiteModel(export(IMPLICIT)).manifest
    store = ExampleStore(tmp_path / "device.sqlite", manifest.features)
    store.add(Event({"item": i, "label": 1.0}, float(t)) for t, i in enumerate(SHARED))
    task = TaskConfig(negatives_per_positive=2, reconstruction_negatives=6, split=split)

    data = prepare(store, manifest, task, seed=0)
    same = prepare(store, manifest, TaskConfig(negatives_per_positive=2, split=split), seed=0)

    shares, negatives, drawn = labels(data.support, manifest.features)
    assert negatives == 6 * shares and not drawn & set(SHARED)
    shares, negatives, drawn = labels(data.query, manifest.features)
    # Alternating batches split shares and negatives at random; reusing, the query has them all.
    assert not drawn & set(SHARED) and (split is SplitPolicy.ALTERNATE or negatives == 2 * shares)
    # Unset: the support keeps the update's count, and the query is the same either way.
    if split is SplitPolicy.REUSE:
        shares, negatives, _ = labels(same.support, manifest.features)
        assert negatives == 2 * shares
    for a, b in zip(data.query, same.query, strict=True):
        np.testing.assert_array_equal(a["item"], b["item"])


def test_bad_values_are_refused_in_one_line_and_round_trip() -> None:
    for bad in (-1, 101, 2.5, True, "8"):
        with pytest.raises(ValueError, match="reconstruction_negatives must be") as raised:
            TaskConfig.from_json({"reconstruction_negatives": bad})
        assert "\n" not in str(raised.value)
    config = TaskConfig(reconstruction_negatives=16)
    assert TaskConfig.from_json(config.to_json()) == config
    assert TaskConfig.from_json(TaskConfig().to_json()).reconstruction_negatives is None
