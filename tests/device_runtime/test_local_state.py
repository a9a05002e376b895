"""Stateful private parameters (FURL): kept on the device across tasks and restarts, held-out
StandardEval, stale locals discarded with a reason, and served by the recommender."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from contracts.features import Examples
from contracts.task_config import LocalState, TaskConfig
from device_runtime.client_task import Outcome, Task, run_evaluation_task, run_training_task
from device_runtime.example_store import Event, ExampleStore
from device_runtime.fedrecon_step import delta_norm
from device_runtime.local_state import LocalStateStore
from device_runtime.recommender import Recommender
from device_runtime.task_environment import Environment
from model_export.config import ModelConfig
from model_runtime.support_query import add_negatives
from model_runtime.task_batches import TaskBatches, split_batches
from model_runtime.tflite_model import TFLiteModel
from tests.conftest import BIASED, IMPLICIT, ROBUST, SMALL, perturbed_globals

KEEP = {"local_state": "keep", "local_learning_rate": 0.1, "shuffle_seed": None}


def make_store(path: Path, n: int = 40, seed: int = 0) -> ExampleStore:
    """A generous user (ratings 4-5): something kept locals can learn whatever the globals, as the
    device's validation of its new locals asks."""
    rng = np.random.default_rng(seed)
    store = ExampleStore(path, BIASED.features())
    items = rng.choice(BIASED.num_items, size=n, replace=False)
    store.add(
        Event({"item": int(i), "label": float(rng.integers(4, 6))}, float(t)) for t, i in enumerate(items)
    )
    return store


@pytest.fixture
def device(export: Callable[[ModelConfig], Path], tmp_path: Path) -> tuple[TFLiteModel, ExampleStore]:
    return TFLiteModel(export(BIASED)), make_store(tmp_path / "device.sqlite")


def config_for(model: TFLiteModel, **changes: object) -> TaskConfig:
    return TaskConfig.from_manifest(model.manifest, **{**KEEP, **changes})


def test_locals_start_from_the_initial_values_and_persist_across_a_restart(
    device: tuple[TFLiteModel, ExampleStore], export: Callable[[ModelConfig], Path], tmp_path: Path
) -> None:
    model, store = device
    globals_ = perturbed_globals(model.get_global(), seed=1)
    config = config_for(model)

    first = run_training_task(model, Environment.of(store), globals_, Task(config, population="movies"))
    kept_after_first = LocalStateStore(store, "movies").load(model)
    store.close()
    # An app restart: a new interpreter and a new store handle on the same file.
    model2, store2 = TFLiteModel(export(BIASED)), ExampleStore(tmp_path / "device.sqlite")
    reloaded = LocalStateStore(store2, "movies").load(model2)
    second = run_training_task(model2, Environment.of(store2), globals_, Task(config, population="movies"))

    assert first.outcome is Outcome.COMPLETED, first.message
    assert "no kept local parameters yet" in first.message
    assert kept_after_first.tasks == 1 and np.any(kept_after_first.params["user_embedding"])
    assert reloaded.tasks == 1 and reloaded.note == ""
    for name, value in kept_after_first.params.items():
        np.testing.assert_array_equal(reloaded.params[name], value)
    assert second.outcome is Outcome.COMPLETED and second.message == ""
    assert LocalStateStore(store2, "movies").load(model2).tasks == 2
    # Kept per population: another population on the same device starts afresh.
    assert not LocalStateStore(store2, "other").load(model2).trained
    # The interpreter never keeps a device's locals after its task (it serves many devices).
    assert all(not np.any(v) for v in model2.get_local().values())


def test_training_holds_out_the_newest_tenth_and_evaluation_measures_it_with_the_kept_locals(
    device: tuple[TFLiteModel, ExampleStore],
) -> None:
    model, store = device
    globals_ = perturbed_globals(model.get_global(), seed=2)
    config = config_for(model)
    kept = LocalStateStore(store, "movies")

    before_training = run_evaluation_task(
        model, Environment.of(store), globals_, Task(config, population=kept.population)
    )
    trained = run_training_task(
        model, Environment.of(store), globals_, Task(config, population=kept.population)
    )
    evaluated = run_evaluation_task(
        model, Environment.of(store), globals_, Task(config, population=kept.population)
    )

    assert before_training.outcome is Outcome.INSUFFICIENT_DATA
    assert "has none" in before_training.message
    # 40 examples: the newest 4 held out for StandardEval, 4 of the other 36 validate the task's locals.
    assert trained.num_examples == 32 and trained.metrics["num_held_out"] == 4
    assert trained.metrics["num_examples"] == 40
    assert evaluated.outcome is Outcome.COMPLETED, evaluated.message
    newest = store.examples().select(slice(None, 4))  # the store hands out newest first
    model.set_global(globals_)
    model.set_local(kept.load(model).params)
    batches = split_batches(newest, model.manifest.batch_size)
    expected = model.evaluate(TaskBatches.pack(batches, model.manifest))
    assert evaluated.num_examples == 4
    assert evaluated.metrics == pytest.approx(expected.as_dict())


