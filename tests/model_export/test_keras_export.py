"""A user's own Keras model (tests/model_export/genre_rating.py: neither MF nor an LSTM) through
`python -m model_export --model`: the manifest it gets, TFLite against TensorFlow on both
interpreters, and the specs that cannot be exported.

Tolerance: float32 TFLite vs float32 TensorFlow after 13 SGD steps: |a - b| <= 2e-5 + 2e-4 |b|.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from contracts.features import Examples
from contracts.manifest import CENTRAL_GRADIENT_WEIGHT, central_gradient_input, load_manifest
from contracts.params import SparseTensor
from model_runtime.task_batches import TaskBatches, split_batches
from model_runtime.tflite_model import TFLiteModel
from tests.conftest import GENRE_RATING, ROOT, perturbed_globals

ATOL, RTOL = 2e-5, 2e-4
HYPER: dict[str, float] = {
    "num_steps": 13,
    "learning_rate": 0.1,
    "local_learning_rate": 0.05,
    "l2_global": 0.01,
    "l2_local": 0.02,
}
CENTRAL_WEIGHT = 0.7


@dataclass(frozen=True)
class Case:
    model_dir: Path
    global_params: dict[str, np.ndarray]
    local_params: dict[str, np.ndarray]
    batches: TaskBatches
    central_gradient: dict[str, SparseTensor]
    infer_inputs: dict[str, np.ndarray]
    tensorflow: dict[str, np.ndarray]


def _subprocess(*args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="session")
def case(genre_rating_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Case:
    """19 examples packed by the device runtime, and TensorFlow's results on exactly those inputs."""
    model = TFLiteModel(genre_rating_model)
    manifest = model.manifest
    rng = np.random.default_rng(3)
    # Repeated movies and genres inside a batch exercise gradient accumulation on one row.
    examples = Examples(
        {
            "movie": rng.integers(0, 12, 19),
            "genre": rng.integers(0, 5, 19),
            "rating": rng.integers(1, 6, 19).astype(np.float32),
        }
    )
    batches = TaskBatches.pack(split_batches(examples, manifest.batch_size), manifest)
    global_params = perturbed_globals(model.get_global(), seed=4)
    local_params = {k: rng.normal(0, 0.4, v.shape).astype(np.float32) for k, v in model.get_local().items()}
    task_globals = {
        s.name: global_params[s.name][batches.rows[s.row_sparse]] if s.row_sparse else global_params[s.name]
        for s in manifest.global_params
    }
    # A central gradient on the examples' rows of each table (and whole dense globals), so that
    # TensorFlow is given the same task rows as the runtime packs.
    central_gradient = {
        s.name: SparseTensor(
            s.shape,
            batches.used_rows(s.row_sparse) if s.row_sparse else np.arange(s.shape[0], dtype=np.int32),
            rng.normal(
                0, 0.5, (batches.num_rows[s.row_sparse], *s.shape[1:]) if s.row_sparse else s.shape
            ).astype(np.float32),
        )
        for s in manifest.global_params
    }
    central_inputs: dict[str, np.ndarray] = {CENTRAL_GRADIENT_WEIGHT: np.asarray(CENTRAL_WEIGHT, np.float32)}
    for s in manifest.global_params:
        padded = np.zeros(manifest.training_shape(s.name), np.float32)
        padded[: len(central_gradient[s.name].rows)] = central_gradient[s.name].values
        central_inputs[central_gradient_input(s.name)] = padded
    inputs = {**{f"global/{k}": v for k, v in global_params.items()}}
    inputs |= {f"local/{k}": v for k, v in local_params.items()}
    infer_inputs = {f.name: examples[f.name][: manifest.batch_size] for f in manifest.input_features}
    for signature in ("reconstruct", "update", "evaluate", "gradient", "infer"):
        if signature == "infer":
            given = infer_inputs
        else:
            hyper = {k: v for k, v in HYPER.items() if k in manifest.signatures[signature]["inputs"]}
            given = {**batches.inputs(), **task_globals, **{k: np.asarray(v) for k, v in hyper.items()}}
            if signature == "update":
                given |= central_inputs
        given = {
            k: np.asarray(v, manifest.signatures[signature]["inputs"][k].dtype) for k, v in given.items()
        }
        inputs |= {f"{signature}/{k}": v for k, v in given.items()}
    work = tmp_path_factory.mktemp("tensorflow-side")
    np.savez(work / "inputs.npz", **inputs)
    _subprocess(
        "tests.model_export.tensorflow_side", GENRE_RATING, str(work / "inputs.npz"), str(work / "out.npz")
    )
    return Case(
        genre_rating_model,
        global_params,
        local_params,
        batches,
        central_gradient,
        infer_inputs,
        dict(np.load(work / "out.npz")),
    )


def assert_close(actual: np.ndarray | float, expected: np.ndarray | float) -> None:
    np.testing.assert_allclose(actual, expected, atol=ATOL, rtol=RTOL)


def test_the_manifest_describes_features_tables_and_task(genre_rating_model: Path) -> None:
    manifest = load_manifest(genre_rating_model)

    assert {s.name: s.row_sparse for s in manifest.global_params} == {
        "movie_embeddings": "movie",
        "genre_embeddings": "genre",
        "hidden_kernel": None,
        "hidden_bias": None,
        "global_mean": None,
    }
    assert [s.name for s in manifest.local_params] == ["user_embedding"]
    assert manifest.feature("movie").value_range == (0, 39) and manifest.feature("movie").tables == (
        "movie_embeddings",
    )
    assert manifest.task.kind == "regression" and [m.name for m in manifest.metrics] == ["squared_error"]
    # Training takes the task's rows of each table, as slots into them: O(batch), not O(table).
    assert manifest.signatures["update"]["inputs"]["movie_embeddings"].shape == (20, 4)
    assert manifest.signatures["update"]["inputs"]["movie"].dtype == "int32"


