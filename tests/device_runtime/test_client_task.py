"""A device's part of a round: outcomes, the split policies, and the maths against the reference."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from contracts.params import SparseTensor
from contracts.task_config import SplitPolicy, TaskConfig
from device_runtime.client_task import Outcome, Task, run_evaluation_task, run_training_task
from device_runtime.example_store import Event, ExampleStore
from device_runtime.fedrecon_step import clip_delta, delta_norm
from device_runtime.task_environment import Environment
from device_runtime.task_examples import prepare
from model_export.config import ModelConfig
from model_export.reference import ReferenceModel
from model_runtime.support_query import reconstruct_locals
from model_runtime.task_batches import TaskBatches
from model_runtime.tflite_model import TFLiteModel
from tests.conftest import IMPLICIT, MOVIELENS, perturbed_globals

UserData = list[tuple[np.ndarray, np.ndarray, np.ndarray]]


def fill(
    store: ExampleStore, items: np.ndarray, labels: np.ndarray, timestamps: np.ndarray | None = None
) -> None:
    times = np.arange(len(items)) if timestamps is None else timestamps
    store.add(
        Event({"item": int(i), "label": float(r)}, float(t))
        for i, r, t in zip(items, labels, times, strict=True)
    )


@pytest.fixture
def movielens_device(
    export: Callable[[ModelConfig], Path], backend: str, tmp_path: Path, movielens_users: UserData
) -> tuple[TFLiteModel, ExampleStore]:
    model = TFLiteModel(export(MOVIELENS), backend=backend)
    store = ExampleStore(tmp_path / "device.sqlite", model.manifest.features)
    fill(store, *movielens_users[0])  # 272 ratings
    return model, store


def test_completed_task_returns_the_reference_delta_and_discards_locals(
    movielens_device: tuple[TFLiteModel, ExampleStore],
) -> None:
    model, store = movielens_device
    globals_ = perturbed_globals(model.get_global(), seed=1)
    config = TaskConfig.from_manifest(model.manifest)

    result = run_training_task(model, Environment.of(store), globals_, Task(config))

    assert result.outcome is Outcome.COMPLETED, result.message
    data = prepare(store, model.manifest, config, seed=0)
    ref = ReferenceModel("explicit", globals_, {k: np.zeros_like(v) for k, v in model.get_local().items()})
    as_ref = [
        [(b["item"], b["label"].astype(np.float64), np.ones(b.num_examples)) for b in part]
        for part in (data.support, data.query)
    ]
    ref.reconstruct(as_ref[0], min(50, 5 * len(as_ref[0])), 0.1, 0.0)
    ref_delta, _ = ref.update(as_ref[1], min(50, len(as_ref[1])), 0.5)
    assert result.num_examples == sum(len(b) for b in data.query) == 135  # |query|: alternate batches of 5
    assert result.metrics["num_support"] == 137
    for k, v in result.delta.items():  # type: ignore[union-attr]
        np.testing.assert_allclose(v, ref_delta[k], atol=5e-5, rtol=5e-4)
    assert all(not np.any(v) for v in model.get_local().values())


def test_a_dp_task_clips_its_whole_delta_to_the_clip_norm(
    movielens_device: tuple[TFLiteModel, ExampleStore],
) -> None:
    model, store = movielens_device
    globals_ = perturbed_globals(model.get_global(), seed=1)
    unclipped = run_training_task(
        model, Environment.of(store), globals_, Task(TaskConfig.from_manifest(model.manifest))
    ).delta
    assert unclipped is not None
    norm = delta_norm(unclipped)
    clip = norm / 4

    result = run_training_task(
        model,
        Environment.of(store),
        globals_,
        Task(TaskConfig.from_manifest(model.manifest, clip_norm=clip, report_within_clip=True)),
    )

    assert result.outcome is Outcome.COMPLETED and result.delta is not None
    assert clip * (1 - 1e-5) < delta_norm(result.delta) <= clip
    assert result.metrics["dp_within_clip"] == 0.0  # for adaptive clipping's count
    for name, value in result.delta.items():  # the direction is kept: every tensor scaled alike
        np.testing.assert_allclose(value, unclipped[name] * (clip / norm), rtol=1e-5, atol=1e-9)


def test_clipping_alone_does_not_hide_the_user_embedding_from_a_curious_server(
    movielens_device: tuple[TFLiteModel, ExampleStore],
) -> None:
    """Issue 11's attack on a clipped report. Clipping scales the whole delta, so a touched row's
    item delta over its bias delta is still the device's (frozen) user embedding; DP's noise goes
    on the round's sum, after the server has read the report. In plaintext mode a report leaks
    with or without DP: only secure aggregation hides one device's update."""
    model, store = movielens_device
    globals_ = perturbed_globals(model.get_global(), seed=1)
    config = TaskConfig.from_manifest(model.manifest, clip_norm=0.05)
    result = run_training_task(model, Environment.of(store), globals_, Task(config))
    assert result.outcome is Outcome.COMPLETED and result.delta is not None
    assert "dp_within_clip" not in result.metrics  # sent only for adaptive clipping

    rows = np.flatnonzero(result.delta["item_bias"])
    recovered = result.delta["item_embeddings"][rows] / result.delta["item_bias"][rows, None]

    support = TaskBatches.pack(prepare(store, model.manifest, config, seed=0).support, model.manifest)
    model.set_global(globals_)
    reconstruct_locals(model, support, config)  # what the device held during its update
    user = model.get_local()["user_embedding"].ravel()
    cosine = recovered @ user / (np.linalg.norm(recovered, axis=1) * np.linalg.norm(user))
    assert len(rows) > 50 and cosine.min() > 0.9999
    np.testing.assert_allclose(recovered, np.broadcast_to(user, recovered.shape), rtol=1e-3, atol=1e-4)


