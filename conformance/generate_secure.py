"""Secure aggregation vectors (step 2)."""

from __future__ import annotations

from pathlib import Path


def generate(out: Path) -> None:
    pass
