"""The device's bounds on what one task may do to its kept locals, and its return to the last
good copy when its own validation examples say the task's locals are worse."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from contracts.features import Examples
from device_runtime.kept_locals_guard import KeptLocalsBounds, bound_change, guard, params_norm
from model_export.config import ModelConfig
from model_runtime.task_batches import TaskBatches, split_batches
from model_runtime.tflite_model import TFLiteModel
from tests.conftest import BIASED

BOUNDS = KeptLocalsBounds()


def vector(*values: float) -> dict[str, np.ndarray]:
    return {
        "user_embedding": np.array(values[:-1], np.float32),
        "user_bias": np.array(values[-1:], np.float32),
    }


def test_a_change_is_scaled_to_the_kept_norm_or_the_floor_keeping_its_direction() -> None:
    kept = vector(3.0, 0.0, 4.0)  # norm 5
    small = bound_change(kept, vector(3.5, 0.0, 4.0), BOUNDS)
    large = bound_change(kept, vector(3.0, 300.0, 4.0), BOUNDS)
    fresh = bound_change(vector(0.0, 0.0, 0.0), vector(0.0, 0.0, 40.0), BOUNDS)

    assert small.note == "" and small.params is not None
    np.testing.assert_array_equal(small.params["user_embedding"], [3.5, 0.0])
    assert large.params is not None and "the task's change of norm 300 scaled to 5" in large.note
    np.testing.assert_allclose(large.params["user_embedding"], [3.0, 5.0], rtol=1e-6)
    assert large.change_norm == pytest.approx(300)
    # Fresh locals are zeros: the floor, 1, is what one task may move them.
    assert fresh.params is not None
    assert params_norm(fresh.params) == pytest.approx(1.0)


def test_the_kept_norm_is_capped_and_non_finite_locals_are_refused() -> None:
    kept = vector(0.0, 80.0, 0.0)
    capped = bound_change(kept, vector(0.0, 150.0, 0.0), BOUNDS)
    refused = bound_change(kept, vector(0.0, np.inf, 0.0), BOUNDS)
    nan = bound_change(kept, vector(np.nan, 1.0, 0.0), BOUNDS)

    assert capped.params is not None and "norm 150 scaled to the cap 100" in capped.note
    assert params_norm(capped.params) == pytest.approx(100.0)
    assert refused.params is None and nan.params is None
    assert "not finite" in refused.note


def test_bounds_that_protect_nothing_are_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"max_relative_change must be a finite number > 0, got inf"):
        KeptLocalsBounds(max_relative_change=float("inf"))
    with pytest.raises(ValueError, match=r"max_norm must be a finite number > 0, got 0"):
        KeptLocalsBounds(max_norm=0)
    with pytest.raises(ValueError, match=r"tolerance must be a finite number >= 0, got nan"):
        KeptLocalsBounds(tolerance=float("nan"))
    assert BOUNDS.validation_count(9) == 0 and BOUNDS.validation_count(10) == 1
    assert BOUNDS.validation_count(36) == 4


def test_locals_that_do_worse_on_the_validation_examples_leave_the_last_good_copy(
    export: Callable[[ModelConfig], Path],
) -> None:
    model = TFLiteModel(export(BIASED))
    model.set_global(model.get_global())
    # A user who rates everything 5: the closer the user bias to 1.5 (global mean 3.5), the better.
    items = np.arange(8, dtype=np.int32)
    validation = TaskBatches.pack(
        split_batches(Examples({"item": items, "label": np.full(8, 5.0, np.float32)}), BIASED.batch_size),
        model.manifest,
    )
    zeros = np.zeros(BIASED.embedding_dim)
    good = vector(*zeros, 1.0)

    refused = guard(model, good, vector(*zeros, 0.2), validation, BOUNDS)
    kept = guard(model, good, vector(*zeros, 1.2), validation, BOUNDS)
    unvalidated = guard(model, good, vector(*zeros, 0.5), TaskBatches.pack([], model.manifest), BOUNDS)

    assert refused.params is good
    assert refused.note.startswith(
        "kept the last good local parameters: on 8 validation examples the new ones' loss is"
    )
    assert kept.params is not good and kept.note == ""
    np.testing.assert_allclose(kept.params["user_bias"], [1.2])
    # Too few examples to validate (a small device): the bounds alone decide.
    assert unvalidated.params is not good