def test_clip_delta_leaves_a_small_delta_alone_and_scales_a_large_one() -> None:
    delta = {"a": np.array([3.0, 0.0], np.float32), "b": np.array([[4.0]], np.float32)}  # norm 5

    kept, kept_within = clip_delta(delta, 10.0)
    clipped, within = clip_delta(delta, 1.0)

    assert kept is delta and kept_within
    assert not within and delta_norm(clipped) <= 1.0
    np.testing.assert_allclose(clipped["a"], [0.6, 0.0], rtol=1e-5)
    np.testing.assert_allclose(clipped["b"], [[0.8]], rtol=1e-5)


def test_repeated_rounds_on_a_device_lower_its_query_loss(
    movielens_device: tuple[TFLiteModel, ExampleStore],
) -> None:
    model, store = movielens_device
    globals_ = model.get_global()
    config = TaskConfig.from_manifest(model.manifest, update_learning_rate=0.05)
    losses = []

    for _ in range(8):
        result = run_training_task(model, Environment.of(store), globals_, Task(config))
        assert result.outcome is Outcome.COMPLETED
        losses.append(result.metrics["query_loss_sum"] / result.metrics["query_weight_sum"])
        globals_ = {k: globals_[k] + result.delta[k] for k in globals_}  # type: ignore[index]

    assert losses[-1] < 0.8 * losses[0]


def test_too_few_examples_is_insufficient_data(
    movielens_device: tuple[TFLiteModel, ExampleStore], tmp_path: Path
) -> None:
    model, _ = movielens_device
    store = ExampleStore(tmp_path / "small.sqlite", model.manifest.features)
    fill(store, np.array([1, 2, 3]), np.array([4.0, 5.0, 3.0]))

    few = run_training_task(
        model, Environment.of(store), model.get_global(), Task(TaskConfig(min_examples=5))
    )
    empty = run_training_task(
        model,
        Environment.of(ExampleStore(tmp_path / "empty.sqlite", model.manifest.features)),
        model.get_global(),
        Task(TaskConfig()),
    )

    assert few.outcome is Outcome.INSUFFICIENT_DATA
    assert "3 usable examples" in few.message
    assert few.delta is None
    assert empty.outcome is Outcome.INSUFFICIENT_DATA


def test_few_examples_are_reused_for_support_and_query(
    movielens_device: tuple[TFLiteModel, ExampleStore], tmp_path: Path
) -> None:
    model, _ = movielens_device
    store = ExampleStore(tmp_path / "few.sqlite", model.manifest.features)
    fill(store, np.arange(12), np.full(12, 4.0))

    reused = run_training_task(
        model, Environment.of(store), model.get_global(), Task(TaskConfig(reuse_below=20))
    )
    split = run_training_task(
        model, Environment.of(store), model.get_global(), Task(TaskConfig(reuse_below=5))
    )
    policy = run_training_task(
        model, Environment.of(store), model.get_global(), Task(TaskConfig(split=SplitPolicy.REUSE))
    )

    assert (reused.metrics["num_support"], reused.num_examples) == (12, 12)
    assert (split.metrics["num_support"], split.num_examples) == (7, 5)  # batches of 5: [5, 2] and [5]
    assert policy.num_examples == 12


