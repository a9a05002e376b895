"""The device runtime runs where TensorFlow cannot even be imported."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from model_export.config import ModelConfig
from tests.conftest import BIASED, ROOT

SCRIPT = """
import importlib.abc, json, sys

class NoTensorFlow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" or name.startswith("tensorflow."):
            raise ImportError("tensorflow is not available on this device")
        return None

sys.meta_path.insert(0, NoTensorFlow())

from pathlib import Path
from device_runtime.client_task import Task, run_training_task
from device_runtime.task_environment import Environment
from contracts.task_config import TaskConfig
from device_runtime.example_store import Event, ExampleStore
from model_runtime.tflite_model import TFLiteModel
from device_runtime.recommender import Recommender
import device_runtime.agent, device_runtime.__main__  # the agent and the command line load no table reader

model = TFLiteModel(Path(sys.argv[1]), backend=sys.argv[3])
store = ExampleStore(Path(sys.argv[2]), model.manifest.features)
store.add(Event({"item": i, "label": 4.0}, float(i)) for i in range(30))
result = run_training_task(model, Environment.of(store), model.get_global(), Task(TaskConfig()))
top = Recommender(model, store, model.get_global()).recommend(5)
print(json.dumps({
    "outcome": result.outcome.value,
    "top": len(top.items),
    "tensorflow_loaded": any(m == "tensorflow" or m.startswith("tensorflow.") for m in sys.modules),
    # Tables are read off the device (the `tables` extra): the device's own code never needs pyarrow.
    "pyarrow_loaded": any(m == "pyarrow" or m.startswith("pyarrow.") for m in sys.modules),
}))
"""


def test_client_task_and_recommender_without_tensorflow(
    export: Callable[[ModelConfig], Path], backend: str, tmp_path: Path
) -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(export(BIASED)), str(tmp_path / "s.sqlite"), backend],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )

    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"outcome": "completed", "top": 5, "tensorflow_loaded": False, "pyarrow_loaded": False}


def test_the_blocker_really_blocks_tensorflow() -> None:
    probe = SCRIPT.split("from pathlib")[0] + "import tensorflow\n"

    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)

    assert result.returncode != 0
    assert "tensorflow is not available on this device" in result.stderr
