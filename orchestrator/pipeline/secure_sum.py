"""Secure aggregation's sum, as a stage: the server never holds a device's delta, only the sum of a
round's survivors once `secure_rounds` has unmasked it."""

from __future__ import annotations

from collections.abc import Mapping

from contracts.params import Params, SparseTensor
from orchestrator.aggregation.pipeline import Aggregate


class SecureSum:
    """The unmasked mean of `survivors` clipped, quantized deltas (uniform weights). It accepts no
    single contribution: under secure aggregation none ever reaches the server unmasked."""

    def __init__(self, mean_delta: Params, survivors: int) -> None:
        if survivors < 1:
            raise ValueError(f"a secure sum needs at least one survivor, got {survivors}")
        self._mean, self._survivors = mean_delta, survivors

    def accept(self, delta: Mapping[str, SparseTensor], weight: float) -> None:
        raise ValueError("a secure round's server never sees a device's delta, only the survivors' sum")

    def finish(self) -> Aggregate:
        return Aggregate(mean_delta=self._mean, count=self._survivors)
