"""The next-word benchmark's methods on the tiny exported model: FedAvg ships the OOV rows every
round, FedRecon keeps them on the device; held-out accuracies are token ratios."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from android_sim.shakespeare import NextWordData, RoleSplit, Vocabulary, next_word_data, read_roles
from android_sim.simulation.rounds import Rounds
from benchmarks.nextword_ceiling import train_centrally
from benchmarks.nextword_study import (
    CEILING,
    Method,
    ModelShape,
    Row,
    most_frequent_baseline,
    pack,
    run_ceiling,
    run_methods,
    share_of_the_way,
    table,
    task_config,
)
from contracts.features import Examples
from model_runtime.tflite_model import TFLiteModel
from tests.conftest import NEXT_WORD_SIZES

VOCAB = int(NEXT_WORD_SIZES["num_global_tokens"]) - 3  # PAD, BOS, EOS
BUCKETS = int(NEXT_WORD_SIZES["num_oov_buckets"])


@pytest.fixture(scope="module")
def data(tiny_shakespeare: Path) -> NextWordData:
    return next_word_data(
        read_roles(tiny_shakespeare), VOCAB, BUCKETS, seq_len=int(NEXT_WORD_SIZES["seq_len"])
    )


def test_fedavg_communicates_the_oov_rows_and_fedrecon_does_not(
    next_word_model: Path, data: NextWordData
) -> None:
    # Prepare
    manifest = TFLiteModel(next_word_model).manifest
    rounds = Rounds(rounds=2, clients_per_round=4, evaluate_every=2)

    # Execute
    (fedavg,) = run_methods(data, next_word_model, [Method("FedAvg", BUCKETS, False)], rounds, 1, VOCAB)
    (fedrecon,) = run_methods(
        data, next_word_model, [Method("FedRecon", BUCKETS, True, True)], rounds, 1, VOCAB
    )

    # Assert: download + upload of float32 parameters; the OOV rows only in FedAvg's
    global_bytes = 4 * sum(math.prod(p.shape) for p in manifest.global_params)
    local_bytes = 4 * sum(math.prod(p.shape) for p in manifest.local_params)
    assert fedrecon.bytes_per_round == 2 * global_bytes
    assert fedavg.bytes_per_round == 2 * (global_bytes + local_bytes)
    for row in (fedavg, fedrecon):
        assert 0.0 <= row.accuracy_without_oov <= 1.0
        assert 0.0 <= row.accuracy_with_oov <= 1.0


def test_rows_carry_the_most_frequent_token_baseline_of_their_data(
    next_word_model: Path, data: NextWordData
) -> None:
    # Prepare
    manifest = TFLiteModel(next_word_model).manifest
    rounds = Rounds(rounds=1, clients_per_round=2, evaluate_every=1)

    # Execute
    rows = run_methods(data, next_word_model, [Method("FedRecon", BUCKETS, True)], rounds, 1, VOCAB)

    # Assert
    assert rows[0].baseline == most_frequent_baseline(data, manifest.batch_size * manifest.max_batches)


def test_a_method_and_its_fine_tuned_variant_share_one_training(
    next_word_model: Path, data: NextWordData
) -> None:
    # Prepare
    rounds = Rounds(rounds=2, clients_per_round=4, evaluate_every=2)
    plain, tuned = Method("FedRecon", BUCKETS, True), Method("FedRecon + fine-tuning", BUCKETS, True, True)

    # Execute
    together = run_methods(data, next_word_model, [plain, tuned], rounds, 1, VOCAB)
    alone = run_methods(data, next_word_model, [plain], rounds, 1, VOCAB)

    # Assert: the same rounds train the same globals, so the plain row does not depend on its company
    assert [r.method for r in together] == ["FedRecon", "FedRecon + fine-tuning"]
    assert together[0].accuracy_without_oov == alone[0].accuracy_without_oov
    assert together[0].accuracy_with_oov == alone[0].accuracy_with_oov


def test_methods_that_train_differently_are_refused(next_word_model: Path, data: NextWordData) -> None:
    # Prepare
    rounds = Rounds(rounds=1, clients_per_round=1, evaluate_every=1)
    mixed = [Method("FedRecon", BUCKETS, True), Method("FedAvg", BUCKETS, False)]

    # Execute / Assert
    with pytest.raises(ValueError, match="train differently"):
        run_methods(data, next_word_model, mixed, rounds, 1, VOCAB)


def _data(train_targets: list[list[int]], test_targets: list[list[int]]) -> NextWordData:
    """Two words `a` (id 3) and `b` (id 4), one OOV bucket (id 5); targets are what counts."""

    def role(targets: list[list[int]]) -> dict[str, np.ndarray]:
        array = np.asarray(targets, np.int32)
        return {"tokens": np.zeros_like(array), "targets": array}

    return NextWordData(
        Vocabulary(("a", "b"), 1), 3, RoleSplit([], [], []), [role(train_targets)], [], [role(test_targets)]
    )


def test_baseline_predicts_the_training_roles_most_frequent_token_on_the_scored_newer_half() -> None:
    # Prepare: training targets mostly `a`; the held-out role's older half (2 windows) is not scored
    data = _data([[3, 3, 3], [4, 2, 0]], [[3, 3, 3], [3, 3, 3], [3, 5, 0], [4, 3, 2]])

    # Execute
    all_scored = most_frequent_baseline(data, windows_per_task=8)
    first_scored = most_frequent_baseline(data, windows_per_task=1)

    # Assert: newer half's targets 3 5 | 4 3 2 (padding left out); `a` is right 2 of 4 in-vocabulary
    # targets and 2 of 5 with the OOV one; only the first window [3 5] when a task reads one
    assert all_scored == (0.5, 0.4)
    assert first_scored == (1.0, 0.5)


def test_baseline_with_oov_predicts_a_bucket_when_it_is_the_most_frequent_target() -> None:
    # Prepare: the bucket (5) is the most frequent training target, `b` (4) the most frequent word
    data = _data([[5, 5, 5], [5, 4, 4]], [[3, 3, 3], [5, 4, 3]])

    # Execute
    without, with_oov = most_frequent_baseline(data, windows_per_task=8)

    # Assert: without OOV the floor predicts `b` (a bucket would never be right there)
    assert without == 0.5
    assert with_oov == pytest.approx(1 / 3)


def test_task_epochs_become_steps_over_every_batch_uncapped() -> None:
    # Execute: 12 x 8 steps would exceed TaskConfig's default cap of 50
    task = task_config(0.7, 0.2, update_epochs=12, reconstruction_epochs=3, max_batches=8)

    # Assert
    assert (task.update_learning_rate, task.reconstruction_learning_rate) == (0.7, 0.2)
    assert (task.update_max_epochs, task.update_max_steps) == (12, 96)
    assert (task.reconstruction_max_epochs, task.reconstruction_max_steps) == (3, 24)
    with pytest.raises(ValueError, match="update epochs is 0; expected at least 1"):
        task_config(0.7, 0.2, update_epochs=0, reconstruction_epochs=1, max_batches=8)


def test_model_shape_passes_only_the_sizes_given_and_refuses_non_positive_ones() -> None:
    # Execute
    shape = ModelShape(embedding_dim=16, max_batches=4)

    # Assert
    assert shape.builder_args() == {"embedding_dim": 16, "max_batches": 4}
    assert ModelShape().builder_args() == {}
    with pytest.raises(ValueError, match="lstm_units is 0; expected at least 1"):
        ModelShape(lstm_units=0)


def test_the_ceiling_trains_the_same_network_centrally_and_fits_its_training_windows(
    next_word_model: Path, data: NextWordData
) -> None:
    # Prepare: a few training roles, so that three epochs run in seconds
    small = replace(data, train=data.train[:6], test=data.test[:5])
    model = TFLiteModel(next_word_model)
    manifest = model.manifest
    pooled = pack(
        Examples.concat([Examples(dict(r)) for r in small.train], manifest.features).columns, manifest
    )
    model.reset_local()
    before = model.evaluate(pooled).metrics()["loss"]

    # Execute
    params, _ = train_centrally(model, small, epochs=3, learning_rate=1.0)
    row = run_ceiling(small, next_word_model, 1, VOCAB, epochs=2)

    # Assert: the pooled windows' loss fell, and the row is scored with its interval around it
    model.set_global(params)
    assert model.evaluate(pooled).metrics()["loss"] < before
    assert row.method == CEILING
    assert row.interval_without_oov[0] <= row.accuracy_without_oov <= row.interval_without_oov[1]
    assert row.interval_with_oov[0] <= row.accuracy_with_oov <= row.interval_with_oov[1]
    with pytest.raises(ValueError, match="epochs"):
        train_centrally(model, small, epochs=0)


def test_share_of_the_way_is_zero_at_the_floor_and_one_at_the_ceiling() -> None:
    def row(accuracy: float) -> Row:
        return Row(1000, "m", accuracy, 0.0, 0, 0.0, (0.06, 0.05))

    top = row(0.16)
    assert share_of_the_way(row(0.06), top) == pytest.approx(0.0)
    assert share_of_the_way(row(0.11), top) == pytest.approx(0.5)
    assert share_of_the_way(top, top) == pytest.approx(1.0)
    assert "share of the way" in table([row(0.11), replace(top, method=CEILING)])
