"""A user's own model for the tests: an hour-aware expression recommender (not one of ours).

The score of an expression at an hour is `<e, u + h[hour]> + b`: global expression embeddings
`e` and biases `b` (row-sparse: a task trains only the rows it uses), a local user embedding `u`
and a local per-user hour-preference table `h` (two local tensors that never leave the device).
The hour is a context feature: `infer` ranks every expression for one hour. Implicit feedback:
the examples are shares, the tasks sample non-shared expressions as negatives. Exported with
`python -m model_export --model tests.device_runtime.hour_recommender:build`.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from contracts.features import FeatureSpec
from contracts.manifest import TaskSpec
from model_export.layers import LocalVector, RowTable
from model_export.spec import ExportSpec, Metric

HOURS = 24


def build(
    num_expressions: int = 30, dim: int = 6, batch_size: int = 16, max_batches: int = 8, top_k: int = 10
) -> ExportSpec:
    keras.utils.set_random_seed(3)
    expression = keras.Input(shape=(), dtype="int32", name="expression")
    hour = keras.Input(shape=(), dtype="int32", name="hour")
    init = keras.initializers.RandomNormal(stddev=0.3, seed=2)
    e = keras.layers.Embedding(
        num_expressions, dim, embeddings_initializer=init, name="expression_embeddings"
    )(expression)
    bias = RowTable(num_expressions, name="expression_bias")(expression)
    preference = RowTable(HOURS, (dim,), name="hour_preference")(hour)
    in_hour = keras.ops.sum(keras.layers.Multiply(name="at_hour")([e, preference]), axis=-1)
    score = keras.layers.Add(name="score")([LocalVector(dim, name="user_embedding")(e), in_hour, bias])
    return ExportSpec(
        model=keras.Model({"expression": expression, "hour": hour}, score),
        features=(
            FeatureSpec("expression", "int32"),
            FeatureSpec("hour", "int32", value_range=(0, HOURS - 1)),
            FeatureSpec("label", "float32", role="label", value_range=(0, 1), discrete=True),
        ),
        local_variables=("user_embedding", "hour_preference"),
        loss=lambda y, s: tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=s),
        metrics=(
            Metric("correct", lambda y, s: tf.cast(tf.cast(s > 0.0, tf.float32) == y, tf.float32), (0, 1)),
        ),
        row_sparse={"expression_embeddings": "expression", "expression_bias": "expression"},
        task=TaskSpec(
            "ranking",
            top_k=top_k,
            catalog_feature="expression",
            negative_sampling=True,
            popularity="expression_bias",
        ),
        batch_size=batch_size,
        max_batches=max_batches,
        training_defaults={"reconstruction_learning_rate": 0.5, "update_learning_rate": 0.5},
        config={"model": "hour_recommender"},
    )
