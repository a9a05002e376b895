"""`python -m device_runtime recommend`: a device's top-k from its store and a model directory."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from contracts.manifest import INITIAL_GLOBAL_FILE
from contracts.params import decode_params
from contracts.task_config import LocalState, TaskConfig
from device_runtime.__main__ import main
from device_runtime.client_task import Task, run_training_task
from device_runtime.example_store import Event, ExampleStore
from device_runtime.local_state import LocalStateStore
from device_runtime.recommender import Recommender
from device_runtime.task_environment import Environment
from model_export.config import ModelConfig
from model_runtime.tflite_model import TFLiteModel
from tests.conftest import BIASED, ROOT
from tests.device_runtime.test_example_store import first_schema_store


@pytest.fixture
def device(export: Callable[[ModelConfig], Path], tmp_path: Path) -> tuple[Path, Path]:
    """(model dir, store path) of a device with 30 ratings that has trained once in population 'p'."""
    model_dir = export(BIASED)
    path = tmp_path / "device.sqlite"
    with ExampleStore(path, BIASED.features()) as store:
        rng = np.random.default_rng(0)
        store.add(
            Event({"item": int(i), "label": float(rng.integers(1, 6))}, float(t))
            for t, i in enumerate(range(0, 60, 2))
        )
        model = TFLiteModel(model_dir)
        config = TaskConfig(local_state=LocalState.KEEP, local_learning_rate=0.5)
        result = run_training_task(
            model, Environment.of(store), model.get_global(), Task(config, population="p")
        )
        assert result.outcome.value == "completed", result.message
    return model_dir, path


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:  # type: ignore[type-arg]
    assert main(["recommend", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_top_k_from_reconstructed_and_from_kept_locals(
    device: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir, path = device
    common = ["--store", str(path), "--model-dir", str(model_dir), "-k", "5"]

    reconstructed = run_json(capsys, *common)
    kept = run_json(capsys, *common, "--locals", "kept", "--population", "p")

    model = TFLiteModel(model_dir)
    params = decode_params((model_dir / INITIAL_GLOBAL_FILE).read_bytes(), model.manifest.global_params, "g")
    with ExampleStore(path) as store:
        expected_kept = Recommender(model, store, params, kept=LocalStateStore(store, "p")).recommend(5)
        expected_reconstructed = Recommender(model, store, params).recommend(5)
    assert reconstructed["local_params"] == "reconstructed" and kept["local_params"] == "kept"
    assert reconstructed["items"] == expected_reconstructed.items.tolist()
    assert kept["items"] == expected_kept.items.tolist()
    assert reconstructed["items"] != kept["items"]
    assert not set(kept["items"]) & set(range(0, 60, 2))  # used items left out by default


def test_a_populations_task_config_reconstructs_as_its_training_does(
    device: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: the task config a population's devices train with (GET .../task-config)
    model_dir, path = device
    task = {"reconstruction_learning_rate": 0.02, "reconstruction_max_epochs": 1, "shuffle_seed": 7}
    (tmp_path / "task.json").write_text(json.dumps(task))
    common = ["--store", str(path), "--model-dir", str(model_dir), "-k", "5"]

    # Execute
    default = run_json(capsys, *common)
    served = run_json(capsys, *common, "--task-config", str(tmp_path / "task.json"))

    # Assert: the population's reconstruction, not the export's defaults
    model = TFLiteModel(model_dir)
    params = decode_params((model_dir / INITIAL_GLOBAL_FILE).read_bytes(), model.manifest.global_params, "g")
    with ExampleStore(path) as store:
        config = TaskConfig.from_manifest(model.manifest, **task)
        expected = Recommender(model, store, params, config).recommend(5)
    assert served["items"] == expected.items.tolist()
    assert np.allclose(served["scores"], expected.scores, atol=1e-5)
    assert not np.allclose(served["scores"], default["scores"], atol=1e-3)


def test_the_command_runs_as_a_module_and_prints_a_table(device: tuple[Path, Path]) -> None:
    model_dir, path = device

    command = ["recommend", "--store", str(path), "--model-dir", str(model_dir)]

    done = subprocess.run(
        [sys.executable, "-m", "device_runtime", *command],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )

    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert "30 examples" in lines[0] and "reconstructed local parameters" in lines[0]
    assert len(lines) == 2 + 10  # header, column names, ten items


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"--store": "missing.sqlite"}, "no example store at"),
        ({"--store": "garbage.sqlite"}, "is not a usable example store"),
        ({"--model-dir": "no-model"}, "no model directory at"),
        ({"--model-dir": "empty-model"}, "manifest"),
        ({"--globals": "garbage.sqlite"}, "not a valid safetensors payload"),
        ({"--locals": "kept"}, "--locals kept needs --population"),
        ({"--locals": "kept", "--population": "other"}, "no kept local parameters for population 'other'"),
        ({"-k": "0"}, "k must be in [1, 200]"),
        ({"--exclude": "3,x"}, "comma-separated item ids"),
        ({"--task-config": "missing.json"}, "cannot read --task-config"),
        ({"--task-config": "garbage.sqlite"}, "is not JSON"),
        ({"--task-config": "list.json"}, "expected a JSON object of task settings"),
        ({"--task-config": "typo.json"}, "unknown task config fields ['reconstruction_rate']"),
    ],
)
def test_bad_input_is_one_clear_line(
    change: dict[str, str],
    message: str,
    device: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    model_dir, path = device
    (tmp_path / "garbage.sqlite").write_bytes(b"this is not a database" * 100)
    (tmp_path / "empty-model").mkdir()
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "typo.json").write_text('{"reconstruction_rate": 0.1}')
    options = {"--store": str(path), "--model-dir": str(model_dir)}
    for flag, value in change.items():
        options[flag] = str(tmp_path / value) if value.endswith(("sqlite", "model", "json")) else value

    code = main(["recommend", *[part for pair in options.items() for part in pair]])

    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "missing.sqlite").exists()  # a typo never becomes an empty store


def test_a_first_schema_store_is_migrated_to_the_model_and_then_recommended_from(
    export: Callable[[ModelConfig], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: a store written before feature specs (schema 1: item and label columns)
    path = first_schema_store(tmp_path / "old.sqlite")
    common = ["--store", str(path), "--model-dir", str(export(BIASED)), "-k", "5"]

    # Execute
    first = run_json(capsys, *common)
    again = run_json(capsys, *common)

    # Assert: migrated once (and said so), its two examples kept and used
    assert "migrated from example store schema 1" in first["message"]
    assert "migrated" not in again["message"]
    assert first["examples"] == again["examples"] == 2
    assert first["source"] == "personalized" and first["items"] == again["items"]
    assert not {4, 9} & set(first["items"])  # the items it has examples for are left out


def test_a_first_schema_store_that_does_not_fit_the_model_is_refused_and_left_as_it_is(
    next_word_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = first_schema_store(tmp_path / "old.sqlite")

    tokens = ["--input", "tokens=1 2 3 4 5 6 7 8"]
    code = main(["predict", "--store", str(path), "--model-dir", str(next_word_model), *tokens])

    assert code == 2
    assert "can be migrated only to a model with one scalar int32 input" in capsys.readouterr().err
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 1
        assert conn.execute("SELECT count(*) FROM examples").fetchone()[0] == 2
