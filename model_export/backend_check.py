"""Refuse an export that trains on one interpreter backend and not another.

The converted model runs through `model_runtime.backend_agreement` in a subprocess (TensorFlow is
loaded here, and `tflite_runtime` cannot load a model in a process that imported it): every
signature on every installed backend (`ai_edge_litert`'s and `tflite_runtime`'s Interpreter,
LiteRT's CompiledModel), compared to float tolerance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from contracts.manifest import MANIFEST_FILE, MODEL_FILE, Manifest
from model_export.spec import ExportError

ROOT = Path(__file__).resolve().parent.parent


def check_backends(blob: bytes, manifest: Manifest) -> tuple[str, ...]:
    """The warnings a port should know of; ExportError (one line per problem) when the model
    fails or gives different results on one of the installed backends."""
    with tempfile.TemporaryDirectory(prefix="model-export-backends-") as folder:
        (Path(folder) / MODEL_FILE).write_bytes(blob)
        (Path(folder) / MANIFEST_FILE).write_text(json.dumps(manifest.to_json()))
        result = subprocess.run(
            [sys.executable, "-m", "model_runtime.backend_agreement", folder],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
            },
        )
    if result.returncode != 0:
        raise ExportError(
            "the converted model crashed the interpreter backends' check (exit "
            f"{result.returncode}): {result.stderr.strip()[-500:]}"
        )
    found = json.loads(result.stdout.strip().splitlines()[-1])
    if found["problems"]:
        raise ExportError(
            "the model does not run alike on every interpreter backend "
            f"({', '.join(found['backends'])}):\n" + "\n".join(f"- {p}" for p in found["problems"])
        )
    return tuple(found["warnings"])
