"""Where `reconstruct` starts a local vector (`ExportSpec.local_start`): at a scaled mean of one
layer's per-example outputs over the device's support examples weighted by label, e.g. the mean of
the item vectors of what the device shared, instead of its exported initial value. The
reconstruction's SGD then refines a vector that already points at the device's history (each
share weighing the same) rather than building it from zero, where its first steps weigh each
share by how surprising the model finds it.
"""

from __future__ import annotations

import math
from typing import Any

import keras
import tensorflow as tf

from model_export.spec import ExportError, LocalStart


def start_model(twin: Any, start: LocalStart, local_shapes: dict[str, tuple[int, ...]]) -> Any:
    """The training twin cut at `start.layer`: its per-example outputs, checked to have the
    shape of the local `start.local`."""
    if start.local not in local_shapes:
        raise ExportError(
            f"local_start names the local {start.local!r}; the model's locals are {sorted(local_shapes)}"
        )
    if not (isinstance(start.scale, int | float) and math.isfinite(start.scale)):
        raise ExportError(f"local_start's scale must be a finite number, got {start.scale!r}")
    names = [layer.name for layer in twin.layers]
    if start.layer not in names:
        raise ExportError(f"local_start names the layer {start.layer!r}; the model's layers are {names}")
    # Layers the twin shares with the model have a call (node) in each: take the twin's.
    in_twin = {id(n) for nodes in twin._nodes_by_depth.values() for n in nodes}
    calls = [n for n in twin.get_layer(start.layer)._inbound_nodes if id(n) in in_twin]
    if len(calls) != 1 or len(calls[0].output_tensors) != 1:
        raise ExportError(
            f"local_start's layer {start.layer!r} must be called once in the model, with one output"
        )
    output = calls[0].output_tensors[0]
    shape = tuple(output.shape[1:])
    if shape != local_shapes[start.local]:
        raise ExportError(
            f"local_start's layer {start.layer!r} gives per-example outputs of shape {shape}; "
            f"the local {start.local!r} has shape {local_shapes[start.local]}"
        )
    return keras.Model(twin.input, output, name=f"{twin.name}_local_start")


def history_mean(
    vectors: tf.Tensor, weights: tf.Tensor, labels: tf.Tensor, contrast: bool = False
) -> tuple[tf.Tensor, tf.Tensor]:
    """(the weights x labels weighted mean of the per-example `vectors` [n, *shape], minus with
    `contrast` the weights x (1 - labels) weighted mean; the first mean's total): a mean is zeros
    when its total is not positive."""
    labels = tf.reshape(tf.cast(labels, tf.float32), [-1])
    weights = tf.reshape(weights, [-1])

    def mean(w: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        total = tf.reduce_sum(w)
        expand = tf.reshape(w, [-1] + [1] * (vectors.shape.rank - 1))
        return tf.math.divide_no_nan(tf.reduce_sum(expand * vectors, axis=0), total), total

    shared, total = mean(weights * labels)
    if contrast:
        shared -= mean(weights * (1.0 - labels))[0]
    return shared, total


def started(current: tf.Tensor, mean: tf.Tensor, total: tf.Tensor, scale: float) -> tf.Tensor:
    """`scale` x `mean` where the history has weight, else `current` (the reset value)."""
    return tf.where(total > 0.0, scale * mean, current)
