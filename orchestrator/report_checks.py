"""What a report must be to count: its tensors, metadata, metrics and norms, checked before anything
is stored. A refusal is returned as a `Refused` value that says what was wrong and what was expected."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from contracts.manifest import Manifest
from contracts.params import (
    ParamsError,
    check_sparse_delta,
    decode_sparse_delta,
    encode_sparse_delta,
    read_metadata,
)
from orchestrator.aggregation.private import CLIP_NORM, WITHIN_CLIP
from orchestrator.db import Round
from orchestrator.limits import MAX_METRIC_MAGNITUDE, MAX_REPORT_HEADER_BYTES, json_document
from orchestrator.populations.config import PopulationConfig
from orchestrator.rounds.refusals import Refused

MAX_METRICS = 64


def evaluation_metrics(manifest: Manifest) -> tuple[str, ...]:
    """The sums an evaluation report holds: the model's loss, weight and declared metrics."""
    return ("loss_sum", "weight_sum", *(f"{m.name}_sum" for m in manifest.metrics))


def _check_metrics(raw: Any) -> dict[str, float] | Refused:
    if not isinstance(raw, Mapping) or len(raw) > MAX_METRICS:
        return Refused(422, f"metrics must be an object of at most {MAX_METRICS} numbers", reason="metrics")
    metrics: dict[str, float] = {}
    for k, v in raw.items():
        if (
            not isinstance(k, str)
            or not 0 < len(k) <= 64
            or not k.replace("_", "").isascii()
            or not (k.replace("_", "").isalnum())
        ):
            return Refused(
                422,
                f"metric name {k!r:.80} must be 1-64 ASCII letters, digits or underscores",
                reason="metrics",
            )
        # abs(v) <= bound is False for NaN and infinities, and compares a huge int without
        # converting it (float() of a 400-digit int would overflow).
        if isinstance(v, bool) or not isinstance(v, int | float) or not abs(v) <= MAX_METRIC_MAGNITUDE:
            return Refused(
                422,
                f"metric {k!r} must be a finite number of magnitude <= {MAX_METRIC_MAGNITUDE:g}, "
                f"got {v!r:.40}",
                reason="metrics",
            )
        metrics[k] = float(v)
    return metrics


REPORT_METADATA = ("metrics", "num_examples")


def _header_size(body: bytes) -> int | Refused:
    """The size of a safetensors payload's JSON header, refused when it exceeds the bound."""
    size = int.from_bytes(body[:8], "little") if len(body) >= 8 else 0
    if size > MAX_REPORT_HEADER_BYTES:
        return Refused(
            422,
            f"not a valid safetensors payload: its header claims {size} bytes; the limit is "
            f"{MAX_REPORT_HEADER_BYTES} (tensor entries and the metadata num_examples and metrics)",
            reason="tensors",
        )
    return size


def _check_dp_metrics(metrics: dict[str, float], adaptive: bool) -> Refused | None:
    """Devices may send WITHIN_CLIP (0 or 1; required under adaptive clipping) and no other "dp_"
    metric: those are the server's, and a device's would be summed into them."""
    reserved = sorted(k for k in metrics if k.startswith("dp_") and k != WITHIN_CLIP)
    if reserved:
        return Refused(422, f"metrics {reserved} are reserved for the server (names starting with 'dp_')")
    within = metrics.get(WITHIN_CLIP)
    if within not in (None, 0.0, 1.0) or (adaptive and within is None):
        return Refused(
            422,
            f"metric {WITHIN_CLIP!r} must be 1 (the delta was within the clip norm) or 0 (it was "
            f"clipped){'; adaptive clipping needs it' if adaptive else ''}, got {within!r}",
        )
    return None


