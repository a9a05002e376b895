"""Parallel training's MERGEOPT (Augenstein et al., "Mixing centralized and federated data"): the
federated mean delta merged with the one the server trained on the centralized data."""

from __future__ import annotations

from collections.abc import Mapping

from contracts.params import SparseTensor
from orchestrator.aggregation.central_merge import CentralUpdate, merge
from orchestrator.aggregation.pipeline import Aggregate, Stage, with_measurements


class CentralMerge:
    """`(1 - weight) x` the inner stage's mean `+ weight x` the central delta, after the secure sum
    and the DP noise when the population has them. The centralized data is public, so its part
    costs no privacy: DP's accounting covers the devices' reports, which are unchanged. A central
    training that diverged (`central` None) leaves the round federated only, and says so."""

    def __init__(self, inner: Stage, central: CentralUpdate | None, weight: float) -> None:
        self._inner, self._central, self._weight = inner, central, weight

    def accept(self, delta: Mapping[str, SparseTensor], weight: float) -> None:
        self._inner.accept(delta, weight)

    def finish(self) -> Aggregate:
        inner = self._inner.finish()
        if self._central is None:
            return with_measurements(inner, inner.mean_delta, {"central_diverged": 1.0})
        central = self._central
        merged = merge(inner.mean_delta, central.delta, self._weight)
        return with_measurements(
            inner, merged, {"central_loss": central.loss, "central_steps": float(central.steps)}
        )
