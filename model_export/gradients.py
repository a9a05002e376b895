"""Builtin-op gradients for the ops whose TensorFlow gradient needs a Flex (select-TF) op.

The TFLite interpreters a device has (`tflite-runtime`, `ai-edge-litert`) run builtin ops
only. Two common gradients are not builtins (verified with TF 2.21, DESIGN.md): `ReluGrad`
and `StridedSliceGrad`. While the signatures are traced, `builtin_gradients()` swaps in
equivalents made of builtin ops: for ReLU `dy * cast(y > 0)`, and for a slice with constant
bounds and unit strides (e.g. `x[:, t, :]`) a `PAD` of `dy` back to the input's shape. A slice
they do not cover keeps TensorFlow's gradient, and the export then fails naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import tensorflow as tf
from tensorflow.python.framework import ops

_Gradient = Callable[..., Any]


def _relu_grad(op: Any, grad: tf.Tensor) -> tf.Tensor:
    return grad * tf.cast(op.outputs[0] > 0, grad.dtype)


def _slice_paddings(op: Any) -> tuple[list[int], list[list[int]]] | None:
    """(sliced shape with shrunk axes kept as 1, paddings back to the input) or None if unsupported."""
    x = op.inputs[0]
    begin, end, strides = (tf.get_static_value(t) for t in op.inputs[1:4])
    if begin is None or end is None or strides is None or not x.shape.is_fully_defined():
        return None
    if op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask") or any(s != 1 for s in strides):
        return None
    begin_mask, end_mask, shrink = (op.get_attr(a) for a in ("begin_mask", "end_mask", "shrink_axis_mask"))
    kept: list[int] = []
    paddings: list[list[int]] = []
    for axis, dim in enumerate(x.shape.as_list()):
        if axis >= len(begin):
            kept.append(dim)
            paddings.append([0, 0])
            continue
        start = 0 if begin_mask >> axis & 1 else int(begin[axis])
        start = min(max(start + dim if start < 0 else start, 0), dim)
        if shrink >> axis & 1:
            stop = start + 1
        else:
            stop = dim if end_mask >> axis & 1 else int(end[axis])
            stop = min(max(stop + dim if stop < 0 else stop, start), dim)
        kept.append(stop - start)
        paddings.append([start, dim - stop])
    return kept, paddings


@contextmanager
def builtin_gradients() -> Iterator[None]:
    """Trace with the builtin gradients above in place of TensorFlow's (restored on exit)."""
    registry: dict[str, dict[str, Any]] = ops._gradient_registry._registry
    saved = {name: dict(registry[name]) for name in ("Relu", "StridedSlice")}
    tf_strided_slice_grad: _Gradient = saved["StridedSlice"]["type"]

    def strided_slice_grad(op: Any, grad: tf.Tensor) -> Any:
        layout = _slice_paddings(op)
        if layout is None:
            return tf_strided_slice_grad(op, grad)
        kept, paddings = layout
        return [tf.pad(tf.reshape(grad, kept), paddings), None, None, None]

    registry["Relu"] = {**saved["Relu"], "type": _relu_grad}
    registry["StridedSlice"] = {**saved["StridedSlice"], "type": strided_slice_grad}
    try:
        yield
    finally:
        registry.update(saved)
