"""Specs for the export's checks: each bad one fails for one reason; `slices_convert` exports
(its slice's gradient is rewritten to builtin ops), and so does `next_token`, a classification
model with no row-sparse table and a local embedding table. The tests run them through the CLI."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import keras
import tensorflow as tf

from contracts.features import FeatureSpec
from contracts.manifest import TaskSpec
from model_export.layers import CatalogAttribute, LocalVector
from model_export.spec import ExportSpec, LocalStart, Metric
from tests.model_export import genre_rating


def unknown_local_variable() -> ExportSpec:
    return replace(genre_rating.build(), local_variables=("user_embeddings",))


def features_disagree_with_inputs() -> ExportSpec:
    spec = genre_rating.build()
    return replace(spec, features=[f for f in spec.features if f.name != "genre"])


def feature_of_another_dtype() -> ExportSpec:
    spec = genre_rating.build()
    features = [replace(f, dtype="float32") if f.name == "genre" else f for f in spec.features]
    return replace(spec, features=features)


def local_start_of_another_shape() -> ExportSpec:
    """The user vector has 6 values, a genre embedding 3."""
    return replace(genre_rating.build(), local_start=LocalStart("user_embedding", "genre_embeddings"))


def local_start_of_an_unknown_local() -> ExportSpec:
    return replace(genre_rating.build(), local_start=LocalStart("user_vector", "hidden"))


def row_sparse_layer_that_is_not_a_table() -> ExportSpec:
    return replace(genre_rating.build(), row_sparse={"hidden": "movie"})


def unsupported_gradient() -> ExportSpec:
    """ELU's gradient (EluGrad) is not a TFLite builtin and the export does not rewrite it."""
    spec = genre_rating.build()
    movie = keras.Input(shape=(), dtype="int32", name="movie")
    genre = keras.Input(shape=(), dtype="int32", name="genre")
    m = keras.layers.Embedding(genre_rating.NUM_MOVIES, 4, name="movie_embeddings")(movie)
    g = keras.layers.Embedding(genre_rating.NUM_GENRES, 3, name="genre_embeddings")(genre)
    hidden = keras.layers.Dense(4, activation="elu", name="smooth")(keras.layers.Concatenate()([m, g]))
    rating = keras.layers.Dense(1, name="rating")(hidden)
    features = (*spec.features[:2], FeatureSpec("rating", "float32", role="label", value_range=(1, 5)))
    return replace(
        spec,
        model=keras.Model({"movie": movie, "genre": genre}, rating),
        features=features,
        local_variables=("rating",),
        loss=lambda y, p: (p[:, 0] - y) ** 2,
        metrics=(),
    )


@keras.saving.register_keras_serializable(package="tests")
class Middle(keras.layers.Layer):  # type: ignore[misc]
    """Columns 1 and 2 of its input: a slice with constant bounds (TensorFlow's gradient of it,
    StridedSliceGrad, is not a TFLite builtin)."""

    def call(self, inputs: Any) -> Any:
        return inputs[:, 1:3]


def catalog_attribute_of_another_length() -> ExportSpec:
    """A movie's catalog attribute (its decade) with a value for 10 movies of the catalog's 40."""
    spec = genre_rating.build()
    movie = keras.Input(shape=(), dtype="int32", name="movie")
    genre = keras.Input(shape=(), dtype="int32", name="genre")
    m = keras.layers.Embedding(genre_rating.NUM_MOVIES, 4, name="movie_embeddings")(movie)
    decade = CatalogAttribute([i % 3 for i in range(10)], name="decade")(movie)
    d = keras.layers.Embedding(3, 4, name="decade_embeddings")(decade)
    g = keras.layers.Embedding(genre_rating.NUM_GENRES, 3, name="genre_embeddings")(genre)
    joined = keras.layers.Concatenate()([keras.layers.Add()([m, d]), g])
    rating = LocalVector(7, name="user_embedding")(joined)
    return replace(spec, model=keras.Model({"movie": movie, "genre": genre}, rating))


