"""The aggregation pipeline: how a round's contributions become one mean delta.

A population's pipeline is assembled once from its settings (`assemble.Pipeline`); each
training round gets a fresh stack of stages from it. Every stage has the same small interface
(`Stage`): `accept` one device's contribution (a sparse delta and its weight), then `finish`
into an `Aggregate`, the mean delta and the stage's measurements. A stage that wraps another
(as TFF's aggregation factories do) transforms what it accepts on the way in and what its inner
stage finishes with on the way out:

    plaintext        ClipAndCap -> the robust rule's stage (registry.ROBUST_RULES: WeightedMean,
                                   CoordinateWise's trimmed mean or median)
    plaintext + DP   GaussianNoise -> WeightedMean (equal weights, the sum kept)
    secure (+ DP)    [GaussianNoise ->] SecureSum (the unmasked sum of the survivors)
    + mixing         CentralMerge -> any of the above

No stage touches the database, HTTP or the clock: the round's commit (`rounds.lifecycle`) reads
the inputs the stages need (weights, reference norms, the round's clip norm) and hands them with
the round's reports to one call (`Pipeline.aggregate`), which builds the stack, feeds it and
finishes it; the commit stores what comes back. A new robust rule is one stage module and one
entry in `registry.ROBUST_RULES` (docs/contributing.md, "Adding an aggregation stage").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from contracts.params import Params, SparseTensor
from orchestrator.aggregation.norm_reference import NormReference


@dataclass(frozen=True)
class Aggregate:
    """What a stage finishes with: the round's mean delta, and its measurements."""

    mean_delta: Params
    count: int  # contributions accepted
    # Round metrics this stage measured (merged into the round's), and those it consumed (removed
    # from the round's: DP's raw count of unclipped devices is not for release).
    metrics: Mapping[str, float] = field(default_factory=dict)
    consumed: frozenset[str] = frozenset()
    # Per tensor, the reference update norm the next round's clipping starts from (robust clipping).
    norm_reference: NormReference | None = None
    # The sum the mean divides, float64, when a stage kept it (DP noises the sum, not the mean).
    total: Params | None = None


class Stage(Protocol):
    """One step of a round's aggregation."""

    def accept(self, delta: Mapping[str, SparseTensor], weight: float) -> None:
        """Take one device's contribution (its sparse delta and its weight, > 0)."""

    def finish(self) -> Aggregate:
        """The round's result, once every contribution was accepted."""


def with_measurements(
    inner: Aggregate,
    mean_delta: Params,
    metrics: Mapping[str, float],
    consumed: frozenset[str] = frozenset(),
) -> Aggregate:
    """`inner` with a new mean delta and more measurements (what a wrapping stage finishes with)."""
    return Aggregate(
        mean_delta=mean_delta,
        count=inner.count,
        metrics={**inner.metrics, **metrics},
        consumed=inner.consumed | consumed,
        norm_reference=inner.norm_reference,
    )


def apply_measurements(round_metrics: Mapping[str, float], aggregate: Aggregate) -> dict[str, float]:
    """A round's metrics after its aggregation: without what it consumed, with what it measured."""
    kept = {k: v for k, v in round_metrics.items() if k not in aggregate.consumed}
    return {**kept, **aggregate.metrics}
