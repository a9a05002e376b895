"""A model that trains on LiteRT's and tflite_runtime's Interpreter but whose `infer` fails on
LiteRT's CompiledModel: its output is an UNSORTED_SEGMENT_SUM over ids from the input, which TFLite
makes a dynamic tensor, and CompiledModel cannot bind a signature's output buffer to one. The
export must refuse it (`tests/model_export/test_backend_check.py`)."""

from __future__ import annotations

import keras
import tensorflow as tf

from contracts.features import FeatureSpec
from contracts.manifest import TaskSpec
from model_export.layers import LocalVector
from model_export.spec import ExportSpec, Metric

NUM_ITEMS, DIM, BATCH_SIZE = 12, 3, 4


class SegmentSum(keras.layers.Layer):  # type: ignore[misc]
    """Each example's value summed into the slot `item mod examples` (a dynamic TFLite tensor)."""

    def call(self, values: tf.Tensor, item: tf.Tensor) -> tf.Tensor:
        n = tf.shape(values)[0]  # static in every signature: the batch, or all batches flattened
        return tf.math.unsorted_segment_sum(values, tf.math.floormod(item, n), n)


def build() -> ExportSpec:
    keras.utils.set_random_seed(3)
    item = keras.Input(shape=(), dtype="int32", name="item")
    embedded = keras.layers.Embedding(NUM_ITEMS, DIM, name="item_embeddings")(item)
    score = LocalVector(DIM, name="user_embedding")(embedded)
    return ExportSpec(
        model=keras.Model({"item": item}, SegmentSum(name="segment_sum")(score, item)),
        features=(
            FeatureSpec("item", "int32"),
            FeatureSpec("label", "float32", role="label", value_range=(0, 1)),
        ),
        local_variables=("user_embedding",),
        loss=lambda y, p: tf.square(p - y),
        metrics=(Metric("squared_error", lambda y, p: tf.square(p - y)),),
        task=TaskSpec("regression"),
        batch_size=BATCH_SIZE,
        max_batches=2,
        config={"model": "dynamic_output"},
    )
