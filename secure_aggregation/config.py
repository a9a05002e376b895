"""The parameters of a secure round, as the server announces them to every device of the round.

Aggregation weights are **uniform**: a device contributes its clipped delta with weight 1 and the
server averages over the survivors. Weighting by example count would have to travel inside the
masked vector as `weight x delta` plus a weight coordinate; that widens every coordinate's range by
the largest weight (up to max_examples x (1 + negatives): ~11 more bits per coordinate for the same
precision), and it breaks the bounded per-device contribution that DP-FedAvg's noise is calibrated
to (McMahan et al. 2018 use uniform weights for that reason). With uniform weights a device's whole
influence on the round is bounded by `clip_norm`, and its example count is not revealed either.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

# Above 62 bits a sum of two coordinates could overflow numpy's uint64 before the modulus is taken.
MAX_BITS = 62
MIN_BITS = 16


class ProtocolError(ValueError):
    """A message that does not follow the protocol: what was wrong and what was expected."""


@dataclass(frozen=True)
class RoundParameters:
    """What every device of a secure round must agree on.

    - `context`: unique per round (e.g. population, round id and a random seed in hex); it goes into
      every key derivation and every authenticated encryption, so no message replays into another
      round, and its hash seeds the neighbour graph.
    - `vector_length`: coordinates of the flattened update (every global tensor, dense).
    - `bits`: the modulus is 2^bits; coordinates travel as 4 bytes when bits <= 32, else 8.
    - `clip_norm`: each device clips its delta to this L2 norm before quantizing.
    - `max_summands`: the most inputs the round can sum (its capacity): each device's integer range
      is 2^(bits-1) / max_summands, so the sum of a full round cannot wrap.
    - `neighbours`: SecAgg+ neighbourhood size k (even); 0, or k >= roster size - 1, is the full graph.
    - `threshold`: the fraction of a device's neighbours whose shares reconstruct its secrets
      (Shamir threshold t = ceil(threshold x k), at least 2 so no single share is the secret).
    - `min_survivors`: inputs the sum needs; fewer at any phase and nothing is unmasked.
    """

    context: str
    vector_length: int
    bits: int
    clip_norm: float
    max_summands: int
    neighbours: int
    threshold: float
    min_survivors: int

    def __post_init__(self) -> None:
        problems = []
        if not self.context or len(self.context) > 200:
            problems.append("context must be a non-empty string of at most 200 characters")
        if self.vector_length < 1:
            problems.append(f"vector_length must be >= 1, got {self.vector_length}")
        if not MIN_BITS <= self.bits <= MAX_BITS:
            problems.append(f"bits must be in [{MIN_BITS}, {MAX_BITS}], got {self.bits}")
        if not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            problems.append(f"clip_norm must be a finite number > 0, got {self.clip_norm}")
        if self.max_summands < 1:
            problems.append(f"max_summands must be >= 1, got {self.max_summands}")
        elif MIN_BITS <= self.bits <= MAX_BITS and self.levels < 2**7:
            problems.append(
                f"{self.bits} bits leave {self.levels} quantization levels per device for "
                f"{self.max_summands} summands; raise bits (at least 8 bits of precision are needed)"
            )
        if self.neighbours < 0 or self.neighbours % 2:
            problems.append(f"neighbours must be an even number >= 0, got {self.neighbours}")
        if not 0 < self.threshold <= 1:
            problems.append(f"threshold must be a fraction in (0, 1], got {self.threshold}")
        if self.min_survivors < 1:
            problems.append(f"min_survivors must be >= 1, got {self.min_survivors}")
        if problems:
            raise ProtocolError("invalid secure round parameters: " + "; ".join(problems))

    @property
    def modulus_mask(self) -> int:
        return (1 << self.bits) - 1

    @property
    def levels(self) -> int:
        """Largest absolute integer one device's coordinate may take."""
        return ((1 << (self.bits - 1)) - 1) // self.max_summands

    @property
    def wire_dtype(self) -> str:
        return "<u4" if self.bits <= 32 else "<u8"

    def shamir_threshold(self, neighbourhood_size: int) -> int:
        """Shares that reconstruct a secret shared among `neighbourhood_size` neighbours."""
        return max(2, math.ceil(self.threshold * neighbourhood_size - 1e-9))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RoundParameters:
        expected = {
            "context": str,
            "vector_length": int,
            "bits": int,
            "clip_norm": float,
            "max_summands": int,
            "neighbours": int,
            "threshold": float,
            "min_survivors": int,
        }
        if not isinstance(data, Mapping) or set(data) != set(expected):
            got = sorted(data) if isinstance(data, Mapping) else type(data).__name__
            raise ProtocolError(f"secure round parameters must have exactly {sorted(expected)}, got {got}")
        values: dict[str, Any] = {}
        for key, kind in expected.items():
            value = data[key]
            ok = isinstance(value, (int, float) if kind is float else kind) and not isinstance(value, bool)
            if not ok:
                raise ProtocolError(f"secure round parameter {key!r} must be {kind.__name__}, got {value!r}")
            values[key] = kind(value)
        return cls(**values)
