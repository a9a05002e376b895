"""Small Keras layers that partially local models need and Keras lacks.

- `RowTable`: a table of rows of any shape (also scalars, e.g. per-item biases) looked up by
  an integer feature, like `Embedding`; it can be row-sparse.
- `LocalVector`: the dot product of its input with a learnt vector (e.g. a user embedding).
- `Offset`: adds a learnt scalar (a user bias, a global mean).
- `CatalogAttribute`: a constant per catalog row (public metadata such as each item's topic),
  looked up by the catalog feature, e.g. to index a dense table shared by the items of a topic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np


@keras.saving.register_keras_serializable(package="model_export")
class RowTable(keras.layers.Layer):  # type: ignore[misc]
    """`table[inputs]` for a table of `rows` rows of shape `row_shape`."""

    def __init__(
        self, rows: int, row_shape: tuple[int, ...] = (), initializer: Any = "zeros", **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.rows = int(rows)
        self.row_shape = tuple(int(d) for d in row_shape)
        self.initializer = keras.initializers.get(initializer)
        self.table = self.add_weight(
            shape=(self.rows, *self.row_shape), initializer=self.initializer, name="table"
        )

    def call(self, inputs: Any) -> Any:
        return keras.ops.take(self.table, keras.ops.cast(inputs, "int32"), axis=0)

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        return (*input_shape, *self.row_shape)

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "rows": self.rows,
            "row_shape": list(self.row_shape),
            "initializer": keras.initializers.serialize(self.initializer),
        }


@keras.saving.register_keras_serializable(package="model_export")
class LocalVector(keras.layers.Layer):  # type: ignore[misc]
    """`<inputs, v>` over the last axis, for a learnt vector `v` of `dim` values (zeros at first)."""

    def __init__(self, dim: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dim = int(dim)
        self.vector = self.add_weight(shape=(self.dim,), initializer="zeros", name="vector")

    def call(self, inputs: Any) -> Any:
        # A matrix-vector product, not a sum of products: scoring a whole catalog then needs no
        # catalog-sized temporary (2-3x faster for 20,000 x 50 under TFLite).
        return keras.ops.matmul(inputs, self.vector)

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        return tuple(input_shape[:-1])

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "dim": self.dim}


@keras.saving.register_keras_serializable(package="model_export")
class Offset(keras.layers.Layer):  # type: ignore[misc]
    """`inputs + b` for a learnt scalar `b` (a `[1]` weight) starting at `initial`."""

    def __init__(self, initial: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.initial = float(initial)
        self.offset = self.add_weight(
            shape=(1,), initializer=keras.initializers.Constant(self.initial), name="offset"
        )

    def call(self, inputs: Any) -> Any:
        return inputs + self.offset

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        return input_shape

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "initial": self.initial}


@keras.saving.register_keras_serializable(package="model_export")
class CatalogAttribute(keras.layers.Layer):  # type: ignore[misc]
    """`values[inputs]`: a constant of each catalog row (e.g. each item's topic), exported inside
    the model. It is public metadata, fixed at export: never trained, never sent.

    Called on a feature that indexes a row-sparse table, it is what lets a model use a catalog
    row's metadata inside the training signatures, where the feature arrives as slots into the
    task's rows: the signatures then also take the task rows' catalog values
    (`<feature>_task_rows`) and look the attribute up at those (`model_export.task_rows`)."""

    def __init__(self, values: Sequence[int] | Sequence[float] | np.ndarray, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        array = np.asarray(values)
        if array.ndim != 1 or array.size == 0:
            raise ValueError(f"a catalog attribute needs one value per catalog row, got shape {array.shape}")
        integral = np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.bool_)
        self.values = array.astype(np.int32 if integral else np.float32)
        self.table = self.add_weight(
            shape=self.values.shape,
            dtype="int32" if integral else "float32",
            initializer=keras.initializers.Constant(self.values),
            trainable=False,
            name="values",
        )

    def call(self, inputs: Any) -> Any:
        return keras.ops.take(self.table, keras.ops.cast(inputs, "int32"), axis=0)

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        return tuple(input_shape)

    def compute_output_spec(self, inputs: Any) -> Any:
        return keras.KerasTensor(inputs.shape, dtype=self.table.dtype)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "values": self.values.tolist()}