def test_interrupted_task_reports_nothing(movielens_device: tuple[TFLiteModel, ExampleStore]) -> None:
    model, store = movielens_device
    calls = iter([True, False])

    result = run_training_task(
        model, Environment.of(store, lambda: next(calls)), model.get_global(), Task(TaskConfig())
    )

    assert result.outcome is Outcome.INTERRUPTED
    assert result.delta is None
    assert all(not np.any(v) for v in model.get_local().values())


def test_bad_global_parameters_are_an_error_outcome(
    movielens_device: tuple[TFLiteModel, ExampleStore],
) -> None:
    model, store = movielens_device
    globals_ = model.get_global()
    globals_["item_embeddings"][0, 0] = np.inf

    result = run_training_task(model, Environment.of(store), globals_, Task(TaskConfig()))

    assert result.outcome is Outcome.ERROR
    assert "non-finite" in result.message


def test_divergence_is_an_error_outcome(movielens_device: tuple[TFLiteModel, ExampleStore]) -> None:
    model, store = movielens_device

    result = run_training_task(
        model, Environment.of(store), model.get_global(), Task(TaskConfig(update_learning_rate=1_000.0))
    )

    assert result.outcome is Outcome.ERROR
    assert "diverged" in result.message


def test_items_outside_the_catalog_are_left_out_and_counted(
    movielens_device: tuple[TFLiteModel, ExampleStore], tmp_path: Path
) -> None:
    model, _ = movielens_device
    item, label = model.manifest.features
    # The app knows items the model does not.
    store = ExampleStore(tmp_path / "new-items.sqlite", (replace(item, value_range=(0, 9999)), label))
    fill(store, np.array([1, 2, 3, 5000, 6000, 4, 5, 6]), np.full(8, 4.0))

    result = run_training_task(
        model, Environment.of(store), model.get_global(), Task(TaskConfig(min_examples=1))
    )

    assert result.outcome is Outcome.COMPLETED
    assert result.metrics["outside_catalog"] == 2
    assert result.metrics["num_examples"] == 6


def test_examples_are_capped_at_max_examples(
    movielens_device: tuple[TFLiteModel, ExampleStore], movielens_users: UserData, tmp_path: Path
) -> None:
    model, _ = movielens_device
    heavy = max(movielens_users, key=lambda u: len(u[0]))
    store = ExampleStore(tmp_path / "heavy.sqlite", model.manifest.features)
    fill(store, *heavy)

    result = run_training_task(
        model, Environment.of(store), model.get_global(), Task(TaskConfig(max_examples=300))
    )

    assert len(heavy[0]) > 600
    assert result.metrics["num_examples"] == 300
    assert result.num_examples == 150


def test_implicit_feedback_adds_sampled_negatives(
    export: Callable[[ModelConfig], Path], backend: str, tmp_path: Path
) -> None:
    model = TFLiteModel(export(IMPLICIT), backend=backend)
    store = ExampleStore(tmp_path / "shares.sqlite", model.manifest.features)
    fill(store, np.arange(10), np.ones(10))
    config = TaskConfig(negatives_per_positive=3, reuse_below=100)

    data = prepare(store, model.manifest, config, seed=0)
    result = run_training_task(model, Environment.of(store), model.get_global(), Task(config))

    labels = np.concatenate([b["label"] for b in data.query])
    negatives = np.concatenate([b["item"] for b in data.query])[labels == 0]
    assert (labels == 1).sum() == 10 and (labels == 0).sum() == 30
    assert not set(negatives) & set(range(10))
    assert result.outcome is Outcome.COMPLETED
    assert result.num_examples == 40


def test_evaluation_task_reports_metrics_only(movielens_device: tuple[TFLiteModel, ExampleStore]) -> None:
    model, store = movielens_device

    result = run_evaluation_task(model, Environment.of(store), model.get_global(), Task(TaskConfig()))

    assert result.outcome is Outcome.COMPLETED
    assert result.delta is None
    assert set(result.metrics) == {"loss_sum", "squared_error_sum", "correct_sum", "weight_sum"}
    assert result.metrics["weight_sum"] == result.num_examples == 135


