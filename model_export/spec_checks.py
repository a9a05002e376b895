"""What the export checks of an `ExportSpec` against its Keras model before it builds any
signature, and what it resolves on the way: each variable's name in the manifest, the feature
specs, which variables are local, and that no two signature inputs share a name. The row-sparse
tables and the catalog attributes on their features are `model_export.task_rows`'."""

from __future__ import annotations

import re
from typing import Any

import keras

from contracts.features import FeatureSpec, FeatureSpecError, check_feature_specs
from contracts.manifest import (
    CENTRAL_GRADIENT_WEIGHT,
    HYPERPARAMETERS,
    NUM_BATCHES,
    WEIGHTS,
    TaskSpec,
    central_gradient_input,
    task_rows_input,
)
from model_export.spec import ExportError, ExportSpec

RESERVED = {
    WEIGHTS,
    NUM_BATCHES,
    "exclude",
    CENTRAL_GRADIENT_WEIGHT,
    *(h for names in HYPERPARAMETERS.values() for h in names),
}


def check_model(spec: ExportSpec) -> None:
    """A functional model keyed by feature name, and positive batch bounds."""
    model = spec.model
    if not isinstance(model, keras.Model) or not isinstance(model.input, dict):
        raise ExportError(
            "the model must be a functional keras.Model whose inputs are a dict keyed by feature "
            "name, e.g. keras.Model({'item': item_input}, outputs)"
        )
    if spec.batch_size < 1 or spec.max_batches < 1:
        raise ExportError(
            f"batch_size and max_batches must be >= 1, got {spec.batch_size}, {spec.max_batches}"
        )


def parameter_names(paths: list[str]) -> dict[str, str]:
    """Variable path -> its name in the manifest: the layer's name when the layer has one
    variable (`item_embeddings/embeddings` -> `item_embeddings`), else the path with `_`."""
    layers = [p.split("/", 1)[0] for p in paths]
    return {
        p: layer if layers.count(layer) == 1 else re.sub(r"\W", "_", p)
        for p, layer in zip(paths, layers, strict=True)
    }


def checked_features(spec: ExportSpec, model: Any) -> list[FeatureSpec]:
    """The spec's features, checked on their own and against the model's inputs."""
    try:
        check_feature_specs(list(spec.features))
    except FeatureSpecError as e:
        raise ExportError(str(e)) from None
    inputs = {f.name: f for f in spec.features if f.role == "input"}
    labels = [f.name for f in spec.features if f.role == "label"]
    if len(labels) != 1:
        raise ExportError(f"the features must include exactly one label (role 'label'), got {labels}")
    model_inputs = model.input
    if set(inputs) != set(model_inputs):
        raise ExportError(
            "the feature spec disagrees with the model's inputs: the model takes "
            f"{sorted(model_inputs)}, the spec declares inputs {sorted(inputs)}"
        )
    for name, tensor in model_inputs.items():
        feature = inputs[name]
        shape = tuple(tensor.shape[1:])
        if shape != feature.shape or str(tensor.dtype) != feature.dtype:
            raise ExportError(
                f"the feature spec disagrees with the model's input {name!r}: the model takes "
                f"{tensor.dtype}{list(shape)} per example, the spec says "
                f"{feature.dtype}{list(feature.shape)}"
            )
    return list(spec.features)


def resolve_locals(wanted: Any, paths: list[str], names: dict[str, str]) -> set[str]:
    """The paths of the variables `wanted` names (by path, manifest name or layer name)."""
    if isinstance(wanted, str):
        raise ExportError(f"local_variables must be a list of names, got the string {wanted!r}")
    found: set[str] = set()
    for name in wanted:
        matches = {p for p in paths if name in (p, names[p], p.split("/", 1)[0])}
        if not matches:
            raise ExportError(
                f"local variable {name!r} does not exist; the model's trainable variables are "
                f"{sorted(names.values())} (paths {paths})"
            )
        found |= matches
    return found


def check_locals_not_row_sparse(local_paths: set[str], row_sparse_layers: set[str]) -> None:
    clash = sorted({p.split("/", 1)[0] for p in local_paths} & row_sparse_layers)
    if clash:
        raise ExportError(f"row-sparse tables are global; {clash} are also listed as local variables")


def check_names(
    features: list[FeatureSpec], names: dict[str, str], global_names: list[str], task_row_features: list[str]
) -> None:
    """No two signature inputs share a name, and none takes a reserved one."""
    taken = (
        [f.name for f in features]
        + list(names.values())
        + [central_gradient_input(n) for n in global_names]
        + [task_rows_input(f) for f in task_row_features]
    )
    clash = sorted({n for n in taken if taken.count(n) > 1 or n in RESERVED})
    if clash:
        raise ExportError(
            f"signature inputs would share the names {clash}: rename the features or layers "
            f"(reserved: {sorted(RESERVED)})"
        )


def check_task(
    task: TaskSpec, features: list[FeatureSpec], row_sparse: dict[str, str], global_names: list[str]
) -> None:
    """The task fits the model: top_k within its classes or catalog, a ranking's catalog feature
    indexing a row-sparse table, its popularity a global."""
    if task.kind == "classification" and not 1 <= task.top_k <= task.num_classes:
        raise ExportError(
            f"a classification task's top_k must be in [1, num_classes = {task.num_classes}], "
            f"got {task.top_k}"
        )
    if task.kind == "ranking":
        catalog = task.catalog_feature
        if catalog not in row_sparse.values():
            raise ExportError(
                f"a ranking task scores every row of its catalog feature's table, so the catalog feature "
                f"({catalog!r}) must be an input that indexes a row-sparse table; the model's other "
                "inputs are its context (e.g. the hour), one value per ranking"
            )
        rows = next(f for f in features if f.name == catalog).num_values
        if not 1 <= task.top_k <= rows:
            raise ExportError(
                f"a ranking task's top_k must be in [1, {rows}] (the rows of its catalog feature "
                f"{catalog!r}), got {task.top_k}"
            )
        if task.popularity is not None and task.popularity not in global_names:
            raise ExportError(f"ranking popularity {task.popularity!r} is not a global parameter")
