"""What a user gives to export their own Keras model for partially local federated training.

A runnable example: a rating model over movies with a genre side feature, a ReLU layer and a
local user vector (the embedding tables are trained only in the rows a task uses)::

    import keras
    from contracts.features import FeatureSpec
    from contracts.manifest import TaskSpec
    from model_export.spec import ExportSpec, Metric
    from model_export.layers import LocalVector

    def build() -> ExportSpec:
        movie = keras.Input(shape=(), dtype="int32", name="movie")
        genre = keras.Input(shape=(), dtype="int32", name="genre")
        m = keras.layers.Embedding(100, 8, name="movie_embeddings")(movie)
        g = keras.layers.Embedding(10, 4, name="genre_embeddings")(genre)
        h = keras.layers.Dense(8, activation="relu", name="hidden")(keras.layers.Concatenate()([m, g]))
        rating = LocalVector(8, name="user_embedding")(h)  # <h, u>: u is the user's own vector
        return ExportSpec(
            model=keras.Model({"movie": movie, "genre": genre}, rating),
            features=(
                FeatureSpec("movie", "int32"),  # its range and tables come from the model
                FeatureSpec("genre", "int32"),
                FeatureSpec("rating", "float32", role="label", value_range=(1, 5)),
            ),
            local_variables=("user_embedding",),
            loss=lambda y, p: (p - y) ** 2,
            metrics=(Metric("squared_error", lambda y, p: (p - y) ** 2),),
            row_sparse={"movie_embeddings": "movie", "genre_embeddings": "genre"},
            task=TaskSpec("regression"),
            batch_size=5,
            max_batches=16,
        )

    # python -m model_export --model my_pkg.my_model:build --output-dir out/

`export_spec(build(), out_dir)` (in `model_export.export`) writes `model.tflite`,
`manifest.json` and the initial global parameters; see that module for the signature layout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from contracts.features import FeatureSpec
from contracts.manifest import TaskSpec

# (labels of one batch, model outputs of that batch) -> one value per example, [batch_size].
PerExample = Callable[[Any, Any], Any]


@dataclass(frozen=True)
class Metric:
    """A metric `evaluate` sums over examples (weighted), so that devices' sums add up on the
    server. `value_range` bounds one example's value (e.g. (0, 1) for a correctness indicator),
    so the server can refuse sums no honest device could send."""

    name: str
    per_example: PerExample
    value_range: tuple[float, float] | None = None


@dataclass(frozen=True)
class LocalStart:
    """Where `reconstruct` starts a local vector: at `scale` times the mean, over the support
    examples weighted by example weight x label (implicit feedback: the device's shares), of
    `layer`'s output for each example, which has the local's shape (e.g. the item vector a user
    vector is dotted with). So the vector starts at what the device's history already says and
    the reconstruction's steps refine it; without such examples it starts where `reset_local`
    put it. `contrast`: minus the mean over the other support examples (weight x (1 - label):
    the sampled negatives), so what every item's vector shares cancels."""

    local: str  # a local variable's manifest name
    layer: str  # a layer of the model called once, whose per-example output has the local's shape
    scale: float = 1.0
    contrast: bool = False


@dataclass(frozen=True)
class ExportSpec:
    """A Keras model and what federated training needs to know about it.

    - `model`: a functional Keras model whose inputs are a dict keyed by the input features'
      names (built, with the initial values the federation starts from);
    - `features`: every feature of an example, inputs and exactly one label;
    - `local_variables`: the variables that stay on the device (a variable's path such as
      `"user/embedding"`, its manifest name, or a layer name for all its variables);
    - `loss`, `metrics`: per-example functions of (label, model output);
    - `row_sparse`: embedding layer name -> the input feature that feeds it; a task reads and
      trains only the rows its examples use, and its report carries only those rows;
    - `task`: what `infer` does (`ranking` over a catalog feature, `classification`, `regression`);
    - `infer_scores`: optional (inputs, outputs) -> what `infer` ranks or returns, when the model's
      output is not it as is (e.g. the last position of a sequence model's logits);
    - `batch_size`, `max_batches`: the static shapes of one signature call;
    - `training_defaults`: the task-config defaults recorded in the manifest;
    - `config`: anything worth recording in the manifest (how the model was built);
    - `local_start`: optional, where `reconstruct` starts a local vector (`LocalStart`).
    """

    model: Any
    features: Sequence[FeatureSpec]
    local_variables: Sequence[str]
    loss: PerExample
    task: TaskSpec
    batch_size: int
    max_batches: int
    metrics: Sequence[Metric] = ()
    row_sparse: Mapping[str, str] = field(default_factory=dict)
    infer_scores: Callable[[Mapping[str, Any], Any], Any] | None = None
    training_defaults: Mapping[str, float | int] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)
    local_start: LocalStart | None = None


class ExportError(ValueError):
    """The spec cannot be exported as given; the message says what to change."""
