"""Checks of secure aggregation answers (step 2)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SECURE_CHECKS: dict[str, Callable[[Any, Any, str], str | None]] = {}
