"""Checks of answers a port may not give byte for byte: what the kit's reference decodes them to.

An expected value `{"$<check>": spec}` in a case is checked by `CHECKS[check](spec, actual, where)`,
which returns the problem or None."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np

from conformance.port import to_bytes
from conformance.secure_checks import SECURE_CHECKS
from conformance.tensors import sparse_json
from contracts.params import ParamsError, decode_sparse_delta, read_metadata

Check = Callable[[Any, Any, str], str | None]


def blob(actual: Any, where: str) -> bytes | str:
    try:
        return to_bytes(actual)
    except ValueError as e:
        return f"{where}: {e}"


def sparse_delta(spec: dict[str, Any], actual: Any, where: str) -> str | None:
    """A row-sparse safetensors delta: per tensor `<name>/rows` (int32, strictly increasing, only
    rows with a nonzero value), `<name>/values` (float32), `<name>/shape` (int64), and metadata
    `num_examples` (decimal) and `metrics` (a JSON object of numbers)."""
    data = blob(actual, where)
    if isinstance(data, str):
        return data
    try:
        delta = decode_sparse_delta(data)
        metadata = read_metadata(data)
    except ParamsError as e:
        return f"{where}: {e}"
    tolerance = float(spec.get("tolerance", 0.0))
    if sorted(delta) != sorted(spec["tensors"]):
        return f"{where}: tensors {sorted(delta)}, expected {sorted(spec['tensors'])}"
    for name, expected in spec["tensors"].items():
        got = sparse_json(delta[name])
        if got["shape"] != expected["shape"] or got["rows"] != expected["rows"]:
            return (
                f"{where}: {name} has shape {got['shape']} rows {got['rows']}, "
                f"expected {expected['shape']} rows {expected['rows']}"
            )
        if not np.allclose(got["values"], expected["values"], rtol=0, atol=tolerance):
            return f"{where}: {name}'s values differ by more than {tolerance:g}"
    want = spec["metadata"]
    if sorted(metadata) != sorted(want):
        return f"{where}: metadata keys {sorted(metadata)}, expected {sorted(want)}"
    if metadata["num_examples"] != want["num_examples"]:
        return f"{where}: num_examples {metadata['num_examples']!r}, expected {want['num_examples']!r}"
    try:
        metrics = json.loads(metadata["metrics"])
    except json.JSONDecodeError:
        return f"{where}: metadata metrics is not JSON: {metadata['metrics'][:80]!r}"
    expected_metrics = json.loads(want["metrics"])
    if sorted(metrics) != sorted(expected_metrics) or not all(
        abs(float(metrics[k]) - float(v)) <= tolerance for k, v in expected_metrics.items()
    ):
        return f"{where}: metrics {metrics}, expected {expected_metrics} (within {tolerance:g})"
    return None


CHECKS: dict[str, Check] = {"$sparse_delta": sparse_delta, **SECURE_CHECKS}