def parse_training_report(
    config: PopulationConfig, round_: Round, example_count: int, body: bytes
) -> tuple[float, bytes, dict[str, float]] | Refused:
    manifest, settings = config.manifest, config.settings
    header = _header_size(body)
    if isinstance(header, Refused):
        return header
    try:
        metadata = read_metadata(body)
        delta = check_sparse_delta(decode_sparse_delta(body), manifest.global_params, "report")
    except (ParamsError, RecursionError) as e:
        problem = str(e) if isinstance(e, ParamsError) else "the safetensors header nests too deeply"
        return Refused(
            422,
            f"{problem}; a report is the sparse delta of the manifest's global tensors: safetensors with "
            "'<name>/rows' (int32, increasing), '<name>/values' (float32) and '<name>/shape' (int64) each",
            reason="tensors",
        )
    if "num_examples" not in metadata or not set(metadata) <= set(REPORT_METADATA):
        return Refused(
            422,
            f"report metadata must be 'num_examples' (an integer) and optionally 'metrics' (a JSON object); "
            f"got keys {sorted(metadata)[:8]}",
            reason="metadata",
        )
    try:
        weight = int(metadata["num_examples"])
        raw_metrics = json_document(metadata.get("metrics", "{}"), "the report's metrics")
    except ValueError as e:
        return Refused(
            422,
            f"report metadata must hold 'num_examples' (an integer) and 'metrics' (a JSON object): {e}",
            reason="metadata",
        )
    # `min_examples` counts a device's examples (checked at check-in and on the device); the
    # weight is |query|, which an honest device's split makes smaller, so only >= 1 is required here.
    limit = min(example_count, config.task.max_examples) * config.weight_per_example
    if not 1 <= weight <= limit:
        return Refused(
            422,
            f"num_examples {weight} is outside [1, {limit}] "
            f"(the device checked in with {example_count} examples)",
            reason="num_examples",
        )
    # float64 sums: a float32 dot product over many values can be off by more than the
    # margin a device clips below the DP bound with.
    norm = math.sqrt(sum(float(np.vdot(v, v)) for v in (t.values.astype(np.float64) for t in delta.values())))
    if norm > settings.update_norm_bound:
        return Refused(
            422,
            f"update norm {norm:.4g} exceeds the bound {settings.update_norm_bound:.4g}",
            reason="update_norm",
        )
    dp = config.dp
    clip_norm = None if dp is None else float(round_.metrics.get(CLIP_NORM, dp.clip_norm))
    if clip_norm is not None and norm > clip_norm:
        return Refused(
            422,
            f"update norm {norm:.6g} exceeds this round's DP clip norm {clip_norm:g}: a device "
            "clips its whole delta (all global tensors together) to L2 <= task_config.clip_norm",
            reason="update_norm",
        )
    metrics = _check_metrics(raw_metrics)
    if isinstance(metrics, Refused):
        return metrics
    refused = _check_dp_metrics(metrics, dp is not None and dp.adaptive)
    if refused is not None:
        return refused
    # Only the tensors are stored (the metadata is in the columns): anything else a device put
    # in its header is not kept.
    return float(weight), encode_sparse_delta(delta), metrics


def parse_evaluation_report(
    config: PopulationConfig, example_count: int, body: bytes
) -> tuple[float, None, dict[str, float]] | Refused:
    try:
        data = json_document(body, "evaluation report")
    except ValueError as e:
        return Refused(422, f"{e}; an evaluation report is JSON: {{num_examples, metrics}}", reason="format")
    if not isinstance(data, dict) or set(data) != {"num_examples", "metrics"}:
        return Refused(422, "evaluation report must be exactly {num_examples, metrics}", reason="format")
    metrics = _check_metrics(data["metrics"])
    if isinstance(metrics, Refused):
        return metrics
    manifest = config.manifest
    expected = evaluation_metrics(manifest)
    if set(metrics) != set(expected):
        return Refused(422, f"evaluation metrics must be exactly {list(expected)}", reason="metrics")
    weight = data["num_examples"]
    # The same bound as training reports: sampled negatives count too.
    limit = min(example_count, config.task.max_examples) * config.weight_per_example
    if isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= limit:
        return Refused(
            422, f"num_examples must be an integer in [1, {limit}], got {weight!r}", reason="num_examples"
        )
    if any(v < 0 for v in metrics.values()) or metrics["weight_sum"] != weight:
        return Refused(
            422, "metric sums must be >= 0 and weight_sum must equal num_examples", reason="metrics"
        )
    for metric in manifest.metrics:
        # A metric whose per-example value is bounded bounds its weighted sum.
        if metric.value_range is not None:
            low, high = metric.value_range
            total = metrics[f"{metric.name}_sum"]
            if not low * weight <= total <= high * weight:
                return Refused(
                    422,
                    f"{metric.name}_sum must be within [{low:g}, {high:g}] x weight_sum, got {total}",
                    reason="metrics",
                )
    return float(weight), None, metrics
