"""DP-FedAvg's server step (McMahan et al. 2018; adaptive clipping: Andrew et al. 2021): Gaussian
noise on the sum of the round's equally weighted, clipped contributions."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from contracts.params import SparseTensor
from orchestrator.aggregation.differential_privacy import DPConfig, adapt_clip_norm, noised_mean
from orchestrator.aggregation.pipeline import Aggregate, Stage

# DP round metrics. A training round under adaptive clipping is opened with its clip norm in
# its metrics; devices send WITHIN_CLIP (0 or 1) and may send no other "dp_" metric.
CLIP_NORM, NEXT_CLIP_NORM, WITHIN_CLIP = "dp_clip_norm", "dp_next_clip_norm", "dp_within_clip"


class GaussianNoise:
    """Noise on the inner stage's sum, divided by its count; measures the noise on the mean, epsilon
    after this round and, under adaptive clipping, the next round's clip norm.

    Every contribution weighs the same and is not clipped again: the devices clipped to the bound
    the noise is calibrated to (the server checks it per report), and an example count would scale
    a device's influence past it. `inner` is an equally weighted sum (it keeps `total`) or the
    secure sum (its mean times its count is the sum)."""

    def __init__(
        self,
        inner: Stage,
        dp: DPConfig,
        round_metrics: Mapping[str, float],
        epsilon: float,
        rng: np.random.Generator,
    ) -> None:
        self._inner, self._dp, self._rng, self._epsilon = inner, dp, rng, epsilon
        # The raw count of unclipped devices is not for release; only its noised share is.
        self._unclipped = round(round_metrics.get(WITHIN_CLIP, 0.0))
        self._clip_norm = float(round_metrics.get(CLIP_NORM, dp.clip_norm))

    def accept(self, delta: Mapping[str, SparseTensor], weight: float) -> None:
        self._inner.accept(delta, weight)

    def finish(self) -> Aggregate:
        inner = self._inner.finish()
        count, dp = inner.count, self._dp
        total = inner.total
        if total is None:
            total = {name: value * count for name, value in inner.mean_delta.items()}
        mean = noised_mean(total, count, dp, self._rng, self._clip_norm)
        measured = {"dp_noise_stddev": dp.noise_stddev(self._clip_norm) / count}
        if dp.adaptive:
            measured[NEXT_CLIP_NORM], measured["dp_unclipped_share"] = adapt_clip_norm(
                self._clip_norm, self._unclipped, count, dp, self._rng
            )
        if math.isfinite(self._epsilon):  # JSON has no infinity; without noise there is no epsilon
            measured["dp_epsilon"] = self._epsilon
        return Aggregate(
            mean_delta=mean,
            count=count,
            metrics={**inner.metrics, **measured},
            consumed=inner.consumed | {WITHIN_CLIP},
            norm_reference=inner.norm_reference,
        )
