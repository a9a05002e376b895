"""The weighted mean (FedAvg): the plain stage every other one ends in or wraps, and its maths.

- Sparse deltas (`contracts.params.SparseTensor`): a client trains only the item rows it has
  examples for (about 150 of 20,000), so its delta travels and is stored as those rows.
- `WeightedMean`: a streaming weighted mean of deltas, memory O(model) however many clients report.
- `PartialSum`: part of a round's weighted sum, added up where its deltas were made.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from contracts.params import Params, SparseTensor, row_shape
from orchestrator.aggregation.pipeline import Aggregate
from orchestrator.aggregation.tensor_shapes import check_shapes, shapes_of


def _touched_rows(total: np.ndarray) -> np.ndarray:
    """The rows of a sum in row form that are not all zero (an untouched row adds nothing)."""
    return np.flatnonzero(np.any(total != 0, axis=tuple(range(1, total.ndim))))


@dataclass(frozen=True, eq=False)  # eq=False: comparing numpy arrays with == is not a bool
class PartialSum:
    """Part of a round's weighted sum, added up where its deltas were made (a simulation worker's
    shard of the round): per tensor (`shapes`), the rows its deltas touched (`rows`, increasing)
    and their float64 weighted sums (`sums`, in row form), the weights' total and how many deltas
    it holds. Only touched rows travel, so a partial of one sparse delta is about that delta's size.
    Adding partials gives the round's sum up to float64 summation order."""

    shapes: Mapping[str, tuple[int, ...]]
    rows: Mapping[str, np.ndarray]
    sums: Mapping[str, np.ndarray]
    total_weight: float
    count: int

    @property
    def nbytes(self) -> int:
        return sum(int(self.rows[name].nbytes + self.sums[name].nbytes) for name in self.sums)


class WeightedMean:
    """Weighted mean of client deltas, added one at a time.

    Memory is O(model), never O(clients x model): only a running float64 weighted sum per tensor and
    the total weight are kept; each delta can be dropped once added. float64 so that summing many
    small float32 contributions does not lose precision.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self._shapes = {name: tuple(int(n) for n in shape) for name, shape in shapes.items()}
        # Kept in row form (a 0-D tensor as shape (1,)) so dense and sparse adds index the same way.
        self._sums = {
            name: np.zeros(row_shape(shape), dtype=np.float64) for name, shape in self._shapes.items()
        }
        self._scratch = {name: np.empty_like(total) for name, total in self._sums.items()}
        self._total_weight = 0.0
        self._count = 0

    @property
    def total_weight(self) -> float:
        return self._total_weight

    @property
    def count(self) -> int:
        """Number of deltas added."""
        return self._count

    def _check(self, what: str, shapes: Mapping[str, tuple[int, ...]], weight: float) -> None:
        # Everything is checked before anything is accumulated, so a refused delta leaves no trace.
        # numbers.Real admits numpy scalars (an example count may well be an np.int64); bool is refused.
        if (
            isinstance(weight, bool)
            or not isinstance(weight, numbers.Real)
            or not math.isfinite(weight)
            or weight <= 0
        ):
            raise ValueError(f"{what}: weight must be a finite number > 0, got {weight!r}")
        check_shapes(what, shapes, self._shapes)

    def add(self, delta: Mapping[str, np.ndarray], weight: float) -> None:
        """Add a dense delta with the given weight (e.g. the client's number of examples)."""
        self._check("delta", shapes_of(delta), weight)
        for name, value in delta.items():
            total, scratch = self._sums[name], self._scratch[name]
            # Into a buffer kept for the purpose: a fresh 1.5 MB temporary per add is mapped and
            # page-faulted in by the allocator every time, which made adds ~10x slower.
            np.multiply(np.reshape(value, total.shape), float(weight), out=scratch, dtype=np.float64)
            total += scratch
        self._total_weight += float(weight)
        self._count += 1

    def add_sparse(self, delta: Mapping[str, SparseTensor], weight: float) -> None:
        """Add a sparse delta: only its stored rows are touched, the rest are zero."""
        self._check("sparse delta", {name: t.shape for name, t in delta.items()}, weight)
        for name, tensor in delta.items():
            total = self._sums[name]
            if len(tensor.rows) == len(total):  # every row (they are strictly increasing): as `add`
                scratch = self._scratch[name]
                np.multiply(tensor.values, float(weight), out=scratch, dtype=np.float64)
                total += scratch
            else:
                # Rows are unique (SparseTensor checks it), so fancy-index += adds each row exactly once.
                total[tensor.rows] += float(weight) * tensor.values.astype(np.float64)
        self._total_weight += float(weight)
        self._count += 1

    def partial(self) -> PartialSum:
        """What was added so far, to be added to another `WeightedMean` (`add_partial`)."""
        rows = {name: _touched_rows(total) for name, total in self._sums.items()}
        return PartialSum(
            dict(self._shapes),
            rows,
            {name: total[rows[name]] for name, total in self._sums.items()},
            self._total_weight,
            self._count,
        )

    def add_partial(self, part: PartialSum) -> None:
        """Add another mean's deltas at once, as if each had been added here. Everything is
        checked before anything is added."""
        if part.count < 1 or not math.isfinite(part.total_weight) or part.total_weight <= 0:
            raise ValueError(
                f"partial sum: expected at least one delta and a total weight > 0, got {part.count} "
                f"deltas weighing {part.total_weight!r}"
            )
        check_shapes("partial sum", part.shapes, self._shapes)
        for name, total in self._sums.items():
            rows, sums = np.asarray(part.rows[name]), np.asarray(part.sums[name])
            if (
                rows.ndim != 1
                or sums.shape != (len(rows), *total.shape[1:])
                or (len(rows) and (rows.min() < 0 or rows.max() >= len(total) or np.any(np.diff(rows) <= 0)))
            ):
                raise ValueError(
                    f"partial sum: {name} must hold increasing rows of 0..{len(total) - 1} and their "
                    f"sums of shape (rows, {', '.join(map(str, total.shape[1:]))}), got {len(rows)} rows "
                    f"and sums of shape {sums.shape}"
                )
        for name, total in self._sums.items():
            total[part.rows[name]] += part.sums[name]
        self._total_weight += part.total_weight
        self._count += part.count

    def weighted_sum(self) -> Params:
        """The weighted sum so far, float64, in the template's shapes (DP-FedAvg noises the sum)."""
        return {name: total.reshape(self._shapes[name]).copy() for name, total in self._sums.items()}

    def mean(self) -> Params:
        """The weighted mean, float32, in the template's shapes."""
        if self._count == 0 or self._total_weight <= 0:
            raise ValueError("weighted mean of no deltas: add at least one delta with a weight > 0 first")
        return {
            name: (total / self._total_weight).reshape(self._shapes[name]).astype(np.float32)
            for name, total in self._sums.items()
        }


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
