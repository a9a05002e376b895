"""The `Interpreter` backends: `ai_edge_litert.interpreter` and `tflite_runtime.interpreter`, one
API, whose signature runners take and give numpy arrays by name."""

from __future__ import annotations

import functools
import importlib
from typing import Any

import numpy as np

from model_runtime.interpreter import Loader, ModelBackend, Signature, TensorShape


def interpreter_loader(package: str) -> Loader:
    """A loader for `package`'s Interpreter; ImportError if the package is missing."""
    module = importlib.import_module(f"{package}.interpreter")
    return functools.partial(_load, package, module)


def _load(
    package: str, module: Any, content: bytes, *, num_threads: int, default_delegates: bool
) -> ModelBackend:
    resolver = module.OpResolverType
    interpreter = module.Interpreter(
        model_content=content,
        num_threads=num_threads,
        experimental_op_resolver_type=(
            resolver.AUTO if default_delegates else resolver.BUILTIN_WITHOUT_DEFAULT_DELEGATES
        ),
    )
    return InterpreterBackend(package, interpreter)


def _shapes(details: dict[str, dict[str, Any]]) -> dict[str, TensorShape]:
    return {
        k: TensorShape(tuple(int(x) for x in d["shape"]), np.dtype(d["dtype"]).name)
        for k, d in details.items()
    }


class _InterpreterSignature:
    def __init__(self, runner: Any) -> None:
        self._runner = runner
        self.inputs = _shapes(runner.get_input_details())
        self.outputs = _shapes(runner.get_output_details())

    def __call__(self, **inputs: np.ndarray | np.generic) -> dict[str, np.ndarray]:
        result: dict[str, np.ndarray] = self._runner(**inputs)
        return result


class InterpreterBackend:
    def __init__(self, name: str, interpreter: Any) -> None:
        self.name = name
        self._interpreter = interpreter

    def signature_names(self) -> list[str]:
        return list(self._interpreter.get_signature_list())

    def signature(self, name: str) -> Signature:
        return _InterpreterSignature(self._interpreter.get_signature_runner(name))
