"""Which TFLite engine this device runs the model with: LiteRT's `Interpreter` (`ai_edge_litert`),
`tflite_runtime`'s, or LiteRT's `CompiledModel` (`compiled_model`, the engine of LiteRT 2.x's
Kotlin and Swift APIs).

Each backend is an adapter behind one small interface (`ModelBackend`: its signatures, each with
its inputs' and outputs' shapes and a call by name), so `TFLiteModel` runs all three alike.
Never TensorFlow: a phone does not have it, and importing it would cost hundreds of MB.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np

BACKENDS = ("ai_edge_litert", "tflite_runtime", "compiled_model")
BACKEND_ENV = "DEVICE_RUNTIME_INTERPRETER"


class InterpreterUnavailable(RuntimeError):
    """No supported TFLite interpreter package is installed."""


@dataclass(frozen=True)
class TensorShape:
    """A signature input's or output's shape and dtype name (`float32`, `int32`)."""

    shape: tuple[int, ...]
    dtype: str


class Signature(Protocol):
    """One signature of the loaded model: what it takes and gives, and a call by input name."""

    inputs: dict[str, TensorShape]
    outputs: dict[str, TensorShape]

    def __call__(self, **inputs: np.ndarray | np.generic) -> dict[str, np.ndarray]: ...


class ModelBackend(Protocol):
    """A model loaded by one backend; its signatures share the model's variables."""

    name: str

    def signature_names(self) -> list[str]: ...

    def signature(self, name: str) -> Signature: ...


def backend_name(backend: str | None = None) -> str | None:
    """The backend asked for (`backend`, else $DEVICE_RUNTIME_INTERPRETER), None for any."""
    wanted = backend or os.environ.get(BACKEND_ENV) or None
    if wanted is not None and wanted not in BACKENDS:
        raise InterpreterUnavailable(f"unknown interpreter backend {wanted!r}; expected one of {BACKENDS}")
    return wanted


def load_backend(
    content: bytes, backend: str | None = None, *, num_threads: int = 1, default_delegates: bool = True
) -> ModelBackend:
    """`content` loaded by `backend` (or $DEVICE_RUNTIME_INTERPRETER; neither: the first of
    BACKENDS installed). ValueError/RuntimeError: the bytes are not a loadable model."""
    wanted = backend_name(backend)
    errors = []
    for name in [wanted] if wanted else list(BACKENDS):
        try:
            loader = _loader(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        return loader(content, num_threads=num_threads, default_delegates=default_delegates)
    raise InterpreterUnavailable(
        "no TFLite interpreter could be imported (" + "; ".join(errors) + "); "
        "install ai-edge-litert or tflite-runtime"
    )


def installed_backends() -> list[str]:
    """The backends this installation can load models with."""
    found = []
    for name in BACKENDS:
        try:
            _loader(name)
        except ImportError:
            continue
        found.append(name)
    return found


class Loader(Protocol):
    def __call__(self, content: bytes, *, num_threads: int, default_delegates: bool) -> ModelBackend: ...


def _loader(name: str) -> Loader:
    """The backend's load function; ImportError when its package is missing."""
    if name == "compiled_model":
        from model_runtime.compiled_model_backend import load_compiled_model

        return load_compiled_model
    from model_runtime.interpreter_backend import interpreter_loader

    return interpreter_loader(name)
