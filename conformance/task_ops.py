"""A round's task as the kit's operation: the exact signature calls the Python device makes for
fixed examples (reconstruct, evaluate, update, infer), and the delta it reports.

The device's steps: install the round's globals, reset the locals, reconstruct them on the support
examples, evaluate and update on the query examples, rank the catalog. Each call is recorded as
the signature's name, its inputs and its outputs, in order."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from conformance.port import to_bytes
from conformance.tensors import sparse_json, tensor_json
from contracts.features import Examples
from contracts.manifest import MANIFEST_FILE, MODEL_FILE
from contracts.params import decode_params, sparse_rows
from model_runtime.task_batches import TaskBatches, split_batches
from model_runtime.tflite_model import TFLiteModel


class RecordedModel(TFLiteModel):
    """The runtime's model, keeping each signature call it makes."""

    calls: list[dict[str, Any]]

    def _call(self, name: str, **inputs: Any) -> dict[str, np.ndarray]:
        outputs = super()._call(name, **inputs)
        self.calls.append(
            {
                "signature": name,
                "inputs": {k: tensor_json(np.asarray(v)) for k, v in sorted(inputs.items())},
                "outputs": {k: tensor_json(np.asarray(v)) for k, v in sorted(outputs.items())},
            }
        )
        return outputs


def _batches(columns: dict[str, list[Any]], model: TFLiteModel) -> TaskBatches:
    examples = Examples({k: np.asarray(v) for k, v in columns.items()})
    return TaskBatches.pack(split_batches(examples, model.manifest.batch_size), model.manifest)


def run_task(args: dict[str, Any], backend: str | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        model_dir = Path(folder)
        (model_dir / MANIFEST_FILE).write_bytes(to_bytes(args["manifest"]))
        (model_dir / MODEL_FILE).write_bytes(to_bytes(args["model"]))
        model = RecordedModel(model_dir, backend=backend, default_delegates=False)
    model.calls = []
    model.set_global(decode_params(to_bytes(args["globals"]), model.manifest.global_params, "globals"))
    support, query = _batches(args["support"], model), _batches(args["query"], model)
    r, u = args["reconstruction"], args["update"]
    model.reset_local()
    model.reconstruct(support, r["num_steps"], r["learning_rate"], r["l2_local"])
    model.evaluate(query)
    update = model.update_rows(
        query,
        u["num_steps"],
        u["learning_rate"],
        local_learning_rate=u["local_learning_rate"],
        l2_global=u["l2_global"],
        l2_local=u["l2_local"],
    )
    model.infer(exclude=np.asarray(args["exclude"], dtype=np.int64))
    delta = {name: sparse_json(sparse_rows(value)) for name, value in model.dense_delta(update).items()}
    return {"calls": model.calls, "delta": delta}


TASK_OPS = {"task.run": run_task}
