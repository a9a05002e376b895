"""Bad model files and bad tensors get a clear error before the interpreter sees them."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from contracts.features import Examples
from contracts.manifest import ManifestError, sha256_file
from contracts.params import ParamsError, decode_params, encode_params
from model_export.config import ModelConfig
from model_runtime.interpreter import BACKEND_ENV, BACKENDS
from model_runtime.task_batches import TaskBatches, split_batches
from model_runtime.tflite_model import ModelLoadError, TFLiteModel
from tests.conftest import BIASED


@pytest.fixture
def model_copy(export: Callable[[ModelConfig], Path], tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(export(BIASED), target)
    return target


def edit_manifest(model_dir: Path, edit: Callable[[dict], None]) -> None:
    path = model_dir / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_missing_model_file(model_copy: Path, backend: str) -> None:
    (model_copy / "model.tflite").unlink()

    with pytest.raises(ModelLoadError, match="no model file"):
        TFLiteModel(model_copy, backend=backend)


def test_corrupt_model_file_is_caught_by_its_hash(model_copy: Path, backend: str) -> None:
    path = model_copy / "model.tflite"
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    path.write_bytes(bytes(blob))

    with pytest.raises(ModelLoadError, match="corrupt"):
        TFLiteModel(model_copy, backend=backend)


def test_garbage_model_file_with_matching_manifest_hash(model_copy: Path, backend: str) -> None:
    path = model_copy / "model.tflite"
    path.write_bytes(b"this is not a flatbuffer" * 10)
    edit_manifest(model_copy, lambda d: d["model"].update(sha256=sha256_file(path)))

    with pytest.raises(ModelLoadError, match="not a loadable TFLite model"):
        TFLiteModel(model_copy, backend=backend)


def test_missing_and_malformed_manifest(model_copy: Path) -> None:
    (model_copy / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        TFLiteModel(model_copy)

    (model_copy / "manifest.json").unlink()
    with pytest.raises(ManifestError, match="no manifest"):
        TFLiteModel(model_copy)


def test_manifest_that_disagrees_with_the_model(model_copy: Path, backend: str) -> None:
    def widen_slots(data: dict) -> None:
        for spec in data["signatures"]["update"]["inputs"]:
            if spec["name"] == "item":
                spec["shape"] = [99, 5]

    edit_manifest(model_copy, widen_slots)

    with pytest.raises(ManifestError, match="'update' inputs disagree with the manifest"):
        TFLiteModel(model_copy, backend=backend)


def test_manifest_without_a_required_signature(model_copy: Path) -> None:
    edit_manifest(model_copy, lambda d: d["signatures"].pop("reconstruct"))

    with pytest.raises(ManifestError, match="lacks required signatures"):
        TFLiteModel(model_copy)


def test_manifest_parameter_shape_disagreeing_with_its_numbers(model_copy: Path) -> None:
    edit_manifest(model_copy, lambda d: d["features"][0].update(range=[0, 200]))

    with pytest.raises(
        ManifestError,
        match=r"row-sparse global 'item_embeddings' has shape \[200, 16\]; feature 'item' indexes 201 rows",
    ):
        TFLiteModel(model_copy)


def test_wrong_global_tensors_are_refused_and_the_model_keeps_its_state(
    model_copy: Path, backend: str
) -> None:
    model = TFLiteModel(model_copy, backend=backend)
    before = model.get_global()
    nan = {k: v.copy() for k, v in before.items()}
    nan["item_bias"][3] = np.nan
    wrong_shape = {**before, "item_embeddings": np.zeros((200, 15), np.float32)}
    wrong_dtype = {**before, "global_mean": np.zeros(1, np.float64)}
    missing = {k: v for k, v in before.items() if k != "item_bias"}

    for bad, message in [
        (nan, "non-finite"),
        (wrong_shape, r"float32\[200, 15\], expected float32\[200, 16\]"),
        (wrong_dtype, "float64"),
        (missing, "missing"),
    ]:
        with pytest.raises(ParamsError, match=message):
            model.set_global(bad)

    for k, v in model.get_global().items():
        np.testing.assert_array_equal(v, before[k])


def test_params_round_trip_and_garbage_payload(model_copy: Path) -> None:
    model = TFLiteModel(model_copy)
    params = model.get_global()

    decoded = decode_params(encode_params(params), model.manifest.global_params, "globals")

    for k in params:
        np.testing.assert_array_equal(decoded[k], params[k])
    with pytest.raises(ParamsError, match="not a valid safetensors payload"):
        decode_params(b"\x00garbage", model.manifest.global_params, "globals")


def test_unknown_interpreter_backend(model_copy: Path) -> None:
    from model_runtime.interpreter import InterpreterUnavailable

    with pytest.raises(InterpreterUnavailable, match="expected one of"):
        TFLiteModel(model_copy, backend="tensorflow")


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_environment_variable_picks_the_backend(
    model_copy: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BACKEND_ENV, backend)

    assert TFLiteModel(model_copy).backend == backend


def test_numbers_a_signature_input_cannot_hold_are_refused_not_wrapped(model_copy: Path) -> None:
    model = TFLiteModel(model_copy)
    examples = Examples({"item": np.arange(10, dtype=np.int64), "label": np.full(10, 4.0, np.float32)})
    batches = TaskBatches.pack(split_batches(examples, model.manifest.batch_size), model.manifest)

    with pytest.raises(ValueError, match="num_steps must fit the model's int32 input, got 4294967301"):
        model.reconstruct(batches, 2**32 + 5, 0.1)
    with pytest.raises(ValueError, match="learning_rate must be a finite number within float32's range"):
        model.update(batches, 5, 1e39)
    with pytest.raises(ValueError, match="l2_global must be a finite number"):
        model.update(batches, 5, 0.1, l2_global=float("nan"))
