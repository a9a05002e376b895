"""The next-word LSTM: OOV rows local when asked, metrics as the paper counts them, and training
that converts to builtin TFLite ops, lowers the loss under both interpreters and equals TensorFlow.

TensorFlow runs in subprocesses: tflite_runtime cannot load a model in a process that imported it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

from android_sim.datasets import ENV_DATA_DIR
from tests.conftest import ROOT

BUILDER = """
import json
import numpy as np
import tensorflow as tf
from model_export.models.next_word import (
    NextWordConfig, build_next_word_model, next_word_loss, next_word_metrics,
)

out = {}
for name, buckets, local in (("fedavg", 1, False), ("fedrecon_one", 1, True), ("fedrecon_many", 7, True)):
    model = build_next_word_model(NextWordConfig(
        num_global_tokens=13, num_oov_buckets=buckets, oov_local=local, seq_len=4, embedding_dim=6,
        lstm_units=5,
    ))
    out[name] = {
        "local": [v.path for v in model.local_variables],
        "global": [v.path for v in model.global_variables],
        "shapes": {v.path: list(v.shape) for v in model.keras_model.trainable_variables},
        "logits": list(model.keras_model(np.zeros((2, 4), np.int32)).shape),
    }

# 5 global tokens (PAD = 0), 2 OOV buckets (ids 5 and 6).
targets = tf.constant([[3, 5, 6, 4, 0]])
predicted = tf.constant([[3, 5, 4, 6, 1]])
out["metrics"] = {k: float(v) for k, v in next_word_metrics(targets, tf.one_hot(predicted, 7), 5).items()}
out["uniform_loss"] = float(next_word_loss(targets, tf.zeros([1, 5, 7])))
out["padding_loss"] = float(next_word_loss(tf.zeros([1, 5], tf.int32), tf.zeros([1, 5, 7])))
print(json.dumps(out))
"""

OOV_PATHS = ["embedding/oov_embeddings", "oov_output/kernel", "oov_output/bias"]


def test_oov_rows_are_separate_variables_local_only_for_fedrecon_and_metrics_count_as_the_paper() -> None:
    result = subprocess.run(
        [sys.executable, "-c", BUILDER],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(ROOT)},
    )

    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["fedavg"]["local"] == []
    assert sorted(out["fedrecon_one"]["local"]) == sorted(out["fedrecon_many"]["local"]) == sorted(OOV_PATHS)
    assert not set(OOV_PATHS) & set(out["fedrecon_many"]["global"])
    many = out["fedrecon_many"]["shapes"]
    assert many["embedding/oov_embeddings"] == [7, 6] and many["embedding/global_embeddings"] == [13, 6]
    assert many["oov_output/kernel"] == [6, 7] and many["global_output/kernel"] == [6, 13]
    assert out["fedrecon_many"]["logits"] == [2, 4, 20]
    # Targets: a word predicted right, a bucket predicted right, a bucket predicted as a word,
    # a word predicted as a bucket, padding.
    assert out["metrics"]["tokens_sum"] == 4 and out["metrics"]["correct_sum"] == 2
    assert out["metrics"]["in_vocab_tokens_sum"] == 2 and out["metrics"]["correct_in_vocab_sum"] == 1
    # One-hot logits: -log softmax is log(e + 6) - 1 at the predicted class, log(e + 6) elsewhere.
    assert math.isclose(out["metrics"]["loss_sum"], 4 * math.log(math.e + 6) - 2, rel_tol=1e-6)
    assert math.isclose(out["uniform_loss"], math.log(7), rel_tol=1e-6)
    assert out["padding_loss"] == 0.0


def test_training_converts_to_builtins_lowers_the_loss_on_both_interpreters_and_equals_tensorflow(
    tmp_path: Path, tiny_shakespeare: Path
) -> None:
    small = "--vocab-sizes 50 --variants fedrecon_many --many-buckets 4 --calls 3 --steps 3 --seq-len 5 "
    small += "--embedding-dim 8 --lstm-units 8 --batch-size 4 --num-batches 2"

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.nextword_tflite",
            *small.split(),
            "--json",
            str(tmp_path / "f.json"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, ENV_DATA_DIR: str(tiny_shakespeare.parent)},  # the benchmark reads its default
    )

    assert result.returncode == 0, result.stderr[-3000:]
    [figures] = json.loads((tmp_path / "f.json").read_text())
    assert figures["check"]["num_oov_buckets"] == 4 and figures["check"]["oov_local"]
    # Local: the 4 OOV rows of the input embedding (8 wide) and of the output layer (8 + 1 each).
    assert figures["local_floats"] == 4 * 8 + 4 * (8 + 1)
    for runtime in ("tensorflow", "ai_edge_litert", "tflite_runtime"):
        run = figures[runtime]
        losses = run["update_losses"]
        assert run["loss_after"] < run["loss_before"] - 0.2, (runtime, run)
        assert all(later < earlier for earlier, later in pairwise(losses)), (runtime, losses)
        assert run["max_abs_loss_difference_from_tf"] < 1e-4, (runtime, run)
