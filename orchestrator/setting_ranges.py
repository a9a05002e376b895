"""The range of every numeric setting, readable by code (a generated settings reference, the
tests that walk each setting to its extremes).

Every number an operator sets has two finite ends, so that whatever the server derives from it
(capacities, deadlines, quantization levels, noise, token buckets) stays finite and inside the
database's integers. Pydantic settings carry their ranges as `Field(ge/gt/le/lt)`; the nested
dataclass configs (differential privacy, the server optimizer) declare theirs in a `RANGES`
table that their own validation enforces; the task config's live in contracts.task_config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import annotated_types
from pydantic import BaseModel


@dataclass(frozen=True)
class Range:
    """[low, high], either end open when said so."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False
    integer: bool = False

    def __post_init__(self) -> None:
        assert math.isfinite(self.low) and math.isfinite(self.high), "a range has two finite ends"

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if isinstance(value, float) and not math.isfinite(
            value
        ):  # (an int is finite, and may not fit a float)
            return False
        if self.integer and not isinstance(value, int):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


def check(owner: str, name: str, value: float, allowed: Range) -> str | None:
    """A problem's sentence when `value` is outside `allowed`, else None."""
    if value in allowed:
        return None
    return f"{name} must be a finite number in {allowed}, got {value!r}" + (f" ({owner})" if owner else "")


def field_ranges(model: type[BaseModel], prefix: str = "") -> dict[str, Range | None]:
    """Each numeric field of a pydantic model (and of its nested models), by dotted name, with its
    range from the field's constraints; None for a numeric field that lacks an end."""
    found: dict[str, Range | None] = {}
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found.update(field_ranges(annotation, f"{prefix}{name}."))
            continue
        if annotation not in (int, float, int | None, float | None):
            continue
        low = high = None
        low_open = high_open = False
        for constraint in info.metadata:
            if isinstance(constraint, annotated_types.Ge):
                low = float(constraint.ge)  # type: ignore[arg-type]
            elif isinstance(constraint, annotated_types.Gt):
                low, low_open = float(constraint.gt), True  # type: ignore[arg-type]
            elif isinstance(constraint, annotated_types.Le):
                high = float(constraint.le)  # type: ignore[arg-type]
            elif isinstance(constraint, annotated_types.Lt):
                high, high_open = float(constraint.lt), True  # type: ignore[arg-type]
        found[prefix + name] = (
            None
            if low is None or high is None
            else Range(low, high, low_open, high_open, integer=annotation in (int, int | None))
        )
    return found
