"""Item groups (public catalog metadata, e.g. topics): item embeddings start beside their group's,
or the model has a global embedding and bias per group that every item's score uses."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from contracts.features import Examples
from contracts.manifest import load_manifest
from model_export.config import Feedback, ModelConfig
from model_runtime.task_batches import TaskBatches, split_batches
from model_runtime.tflite_model import TFLiteModel

GROUPS = tuple(i % 4 for i in range(120))
GROUPED = ModelConfig(
    num_items=120,
    embedding_dim=16,
    batch_size=4,
    max_batches=8,
    top_k=10,
    feedback=Feedback.IMPLICIT,
    item_bias=True,
    item_groups=GROUPS,
    group_init_scale=0.5,
)


def initial_items(model_dir: Path) -> np.ndarray:
    return load_file(str(model_dir / "global_params.safetensors"))["item_embeddings"]


def test_items_start_at_their_groups_direction(export: Callable[[ModelConfig], Path]) -> None:
    items = initial_items(export(GROUPED))
    groups = np.asarray(GROUPS)

    means = np.stack([items[groups == g].mean(axis=0) for g in range(4)])
    # Each group's mean is its direction times the scale (the N(0, 0.1) noise averages out
    # over 30 items), and the four directions are distinct.
    assert np.allclose(np.linalg.norm(means, axis=1), 0.5, atol=0.1)
    unit = means / np.linalg.norm(means, axis=1, keepdims=True)
    cosines = items @ unit.T / np.linalg.norm(items, axis=1, keepdims=True)
    assert np.mean(cosines[np.arange(len(groups)), groups]) > 0.6
    assert np.mean(np.argmax(cosines, axis=1) == groups) > 0.9


def test_without_groups_items_are_noise_only(export: Callable[[ModelConfig], Path]) -> None:
    plain = ModelConfig(**{**GROUPED.__dict__, "item_groups": ()})
    items = initial_items(export(plain))

    groups = np.asarray(GROUPS)
    means = np.stack([items[groups == g].mean(axis=0) for g in range(4)])
    assert np.all(np.linalg.norm(means, axis=1) < 0.15)


def test_groups_survive_the_config_round_trip() -> None:
    data = json.loads(json.dumps(GROUPED.to_json()))

    assert data["item_groups"] == list(GROUPS)
    assert ModelConfig.from_json(data) == GROUPED


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"item_groups": (0, 1)}, "item_groups must give one group per item (120), got 2"),
        ({"item_groups": (-1,) * 120}, "item_groups must be integers >= 0"),
        ({"group_init_scale": float("nan")}, "group_init_scale must be finite and >= 0"),
    ],
)
def test_bad_groups_are_refused_in_one_line(changes: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match="invalid model config") as raised:
        ModelConfig(**{**GROUPED.__dict__, **changes})

    assert says in str(raised.value)
    assert "\n" not in str(raised.value)


# The group tables: dense globals looked up by each item's group inside the model.
SHARED = ModelConfig(**{**GROUPED.__dict__, "group_embeddings": True, "group_bias": True, "group_rate": 0.25})


def test_group_tables_are_dense_globals_the_group_directions_start(
    export: Callable[[ModelConfig], Path],
) -> None:
    model_dir = export(SHARED)
    manifest = load_manifest(model_dir)
    initial = load_file(str(model_dir / "global_params.safetensors"))

    specs = {s.name: (s.shape, s.row_sparse) for s in manifest.global_params}
    assert specs["group_embeddings"] == ((4, 16), None)
    assert specs["group_bias"] == ((4,), None)
    # The training signatures take the catalog ids of the task's item rows, to look groups up at.
    assert manifest.task_row_features == ("item",)
    for signature in ("reconstruct", "update", "evaluate", "gradient"):
        spec = manifest.signatures[signature]["inputs"]["item_task_rows"]
        assert (spec.shape, spec.dtype) == ((SHARED.max_examples,), "int32")
    # The directions start the group table (stored over sqrt(group_rate): its values are 0.5
    # long), and the items are noise only.
    assert np.allclose(np.linalg.norm(initial["group_embeddings"], axis=1) * 0.5, 0.5, atol=1e-5)
    groups = np.asarray(GROUPS)
    means = np.stack([initial["item_embeddings"][groups == g].mean(axis=0) for g in range(4)])
    assert np.all(np.linalg.norm(means, axis=1) < 0.15)


def test_an_item_no_task_used_moves_with_its_group(export: Callable[[ModelConfig], Path]) -> None:
    """One device's update on items of group 0 changes the score of every item of group 0 (its
    group's embedding and bias moved), and of no item of the other groups."""
    model = TFLiteModel(export(SHARED))
    shared = [i for i in range(0, 40, 4)]  # group 0
    examples = Examples({"item": np.array(shared), "label": np.ones(len(shared), np.float32)})
    batches = TaskBatches.pack(split_batches(examples, SHARED.batch_size), model.manifest)
    model.reconstruct(batches, 20, 0.5)
    before = model.infer().scores
    update = model.update(batches, 5, 0.5)
    model.set_global({k: v + update.delta[k] for k, v in model.get_global().items()})

    change = model.infer().scores - before
    groups = np.asarray(GROUPS)
    untouched = (groups == 0) & ~np.isin(np.arange(120), shared)
    assert np.all(change[untouched] > 1e-3)
    assert np.allclose(change[groups != 0], 0.0)


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"item_groups": (), "group_embeddings": True}, "group_embeddings needs item_groups"),
        ({"item_groups": (), "group_bias": True}, "group_bias needs item_groups"),
        ({"group_rate": 0.0}, "group_rate must be finite and > 0"),
        ({"group_bias": 1}, "group_bias must be true or false"),
    ],
)
def test_bad_group_tables_are_refused_in_one_line(changes: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match="invalid model config") as raised:
        ModelConfig(**{**GROUPED.__dict__, **changes})

    assert says in str(raised.value)
    assert "\n" not in str(raised.value)
