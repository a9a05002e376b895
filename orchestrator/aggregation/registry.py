"""The robust rules a population may choose, by name: the registry `ROBUST_RULES` maps each name
to the stage that combines a round's clipped, capped contributions (`robust.ClipAndCap` wraps it),
and `RobustAggregation` is a population's choice with the clipping and capping every rule shares.

A new rule is its stage module and one entry in `ROBUST_RULES`: the pipeline builds its stage
from the entry, and the population settings (`robust_aggregation`) accept exactly these names.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from orchestrator.aggregation.coordinate_wise import CoordinateWiseStage
from orchestrator.aggregation.norm_reference import (
    HISTORY_ROUNDS,
    ROUND_GROWTH,
    WINDOW_GROWTH,
    WINDOW_ROUNDS,
    NormRule,
)
from orchestrator.aggregation.pipeline import Stage
from orchestrator.aggregation.weighted_mean import WeightedMeanStage


@dataclass(frozen=True)
class RobustRule:
    """A registry entry: how the rule's stage is made from the model's tensor shapes and the
    population's rule (where the rule's parameters are), and what it does, in a few words (the
    population settings' description of `robust_aggregation`, and so the settings page, says it)."""

    stage: Callable[[Mapping[str, tuple[int, ...]], RobustAggregation], Stage]
    what: str


ROBUST_RULES: dict[str, RobustRule] = {
    "none": RobustRule(
        lambda shapes, rule: WeightedMeanStage(shapes), "the weighted mean of the clipped deltas (FedAvg)"
    ),
    "trimmed_mean": RobustRule(
        lambda shapes, rule: CoordinateWiseStage(shapes, "trimmed_mean", rule.trim_fraction),
        "per coordinate, the mean of the reports that changed it, trim_fraction of them cut at each end",
    ),
    "median": RobustRule(
        lambda shapes, rule: CoordinateWiseStage(shapes, "median", rule.trim_fraction),
        "per coordinate, the median of the reports that changed it",
    ),
}


@dataclass(frozen=True)
class RobustAggregation:
    """How a round's reports are combined so that hostile devices cannot move the model far.

    - Clipping: each report's delta is scaled down, tensor by tensor, to at most
      `norm_clip_multiple` x the tensor's reference norm. The reference is learnt from the honest
      rounds before (`plan_round`), not fixed: a fixed bound is either loose enough for any model
      (1000, which let ten devices move a global mean from 3.5 to 1002.5) or wrong for most.
    - Weights: a device's weight (its example count, already at most what it checked in with and
      the task's max_examples) is capped at `max_weight_multiple` x the round's median weight.
    - `method`: the name of the stage that combines the clipped deltas (`ROBUST_RULES`): "none" is
      the weighted mean (FedAvg); "trimmed_mean" and "median" replace it per coordinate (Yin et
      al., ICML 2018), over the reports that changed that row, scaled by their share of the
      round's weight (as the weighted mean scales a row that few reports changed).
    """

    method: str = "none"
    trim_fraction: float = 0.1  # trimmed_mean: this fraction of the values dropped at each end
    norm_clip_multiple: float = 3.0
    max_weight_multiple: float = 5.0
    # How the reference norm may move (orchestrator.aggregation.norm_reference): at most this factor a
    # round, at most `reference_window_growth` over any `reference_window_rounds` rounds, and
    # never above the median of the last `reference_history_rounds` rounds' observations.
    reference_growth: float = ROUND_GROWTH
    reference_history_rounds: int = HISTORY_ROUNDS
    reference_window_rounds: int = WINDOW_ROUNDS
    reference_window_growth: float = WINDOW_GROWTH

    def __post_init__(self) -> None:
        if self.method not in ROBUST_RULES:
            raise ValueError(f"unknown robust aggregation {self.method!r}; known: {list(ROBUST_RULES)}")
        if not 0 <= self.trim_fraction < 0.5:
            raise ValueError(f"trim_fraction must be in [0, 0.5), got {self.trim_fraction}")
        for name in (
            "norm_clip_multiple",
            "max_weight_multiple",
            "reference_growth",
            "reference_window_growth",
        ):
            if not 1 <= getattr(self, name) <= 1e6:
                raise ValueError(f"{name} must be in [1, 1e6], got {getattr(self, name)}")
        _ = self.norm_rule  # checks the history and the window

    @functools.cached_property
    def norm_rule(self) -> NormRule:
        """Built once per rule (a population's is built once per settings version), not per round."""
        return NormRule(
            history_rounds=self.reference_history_rounds,
            window_rounds=self.reference_window_rounds,
            window_growth=self.reference_window_growth,
            round_growth=self.reference_growth,
        )
