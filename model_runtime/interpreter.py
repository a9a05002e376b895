"""Which TFLite interpreter this device has: `ai_edge_litert` (LiteRT) or `tflite_runtime`.

Never TensorFlow: a phone does not have it, and importing it would cost hundreds of MB.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

BACKENDS = ("ai_edge_litert", "tflite_runtime")
BACKEND_ENV = "DEVICE_RUNTIME_INTERPRETER"


class InterpreterUnavailable(RuntimeError):
    """No supported TFLite interpreter package is installed."""


def interpreter_class(backend: str | None = None) -> tuple[str, Any]:
    """(backend name, Interpreter class); `backend` or $DEVICE_RUNTIME_INTERPRETER picks one."""
    wanted = backend or os.environ.get(BACKEND_ENV) or None
    if wanted is not None and wanted not in BACKENDS:
        raise InterpreterUnavailable(f"unknown interpreter backend {wanted!r}; expected one of {BACKENDS}")
    errors = []
    for name in [wanted] if wanted else list(BACKENDS):
        try:
            module = importlib.import_module(f"{name}.interpreter")
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        return name, module.Interpreter
    raise InterpreterUnavailable(
        "no TFLite interpreter could be imported (" + "; ".join(errors) + "); "
        "install ai-edge-litert or tflite-runtime"
    )