def catalog_feature_into_another_layer() -> ExportSpec:
    """The movie id, which training sees as slots into the task's rows, used as a number."""
    spec = genre_rating.build()
    movie = keras.Input(shape=(), dtype="int32", name="movie")
    genre = keras.Input(shape=(), dtype="int32", name="genre")
    m = keras.layers.Embedding(genre_rating.NUM_MOVIES, 4, name="movie_embeddings")(movie)
    as_number = keras.layers.Reshape((1,), name="movie_number")(keras.ops.cast(movie, "float32"))
    g = keras.layers.Embedding(genre_rating.NUM_GENRES, 3, name="genre_embeddings")(genre)
    rating = LocalVector(8, name="user_embedding")(keras.layers.Concatenate()([m, as_number, g]))
    return replace(spec, model=keras.Model({"movie": movie, "genre": genre}, rating))


def ranking_catalog_without_a_table() -> ExportSpec:
    """The hour recommender ranking its context (the hour indexes a local table, not a row-sparse one)."""
    from tests.device_runtime import hour_recommender

    spec = hour_recommender.build()
    return replace(spec, task=replace(spec.task, catalog_feature="hour", popularity=None))


def slices_convert() -> ExportSpec:
    spec = genre_rating.build()
    movie = keras.Input(shape=(), dtype="int32", name="movie")
    genre = keras.Input(shape=(), dtype="int32", name="genre")
    m = keras.layers.Embedding(genre_rating.NUM_MOVIES, 4, name="movie_embeddings")(movie)
    g = keras.layers.Embedding(genre_rating.NUM_GENRES, 3, name="genre_embeddings")(genre)
    joined = keras.layers.Concatenate()([Middle(name="middle")(m), g])
    rating = LocalVector(5, name="user_embedding")(joined)
    return replace(spec, model=keras.Model({"movie": movie, "genre": genre}, rating))


VOCABULARY, CONTEXT = 12, 4


def next_token() -> ExportSpec:
    """The next token from the previous four: token embeddings local (e.g. a user's own words),
    a dense softmax layer global; `infer` gives the top 3 tokens."""
    tokens = keras.Input(shape=(CONTEXT,), dtype="int32", name="tokens")
    embedded = keras.layers.Embedding(VOCABULARY, 3, name="token_embeddings")(tokens)
    logits = keras.layers.Dense(VOCABULARY, name="logits")(keras.layers.Flatten()(embedded))
    return ExportSpec(
        model=keras.Model({"tokens": tokens}, logits),
        features=(
            FeatureSpec("tokens", "int32", (CONTEXT,), value_range=(0, VOCABULARY - 1)),
            FeatureSpec("next", "int32", role="label", value_range=(0, VOCABULARY - 1)),
        ),
        local_variables=("token_embeddings",),
        loss=lambda y, logits: keras.ops.sparse_categorical_crossentropy(y, logits, from_logits=True),
        metrics=(
            Metric(
                "correct",
                lambda y, logits: tf.cast(tf.argmax(logits, -1, output_type=tf.int32) == y, tf.float32),
                (0.0, 1.0),
            ),
        ),
        task=TaskSpec("classification", top_k=3, num_classes=VOCABULARY),
        batch_size=4,
        max_batches=3,
    )


CASES = (
    "slices_convert",
    "next_token",
    "unknown_local_variable",
    "features_disagree_with_inputs",
    "feature_of_another_dtype",
    "row_sparse_layer_that_is_not_a_table",
    "unsupported_gradient",
    "ranking_catalog_without_a_table",
    "catalog_attribute_of_another_length",
    "catalog_feature_into_another_layer",
    "local_start_of_another_shape",
    "local_start_of_an_unknown_local",
)


def main(out: str) -> None:
    """Export each case through the CLI into `out/<case>`; print {case: [exit code, stderr]} as JSON."""
    import contextlib
    import io
    import json
    from pathlib import Path

    from model_export.__main__ import main as cli

    results = {}
    for case in CASES:
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            code = cli(["--model", f"tests.model_export.export_cases:{case}", "--out", str(Path(out) / case)])
        results[case] = [code, stderr.getvalue()]
    print(json.dumps(results))


if __name__ == "__main__":
    import sys

    main(sys.argv[1])
