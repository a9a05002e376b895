"""Checks of the wire formats: manifests, task configs, dense and row-sparse safetensors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load

from conformance.outcome import Outcome, differs, refused, run
from conformance.port import Port
from conformance.vectors import read_json

# Parameters travel as float32 bit patterns: what a port decodes must be exactly what was encoded.
TOLERANCE = "exact"


def _array(spec: dict[str, Any]) -> np.ndarray:
    return np.asarray(spec["values"], dtype=spec["dtype"]).reshape(spec["shape"])


def _same_array(what: str, got: Any, spec: dict[str, Any]) -> str | None:
    expected = _array(spec)
    got = np.asarray(got)
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return f"{what}: got {got.dtype}{list(got.shape)}, expected {expected.dtype}{list(expected.shape)}"
    return None if np.array_equal(got, expected) else f"{what}: values differ"


def _accepted(call: Callable[[Any], Any], document: Any) -> None:
    call(document)


def _resolved(port: Port, case: dict[str, Any]) -> str | None:
    return differs("resolved config", port.parse_task_config(case["document"]), case["resolved"])


def manifests(port: Port, root: Path) -> list[Outcome]:
    data = read_json(root / "wire" / "manifests.json")
    out = [run(f"manifest/{c['name']}", _accepted, port.parse_manifest, c["document"]) for c in data["valid"]]
    out += [
        refused(f"manifest/{c['name']}", c["error"], port.parse_manifest, c["document"])
        for c in data["invalid"]
    ]
    return out


def task_configs(port: Port, root: Path) -> list[Outcome]:
    data = read_json(root / "wire" / "task_configs.json")
    out = [run(f"task_config/{c['name']}", _resolved, port, c) for c in data["valid"]]
    out += [
        refused(f"task_config/{c['name']}", c["error"], port.parse_task_config, c["document"])
        for c in data["invalid"]
    ]
    return out


def _decoded_params(port: Port, blob: bytes, case: dict[str, Any]) -> str | None:
    got = port.decode_params(blob, case["specs"])
    if sorted(got) != sorted(case["tensors"]):
        return f"tensors {sorted(got)}, expected {sorted(case['tensors'])}"
    problems = [_same_array(n, got[n], spec) for n, spec in case["tensors"].items()]
    return next((p for p in problems if p), None)


def params(port: Port, root: Path) -> list[Outcome]:
    folder = root / "wire" / "params"
    out = []
    for case in read_json(root / "wire" / "params.json")["cases"]:
        name, blob = f"params/{case['name']}", (folder / case["blob"]).read_bytes()
        if "error" in case:
            out.append(refused(name, case["error"], port.decode_params, blob, case["specs"]))
        else:
            out.append(run(name, _decoded_params, port, blob, case))
    return out


def _check_decoded_sparse(got: dict[str, Any], tensors: dict[str, Any]) -> str | None:
    if sorted(got) != sorted(tensors):
        return f"tensors {sorted(got)}, expected {sorted(tensors)}"
    for n, spec in tensors.items():
        problem = differs(f"{n} shape", list(got[n]["shape"]), spec["shape"]) or differs(
            f"{n} rows", [int(r) for r in got[n]["rows"]], spec["rows"]
        )
        problem = problem or _same_array(f"{n} values", got[n]["values"], spec["values"])
        if problem:
            return problem
    return None


def _check_encoded_sparse(blob: bytes, dense: dict[str, Any], rows: dict[str, list[int]]) -> str | None:
    """The layout encode_sparse_delta defines: per tensor <name>/rows int32 strictly increasing,
    <name>/values float32, <name>/shape int64; nothing else."""
    try:
        stored = load(blob)
    except (SafetensorError, ValueError) as error:
        return f"not a safetensors blob: {error}"
    expected_keys = sorted(f"{n}/{p}" for n in dense for p in ("rows", "values", "shape"))
    if sorted(stored) != expected_keys:
        return f"tensors {sorted(stored)}, expected {expected_keys}"
    for n, spec in dense.items():
        got_rows, values, shape = stored[f"{n}/rows"], stored[f"{n}/values"], stored[f"{n}/shape"]
        for part, array, dtype in (
            ("rows", got_rows, "int32"),
            ("values", values, "float32"),
            ("shape", shape, "int64"),
        ):
            if array.dtype != np.dtype(dtype):
                return f"{n}/{part} is {array.dtype}, expected {dtype}"
        if np.any(np.diff(got_rows) <= 0):
            return f"{n}/rows must be strictly increasing, got {got_rows.tolist()}"
        problem = differs(f"{n}/shape", shape.tolist(), spec["shape"]) or differs(
            f"{n}/rows", got_rows.tolist(), rows[n]
        )
        if problem:
            return problem
        if not np.array_equal(values, _array(spec)[got_rows]):
            return f"{n}/values are not the dense tensor's rows {rows[n]}"
    return None


def _decoded_sparse(port: Port, blob: bytes, case: dict[str, Any]) -> str | None:
    return _check_decoded_sparse(port.decode_sparse_delta(blob, case["specs"]), case["tensors"])


def _encoded_sparse(port: Port, case: dict[str, Any]) -> str | None:
    dense = {n: _array(spec) for n, spec in case["dense"].items()}
    return _check_encoded_sparse(port.encode_sparse_delta(dense), case["dense"], case["rows"])


def sparse_deltas(port: Port, root: Path) -> list[Outcome]:
    folder = root / "wire" / "sparse_deltas"
    data = read_json(root / "wire" / "sparse_deltas.json")
    out = []
    for case in data["cases"]:
        name, blob = f"sparse_delta/{case['name']}", (folder / case["blob"]).read_bytes()
        if "error" in case:
            out.append(refused(name, case["error"], port.decode_sparse_delta, blob, case["specs"]))
        else:
            out.append(run(name, _decoded_sparse, port, blob, case))
    out += [run(f"sparse_delta/{c['name']}", _encoded_sparse, port, c) for c in data["encode"]]
    return out


def checks(port: Port, root: Path) -> list[Outcome]:
    return manifests(port, root) + task_configs(port, root) + params(port, root) + sparse_deltas(port, root)
