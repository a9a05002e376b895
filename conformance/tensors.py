"""Tensors in the kit's JSON: `{"dtype": "float32", "shape": [2, 3], "values": [...]}`, row-major.

A sparse tensor adds `"rows"` (strictly increasing) and holds only those rows' values."""

from __future__ import annotations

from typing import Any

import numpy as np

from contracts.params import SparseTensor


def tensor_json(array: np.ndarray) -> dict[str, Any]:
    return {"dtype": str(array.dtype), "shape": list(array.shape), "values": array.reshape(-1).tolist()}


def tensor_of(data: dict[str, Any]) -> np.ndarray:
    return np.asarray(data["values"], dtype=data["dtype"]).reshape(data["shape"])


def sparse_json(tensor: SparseTensor) -> dict[str, Any]:
    return {
        "dtype": "float32",
        "shape": list(tensor.shape),
        "rows": tensor.rows.tolist(),
        "values": np.asarray(tensor.values).reshape(-1).tolist(),
    }
