"""Item groups (public catalog metadata, e.g. topics): item embeddings start beside their group's."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from model_export.config import Feedback, ModelConfig

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
