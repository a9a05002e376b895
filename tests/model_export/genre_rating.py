"""A user's own model for the tests: neither matrix factorization nor an LSTM.

A rating from a movie embedding and a genre embedding (both tables row-sparse: a task trains
only the rows its examples use) through a ReLU layer, dotted with the user's local vector,
plus a global mean. Exported with `python -m model_export --model tests.model_export.genre_rating:build`.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from contracts.features import FeatureSpec
from contracts.manifest import TaskSpec
from model_export.layers import LocalVector, Offset
from model_export.spec import ExportSpec, Metric

NUM_MOVIES, NUM_GENRES, HIDDEN = 40, 5, 6
BATCH_SIZE, MAX_BATCHES = 4, 5


def build() -> ExportSpec:
    keras.utils.set_random_seed(7)
    movie = keras.Input(shape=(), dtype="int32", name="movie")
    genre = keras.Input(shape=(), dtype="int32", name="genre")
    init = keras.initializers.RandomNormal(stddev=0.3, seed=1)
    m = keras.layers.Embedding(NUM_MOVIES, 4, embeddings_initializer=init, name="movie_embeddings")(movie)
    g = keras.layers.Embedding(NUM_GENRES, 3, embeddings_initializer=init, name="genre_embeddings")(genre)
    joined = keras.layers.Concatenate(name="joined")([m, g])
    hidden = keras.layers.Dense(HIDDEN, activation="relu", name="hidden")(joined)
    rating = Offset(3.5, name="global_mean")(LocalVector(HIDDEN, name="user_embedding")(hidden))
    return ExportSpec(
        model=keras.Model({"movie": movie, "genre": genre}, rating),
        features=(
            FeatureSpec("movie", "int32"),
            FeatureSpec("genre", "int32"),
            FeatureSpec("rating", "float32", role="label", value_range=(1, 5)),
        ),
        local_variables=("user_embedding",),
        loss=lambda y, p: tf.square(p - y),
        metrics=(Metric("squared_error", lambda y, p: tf.square(p - y)),),
        row_sparse={"movie_embeddings": "movie", "genre_embeddings": "genre"},
        task=TaskSpec("regression"),
        batch_size=BATCH_SIZE,
        max_batches=MAX_BATCHES,
        training_defaults={"reconstruction_learning_rate": 0.2, "update_learning_rate": 0.2},
        config={"model": "genre_rating"},
    )