def test_an_interrupted_or_diverged_task_keeps_the_previous_locals(
    device: tuple[TFLiteModel, ExampleStore],
) -> None:
    model, store = device
    globals_ = model.get_global()
    kept = LocalStateStore(store, "movies")
    run_training_task(
        model, Environment.of(store), globals_, Task(config_for(model), population=kept.population)
    )
    saved = kept.load(model)
    calls = 0

    def stop_after_update() -> bool:
        nonlocal calls
        calls += 1
        return calls < 2

    interrupted = run_training_task(
        model,
        Environment.of(store, stop_after_update),
        globals_,
        Task(config_for(model), population=kept.population),
    )
    too_fast = config_for(model, update_learning_rate=1_000.0)  # the largest accepted rate
    diverged = run_training_task(
        model, Environment.of(store), globals_, Task(too_fast, population=kept.population)
    )

    assert interrupted.outcome is Outcome.INTERRUPTED
    assert diverged.outcome is Outcome.ERROR
    after = kept.load(model)
    assert after.tasks == 1
    np.testing.assert_array_equal(after.params["user_embedding"], saved.params["user_embedding"])


def test_a_stateful_dp_task_clips_its_delta_too(device: tuple[TFLiteModel, ExampleStore]) -> None:
    model, store = device
    globals_ = perturbed_globals(model.get_global(), seed=1)
    unclipped = run_training_task(
        model, Environment.of(store), globals_, Task(config_for(model), population="free")
    ).delta
    assert unclipped is not None
    clip = delta_norm(unclipped) / 4

    result = run_training_task(
        model,
        Environment.of(store),
        globals_,
        Task(config_for(model, clip_norm=clip, report_within_clip=True), population="private"),
    )

    # A DP population's server refuses a report above its clip norm: kept locals change nothing.
    assert result.outcome is Outcome.COMPLETED and result.delta is not None
    assert clip * (1 - 1e-5) < delta_norm(result.delta) <= clip
    assert result.metrics["dp_within_clip"] == 0.0


def test_stale_locals_are_discarded_with_the_reason(
    device: tuple[TFLiteModel, ExampleStore], export: Callable[[ModelConfig], Path]
) -> None:
    model, store = device
    run_training_task(
        model, Environment.of(store), model.get_global(), Task(config_for(model), population="p")
    )
    reshaped = TFLiteModel(export(SMALL))  # user embedding of 8, no user bias
    other_export = TFLiteModel(export(ROBUST))  # the same local shapes, another model

    shape_changed = LocalStateStore(store, "p").load(reshaped)
    model_changed = LocalStateStore(store, "p").load(other_export)
    # A training task with the reshaped model says why it started afresh (on the catalog it knows).
    result = run_training_task(
        reshaped, Environment.of(store), reshaped.get_global(), Task(config_for(reshaped), population="p")
    )
    store.save_local_state("kept_locals/p", b"not safetensors")
    damaged = LocalStateStore(store, "p").load(model)

    assert not shape_changed.trained and "local parameters changed shape" in shape_changed.note
    assert all(not np.any(v) for v in shape_changed.params.values())
    assert set(shape_changed.params) == {s.name for s in reshaped.manifest.local_params}
    assert not model_changed.trained and "the population's model changed" in model_changed.note
    assert result.outcome is Outcome.COMPLETED and "changed shape" in result.message
    assert not damaged.trained and "unreadable" in damaged.note


def test_the_recommender_serves_from_the_kept_locals(device: tuple[TFLiteModel, ExampleStore]) -> None:
    model, store = device
    globals_ = perturbed_globals(model.get_global(), seed=3)
    kept = LocalStateStore(store, "movies")
    untrained = Recommender(model, store, globals_, kept=kept).recommend(10)
    run_training_task(
        model, Environment.of(store), globals_, Task(config_for(model), population=kept.population)
    )

    served = Recommender(model, store, globals_, kept=kept).recommend(10)

    assert untrained.local_params == "reconstructed"
    assert served.local_params == "kept" and served.source == "personalized"
    model.set_global(globals_)
    model.set_local(kept.load(model).params)
    mask = np.zeros(model.manifest.catalog_size, bool)
    mask[store.distinct_values("item")] = True
    scores = np.where(mask, -np.inf, model.infer().scores)
    np.testing.assert_array_equal(served.items, np.argsort(-scores, kind="stable")[:10])


def test_a_stateful_task_needs_its_storage_and_a_local_learning_rate(
    device: tuple[TFLiteModel, ExampleStore],
) -> None:
    model, store = device

    without_storage = run_training_task(
        model, Environment.of(store), model.get_global(), Task(config_for(model))
    )

    assert without_storage.outcome is Outcome.ERROR and "local state storage" in without_storage.message
    with pytest.raises(ValueError, match="local_learning_rate > 0"):
        TaskConfig(local_state=LocalState.KEEP)
    with pytest.raises(ValueError, match=r"local_state must be one of \['reconstruct', 'keep'\]"):
        TaskConfig.from_json({"local_state": "remember"})
    with pytest.raises(ValueError, match=r"local_state must be one of"):
        TaskConfig(local_state="remember")  # type: ignore[arg-type]
    assert TaskConfig(local_state="keep", local_learning_rate=0.1).local_state is LocalState.KEEP  # type: ignore[arg-type]
    assert TaskConfig.from_json(config_for(model).to_json()).local_state is LocalState.KEEP


def test_held_out_negatives_are_never_one_of_the_users_other_shares(
    export: Callable[[ModelConfig], Path],
) -> None:
    manifest = TFLiteModel(export(IMPLICIT)).manifest
    held_out = Examples({"item": np.array([3, 7], np.int32), "label": np.ones(2, np.float32)})
    trained_shares = np.arange(10, 150)  # all but items 0-9 were shared in the training part

    mixed = add_negatives(held_out, manifest, 4, np.random.default_rng(0), also_shared=trained_shares)

    negatives = mixed["item"][mixed["label"] == 0]
    assert len(negatives) == 8
    assert set(negatives.tolist()) <= set(range(10)) - {3, 7}
