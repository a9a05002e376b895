"""The bounds on what a client sends: every number has a range, every document a size and depth.

Checked at the edge of the server, before anything reaches the database (whose integers are
64-bit) or the aggregation, so that hostile input is a 4xx that names the limit, never a 500.
"""

from __future__ import annotations

import json
from typing import Any

# Counts a device or an admin may state (examples, reports, versions): part of the protocol,
# which the device shares.
from contracts.protocol import MAX_COUNT as MAX_COUNT

# A JSON document a client sends (population settings, a manifest, an evaluation report,
# a report's metrics): how deeply it may nest, and how large its text may be.
MAX_JSON_DEPTH = 16
MAX_JSON_BYTES = 64 * 1024
MAX_MANIFEST_BYTES = 4 * 1024 * 1024
# A training report's safetensors header (tensor names, dtypes, shapes, offsets, and the
# metadata `num_examples` and `metrics`): a few hundred bytes per tensor and 64 metrics.
MAX_REPORT_HEADER_BYTES = 64 * 1024
# A metric a device reports: a sum over its examples, finite and of a sane magnitude, so that
# sums over a round stay finite too.
MAX_METRIC_MAGNITUDE = 1e12


class LimitError(ValueError):
    """Input beyond a bound; the message names the bound."""


def json_document(text: str | bytes, what: str, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """`text` parsed as JSON, at most `max_bytes` long and MAX_JSON_DEPTH deep; LimitError
    (a ValueError) says what was wrong."""
    if len(text) > max_bytes:
        raise LimitError(f"{what} is {len(text)} bytes; the limit is {max_bytes}")
    try:
        document = json.loads(text)
    except RecursionError:
        raise LimitError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LimitError(f"{what} is not valid JSON: {e}") from None
    if depth(document) > MAX_JSON_DEPTH:
        raise LimitError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    return document


def depth(document: Any) -> int:
    """How deeply a parsed JSON document nests (a scalar is 0, [] or {} is 1); iterative, so a
    hostile document cannot exhaust the stack."""
    deepest, stack = 0, [(document, 0)]
    while stack:
        value, level = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            deepest = max(deepest, level)
            continue
        deepest = max(deepest, level + 1)
        stack.extend((child, level + 1) for child in children)
    return deepest
