"""A population's aggregation pipeline, assembled once from its settings."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from contracts.params import Params, SparseTensor, decode_sparse_delta
from orchestrator.aggregation.central_merge import CentralMerge, CentralUpdate
from orchestrator.aggregation.differential_privacy import DPConfig, secure_rng
from orchestrator.aggregation.norm_reference import NormReference
from orchestrator.aggregation.pipeline import Aggregate, Stage
from orchestrator.aggregation.private import GaussianNoise
from orchestrator.aggregation.registry import ROBUST_RULES, RobustAggregation
from orchestrator.aggregation.robust import ClipAndCap
from orchestrator.aggregation.secure_sum import SecureSum
from orchestrator.aggregation.weighted_mean import PartialSum, WeightedMeanStage


@dataclass(frozen=True)
class CentralPart:
    """Parallel training's part of a round: the central delta (None: its training diverged) and
    the weight it is merged with."""

    update: CentralUpdate | None
    weight: float


@dataclass(frozen=True)
class RoundInputs:
    """What a round's stages need besides the contributions, read by the commit."""

    rounds_committed: int  # training rounds committed before this one (DP's epsilon after it)
    metrics: Mapping[str, float] = field(default_factory=dict)  # the round's, so far
    # Plaintext rounds: the reports' weights in the order they will be accepted, and the reference
    # norms the population's last committed round left (robust clipping).
    weights: Sequence[float] = ()
    reference: NormReference | None = None
    central: CentralPart | None = None  # None: the population does not train on centralized data


class Pipeline:
    """Builds each training round's stack of stages from its parts: `rule` None is the plain
    weighted mean, unclipped (the FedAvg papers' baseline); `epsilon_after` gives DP's epsilon
    after a number of committed rounds (a population's accountant; None, as in the fast
    simulation: not measured). A population's is `populations.config.pipeline_of`."""

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        rule: RobustAggregation | None = None,
        dp: DPConfig | None = None,
        epsilon_after: Callable[[int], float] | None = None,
        rng: Callable[[], np.random.Generator] = secure_rng,
    ) -> None:
        self._shapes, self._rule, self._dp, self._rng = dict(shapes), rule, dp, rng
        self._epsilon_after = epsilon_after
        # Under DP every report weighs the same: the commit reads no weights or reference norms.
        self.private = dp is not None

    @property
    def sums_in_parts(self) -> bool:
        """Whether a round's contributions may be added up in parts where they are made
        (`aggregate(partials=...)`): the plain weighted mean only. Clipping, robust means and DP
        need each contribution on its own."""
        return self._dp is None and self._rule is None

    def aggregate(
        self,
        inputs: RoundInputs,
        contributions: Iterable[tuple[Mapping[str, SparseTensor], float]] = (),
        secure: tuple[Params, int] | None = None,
        stored: Iterable[tuple[float, bytes]] = (),
        partials: Sequence[PartialSum] = (),
    ) -> Aggregate:
        """A round's whole aggregation in one call: its stack of stages assembled, every
        contribution (sparse delta, weight) accepted in order, finished. `stored`: the
        contributions as the server stores them, (weight, encoded sparse delta), decoded one at a
        time as they are read (the server's commit passes its database cursor). `secure`: a secure
        round's unmasked (mean delta, survivors) instead of contributions. `partials`: the
        contributions added up in parts where they were made (the fast simulation's workers), instead
        of one by one; only where `sums_in_parts`. The stages stay inside this call: the caller hands
        over the round's inputs and gets the mean delta and measurements back."""
        if secure is not None:
            return self.secure_round(*secure, inputs).finish()
        if partials:
            return self._merged(self._summed(partials), inputs).finish()
        stage = self.plaintext_round(inputs)
        for delta, weight in contributions:
            stage.accept(delta, weight)
        for weight, blob in stored:
            stage.accept(decode_sparse_delta(blob), weight)
        return stage.finish()

    def plaintext_round(self, inputs: RoundInputs) -> Stage:
        """A round whose reports are accepted one by one: under DP equally weighted and noised;
        otherwise clipped, capped and combined by the stage the population's robust rule names
        (`registry.ROBUST_RULES`)."""
        stage: Stage
        if self._dp is not None:
            stage = self._noised(WeightedMeanStage(self._shapes, equal_weights=True), inputs)
        elif self._rule is None:
            stage = WeightedMeanStage(self._shapes)
        else:
            rule = self._rule
            inner = ROBUST_RULES[rule.method].stage(self._shapes, rule)
            stage = ClipAndCap(inner, rule, self._shapes, inputs.weights, inputs.reference)
        return self._merged(stage, inputs)

    def _summed(self, partials: Sequence[PartialSum]) -> Stage:
        if not self.sums_in_parts:
            raise ValueError(
                "this pipeline clips, averages robustly or adds noise per contribution: "
                "it takes contributions one by one, not partial sums"
            )
        stage = WeightedMeanStage(self._shapes)
        for part in partials:
            stage.accept_partial(part)
        return stage

    def secure_round(self, mean_delta: Params, survivors: int, inputs: RoundInputs) -> Stage:
        """A secure round: the survivors' unmasked mean, noised under DP."""
        stage: Stage = SecureSum(mean_delta, survivors)
        if self._dp is not None:
            stage = self._noised(stage, inputs)
        return self._merged(stage, inputs)

    def _noised(self, inner: Stage, inputs: RoundInputs) -> Stage:
        assert self._dp is not None
        after = self._epsilon_after
        epsilon = math.inf if after is None else after(inputs.rounds_committed + 1)
        return GaussianNoise(inner, self._dp, inputs.metrics, epsilon, self._rng())

    def _merged(self, stage: Stage, inputs: RoundInputs) -> Stage:
        if inputs.central is None:
            return stage
        return CentralMerge(stage, inputs.central.update, inputs.central.weight)
