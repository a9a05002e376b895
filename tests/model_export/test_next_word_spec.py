"""The next-word model exported through `--model model_export.models.next_word:build` trains
under the device runtime: real Shakespeare windows, the real TFLite interpreter.

Exported once per session at tiny sizes (`tests.conftest.NEXT_WORD_SIZES`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from android_sim.shakespeare import Vocabulary, read_roles, role_examples
from contracts.features import Examples
from model_runtime.task_batches import TaskBatches, split_batches
from model_runtime.tflite_model import TFLiteModel
from tests.conftest import NEXT_WORD_SIZES

NUM_GLOBAL_TOKENS = int(NEXT_WORD_SIZES["num_global_tokens"])
OOV_BUCKETS = int(NEXT_WORD_SIZES["num_oov_buckets"])
SEQ_LEN = int(NEXT_WORD_SIZES["seq_len"])


@pytest.fixture(scope="module")
def windows(tiny_shakespeare: Path) -> Examples:
    """Twelve windows of the most talkative role, 47 words (+ PAD, BOS, EOS) global."""
    roles = read_roles(tiny_shakespeare)
    vocabulary = Vocabulary.build(roles, NUM_GLOBAL_TOKENS - 3, OOV_BUCKETS)
    role = max(roles, key=lambda r: r.num_examples(SEQ_LEN))
    columns = role_examples(role, vocabulary, SEQ_LEN)
    return Examples({k: v[:12] for k, v in columns.items()})


def test_manifest_declares_local_oov_rows_and_classification_over_all_tokens(next_word_model: Path) -> None:
    # Execute
    manifest = TFLiteModel(next_word_model).manifest

    # Assert: the OOV rows stay on the device; the vocabulary's rows and the LSTM are global
    assert {p.name for p in manifest.local_params} == {
        "embedding_oov_embeddings",
        "oov_output_kernel",
        "oov_output_bias",
    }
    assert "embedding_global_embeddings" in {p.name for p in manifest.global_params}
    assert manifest.task.kind == "classification"
    assert manifest.task.num_classes == NUM_GLOBAL_TOKENS + OOV_BUCKETS


def test_reconstruct_update_and_evaluate_lower_the_loss_and_count_tokens(
    next_word_model: Path, windows: Examples
) -> None:
    # Prepare
    model = TFLiteModel(next_word_model)
    batches = TaskBatches.pack(split_batches(windows, model.manifest.batch_size), model.manifest)
    targets = windows["targets"]
    before = model.evaluate(batches).sums

    # Execute: reconstruct the local OOV rows, then five rounds of a global update applied
    model.reconstruct(batches, num_steps=5, learning_rate=0.5)
    reconstructed = model.evaluate(batches).sums
    for _ in range(5):
        update = model.update(batches, num_steps=3, learning_rate=0.5)
        model.set_global({k: v + update.delta[k] for k, v in model.get_global().items()})
    trained = model.evaluate(batches).sums

    # Assert: token counts as the paper counts them, and both steps lower the loss
    tokens = int(np.count_nonzero(targets))
    in_vocab = int(np.count_nonzero((targets > 0) & (targets < NUM_GLOBAL_TOKENS)))
    assert 0 < in_vocab < tokens  # the role says words outside the 47
    for sums in (before, reconstructed, trained):
        assert sums["tokens_sum"] == tokens
        assert sums["in_vocab_tokens_sum"] == in_vocab
        assert 0 <= sums["correct_in_vocab_tokens_sum"] <= sums["correct_tokens_sum"] <= tokens
    assert reconstructed["loss_sum"] < before["loss_sum"]
    assert trained["loss_sum"] < 0.9 * reconstructed["loss_sum"]
    assert trained["correct_tokens_sum"] > before["correct_tokens_sum"]
