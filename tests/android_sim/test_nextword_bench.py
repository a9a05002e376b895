"""The next-word benchmark's methods on the tiny exported model: FedAvg ships the OOV rows every
round, FedRecon keeps them on the device; held-out accuracies are token ratios."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from android_sim.bench.federated import Rounds
from android_sim.bench.nextword import Method, run_method
from android_sim.shakespeare import NextWordData, next_word_data, read_roles
from model_runtime.tflite_model import TFLiteModel
from tests.conftest import NEXT_WORD_SIZES

VOCAB = int(NEXT_WORD_SIZES["num_global_tokens"]) - 3  # PAD, BOS, EOS
BUCKETS = int(NEXT_WORD_SIZES["num_oov_buckets"])


@pytest.fixture(scope="module")
def data() -> NextWordData:
    return next_word_data(read_roles(), VOCAB, BUCKETS, seq_len=int(NEXT_WORD_SIZES["seq_len"]))


def test_fedavg_communicates_the_oov_rows_and_fedrecon_does_not(
    next_word_model: Path, data: NextWordData
) -> None:
    # Prepare
    manifest = TFLiteModel(next_word_model).manifest
    rounds = Rounds(rounds=2, clients_per_round=4, evaluate_every=2)

    # Execute
    fedavg = run_method(data, next_word_model, Method("FedAvg", BUCKETS, False), rounds, 1, VOCAB)
    fedrecon = run_method(data, next_word_model, Method("FedRecon", BUCKETS, True, True), rounds, 1, VOCAB)

    # Assert: download + upload of float32 parameters; the OOV rows only in FedAvg's
    global_bytes = 4 * sum(math.prod(p.shape) for p in manifest.global_params)
    local_bytes = 4 * sum(math.prod(p.shape) for p in manifest.local_params)
    assert fedrecon.bytes_per_round == 2 * global_bytes
    assert fedavg.bytes_per_round == 2 * (global_bytes + local_bytes)
    for row in (fedavg, fedrecon):
        assert 0.0 <= row.accuracy_without_oov <= 1.0
        assert 0.0 <= row.accuracy_with_oov <= 1.0
