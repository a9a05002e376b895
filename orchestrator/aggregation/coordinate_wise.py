"""Coordinate-wise trimmed mean and median (Yin et al., ICML 2018): per coordinate, over the
reports that changed its row, instead of the weighted mean."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from contracts.params import Params, SparseTensor, row_shape
from orchestrator.aggregation.pipeline import Aggregate


def robust_mean(
    deltas: Sequence[Mapping[str, SparseTensor]],
    weights: Sequence[float],
    shapes: Mapping[str, tuple[int, ...]],
    method: str,
    trim_fraction: float = 0.1,
) -> Params:
    """The coordinate-wise median or trimmed mean of sparse deltas, per row over the deltas that
    changed it, times those deltas' share of the total weight. Holds every delta: memory is the
    sum of the reports' sizes, not O(model) as the weighted mean's."""
    if method not in ("trimmed_mean", "median"):
        raise ValueError(f"robust_mean: method must be 'trimmed_mean' or 'median', got {method!r}")
    if not deltas or len(deltas) != len(weights) or not sum(weights) > 0:
        raise ValueError("robust_mean needs at least one delta and one weight > 0 per delta")
    total = float(sum(weights))
    out: Params = {}
    for name, shape in shapes.items():
        by_row = row_shape(shape)
        result = np.zeros(by_row, np.float64)
        parts = [(d[name], float(w)) for d, w in zip(deltas, weights, strict=True) if name in d]
        if parts:
            rows = np.concatenate([t.rows for t, _ in parts])
            values = np.concatenate([t.values.reshape(len(t.rows), *by_row[1:]) for t, _ in parts])
            row_weights = np.concatenate([np.full(len(t.rows), w) for t, w in parts])
            order = np.argsort(rows, kind="stable")
            rows, values, row_weights = rows[order], values[order].astype(np.float64), row_weights[order]
            unique, starts, counts = np.unique(rows, return_index=True, return_counts=True)
            share = np.add.reduceat(row_weights, starts) / total
            # Rows changed by the same number of deltas are reduced together, as one array.
            for count in np.unique(counts):
                which = np.flatnonzero(counts == count)
                stacked = values[starts[which][:, None] + np.arange(count)]  # (rows, count, ...)
                if method == "median":
                    reduced = np.median(stacked, axis=1)
                else:
                    cut = math.floor(trim_fraction * count)
                    reduced = np.sort(stacked, axis=1)[:, cut : count - cut].mean(axis=1)
                result[unique[which]] = reduced * share[which].reshape(-1, *([1] * (reduced.ndim - 1)))
        out[name] = result.reshape(shape).astype(np.float32)
    return out


class CoordinateWiseStage:
    """Per coordinate, the trimmed mean or the median of the contributions that changed its row,
    scaled by their share of the round's weight. It holds every contribution: memory is the sum
    of the reports' sizes, not O(model)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], method: str, trim_fraction: float) -> None:
        if method not in ("trimmed_mean", "median"):
            raise ValueError(f"coordinate-wise aggregation is 'trimmed_mean' or 'median', got {method!r}")
        self._shapes = dict(shapes)
        self._method, self._trim = method, trim_fraction
        self._deltas: list[Mapping[str, SparseTensor]] = []
        self._weights: list[float] = []

    def accept(self, delta: Mapping[str, SparseTensor], weight: float) -> None:
        self._deltas.append(delta)
        self._weights.append(weight)

    def finish(self) -> Aggregate:
        mean = robust_mean(self._deltas, self._weights, self._shapes, self._method, self._trim)
        return Aggregate(mean_delta=mean, count=len(self._deltas))