def test_training_and_evaluation_match_tensorflow(case: Case, backend: str) -> None:
    model = TFLiteModel(case.model_dir, backend=backend)
    model.set_global(case.global_params)
    tf = case.tensorflow
    steps, lr, local_lr = int(HYPER["num_steps"]), HYPER["learning_rate"], HYPER["local_learning_rate"]

    model.set_local(case.local_params)
    loss = model.reconstruct(case.batches, steps, lr, HYPER["l2_local"])
    reconstructed = model.get_local()
    model.set_local(case.local_params)
    update = model.update_rows(
        case.batches,
        steps,
        lr,
        local_learning_rate=local_lr,
        l2_global=HYPER["l2_global"],
        l2_local=HYPER["l2_local"],
        central_gradient=case.central_gradient,
        central_gradient_weight=CENTRAL_WEIGHT,
    )
    after_update = model.get_local()
    model.set_local(case.local_params)
    sums = model.evaluate(case.batches).as_dict()
    gradient = model.gradient(case.batches)
    predictions = model.predict(Examples(case.infer_inputs))["predictions"]

    assert_close(loss, tf["reconstruct/loss"])
    assert_close(reconstructed["user_embedding"], tf["reconstruct/local/user_embedding"])
    assert_close(update.loss, tf["update/loss"])
    for name, delta in update.delta.items():
        expected = tf[f"update/{name}_delta"]
        if name in update.rows:  # the task's rows only, in the order of `rows`
            expected = expected[: len(update.rows[name])]
        assert delta.shape == expected.shape
        assert_close(delta, expected)
    assert np.any(update.delta["hidden_kernel"])  # the ReLU layer trained (its gradient is rewritten)
    assert_close(after_update["user_embedding"], tf["update/local/user_embedding"])
    assert set(sums) == {"loss_sum", "weight_sum", "squared_error_sum"}
    for name, value in sums.items():
        assert_close(value, tf[f"evaluate/{name}"])
    assert_close(predictions, tf["infer/predictions"])
    assert_close(gradient.loss, tf["gradient/loss"])
    assert gradient.weight_sum == case.batches.num_examples
    for name, tensor in gradient.gradient.items():
        expected = tf[f"gradient/{name}_gradient"][: len(tensor.rows)]
        assert_close(tensor.values, expected)
    assert np.any(gradient.gradient["hidden_kernel"].values)


EXPECTED_ERRORS = {
    "unknown_local_variable": r"local variable 'user_embeddings' does not exist; "
    r"the model's trainable variables are \['genre_embeddings', .*'user_embedding'\]",
    "features_disagree_with_inputs": r"the feature spec disagrees with the model's inputs: "
    r"the model takes \['genre', 'movie'\], the spec declares inputs \['movie'\]",
    "feature_of_another_dtype": r"the model's input 'genre': the model takes int32\[\] per example, "
    r"the spec says float32\[\]",
    "row_sparse_layer_that_is_not_a_table": r"row_sparse names 'hidden': "
    r"expected an Embedding or RowTable layer",
    "unsupported_gradient": r"needs ops that are not TFLite builtins.*\n"
    r"- EluGrad \(from layer 'smooth'\); fix: ",
    "ranking_catalog_without_a_table": r"the catalog feature \('hour'\) must be an input that indexes a "
    r"row-sparse table; the model's other inputs are its context",
    "catalog_attribute_of_another_length": r"catalog attribute 'decade' has 10 values; the feature 'movie' "
    r"it is called on has 40 rows, so it needs one value per row",
    "catalog_feature_into_another_layer": r"it may feed only row-sparse tables and CatalogAttribute layers "
    r"\(a catalog row's constants, e.g. its topic\), but also feeds \[",
    "local_start_of_another_shape": r"local_start's layer 'genre_embeddings' gives per-example outputs "
    r"of shape \(3,\); the local 'user_embedding' has shape \(6,\)",
    "local_start_of_an_unknown_local": r"local_start names the local 'user_vector'; "
    r"the model's locals are \['user_embedding'\]",
}


def test_specs_that_cannot_be_exported_fail_clearly_and_write_nothing(tmp_path: Path) -> None:
    result = _subprocess("tests.model_export.export_cases", str(tmp_path))

    outcomes = json.loads(result.stdout.strip().splitlines()[-1])

    assert set(outcomes) == {*EXPECTED_ERRORS, "slices_convert", "next_token"}
    assert outcomes["slices_convert"][0] == 0, outcomes["slices_convert"][1]
    assert load_manifest(tmp_path / "slices_convert").task.kind == "regression"
    assert outcomes["next_token"][0] == 0, outcomes["next_token"][1]
    classifier = TFLiteModel(tmp_path / "next_token")
    contexts = Examples(
        {"tokens": np.array([[1, 2, 3, 4], [5, 6, 7, 8], [0, 0, 0, 1], [9, 10, 11, 2], [3, 3, 3, 3]])}
    )
    top = classifier.predict(contexts)
    assert top["top_classes"].shape == (5, 3) and top["top_scores"].shape == (5, 3)
    assert np.all(np.diff(top["top_scores"], axis=1) <= 0)  # best first
    assert [s.name for s in classifier.manifest.local_params] == ["token_embeddings"]
    for name, pattern in EXPECTED_ERRORS.items():
        code, stderr = outcomes[name]
        assert code == 2, (name, stderr)
        assert re.search(pattern, stderr), (name, stderr)
        assert not (tmp_path / name).exists(), name
