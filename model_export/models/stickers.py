"""A context-aware sticker ranking model, as a user would bring one (`android_sim.stickers`' table).

The score of a sticker s for a user in a context (hour, chat type, previous sticker) is

    <e_s, u + c[chat] + W [h_hour; t_chat; p_previous]> + b_s

Globals: sticker embeddings `e` and biases `b` (row-sparse), hour, chat-type and previous-sticker
embeddings and the dense layer `W`. Locals, which stay on the phone: the user vector `u` and a
per-chat-type preference `c` (a user's taste in group chats differs from their direct chats').

    python -m model_export --model model_export.models.stickers:build --output-dir runs/stickers
"""

from __future__ import annotations

import keras
import tensorflow as tf

from contracts.features import FeatureSpec
from contracts.manifest import TaskSpec
from model_export.layers import LocalVector, RowTable
from model_export.spec import ExportSpec, Metric

HOURS, CHAT_TYPES = 24, 2
# What a plain run starts from (`simulate --tune` searches around them): the rates reconstruction
# and the update need for a user vector to move in a few steps, popularity-tilted negatives.
TRAINING_DEFAULTS = {
    "reconstruction_learning_rate": 0.5,
    "update_learning_rate": 0.5,
    "negatives_per_positive": 4,
}


def build(stickers: int = 240, dim: int = 8, seed: int = 0) -> ExportSpec:
    stickers, dim = int(stickers), int(dim)
    keras.utils.set_random_seed(int(seed))
    sticker = keras.Input(shape=(), dtype="int32", name="sticker")
    hour = keras.Input(shape=(), dtype="int32", name="hour")
    chat = keras.Input(shape=(), dtype="int32", name="chat_type")
    previous = keras.Input(shape=(), dtype="int32", name="previous")
    e = keras.layers.Embedding(
        stickers,
        dim,
        embeddings_initializer=keras.initializers.RandomNormal(stddev=0.1),
        name="sticker_embeddings",
    )(sticker)
    bias = RowTable(stickers, name="sticker_bias")(sticker)
    context = keras.layers.Concatenate()(
        [
            keras.layers.Embedding(HOURS, 4, name="hour_embeddings")(hour),
            keras.layers.Embedding(CHAT_TYPES, 4, name="chat_type_embeddings")(chat),
            keras.layers.Embedding(stickers + 1, dim, name="previous_embeddings")(previous),
        ]
    )
    towards = keras.layers.Add()(
        [
            keras.layers.Dense(dim, name="context")(context),
            RowTable(CHAT_TYPES, (dim,), name="chat_preference")(chat),  # local: c[chat]
        ]
    )
    in_context = keras.ops.sum(keras.layers.Multiply()([e, towards]), axis=-1)
    score = keras.layers.Add()([LocalVector(dim, name="user_embedding")(e), in_context, bias])  # a logit
    return ExportSpec(
        model=keras.Model({"sticker": sticker, "hour": hour, "chat_type": chat, "previous": previous}, score),
        features=(
            FeatureSpec("sticker", "int32"),
            FeatureSpec("hour", "int32", value_range=(0, HOURS - 1)),
            FeatureSpec("chat_type", "int32", value_range=(0, CHAT_TYPES - 1)),
            FeatureSpec("previous", "int32", value_range=(0, stickers)),  # `stickers`: none before
            FeatureSpec("shared", "float32", role="label", value_range=(0, 1), discrete=True),
        ),
        local_variables=("user_embedding", "chat_preference"),
        loss=lambda y, s: tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=s),
        metrics=(
            Metric("correct", lambda y, s: tf.cast(tf.cast(s > 0, tf.float32) == y, tf.float32), (0, 1)),
        ),
        row_sparse={"sticker_embeddings": "sticker", "sticker_bias": "sticker"},
        task=TaskSpec(
            "ranking", top_k=10, catalog_feature="sticker", negative_sampling=True, popularity="sticker_bias"
        ),
        batch_size=8,
        max_batches=16,
        training_defaults=dict(TRAINING_DEFAULTS),
        config={"stickers": stickers, "dim": dim, "seed": int(seed)},
    )
