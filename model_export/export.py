"""Convert a `FedReconModel` to a `.tflite` with training signatures and write its manifest."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tensorflow as tf
from safetensors.numpy import save_file

from contracts.manifest import (
    FORMAT_VERSION,
    INITIAL_GLOBAL_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    Manifest,
    TensorSpec,
    sha256_file,
)
from model_export.config import ModelConfig
from model_export.model import FedReconModel


@dataclass(frozen=True)
class ExportResult:
    model_dir: Path
    manifest: Manifest
    tflite_bytes: int
    parameter_bytes: int


def convert(model: FedReconModel) -> bytes:
    """TFLite flatbuffer with every signature; builtin ops only, so it trains on any interpreter."""
    signatures = model.signatures()
    with tempfile.TemporaryDirectory() as saved:
        tf.saved_model.save(model, saved, signatures=signatures)
        converter = tf.lite.TFLiteConverter.from_saved_model(saved, signature_keys=list(signatures))
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
        converter.experimental_enable_resource_variables = True
        blob: bytes = converter.convert()
    return blob


def _signature_specs(blob: bytes) -> dict[str, dict[str, dict[str, TensorSpec]]]:
    # Read back through the device interpreter: this also proves the file loads there.
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_content=blob)
    specs: dict[str, dict[str, dict[str, TensorSpec]]] = {}
    for name in interpreter.get_signature_list():
        runner = interpreter.get_signature_runner(name)
        specs[name] = {
            side: {
                key: TensorSpec(key, tuple(int(d) for d in detail["shape"]), np.dtype(detail["dtype"]).name)
                for key, detail in sorted(details.items())
            }
            for side, details in (
                ("inputs", runner.get_input_details()),
                ("outputs", runner.get_output_details()),
            )
        }
    return specs


def export_model(config: ModelConfig, model_dir: Path) -> ExportResult:
    """Write `model.tflite`, `manifest.json` and the initial global parameters to `model_dir`."""
    model = FedReconModel(config)
    blob = convert(model)
    model_dir.mkdir(parents=True, exist_ok=True)
    model_path = model_dir / MODEL_FILE
    model_path.write_bytes(blob)

    initial_global = {k: v.numpy() for k, v in model.global_vars.items()}
    save_file(initial_global, str(model_dir / INITIAL_GLOBAL_FILE))

    def param_specs(variables: dict[str, tf.Variable]) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(k, tuple(v.shape.as_list()), v.dtype.name) for k, v in variables.items())

    training = config.to_json()["training"]
    assert isinstance(training, dict)
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        model_sha256=sha256_file(model_path),
        model_bytes=len(blob),
        feedback=config.feedback.value,
        num_items=config.num_items,
        embedding_dim=config.embedding_dim,
        batch_size=config.batch_size,
        max_batches=config.max_batches,
        top_k=config.top_k,
        label_range=config.label_range,
        global_params=param_specs(model.global_vars),
        local_params=param_specs(model.local_vars),
        signatures=_signature_specs(blob),
        training_defaults=training,
        config=config.to_json(),
        exported_with={"tensorflow": tf.__version__},
    )
    (model_dir / MANIFEST_FILE).write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
    parameter_bytes = sum(
        int(np.prod(v.shape)) * v.dtype.size
        for v in (*model.global_vars.values(), *model.local_vars.values())
    )
    return ExportResult(model_dir, manifest, len(blob), parameter_bytes)
