"""Secure aggregation operations (filled in step 2)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SECURE_OPS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {}