def test_evaluation_measures_on_the_query_even_when_training_reuses_examples(
    movielens_device: tuple[TFLiteModel, ExampleStore],
) -> None:
    model, store = movielens_device

    alternate = run_evaluation_task(model, Environment.of(store), model.get_global(), Task(TaskConfig()))
    reuse = run_evaluation_task(
        model, Environment.of(store), model.get_global(), Task(TaskConfig(split=SplitPolicy.REUSE))
    )
    below = run_evaluation_task(
        model, Environment.of(store), model.get_global(), Task(TaskConfig(reuse_below=1000))
    )

    # Training's split does not reach ReconEval: the same query, the same figures.
    assert reuse.metrics == alternate.metrics == below.metrics
    assert reuse.num_examples == 135


def test_task_config_round_trip_and_refusals() -> None:
    config = TaskConfig(split=SplitPolicy.REUSE, reuse_below=3)

    assert TaskConfig.from_json(config.to_json()) == config
    with pytest.raises(ValueError, match="unknown task config fields"):
        TaskConfig.from_json({"reconstrution_max_steps": 3})
    with pytest.raises(ValueError, match="update_learning_rate must be finite, got nan"):
        TaskConfig(update_learning_rate=float("nan"))
    # Beyond 32 bits the model's int32 input would wrap; beyond the documented maximum is absurd.
    with pytest.raises(ValueError, match=r"update_max_steps must be in \[0, 10000\], got 4294967301"):
        TaskConfig.from_json({"update_max_steps": 2**32 + 5})
    with pytest.raises(ValueError, match=r"reconstruction_learning_rate must be in \[0, 1000\], got 1e\+39"):
        TaskConfig.from_json({"reconstruction_learning_rate": 1e39})
    with pytest.raises(ValueError, match=r"shuffle_seed must be in \[0, 4294967295\], got ~2\^1328"):
        TaskConfig.from_json({"shuffle_seed": 10**400})
    with pytest.raises(ValueError, match=r"l2_local must be in \[0, 1000\], got -1"):
        TaskConfig.from_json({"l2_local": -1})
    with pytest.raises(ValueError, match=r"split must be one of \['alternate', 'reuse'\], got \[1\]"):
        TaskConfig.from_json({"split": [1]})
    with pytest.raises(ValueError, match="update_max_steps must be int, got '5'"):
        TaskConfig.from_json({"update_max_steps": "5"})
    with pytest.raises(ValueError, match="clip_norm must be > 0"):
        TaskConfig(clip_norm=0.0)
    assert TaskConfig.from_json({"clip_norm": 2.5}).clip_norm == 2.5


def test_a_task_with_a_central_gradient_matches_the_reference_and_reports_its_own_weight(
    movielens_device: tuple[TFLiteModel, ExampleStore],
) -> None:
    model, store = movielens_device
    globals_ = perturbed_globals(model.get_global(), seed=2)
    config = TaskConfig.from_manifest(model.manifest)
    rng = np.random.default_rng(3)
    # Items 1600+ : rows this user never rated (a held-back movie the server has public data on).
    rows = np.array([0, 5, 1600, 1650], np.int32)
    central = {
        "item_embeddings": SparseTensor((1682, 16), rows, rng.normal(0, 1, (4, 16)).astype(np.float32)),
        "item_bias": SparseTensor((1682,), rows, rng.normal(0, 1, 4).astype(np.float32)),
    }

    plain = run_training_task(model, Environment.of(store), globals_, Task(config))
    mixed = run_training_task(
        model,
        Environment.of(store),
        globals_,
        Task(config, central_gradient=central, central_gradient_weight=0.4),
    )

    assert mixed.outcome is Outcome.COMPLETED, mixed.message
    assert mixed.num_examples == plain.num_examples == 135  # central data is not counted in the weight
    data = prepare(store, model.manifest, config, seed=0)
    ref = ReferenceModel("explicit", globals_, {k: np.zeros_like(v) for k, v in model.get_local().items()})
    as_ref = [
        [(b["item"], b["label"].astype(np.float64), np.ones(b.num_examples)) for b in part]
        for part in (data.support, data.query)
    ]
    ref.reconstruct(as_ref[0], min(50, 5 * len(as_ref[0])), 0.1, 0.0)
    dense = {k: v.dense().astype(np.float64) for k, v in central.items()}
    ref_delta, _ = ref.update(
        as_ref[1], min(50, len(as_ref[1])), 0.5, central_gradient=dense, central_gradient_weight=0.4
    )
    for k, v in mixed.delta.items():  # type: ignore[union-attr]
        np.testing.assert_allclose(v, ref_delta[k], atol=5e-5, rtol=5e-4)
    assert np.any(mixed.delta["item_embeddings"][1600])  # type: ignore[index]
    assert not np.any(plain.delta["item_embeddings"][1600])  # type: ignore[index]
