"""Convert an `ExportSpec` to a `.tflite` with training signatures and write its manifest.

`export_spec(spec, model_dir)` writes `model.tflite`, `manifest.json` and
`global_params.safetensors`; nothing is written when the spec or its graph cannot be
exported (an `ExportError` says what to change). The signature layout is in
`model_export.trainer`; the manifest's fields in `contracts.manifest`.
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf
from safetensors.numpy import save_file

from contracts.manifest import (
    FORMAT_VERSION,
    INITIAL_GLOBAL_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    Manifest,
    ManifestError,
    MetricSpec,
    TensorSpec,
)
from model_export.backend_check import check_backends
from model_export.gradients import builtin_gradients
from model_export.signatures import concrete_signatures
from model_export.spec import ExportError, ExportSpec
from model_export.trainer import Trainer

# What to do about a gradient or op that is not a TFLite builtin, by op type.
_FIXES = {
    "StridedSliceGrad": "slice with constant bounds and unit strides, or use tf.unstack / keras.ops.unstack "
    "instead of slicing (e.g. for an unrolled LSTM: unroll=True over unstacked time steps)",
    "BroadcastGradientArgs": "give every input a static shape (the signatures already fix the batch size)",
    # Verified with Keras 3.15: its TensorFlow argmax of floats uses bitwise ops.
    "BitwiseAnd": "if it comes from keras.ops.argmax on floats (e.g. in a metric), use tf.argmax",
}


@dataclass(frozen=True)
class ExportResult:
    model_dir: Path
    manifest: Manifest
    tflite_bytes: int
    parameter_bytes: int
    # What a port should know, one line each (from the check on every interpreter backend).
    warnings: tuple[str, ...] = ()


def _nodes(trainer_signatures: dict[str, Any]) -> list[tuple[str, str]]:
    """(op type, node name) of every node in the signatures' graphs, nested functions included."""
    found: list[tuple[str, str]] = []
    for concrete in trainer_signatures.values():
        graph_def = concrete.graph.as_graph_def()
        found += [(n.op, n.name) for n in graph_def.node]
        for function in graph_def.library.function:
            found += [(n.op, n.name) for n in function.node_def]
    return found


def _unsupported_op_error(message: str, signatures: dict[str, Any], layer_names: list[str]) -> ExportError:
    """An ExportError naming each op TFLite lacks, the layer it came from (from its name scope), and a fix."""
    op_types = sorted(set(re.findall(r"\btf\.([A-Z]\w*)", message)))  # op types are CamelCase
    nodes = _nodes(signatures)
    lines = []
    for op_type in op_types:
        # The converter's message locates each op by its node name, whose name scopes carry the
        # Keras layer (uniquified, e.g. `smooth_1`, in the training twin).
        scopes = {name for kind, name in nodes if kind == op_type}
        scopes |= set(re.findall(rf'"{re.escape(op_type)}:", "([^"@]+)', message))
        layers = sorted(
            {
                layer
                for layer in layer_names
                for scope in scopes
                if re.search(rf"(^|/){re.escape(layer)}(_\d+)?/", scope)
            }
        )
        where = f"from layer {', '.join(map(repr, layers))}" if layers else "from the loss, metrics or task"
        fix = _FIXES.get(
            op_type, "replace that layer or function with one whose ops and gradients are TFLite builtins"
        )
        lines.append(f"- {op_type} ({where}); fix: {fix}")
    if not lines:
        return ExportError(f"the model does not convert to TFLite builtin ops: {message.strip()[-1500:]}")
    return ExportError(
        "the model's training graph needs ops that are not TFLite builtins (the device interpreters "
        "tflite-runtime and ai-edge-litert have no Flex ops):\n" + "\n".join(lines)
    )


def convert(trainer: Trainer) -> bytes:
    """TFLite flatbuffer with every signature; builtin ops only, so it trains on any interpreter."""
    with builtin_gradients():
        signatures = concrete_signatures(trainer)
    with tempfile.TemporaryDirectory() as saved:
        tf.saved_model.save(trainer, saved, signatures=signatures)
        converter = tf.lite.TFLiteConverter.from_saved_model(saved, signature_keys=list(signatures))
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
        converter.experimental_enable_resource_variables = True
        try:
            blob: bytes = converter.convert()
        except Exception as e:  # the converter raises ConverterError and friends with op names in text
            raise _unsupported_op_error(
                str(e), signatures, [layer.name for layer in trainer.spec.model.layers]
            ) from None
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


def export_spec(spec: ExportSpec, model_dir: Path) -> ExportResult:
    """Write `model.tflite`, `manifest.json` and the initial global parameters to `model_dir`."""
    trainer = Trainer(spec)
    blob = convert(trainer)

    def param_specs(variables: dict[str, tf.Variable]) -> tuple[TensorSpec, ...]:
        return tuple(
            TensorSpec(k, tuple(v.shape.as_list()), v.dtype.name, trainer.row_sparse.get(k))
            for k, v in variables.items()
        )

    manifest = Manifest(
        format_version=FORMAT_VERSION,
        model_sha256="",
        model_bytes=len(blob),
        features=tuple(trainer.features),
        batch_size=spec.batch_size,
        max_batches=spec.max_batches,
        global_params=param_specs(trainer.global_vars),
        local_params=param_specs(trainer.local_vars),
        metrics=tuple(MetricSpec(m.name, m.value_range) for m in spec.metrics),
        task=spec.task,
        signatures=_signature_specs(blob),
        training_defaults=dict(spec.training_defaults),
        config=dict(spec.config),
        exported_with={"tensorflow": tf.__version__},
        task_row_features=tuple(trainer.task_row_features),
    )
    try:
        manifest.check_consistency()
    except ManifestError as e:
        raise ExportError(f"the exported signatures disagree with the spec: {e}") from None
    manifest = replace(manifest, model_sha256=hashlib.sha256(blob).hexdigest())
    warnings = check_backends(blob, manifest)
    model_dir.mkdir(parents=True, exist_ok=True)
    model_path = model_dir / MODEL_FILE
    model_path.write_bytes(blob)
    save_file({k: v.numpy() for k, v in trainer.global_vars.items()}, str(model_dir / INITIAL_GLOBAL_FILE))
    (model_dir / MANIFEST_FILE).write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
    parameter_bytes = sum(
        int(np.prod(v.shape)) * v.dtype.size
        for v in (*trainer.global_vars.values(), *trainer.local_vars.values())
    )
    return ExportResult(model_dir, manifest, len(blob), parameter_bytes, warnings)
