"""The task vectors: the kit's model, fixed globals and examples, and the calls a device makes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from conformance.generate_wire import MODEL
from conformance.port import of_bytes
from conformance.task_ops import run_task
from contracts.params import encode_params

# The signatures' float outputs and the delta, absolute: the Interpreter and tflite_runtime agree
# to ~1e-7 at these magnitudes; a port on another engine (CompiledModel, Core ML) gets some slack.
TOLERANCE = 1e-5


def generate(out: Path) -> None:
    manifest = json.loads((MODEL / "manifest.json").read_text())
    rng = np.random.default_rng(7)
    table = (0.1 * rng.normal(size=(12, 4))).astype(np.float32)
    out.joinpath("blobs").mkdir(parents=True, exist_ok=True)
    (out / "blobs" / "globals.safetensors").write_bytes(encode_params({"item_embeddings": table}))
    args: dict[str, Any] = {
        "manifest": {"$file": "model/manifest.json"},
        "model": {"$file": "model/model.tflite"},
        "globals": {"$file": "blobs/globals.safetensors"},
        "support": {"item": [3, 7, 1], "label": [4.0, 2.0, 5.0]},
        "query": {"item": [7, 9, 3, 10], "label": [3.0, 4.5, 4.0, 1.0]},
        "reconstruction": {"num_steps": 5, "learning_rate": 0.1, "l2_local": 0.0},
        "update": {
            "num_steps": 3,
            "learning_rate": 0.5,
            "l2_global": 0.0,
            "l2_local": 0.0,
            "local_learning_rate": 0.0,
        },
        "exclude": [3, 7, 1],
    }
    # The model is the kit's committed export wherever the vectors are written.
    files = {
        "manifest": MODEL / "manifest.json",
        "model": MODEL / "model.tflite",
        "globals": out / "blobs" / "globals.safetensors",
    }
    resolved = {**args, **{k: of_bytes(path.read_bytes()) for k, path in files.items()}}
    expect = run_task(resolved)
    assert manifest["signatures"].keys() >= {c["signature"] for c in expect["calls"]}
    case = {
        "name": "task: reconstruct, evaluate, update and infer on fixed examples",
        "op": "task.run",
        "args": args,
        "expect": expect,
        "tolerance": TOLERANCE,
    }
    (out / "cases.json").write_text(json.dumps([case], indent=1) + "\n")
