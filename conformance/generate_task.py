"""The task vectors: for the kit's exported model (vectors/task/model), fixed globals and fixed
examples, every signature call one FedRecon round makes (reset_local, reconstruct, evaluate,
update) and a ranking after it (set_global, infer), with their exact inputs and the outputs the
Python device's interpreter gave; and the row-sparse delta the device must report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from conformance.vectors import MODEL_DIR, write_blob, write_json
from contracts.features import Examples
from contracts.manifest import load_manifest
from contracts.params import encode_params, encode_sparse_delta
from contracts.task_config import TaskConfig
from device_runtime.fedrecon_step import Halt, fedrecon_step
from model_runtime.support_query import split_support_query
from model_runtime.task_batches import TaskBatches
from model_runtime.tflite_model import TFLiteModel

# Outputs are float32 from one interpreter; another interpreter, CPU or compiler may round
# differently in the last bits, and training compounds it over the steps.
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
ITEMS = [3, 7, 1, 3, 9, 0, 7, 5]
LABELS = [4.0, 2.5, 5.0, 3.5, 1.0, 4.5, 3.0, 2.0]
CONFIG = {"split": "alternate", "shuffle_seed": None, "reconstruction_max_steps": 4, "update_max_steps": 3}


def tensor_json(value: Any) -> dict[str, Any]:
    array = np.asarray(value)
    return {"dtype": array.dtype.name, "shape": list(array.shape), "values": array.ravel().tolist()}


def examples_json(examples: Examples) -> dict[str, Any]:
    return {name: tensor_json(column) for name, column in examples.columns.items()}


class _Recording(TFLiteModel):
    """The model, writing down each signature call it makes."""

    calls: list[dict[str, Any]]

    def _call(self, name: str, **inputs: Any) -> dict[str, np.ndarray]:
        outputs = super()._call(name, **inputs)
        self.calls.append(
            {
                "signature": name,
                "inputs": {k: tensor_json(v) for k, v in sorted(inputs.items())},
                "outputs": {k: tensor_json(v) for k, v in sorted(outputs.items())},
            }
        )
        return outputs


def task_vectors(model_dir: Path, out: Path) -> dict[str, Any]:
    manifest = load_manifest(model_dir)
    rng = np.random.default_rng(50_000)
    globals_ = {s.name: rng.normal(scale=0.3, size=s.shape).astype(s.dtype) for s in manifest.global_params}
    config = TaskConfig.from_manifest(manifest, **CONFIG)
    examples = Examples({"item": np.asarray(ITEMS, np.int32), "label": np.asarray(LABELS, np.float32)})
    support, query = split_support_query(examples, manifest, config)
    model = _Recording(model_dir, default_delegates=False)
    model.calls = []
    model.set_global(globals_)
    support_batches = TaskBatches.pack(support, manifest)
    query_batches = TaskBatches.pack(query, manifest)
    step = fedrecon_step(model, support_batches, query_batches, config, measured=query_batches)
    if isinstance(step, Halt):
        raise RuntimeError(f"the kit's task halted ({step}); change its examples")
    delta = model.dense_delta(step.trained.update)
    model.infer()
    write_blob(out / "delta.safetensors", encode_sparse_delta(delta))
    write_blob(out / "globals.safetensors", encode_params(globals_))
    return {
        "model": "model",
        "globals": "globals.safetensors",
        "config": config.to_json(),
        "examples": examples_json(examples),
        "support": [examples_json(b) for b in support],
        "query": [examples_json(b) for b in query],
        "calls": model.calls,
        "delta": "delta.safetensors",
        "delta_rows": {name: rows.tolist() for name, rows in step.trained.update.rows.items()},
        "tolerance": TOLERANCE,
    }


def generate(root: Path) -> None:
    write_json(root / "task" / "task.json", task_vectors(MODEL_DIR, root / "task"))
