"""Row-sparse tables, and the catalog attributes on their features, as the signatures see them.

A feature that indexes a row-sparse table (`ExportSpec.row_sparse`) arrives in the training
signatures as slots into the task's rows: the table's rows the examples use, gathered by the
runtime. So training runs a *twin* of the model whose row-sparse tables have `max_rows` rows,
and each `CatalogAttribute` called on such a feature (a constant of each catalog row, e.g. an
item's topic) is looked up at the task rows' catalog ids, which the signatures also take
(`<feature>_task_rows`). Ranking runs another twin that returns the catalog feature's tables
whole (ranking looks up every row, in order).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from contracts.features import FeatureSpec
from contracts.manifest import task_rows_input
from model_export.layers import CatalogAttribute, RowTable
from model_export.spec import ExportError, ExportSpec

ROW_SPARSE_LAYERS = (keras.layers.Embedding, RowTable)


def checked_row_sparse(
    spec: ExportSpec, model: Any, features: list[FeatureSpec], names: dict[str, str]
) -> tuple[dict[str, str], list[FeatureSpec]]:
    """(param name -> the feature that indexes it, the features with each indexing feature's
    `tables` and range filled in from its layers)."""
    layers = {layer.name: layer for layer in model.layers}
    out: dict[str, str] = {}
    by_name = {f.name: f for f in features}
    consumers: dict[int, list[Any]] = {}
    for op in model.operations:
        for node in op._inbound_nodes:
            for tensor in node.arguments.keras_tensors:
                consumers.setdefault(id(tensor), []).append(op)
    for layer_name, feature_name in spec.row_sparse.items():
        layer = layers.get(layer_name)
        if not isinstance(layer, ROW_SPARSE_LAYERS):
            raise ExportError(
                f"row_sparse names {layer_name!r}: expected an Embedding or RowTable layer of the model; "
                f"its layers are {sorted(layers)}"
            )
        feature = by_name.get(feature_name)
        if feature is None or feature.role != "input" or feature.dtype != "int32" or feature.shape:
            raise ExportError(
                f"row_sparse table {layer_name!r} must be indexed by a scalar int32 input feature, "
                f"got {feature_name!r}"
            )
        feature_input = model.input[feature_name]
        if layer not in consumers.get(id(feature_input), []) or len(layer._inbound_nodes) != 1:
            raise ExportError(
                f"row_sparse table {layer_name!r} must be called once, directly on input {feature_name!r}"
            )
        others = [
            op.name
            for op in consumers[id(feature_input)]
            if not isinstance(op, (*ROW_SPARSE_LAYERS, CatalogAttribute))
        ]
        if others:
            raise ExportError(
                f"input {feature_name!r} indexes a row-sparse table, so training sees it as slots into "
                f"the task's rows; it may feed only row-sparse tables and CatalogAttribute layers (a "
                f"catalog row's constants, e.g. its topic), but also feeds {others}"
            )
        (variable,) = layer.trainable_variables
        rows = int(variable.shape[0])
        name = names[variable.path]
        if feature.value_range not in (None, (0.0, rows - 1.0)):
            raise ExportError(
                f"feature {feature_name!r} declares the range {feature.value_range}; the model's "
                f"{layer_name!r} that it indexes has {rows} rows, so it takes [0, {rows - 1}]"
            )
        tables = feature.tables if name in feature.tables else (*feature.tables, name)
        by_name[feature_name] = replace(feature, tables=tables, value_range=(0.0, rows - 1.0))
        out[name] = feature_name
    return out, [by_name[f.name] for f in features]


def attributes_on_row_sparse(
    model: Any, features: list[FeatureSpec], row_sparse: dict[str, str]
) -> dict[str, str]:
    """Each CatalogAttribute called on a row-sparse feature: its constant's path -> the feature,
    checked to have one value per row of the feature's tables."""
    sparse_features = set(row_sparse.values())
    by_name = {f.name: f for f in features}
    found: dict[str, str] = {}
    for layer in model.layers:
        if not isinstance(layer, CatalogAttribute):
            continue
        called_on = [
            name
            for node in layer._inbound_nodes
            for tensor in node.arguments.keras_tensors
            for name, feature_input in model.input.items()
            if tensor is feature_input and name in sparse_features
        ]
        if not called_on:
            continue  # on another input it is a plain lookup, the same in every signature
        if len(layer._inbound_nodes) != 1:
            raise ExportError(
                f"catalog attribute {layer.name!r} must be called once, directly on input {called_on[0]!r}"
            )
        rows = by_name[called_on[0]].num_values
        if layer.values.shape[0] != rows:
            raise ExportError(
                f"catalog attribute {layer.name!r} has {layer.values.shape[0]} values; the feature "
                f"{called_on[0]!r} it is called on has {rows} rows, so it needs one value per row"
            )
        found[layer.table.path] = called_on[0]
    return found


def task_row_features(features: list[FeatureSpec], attributes: dict[str, str]) -> list[str]:
    """The features whose task rows' catalog ids the training signatures take, in feature order."""
    called_on = set(attributes.values())
    return [f.name for f in features if f.name in called_on]


def task_constants(
    constants: dict[str, tf.Tensor], attributes: dict[str, str], inputs: dict[str, tf.Tensor]
) -> dict[str, tf.Tensor]:
    """The training twin's catalog attributes: each constant at its feature's task rows."""
    return {
        path: tf.gather(constants[path], inputs[task_rows_input(feature)])
        for path, feature in attributes.items()
    }


def training_twin(model: Any, spec: ExportSpec, attributes: dict[str, str]) -> Any:
    """The model with each row-sparse table and catalog attribute on a row-sparse feature sized
    to the task rows (`max_rows`); other layers shared."""
    max_rows = spec.batch_size * spec.max_batches
    sparse_layers = set(spec.row_sparse)

    def clone(layer: Any) -> Any:
        if isinstance(layer, CatalogAttribute) and layer.table.path in attributes:
            # Its values at the task rows are given per call (`task_constants`).
            return CatalogAttribute(np.zeros(max_rows, layer.values.dtype), name=layer.name)
        if layer.name not in sparse_layers:
            return layer
        config = layer.get_config()
        config["input_dim" if isinstance(layer, keras.layers.Embedding) else "rows"] = max_rows
        return layer.__class__.from_config(config)

    return keras.models.clone_model(model, clone_function=clone)


class _WholeTable(keras.layers.Layer):  # type: ignore[misc]
    """A row-sparse table in the ranking twin: ranking looks up every catalog row in order, which
    is the table itself, so this returns it without a catalog-sized gather (its input is ignored)."""

    def __init__(self, shape: tuple[int, ...], weight_name: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.table = self.add_weight(shape=shape, initializer="zeros", name=weight_name)

    def call(self, inputs: Any) -> Any:
        return keras.ops.convert_to_tensor(self.table)

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int, ...]:
        return tuple(self.table.shape)


def ranking_twin(model: Any, spec: ExportSpec) -> Any:
    """For a ranking task, the model with the catalog feature's tables returned whole (else None)."""
    if spec.task.kind != "ranking":
        return None
    catalog_tables = {name for name, f in spec.row_sparse.items() if f == spec.task.catalog_feature}

    def clone(layer: Any) -> Any:
        if layer.name not in catalog_tables:
            return layer
        (variable,) = layer.trainable_variables
        return _WholeTable(tuple(variable.shape), variable.name, name=layer.name)

    return keras.models.clone_model(model, clone_function=clone)
