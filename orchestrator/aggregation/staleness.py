"""FedBuff's staleness weights: how much a report trained on an older model version counts.

A buffered population (`rounds: buffered`) adds each report into its buffer with weight
examples x f(s), where s is the number of versions committed since the device downloaded its
model. The functions are a fixed set, named in the settings (no user text is evaluated).
"""

from __future__ import annotations

import math
from collections.abc import Callable

# name -> what it is (the settings page lists them)
STALENESS_WEIGHTINGS = {
    "inverse_sqrt": "1/sqrt(1+s) (FedBuff's choice)",
    "inverse": "1/(1+s)",
    "constant": "1: staleness does not change a report's weight",
}
_FUNCTIONS: dict[str, Callable[[int], float]] = {
    "inverse_sqrt": lambda s: 1.0 / math.sqrt(1.0 + s),
    "inverse": lambda s: 1.0 / (1.0 + s),
    "constant": lambda s: 1.0,
}


def staleness_weight(name: str, staleness: int) -> float:
    """f(s) of the weighting `name`, for a report `staleness` versions behind (s >= 0)."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    return _FUNCTIONS[name](staleness)
