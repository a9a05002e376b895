"""Robust clipping and weight caps: what keeps a few hostile devices from moving the model far.

Each contribution is clipped, tensor by tensor, to a multiple of the reference norm the rounds
before learnt, and its weight is capped at a multiple of the round's median weight
(`registry.RobustAggregation` says how, `plan_round` decides a round's bounds); the rule's stage
(`registry.ROBUST_RULES`) then combines what was clipped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from contracts.params import SparseTensor
from orchestrator.aggregation.norm_reference import NormReference, next_reference
from orchestrator.aggregation.pipeline import Aggregate, Stage
from orchestrator.aggregation.registry import RobustAggregation


def tensor_norms(delta: Mapping[str, SparseTensor]) -> dict[str, float]:
    """The L2 norm of each tensor of a sparse delta (absent rows are zero), summed in float64."""
    return {name: _norm(t.values) for name, t in delta.items()}


def _norm(values: np.ndarray) -> float:
    # einsum sums the float64 squares without a float64 copy of the values (np.linalg.norm of
    # values.astype(float64) made one, and its BLAS call was most of a dense delta's clipping).
    flat = values.reshape(-1)
    return math.sqrt(float(np.einsum("i,i->", flat, flat, dtype=np.float64)))


def cap_weights(weights: Sequence[float], multiple: float) -> list[float]:
    """Each weight, at most `multiple` x the median weight."""
    cap = multiple * float(np.median(weights)) if len(weights) else 0.0
    return [min(float(w), cap) for w in weights]


@dataclass(frozen=True)
class RoundPlan:
    """What `plan_round` decided for one round's reports."""

    weights: list[float]  # capped, in the reports' order
    bounds: dict[str, float]  # per tensor, the norm each report's delta is clipped to
    next_reference: NormReference  # per tensor, the reference norm for the next round, and its history


def plan_round(
    weights: Sequence[float],
    norms: Sequence[Mapping[str, float]],
    reference: NormReference | Mapping[str, float] | None,
    rule: RobustAggregation,
) -> RoundPlan:
    """Capped weights and per-tensor clipping bounds for a round's reports, and the next reference.

    This round's bound is `norm_clip_multiple` x the reference the previous round left
    (`reference`); a population's first round, which has none, uses its own median norm. The
    next reference follows the rounds' median norms under the limits of
    orchestrator.aggregation.norm_reference, so that hostile rounds cannot ratchet it up.
    """
    names = sorted({name for n in norms for name in n})
    medians: dict[str, float] = {}
    for name in names:
        touched = [n[name] for n in norms if n.get(name, 0.0) > 0]
        medians[name] = float(np.median(touched)) if touched else 0.0
    state = NormReference.of(reference)
    known = state.reference if state else {}
    used = {name: known[name] if known.get(name, 0.0) > 0 else medians[name] for name in names}
    return RoundPlan(
        weights=cap_weights(weights, rule.max_weight_multiple),
        bounds={name: rule.norm_clip_multiple * used[name] for name in names},
        next_reference=next_reference(state, used, medians, rule.norm_clip_multiple, rule.norm_rule),
    )


def known_bounds(
    reference: NormReference | Mapping[str, float] | None, names: Iterable[str], rule: RobustAggregation
) -> dict[str, float] | None:
    """The clipping bounds `plan_round` will set for tensors `names`, when the reference fixes
    them all (a norm > 0 for each) so that a round's reports can be clipped as they are read;
    None when some bound depends on the round's own norms."""
    state = NormReference.of(reference)
    known = state.reference if state else {}
    if not all(known.get(name, 0.0) > 0 for name in names):
        return None
    return {name: rule.norm_clip_multiple * known[name] for name in names}


def clip_by_norm(
    delta: Mapping[str, SparseTensor],
    bounds: Mapping[str, float],
    norms: Mapping[str, float] | None = None,
) -> dict[str, SparseTensor]:
    """Each tensor scaled down to L2 norm at most its bound (tensors within it are unchanged);
    `norms`: the tensors' norms (`tensor_norms`), when the caller has them already."""
    clipped: dict[str, SparseTensor] = {}
    for name, tensor in delta.items():
        norm = norms[name] if norms is not None else _norm(tensor.values)
        bound = bounds.get(name, 0.0)
        if norm <= bound:
            clipped[name] = tensor
        else:
            values = (tensor.values.astype(np.float64) * (bound / norm)).astype(np.float32)
            clipped[name] = SparseTensor(tensor.shape, tensor.rows, values)
    return clipped


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
