"""The FedRecon matrix-factorization model as a Keras model, exported through the generic path.

Parameters are split as in Federated Reconstruction:

- global: `item_embeddings` [num_items, dim], optional `item_bias` [num_items] (both row-sparse
  by the `item` feature: a task trains only its items' rows) and `global_mean` [1]; with the
  catalog's item groups, optional `group_embeddings` [groups, dim] and `group_bias` [groups]
  (dense: every task trains them);
- local: `user_embedding` [dim], optional `user_bias` [1], reconstructed on the device (with
  `history_start`, the user vector's reconstruction starts at the scaled mean of the shared
  items' vectors, `model_export.local_start`).

A score is `<item_embeddings[item] + group_embeddings[group], user_embedding> + item_bias[item]
+ group_bias[group] + user_bias + global_mean`, `group` being the item's group (a constant of the
model, `CatalogAttribute`): a predicted rating (explicit feedback) or a logit (implicit: shared
or not).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from contracts.manifest import TaskSpec
from model_export.config import ITEM, Feedback, ModelConfig
from model_export.layers import CatalogAttribute, LocalVector, Offset, RowTable
from model_export.spec import ExportSpec, LocalStart, Metric, PerExample


def explicit_loss(huber_delta: float) -> PerExample:
    def loss(label: tf.Tensor, score: tf.Tensor) -> tf.Tensor:
        error = score - label
        if huber_delta > 0.0:
            # Huber, scaled to match the squared error (value and slope) at +-delta, so the
            # learning rates mean the same as without it.
            abs_error = tf.abs(error)
            return tf.where(
                abs_error <= huber_delta, tf.square(error), 2.0 * huber_delta * abs_error - huber_delta**2
            )
        return tf.square(error)

    return loss


def implicit_loss(label: tf.Tensor, logit: tf.Tensor) -> tf.Tensor:
    return tf.nn.sigmoid_cross_entropy_with_logits(labels=label, logits=logit)


def build_model(config: ModelConfig) -> keras.Model:
    item = keras.Input(shape=(), dtype="int32", name=ITEM)
    init = keras.initializers.RandomNormal(stddev=config.init_stddev, seed=config.seed)
    rows = keras.layers.Embedding(
        config.num_items, config.embedding_dim, embeddings_initializer=init, name="item_embeddings"
    )(item)
    if config.group_embeddings or config.group_bias:
        group = CatalogAttribute(config.item_groups, name="item_group")(item)
    # A group table's values are sqrt(group_rate) times the stored (trained) ones: its SGD steps
    # are group_rate times the others'.
    scale = math.sqrt(config.group_rate)
    if config.group_embeddings:
        shared = keras.layers.Embedding(
            config.num_groups,
            config.embedding_dim,
            embeddings_initializer=keras.initializers.Constant(group_directions(config) / scale),
            name="group_embeddings",
        )(group)
        shared = keras.layers.Rescaling(scale, name="group_embedding_rate")(shared)
        rows = keras.layers.Add(name="plus_group_embedding")([rows, shared])
    score = LocalVector(config.embedding_dim, name="user_embedding")(rows)
    if config.item_bias:
        score = keras.layers.Add(name="plus_item_bias")(
            [score, RowTable(config.num_items, name="item_bias")(item)]
        )
    if config.group_bias:
        bias = RowTable(config.num_groups, name="group_bias")(group)
        score = keras.layers.Add(name="plus_group_bias")(
            [score, keras.layers.Rescaling(scale, name="group_bias_rate")(bias)]
        )
    if config.user_bias:
        score = Offset(name="user_bias")(score)
    if config.global_mean:
        score = Offset(config.global_mean_init, name="global_mean")(score)
    model = keras.Model({ITEM: item}, score, name="matrix_factorization")
    if config.item_groups and not config.group_embeddings:
        table = model.get_layer("item_embeddings")
        groups = np.asarray(config.item_groups, np.int64)
        table.set_weights([table.get_weights()[0] + group_directions(config)[groups]])
    return model


def group_directions(config: ModelConfig) -> np.ndarray:
    """[groups, dim]: each group's random unit direction times `group_init_scale` (seeded by the
    config's seed), what the group's items start from (beside their noise), or with
    `group_embeddings`, what the group's embedding starts at."""
    rng = np.random.default_rng((config.seed, 1))
    directions = rng.normal(size=(config.num_groups, config.embedding_dim))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    return (config.group_init_scale * directions).astype(np.float32)


def rating_prediction(config: ModelConfig) -> Callable[[tf.Tensor], tf.Tensor]:
    """The rating `evaluate` scores for a score: clipped to the rating scale if the config asks
    (MINIMUM and MAXIMUM, TFLite builtins)."""
    if not config.clip_predictions:
        return lambda score: score
    return lambda score: tf.clip_by_value(score, config.rating_min, config.rating_max)


def build_spec(config: ModelConfig) -> ExportSpec:
    """MF as an `ExportSpec`: what `python -m model_export` exports by default."""
    implicit = config.feedback is Feedback.IMPLICIT
    if implicit:
        metrics = (
            Metric("squared_error", lambda y, s: tf.square(tf.sigmoid(s) - y), (0.0, 1.0)),
            Metric(
                "correct", lambda y, s: tf.cast(tf.cast(s > 0.0, tf.float32) == y, tf.float32), (0.0, 1.0)
            ),
        )
    else:
        predicted = rating_prediction(config)
        metrics = (
            # RMSE, whatever the training loss
            Metric("squared_error", lambda y, s: tf.square(predicted(s) - y)),
            # Within 0.5 inclusive, as TFF's RatingAccuracy: the prediction rounds to the rating.
            Metric("correct", lambda y, s: tf.cast(tf.abs(predicted(s) - y) <= 0.5, tf.float32), (0.0, 1.0)),
        )
    model = build_model(config)
    local = ["user_embedding"] + (["user_bias"] if config.user_bias else [])
    return ExportSpec(
        model=model,
        features=config.features(),
        local_variables=local,
        loss=implicit_loss if implicit else explicit_loss(config.huber_delta),
        metrics=metrics,
        row_sparse={"item_embeddings": ITEM, **({"item_bias": ITEM} if config.item_bias else {})},
        task=TaskSpec(
            "ranking",
            top_k=config.top_k,
            catalog_feature=ITEM,
            negative_sampling=implicit,
            popularity="item_bias" if config.item_bias else None,
        ),
        batch_size=config.batch_size,
        max_batches=config.max_batches,
        training_defaults=config.to_json()["training"],  # type: ignore[arg-type]
        config=config.to_json(),
        local_start=history_start(config),
    )


def history_start(config: ModelConfig) -> LocalStart | None:
    """With `history_start` > 0: the user vector starts at that times the mean of the shared
    items' vectors (the layer whose output it is dotted with), or of their groups' embeddings."""
    if config.history_start <= 0:
        return None
    if config.history_start_groups:
        layer = "group_embedding_rate"
    else:
        layer = "plus_group_embedding" if config.group_embeddings else "item_embeddings"
    return LocalStart("user_embedding", layer, config.history_start, config.history_start_contrast)
