"""The weighted mean (FedAvg): the plain stage every other one ends in or wraps."""

from __future__ import annotations

from collections.abc import Mapping

from contracts.params import SparseTensor
from orchestrator.aggregation.maths import PartialSum, WeightedMean
from orchestrator.aggregation.pipeline import Aggregate


class WeightedMeanStage:
    """Streams contributions into a running sum: memory O(model) however many devices report.
    With `equal_weights` every contribution weighs 1 whatever its weight says, and the sum is
    kept in the aggregate (DP noises it)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], equal_weights: bool = False) -> None:
        self._mean = WeightedMean(shapes)
        self._equal = equal_weights

    def accept(self, delta: Mapping[str, SparseTensor], weight: float) -> None:
        self._mean.add_sparse(delta, 1.0 if self._equal else weight)

    def accept_partial(self, part: PartialSum) -> None:
        """Take several contributions at once, added up where they were made."""
        if self._equal:
            raise ValueError("an equally weighted mean takes its contributions one by one")
        self._mean.add_partial(part)

    def finish(self) -> Aggregate:
        if self._equal:
            total = self._mean.weighted_sum()
            return Aggregate(mean_delta=self._mean.mean(), count=self._mean.count, total=total)
        return Aggregate(mean_delta=self._mean.mean(), count=self._mean.count)
