"""The learnt reference norm that robust aggregation clips each report to a multiple of, and
how it may move from round to round.

Per global tensor, a round observes the median norm of the reports that changed it. The next
round's reference is the smallest of:

- the median of the last `history_rounds` rounds' observations (each first capped at the
  round's clipping bound): a robust statistic of many rounds, which a run of hostile rounds
  moves only once they are more than half of that history;
- `round_growth` x the reference in force (it may shrink at once, grow only so fast);
- `window_growth` x the smallest reference of the last `window_rounds` rounds: over any window
  of that many rounds the reference grows at most that much, however the rounds are filled.

The per-round limit alone (the rule before this module: 1.25 a round) compounds: rounds made
only of hostile devices raised it 1.25^k over k rounds, and the model moved with it
(benchmarks/norm_bound.py measures both rules). `NormReference(history_rounds=1,
window_rounds=0)` is that earlier rule.

Stored as JSON with each committed training round (`Round.norm_reference`); a round stored
before this module holds only `{tensor: reference}`, read as a history of one round.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

HISTORY_ROUNDS = 25
WINDOW_ROUNDS = 100
WINDOW_GROWTH = 2.0
ROUND_GROWTH = 1.25


@dataclass(frozen=True)
class NormRule:
    """How fast the reference may move; the defaults are the server's."""

    history_rounds: int = HISTORY_ROUNDS
    window_rounds: int = WINDOW_ROUNDS  # 0: no window bound (the earlier rule)
    window_growth: float = WINDOW_GROWTH
    round_growth: float = ROUND_GROWTH

    def __post_init__(self) -> None:
        if self.history_rounds < 1 or self.window_rounds < 0:
            raise ValueError("history_rounds must be >= 1 and window_rounds >= 0")
        if not (1 <= self.round_growth <= 1e6 and 1 <= self.window_growth <= 1e6):
            raise ValueError("round_growth and window_growth must be in [1, 1e6]")


@dataclass(frozen=True)
class NormReference:
    """Per tensor: the reference in force, the recent rounds' observations, and the recent
    references (oldest first)."""

    reference: dict[str, float]
    observed: dict[str, list[float]] = field(default_factory=dict)
    recent: dict[str, list[float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"reference": self.reference, "observed": self.observed, "recent": self.recent}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> NormReference | None:
        if not data:
            return None
        if "reference" not in data:  # stored before the history: {tensor: reference}
            legacy = {str(k): float(v) for k, v in data.items()}
            return cls(legacy, {}, {k: [v] for k, v in legacy.items()})
        return cls(
            {str(k): float(v) for k, v in data["reference"].items()},
            {str(k): [float(x) for x in v] for k, v in data.get("observed", {}).items()},
            {str(k): [float(x) for x in v] for k, v in data.get("recent", {}).items()},
        )

    @classmethod
    def of(cls, value: NormReference | Mapping[str, float] | None) -> NormReference | None:
        """A state from a state, a bare {tensor: reference}, or None (no round yet)."""
        if value is None or isinstance(value, NormReference):
            return value
        return cls.from_json(dict(value))


def next_reference(
    state: NormReference | None,
    used: Mapping[str, float],
    medians: Mapping[str, float],
    clip_multiple: float,
    rule: NormRule,
) -> NormReference:
    """The state after a round that clipped to `clip_multiple` x `used` and observed `medians`
    (0 for a tensor no report changed: that round says nothing about it)."""
    reference: dict[str, float] = dict(state.reference) if state else {}
    observed = {k: list(v) for k, v in state.observed.items()} if state else {}
    recent = {k: list(v) for k, v in state.recent.items()} if state else {}
    for name, in_force in used.items():
        seen = medians.get(name, 0.0)
        if not seen > 0:
            reference[name] = in_force if in_force > 0 else reference.get(name, 0.0)
            continue
        history = [*observed.get(name, []), min(seen, clip_multiple * in_force)][-rule.history_rounds :]
        candidates = [float(np.median(history)), rule.round_growth * in_force]
        # The references of the last window_rounds rounds, the one in force last.
        window = (recent.get(name) or [in_force])[-rule.window_rounds :] if rule.window_rounds else []
        if window:
            candidates.append(rule.window_growth * min(window))
        new = min(candidates)
        observed[name] = history
        if rule.window_rounds:
            recent[name] = [*recent.get(name, []), new][-rule.window_rounds :]
        reference[name] = new
    return NormReference(reference, observed, recent)
