"""Robust clipping and weight caps: what keeps a few hostile devices from moving the model far.

Each contribution is clipped, tensor by tensor, to a multiple of the reference norm the rounds
before learnt, and its weight is capped at a multiple of the round's median weight
(`aggregation.RobustAggregation` says how, `aggregation.plan_round` decides a round's bounds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from contracts.params import SparseTensor
from orchestrator.aggregation.maths import (
    RobustAggregation,
    cap_weights,
    clip_by_norm,
    known_bounds,
    plan_round,
    tensor_norms,
)
from orchestrator.aggregation.norm_reference import NormReference
from orchestrator.aggregation.pipeline import Aggregate, Stage


class ClipAndCap:
    """Clips and caps each contribution before `inner` accepts it; finishes with the reference
    norms for the next round.

    The weight cap needs the round's median weight, so the round's weights come first, in the order
    the contributions will be accepted (the server reads them before the reports). Once a population
    has reference norms, the clipping bounds are known before any report and each contribution goes
    on at once (memory O(model) for the weighted mean); a population's first round clips to its own
    median norms, so its contributions are held until `finish`."""

    def __init__(
        self,
        inner: Stage,
        rule: RobustAggregation,
        shapes: Mapping[str, tuple[int, ...]],
        weights: Sequence[float],
        reference: NormReference | Mapping[str, float] | None,
    ) -> None:
        self._inner, self._rule, self._reference = inner, rule, reference
        self._weights = [float(w) for w in weights]
        self._capped = cap_weights(self._weights, rule.max_weight_multiple)
        self._bounds = known_bounds(reference, shapes, rule)
        self._norms: list[dict[str, float]] = []
        self._held: list[Mapping[str, SparseTensor]] = []

    def accept(self, delta: Mapping[str, SparseTensor], weight: float) -> None:
        index = len(self._norms)
        if index >= len(self._weights) or float(weight) != self._weights[index]:
            raise ValueError(
                f"contribution {index} has weight {weight!r}; the round's weights, in order, "
                f"are {self._weights[:8]}{'...' if len(self._weights) > 8 else ''}"
            )
        norms = tensor_norms(delta)
        self._norms.append(norms)
        if self._bounds is None:
            self._held.append(delta)
        else:
            self._inner.accept(clip_by_norm(delta, self._bounds, norms), self._capped[index])

    def finish(self) -> Aggregate:
        if len(self._norms) != len(self._weights):
            raise ValueError(f"{len(self._norms)} contributions accepted of the round's {len(self._weights)}")
        plan = plan_round(self._weights, self._norms, self._reference, self._rule)
        if self._bounds is None:
            for delta, weight, norms in zip(self._held, self._capped, self._norms, strict=True):
                self._inner.accept(clip_by_norm(delta, plan.bounds, norms), weight)
            self._held = []
        inner = self._inner.finish()
        return Aggregate(
            mean_delta=inner.mean_delta,
            count=inner.count,
            metrics=inner.metrics,
            consumed=inner.consumed,
            norm_reference=plan.next_reference,
        )
