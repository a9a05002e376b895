"""A model without local variables (plain FedAvg on the user's model): exported without local
signatures, and every device task trains or measures all its examples, under both interpreters."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from contracts.manifest import LOCAL_SIGNATURES, MANIFEST_FILE, Manifest, ManifestError
from contracts.task_config import TaskConfig
from device_runtime.client_task import Outcome, Task, run_evaluation_task, run_training_task
from device_runtime.example_store import Event, ExampleStore
from device_runtime.task_environment import Environment
from model_runtime.tflite_model import TFLiteModel
from tests.conftest import NEXT_WORD_SIZES

TOKENS = int(NEXT_WORD_SIZES["num_global_tokens"]) + int(NEXT_WORD_SIZES["num_oov_buckets"])
SEQ_LEN = int(NEXT_WORD_SIZES["seq_len"])


def store_of(path: Path, model: TFLiteModel, windows: int) -> ExampleStore:
    rng = np.random.default_rng(0)
    store = ExampleStore(path, model.manifest.features)
    store.add(
        Event({"tokens": rng.integers(1, TOKENS, SEQ_LEN), "targets": rng.integers(1, TOKENS, SEQ_LEN)}, t)
        for t in range(windows)
    )
    return store


def test_the_export_has_no_local_parameters_nor_local_signatures(next_word_fedavg_model: Path) -> None:
    manifest = TFLiteModel(next_word_fedavg_model).manifest

    assert manifest.local_params == ()
    assert "embedding_oov_embeddings" in {p.name for p in manifest.global_params}
    assert not set(LOCAL_SIGNATURES) & set(manifest.signatures)


def test_a_manifest_with_local_parameters_still_needs_its_local_signatures(next_word_model: Path) -> None:
    data = json.loads((next_word_model / MANIFEST_FILE).read_text())
    del data["signatures"]["get_local"]

    with pytest.raises(ManifestError, match=r"lacks required signatures \['get_local'\]"):
        Manifest.from_json(data)


def test_a_training_task_updates_on_every_example_and_reports_no_reconstruction(
    next_word_fedavg_model: Path, backend: str, tmp_path: Path
) -> None:
    # Prepare: 10 windows; batches of 4, at most 3 per call: 10 examples fit one call
    model = TFLiteModel(next_word_fedavg_model, backend=backend)
    store = store_of(tmp_path / "device.sqlite", model, 10)
    initial = model.get_global()

    # Execute
    trained = run_training_task(
        model, Environment.of(store), initial, Task(TaskConfig(update_learning_rate=0.5), seed=1)
    )
    evaluated = run_evaluation_task(model, Environment.of(store), initial, Task(TaskConfig()))

    # Assert: no support set, every example in the update and in the evaluation; the OOV rows are
    # global here, so they are in the delta
    assert trained.outcome is Outcome.COMPLETED, trained.message
    assert trained.num_examples == 10 and trained.metrics["num_support"] == 0
    assert "reconstruction_loss" not in trained.metrics
    assert trained.delta is not None and np.abs(trained.delta["embedding_oov_embeddings"]).max() > 0
    assert evaluated.outcome is Outcome.COMPLETED, evaluated.message
    assert evaluated.metrics["weight_sum"] == 10
    assert evaluated.metrics["tokens_sum"] == 10 * SEQ_LEN
    assert model.get_local() == {}
    with pytest.raises(ValueError, match="no local parameters to reconstruct"):
        model.reconstruct(None, 1, 0.1)  # type: ignore[arg-type]
