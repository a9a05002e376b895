"""The `compiled_model` backend: LiteRT's `CompiledModel` (`ai_edge_litert.compiled_model`), the
engine behind LiteRT 2.x's Kotlin `CompiledModel.run(inputs, outputs, signature)`.

It runs a signature on tensor buffers: one set per signature, made once, written before and read
after each run. Two things differ from the Interpreter, and a port meets them too:
- outputs that are one tensor (an evaluate signature whose loss is its squared error gives
  `loss_sum` and `squared_error_sum` from one tensor) come back under one of their names only, so
  outputs are named here from the model's own signature defs, by tensor;
- creating the LiteRT environment prints INFO lines on stderr, so one environment serves the
  process.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

import numpy as np
from ai_edge_litert import schema_py_generated as schema
from ai_edge_litert.compiled_model import (
    CompiledModel,
    CpuKernelMode,
    CpuOptions,
    Environment,
    HardwareAccelerator,
    Options,
)

from model_runtime.interpreter import ModelBackend, Signature, TensorShape

_environment_lock = threading.Lock()


@functools.cache
def _environment() -> Environment:
    return Environment.create()


def load_compiled_model(content: bytes, *, num_threads: int, default_delegates: bool) -> ModelBackend:
    """`content` compiled for the CPU; `default_delegates=False`: the builtin kernels, no XNNPACK."""
    cpu = CpuOptions(
        num_threads=num_threads, kernel_mode=None if default_delegates else CpuKernelMode.BUILTIN
    )
    with _environment_lock:
        environment = _environment()
    model = CompiledModel.from_buffer(
        content,
        environment=environment,
        options=Options(hardware_accelerators=HardwareAccelerator.CPU, cpu_options=cpu),
    )
    return CompiledModelBackend(model, _signature_outputs(content))


def _signature_outputs(content: bytes) -> dict[str, dict[str, int]]:
    """Per signature, each output's name -> its tensor index, as the model file declares them."""
    model = schema.Model.GetRootAsModel(content, 0)
    outputs = {}
    for i in range(model.SignatureDefsLength()):
        definition = model.SignatureDefs(i)
        outputs[_text(definition.SignatureKey())] = {
            _text(definition.Outputs(j).Name()): int(definition.Outputs(j).TensorIndex())
            for j in range(definition.OutputsLength())
        }
    return outputs


def _text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _shape(detail: dict[str, Any]) -> TensorShape:
    return TensorShape(tuple(int(x) for x in detail["shape"]), np.dtype(detail["dtype"]).name)


class _CompiledSignature:
    def __init__(self, model: CompiledModel, key: str, declared_outputs: dict[str, int]) -> None:
        self._model = model
        self._key = key
        input_details = model.get_input_tensor_details(key)
        output_details = model.get_output_tensor_details(key)
        self.inputs = {name: _shape(d) for name, d in input_details.items()}
        # The engine's output name for each tensor, then every declared name of that tensor.
        engine_name = {int(d["index"]): name for name, d in output_details.items()}
        missing = sorted(n for n, t in declared_outputs.items() if t not in engine_name)
        if missing:
            raise RuntimeError(f"CompiledModel gives signature {key!r} no output {missing}")
        self._output_of = {name: engine_name[t] for name, t in declared_outputs.items()}
        self.outputs = {name: _shape(output_details[self._output_of[name]]) for name in declared_outputs}
        self._in = {name: model.create_input_buffer_by_name(key, name) for name in self.inputs}
        self._out = {name: model.create_output_buffer_by_name(key, name) for name in output_details}
        self._out_shapes = {name: _shape(d) for name, d in output_details.items()}

    def __call__(self, **inputs: np.ndarray | np.generic) -> dict[str, np.ndarray]:
        if set(inputs) != set(self.inputs):
            raise ValueError(
                f"signature {self._key!r} takes inputs {sorted(self.inputs)}, got {sorted(inputs)}"
            )
        for name, value in inputs.items():
            array = np.asarray(value)
            spec = self.inputs[name]
            if array.shape != spec.shape or array.dtype.name != spec.dtype:
                raise ValueError(
                    f"signature {self._key!r} input {name!r} is {spec.dtype} {list(spec.shape)}, "
                    f"got {array.dtype.name} {list(array.shape)}"
                )
            if array.size:
                self._in[name].write(array)
        self._model.run_by_name(self._key, self._in, self._out)
        values = {}
        for name, buffer in self._out.items():
            spec = self._out_shapes[name]
            count = math.prod(spec.shape)
            values[name] = (
                buffer.read(count, np.dtype(spec.dtype)).reshape(spec.shape)
                if count
                else np.zeros(spec.shape, spec.dtype)
            )
        return {name: values[engine] for name, engine in self._output_of.items()}


class CompiledModelBackend:
    name = "compiled_model"

    def __init__(self, model: CompiledModel, outputs: dict[str, dict[str, int]]) -> None:
        self._model = model
        self._outputs = outputs

    def signature_names(self) -> list[str]:
        return list(self._model.get_signature_list())

    def signature(self, name: str) -> Signature:
        return _CompiledSignature(self._model, name, self._outputs.get(name, {}))


def aliased_outputs(content: bytes) -> dict[str, list[str]]:
    """Per signature whose outputs share a tensor, the names of those outputs."""
    aliased = {}
    for key, outputs in _signature_outputs(content).items():
        names: dict[int, list[str]] = {}
        for name, tensor in outputs.items():
            names.setdefault(tensor, []).append(name)
        shared = sorted(n for group in names.values() if len(group) > 1 for n in group)
        if shared:
            aliased[key] = shared
    return aliased
