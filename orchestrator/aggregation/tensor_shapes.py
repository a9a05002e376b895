"""Checks that a set of named tensors has the shapes a model's parameters have: a delta added to
the mean and a mean delta or optimizer state fed to the server step are refused, with what differs,
before anything is computed."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def describe_mismatch(
    what: str, got: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]
) -> str | None:
    """What differs between two name -> shape maps, or None when they agree."""
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if missing or extra:
        return (
            f"{what}: expected tensors {sorted(expected)}"
            + (f"; missing {missing}" if missing else "")
            + (f"; unexpected {extra}" if extra else "")
        )
    wrong = [
        f"{name} has shape {got[name]}, expected {expected[name]}"
        for name in sorted(expected)
        if tuple(got[name]) != tuple(expected[name])
    ]
    if wrong:
        return f"{what}: " + "; ".join(wrong)
    return None


def check_shapes(
    what: str, got: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]
) -> None:
    problem = describe_mismatch(what, got, expected)
    if problem is not None:
        raise ValueError(problem)


def shapes_of(tensors: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(np.shape(value)) for name, value in tensors.items()}
