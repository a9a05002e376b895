"""The wire-format vectors: manifests, task configs and safetensors payloads (dense and
row-sparse), valid ones with what they decode to, invalid ones with the error class expected.
Everything derives from the kit's exported model (vectors/task/model) and fixed seeds."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save

from conformance.vectors import MODEL_DIR, read_json, write_blob, write_json
from contracts.params import encode_params, encode_sparse_delta
from contracts.task_config import TaskConfig


def _without(document: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in document.items() if k != key}


def _with(document: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**copy.deepcopy(document), **changes}


def manifests(manifest: dict[str, Any]) -> dict[str, Any]:
    no_update = copy.deepcopy(manifest)
    del no_update["signatures"]["update"]
    bad_dtype = copy.deepcopy(manifest)
    bad_dtype["global_params"][0]["dtype"] = "complex64"
    invalid = {
        "not_an_object": [manifest],
        "format_version_unknown": _with(manifest, format_version=999),
        "batch_size_zero": _with(manifest, batch_size=0),
        "missing_global_params": _without(manifest, "global_params"),
        "missing_update_signature": no_update,
        "unknown_dtype": bad_dtype,
        "task_row_features_not_a_list": _with(manifest, task_row_features="item"),
    }
    return {
        "valid": [{"name": "kit_model", "document": manifest}],
        "invalid": [{"name": n, "document": d, "error": "manifest"} for n, d in invalid.items()],
    }


def task_configs(manifest: dict[str, Any]) -> dict[str, Any]:
    valid = {
        "empty_takes_defaults": {},
        "export_defaults": dict(manifest["training_defaults"]),
        "overrides": {"split": "reuse", "shuffle_seed": None, "max_examples": 50, "clip_norm": 1.5},
        "furl_keep": {"local_state": "keep", "local_learning_rate": 0.1},
    }
    invalid = {
        "not_an_object": [1, 2],
        "unknown_field": {"learning_rate": 0.1},
        "split_unknown": {"split": "sideways"},
        "max_below_min": {"min_examples": 10, "max_examples": 5},
        "negative_rate": {"update_learning_rate": -1.0},
        "text_for_a_number": {"max_examples": "300"},
        "keep_without_local_rate": {"local_state": "keep"},
        "clip_norm_zero": {"clip_norm": 0.0},
    }
    return {
        "valid": [
            {"name": n, "document": d, "resolved": TaskConfig.from_json(d).to_json()}
            for n, d in valid.items()
        ],
        "invalid": [{"name": n, "document": d, "error": "task_config"} for n, d in invalid.items()],
    }


def _tensor_json(value: np.ndarray) -> dict[str, Any]:
    return {"dtype": str(value.dtype), "shape": list(value.shape), "values": value.ravel().tolist()}


def params(manifest: dict[str, Any], out: Path) -> dict[str, Any]:
    """Dense payloads against the manifest's global specs."""
    specs = manifest["global_params"]
    rng = np.random.default_rng(50)
    good = {s["name"]: rng.normal(size=s["shape"]).astype(s["dtype"]) for s in specs}
    name = specs[0]["name"]
    first = good[name]
    nan = first.copy()
    nan.flat[3] = np.nan
    blobs = {
        "dense_valid": encode_params(good, {"version": "7"}),
        "dense_truncated": encode_params(good)[:-5],
        "dense_header_not_json": (20).to_bytes(8, "little") + b"{not json at all!!!!" + bytes(8),
        "dense_wrong_dtype": encode_params({name: first.astype(np.float64)}),
        "dense_wrong_shape": encode_params({name: first[:-1]}),
        "dense_missing_tensor": encode_params({"other": first}),
        "dense_extra_tensor": encode_params({**good, "extra": np.zeros(2, np.float32)}),
        "dense_not_finite": encode_params({name: nan}),
    }
    cases = []
    for case, blob in blobs.items():
        write_blob(out / f"{case}.safetensors", blob)
        entry: dict[str, Any] = {"name": case, "blob": f"{case}.safetensors", "specs": specs}
        if case == "dense_valid":
            entry["tensors"] = {n: _tensor_json(v) for n, v in good.items()}
        else:
            entry["error"] = "params"
        cases.append(entry)
    return {"cases": cases}


def sparse(manifest: dict[str, Any], out: Path) -> dict[str, Any]:
    """Row-sparse deltas: decoded (with the rows that must come out) and encoded by the port."""
    specs = [s for s in manifest["global_params"]]
    spec = specs[0]
    name, shape = spec["name"], tuple(spec["shape"])
    rng = np.random.default_rng(51)
    dense = np.zeros(shape, np.float32)
    rows = np.array([1, 4, 5, 9], np.int32)
    dense[rows] = rng.normal(size=(len(rows), *shape[1:])).astype(np.float32)
    values = dense[rows]

    def parts(r: Any, v: Any, s: Any, **dtypes: Any) -> bytes:
        return save(
            {
                f"{name}/rows": np.ascontiguousarray(r, dtypes.get("rows", np.int32)),
                f"{name}/values": np.ascontiguousarray(v, dtypes.get("values", np.float32)),
                f"{name}/shape": np.asarray(s, dtypes.get("shape", np.int64)),
            }
        )

    nan_values = values.copy()
    nan_values[0, 0] = np.inf
    blobs = {
        "sparse_valid": encode_sparse_delta({name: dense}),
        "sparse_no_rows": encode_sparse_delta({name: np.zeros(shape, np.float32)}),
        "sparse_unsorted_rows": parts(rows[::-1], values[::-1], shape),
        "sparse_repeated_row": parts([1, 4, 4, 9], values, shape),
        "sparse_row_out_of_range": parts([1, 4, 5, shape[0]], values, shape),
        "sparse_rows_int64": parts(rows, values, shape, rows=np.int64),
        "sparse_values_rows_mismatch": parts(rows[:3], values, shape),
        "sparse_not_finite": parts(rows, nan_values, shape),
        "sparse_wrong_shape": parts(rows, values, (shape[0] + 1, *shape[1:])),
        "sparse_missing_part": save({f"{name}/rows": rows, f"{name}/values": values}),
        "sparse_unexpected_tensor": save({name: dense}),
    }
    cases = []
    for case, blob in blobs.items():
        write_blob(out / f"{case}.safetensors", blob)
        entry: dict[str, Any] = {"name": case, "blob": f"{case}.safetensors", "specs": specs}
        if case == "sparse_valid":
            entry["tensors"] = {
                name: {"shape": list(shape), "rows": rows.tolist(), "values": _tensor_json(values)}
            }
        elif case == "sparse_no_rows":
            entry["tensors"] = {name: {"shape": list(shape), "rows": [], "values": _tensor_json(values[:0])}}
        else:
            entry["error"] = "params"
        cases.append(entry)
    encode = [
        {"name": "encode_rows", "dense": {name: _tensor_json(dense)}, "rows": {name: rows.tolist()}},
        {
            "name": "encode_all_zero",
            "dense": {name: _tensor_json(np.zeros(shape, np.float32))},
            "rows": {name: []},
        },
    ]
    return {"cases": cases, "encode": encode}


def generate(root: Path) -> None:
    manifest = read_json(MODEL_DIR / "manifest.json")
    wire = root / "wire"
    write_json(wire / "manifests.json", manifests(manifest))
    write_json(wire / "task_configs.json", task_configs(manifest))
    write_json(wire / "params.json", params(manifest, wire / "params"))
    write_json(wire / "sparse_deltas.json", sparse(manifest, wire / "sparse_deltas"))
