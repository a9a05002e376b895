"""Mixing centralized data: attaching a strategy and dataset, and what each strategy changes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from contracts.features import Examples
from contracts.manifest import Manifest, load_manifest
from contracts.mixing import encode_examples
from model_export.config import ModelConfig
from tests.conftest import BIASED
from tests.orchestrator.conftest import ADMIN_TOKEN, Server, admin_create_population

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def central_examples(manifest: Manifest, count: int, seed: int = 0) -> Examples:
    """`count` examples that fit the manifest's feature spec (values drawn inside each range)."""
    rng = np.random.default_rng(seed)
    columns: dict[str, np.ndarray] = {}
    for f in manifest.features:
        low, high = f.value_range if f.value_range is not None else (0.0, 1.0)
        if f.dtype == "int32":
            columns[f.name] = rng.integers(int(low), int(high) + 1, size=(count, *f.shape)).astype(np.int32)
        else:
            values = rng.uniform(low, high, size=(count, *f.shape))
            columns[f.name] = (np.round(values) if f.discrete else values).astype(np.float32)
    return Examples(columns)


def attach(url: str, name: str, mixing: Any, examples: bytes | None) -> httpx.Response:
    files = {"examples": ("examples.safetensors", examples)} if examples is not None else None
    return httpx.put(
        f"{url}/v1/admin/populations/{name}/mixing",
        data={"mixing": json.dumps(mixing)},
        files=files,
        headers=ADMIN,
        timeout=30,
    )


def test_attaching_bad_mixing_is_a_4xx_that_says_why_and_changes_nothing(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    # Prepare: a population with a valid dataset attached under parallel training.
    model_dir = export(BIASED)
    manifest = load_manifest(model_dir)
    assert admin_create_population(server.url, model_dir, "p", "{}").status_code == 201
    good = encode_examples(central_examples(manifest, 40), manifest.features)
    first = attach(server.url, "p", {"strategy": "parallel_training", "weight": 0.3}, good)
    assert first.status_code == 200, first.text
    before = httpx.get(f"{server.url}/v1/admin/populations/p/mixing", headers=ADMIN, timeout=10).json()
    assert before["num_examples"] == 40 and before["mixing"]["weight"] == 0.3

    item = next(f for f in manifest.features if f.tables)
    outside = central_examples(manifest, 5)
    outside = Examples({**outside.columns, item.name: outside[item.name] + int(item.value_range[1]) + 1})  # type: ignore[index]
    missing = Examples({k: v for k, v in central_examples(manifest, 5).columns.items() if k != item.name})
    cases = {
        "outside": ({"strategy": "example_transfer"}, encode_examples(outside, manifest.features), "outside"),
        "missing": (
            {"strategy": "example_transfer"},
            encode_examples(missing, [f for f in manifest.features if f.name != item.name]),
            "missing",
        ),
        "not safetensors": ({"strategy": "example_transfer"}, b"\x00" * 64, "safetensors"),
        "unknown strategy": ({"strategy": "telepathy"}, good, "strategy must be one of"),
        "alpha above 1": ({"strategy": "parallel_training", "weight": 1.5}, good, "weight"),
        "negative alpha": ({"strategy": "parallel_training", "weight": -0.1}, good, "weight"),
        "unknown setting": ({"strategy": "parallel_training", "alfa": 0.1}, good, "unknown mixing settings"),
        "too many per assignment": (
            {"strategy": "example_transfer", "examples_per_assignment": 10_000},
            good,
            "examples_per_assignment",
        ),
        "no gradient signature": ({"strategy": "gradient_transfer"}, good, "not yet available"),
    }
    for case, (mixing, blob, expected) in cases.items():
        # Execute
        answer = attach(server.url, "p", mixing, blob)
        # Assert
        assert answer.status_code == 422, (case, answer.text)
        assert expected in answer.json()["detail"], (case, answer.json())
    after = httpx.get(f"{server.url}/v1/admin/populations/p/mixing", headers=ADMIN, timeout=10).json()
    assert after == before
    unknown = attach(server.url, "nobody", {"strategy": "none"}, None)
    assert unknown.status_code == 404
