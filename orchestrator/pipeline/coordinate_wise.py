"""Coordinate-wise trimmed mean and median (Yin et al., ICML 2018)."""

from __future__ import annotations

from collections.abc import Mapping

from contracts.params import SparseTensor
from orchestrator.aggregation.maths import robust_mean
from orchestrator.aggregation.pipeline import Aggregate


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
