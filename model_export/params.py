"""Parameter tensors on the wire and on disk: safetensors, checked against the manifest.

Used by the device runtime (downloads, uploads) and the orchestrator (reports, versions).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load, save

from model_export.manifest import TensorSpec

Params = dict[str, np.ndarray]


class ParamsError(ValueError):
    """Tensors that do not match what the manifest declares."""


def encode_params(params: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> bytes:
    # metadata=None, never {}: safetensors 0.8 writes an unreadable header for save({}, metadata={}).
    return save(
        {k: np.ascontiguousarray(v) for k, v in params.items()}, metadata=dict(metadata) if metadata else None
    )


def read_metadata(blob: bytes) -> dict[str, str]:
    """The string metadata of a safetensors payload (its header's `__metadata__`)."""
    if len(blob) < 8:
        raise ParamsError("not a valid safetensors payload (shorter than its 8-byte header length)")
    size = int.from_bytes(blob[:8], "little")
    if size > len(blob) - 8:
        raise ParamsError(
            f"not a valid safetensors payload (header of {size} bytes, body of {len(blob) - 8})"
        )
    try:
        header = json.loads(blob[8 : 8 + size])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ParamsError("not a valid safetensors payload (header is not JSON)") from None
    metadata = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ParamsError("safetensors metadata must map strings to strings")
    return metadata


def check_params(params: Mapping[str, np.ndarray], specs: Iterable[TensorSpec], what: str) -> Params:
    """Exactly the declared tensors, with the declared shapes and dtypes, all finite."""
    specs = list(specs)
    expected = {s.name for s in specs}
    missing, extra = expected - set(params), set(params) - expected
    if missing or extra:
        raise ParamsError(
            f"{what}: expected tensors {sorted(expected)}"
            + (f"; missing {sorted(missing)}" if missing else "")
            + (f"; unexpected {sorted(extra)}" if extra else "")
        )
    checked: Params = {}
    for spec in specs:
        value = params[spec.name]
        if value.dtype != np.dtype(spec.dtype) or value.shape != spec.shape:
            raise ParamsError(
                f"{what}: tensor {spec.name!r} is {value.dtype}{list(value.shape)}, "
                f"expected {spec.dtype}{list(spec.shape)}"
            )
        if not np.all(np.isfinite(value)):
            bad = int(np.size(value) - np.count_nonzero(np.isfinite(value)))
            raise ParamsError(f"{what}: tensor {spec.name!r} has {bad} non-finite values (NaN or inf)")
        checked[spec.name] = value
    return checked


def decode_params(blob: bytes, specs: Iterable[TensorSpec], what: str) -> Params:
    """Parse safetensors bytes and check them; a `ParamsError` says what was wrong."""
    try:
        params = load(blob)
    except (SafetensorError, ValueError, TypeError) as e:
        raise ParamsError(f"{what}: not a valid safetensors payload ({e})") from None
    return check_params(params, specs, what)
