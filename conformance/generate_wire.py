"""The wire-format vectors: manifests, task configs, dense and row-sparse payloads, and the
requests a device sends, each valid and with invalid variants a device must refuse."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save

from conformance.tensors import sparse_json, tensor_json
from contracts.params import encode_params, encode_sparse_delta, sparse_rows
from contracts.task_config import TaskConfig

Case = dict[str, Any]
MODEL = Path(__file__).resolve().parent / "vectors" / "task" / "model"
SHA = "ab" * 32
TOKEN = "Bearer conformance-token"  # what the Python adapter's client holds


def manifest_cases(manifest: dict[str, Any]) -> list[Case]:
    def broken(name: str, change: Any) -> Case:
        data = copy.deepcopy(manifest)
        change(data)
        return {
            "name": f"manifest: {name}",
            "op": "manifest.parse",
            "args": {"manifest": data},
            "expect": {"error": "manifest"},
        }

    return [
        {
            "name": "manifest: the exported model's",
            "op": "manifest.parse",
            "args": {"manifest": manifest},
            "expect": {"manifest": manifest},
        },
        broken("an unknown format_version", lambda m: m.update(format_version=99)),
        broken("no global_params", lambda m: m.pop("global_params")),
        broken("batch_size 0", lambda m: m.update(batch_size=0)),
        broken("the update signature missing", lambda m: m["signatures"].pop("update")),
        broken(
            "a global row-sparse by an unknown feature",
            lambda m: m["global_params"][0].update(row_sparse="no_such_feature"),
        ),
        broken("a tensor dtype outside the list", lambda m: m["local_params"][0].update(dtype="float16")),
        broken("a negative shape", lambda m: m["local_params"][0].update(shape=[-4])),
        broken("a signature's inputs not a list", lambda m: m["signatures"]["infer"].update(inputs={})),
    ]


def task_config_cases() -> list[Case]:
    valid = [
        {},
        {"split": "reuse", "max_examples": 50, "clip_norm": 1.5},
        {"local_state": "keep", "local_learning_rate": 0.05, "central_only_items": [7, 3, 7]},
    ]
    invalid = [
        ("an unknown field", {"learning_rate": 0.1}),
        ("a string for a number", {"max_examples": "300"}),
        ("true for a number", {"min_examples": True}),
        ("a negative learning rate", {"update_learning_rate": -0.5}),
        ("max_examples below min_examples", {"min_examples": 10, "max_examples": 5}),
        ("keep without a local learning rate", {"local_state": "keep"}),
        ("an unknown split", {"split": "by_date"}),
        ("clip_norm 0", {"clip_norm": 0}),
    ]
    cases: list[Case] = [
        {
            "name": f"task config: {json.dumps(c)}",
            "op": "task_config.parse",
            "args": {"task_config": c},
            "expect": {"task_config": TaskConfig.from_json(c).to_json()},
        }
        for c in valid
    ]
    cases += [
        {
            "name": f"task config: {why}",
            "op": "task_config.parse",
            "args": {"task_config": c},
            "expect": {"error": "task_config"},
        }
        for why, c in invalid
    ]
    return cases


def payload_cases(manifest: dict[str, Any], blobs: dict[str, bytes]) -> list[Case]:
    specs = manifest["global_params"]
    rng = np.random.default_rng(50)
    table = rng.normal(size=(12, 4)).astype(np.float32)
    blobs["globals.safetensors"] = encode_params({"item_embeddings": table})
    blobs["globals-truncated.safetensors"] = blobs["globals.safetensors"][:-9]
    blobs["globals-float64.safetensors"] = encode_params({"item_embeddings": table.astype(np.float64)})
    blobs["globals-wrong-shape.safetensors"] = encode_params({"item_embeddings": table[:11]})
    blobs["globals-extra.safetensors"] = encode_params({"item_embeddings": table, "extra": table[0]})
    with_nan = table.copy()
    with_nan[3, 1] = np.nan
    blobs["globals-nan.safetensors"] = encode_params({"item_embeddings": with_nan})
    blobs["globals-not-safetensors.safetensors"] = b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}"
    cases: list[Case] = [
        {
            "name": "globals: dense, as the manifest declares",
            "op": "params.decode",
            "args": {"blob": {"$file": "blobs/globals.safetensors"}, "specs": specs},
            "expect": {"tensors": {"item_embeddings": tensor_json(table)}},
        },
    ]
    for stem in ("truncated", "float64", "wrong-shape", "extra", "nan", "not-safetensors"):
        cases.append(
            {
                "name": f"globals: {stem}",
                "op": "params.decode",
                "args": {"blob": {"$file": f"blobs/globals-{stem}.safetensors"}, "specs": specs},
                "expect": {"error": "params"},
            }
        )
    delta = np.zeros((12, 4), dtype=np.float32)
    delta[[1, 4, 9]] = rng.normal(size=(3, 4)).astype(np.float32)
    sparse = sparse_rows(delta)
    blobs["delta.safetensors"] = encode_sparse_delta({"item_embeddings": delta})
    rows, values = sparse.rows, sparse.values

    def parts(**change: np.ndarray) -> bytes:
        tensors = {
            "item_embeddings/rows": rows,
            "item_embeddings/values": values,
            "item_embeddings/shape": np.asarray([12, 4], dtype=np.int64),
        }
        tensors.update({f"item_embeddings/{k}": v for k, v in change.items()})
        return save({k: v for k, v in tensors.items() if v.size or k.endswith("rows")})

    blobs["delta-unsorted.safetensors"] = parts(rows=rows[::-1].copy(), values=values[::-1].copy())
    blobs["delta-repeated-row.safetensors"] = parts(rows=np.asarray([1, 4, 4], dtype=np.int32))
    blobs["delta-row-out-of-range.safetensors"] = parts(rows=np.asarray([1, 4, 12], dtype=np.int32))
    blobs["delta-int64-rows.safetensors"] = parts(rows=rows.astype(np.int64))
    blobs["delta-no-shape.safetensors"] = save(
        {"item_embeddings/rows": rows, "item_embeddings/values": values}
    )
    blobs["delta-values-mismatch.safetensors"] = parts(values=values[:2].copy())
    cases.append(
        {
            "name": "delta: row-sparse, rows strictly increasing",
            "op": "delta.decode",
            "args": {"blob": {"$file": "blobs/delta.safetensors"}},
            "expect": {"tensors": {"item_embeddings": sparse_json(sparse)}},
        }
    )
    for stem in ("unsorted", "repeated-row", "row-out-of-range", "int64-rows", "no-shape", "values-mismatch"):
        cases.append(
            {
                "name": f"delta: {stem}",
                "op": "delta.decode",
                "args": {"blob": {"$file": f"blobs/delta-{stem}.safetensors"}},
                "expect": {"error": "params"},
            }
        )
    return cases


def assignment(aggregation: str = "plaintext") -> dict[str, Any]:
    return {
        "assignment_id": "a-0001",
        "round_id": 3,
        "kind": "training",
        "deadline": 1_800_000_000.0,
        "seconds_left": 600.0,
        "model_version": 2,
        "artifact_sha256": SHA,
        "artifact_url": f"/v1/artifacts/{SHA}",
        "params_url": "/v1/populations/movies/versions/2/params",
        "manifest_url": f"/v1/artifacts/{SHA}/manifest",
        "report_url": "/v1/assignments/a-0001/report",
        "abort_url": "/v1/assignments/a-0001/abort",
        "task_config": {"max_examples": 50},
        "aggregation": aggregation,
        "secure_url": None,
        "secure_parameters": None,
        "central_examples_url": None,
        "central_gradient_url": None,
        "central_gradient_weight": None,
        "accepted": True,
    }


def request_cases() -> list[Case]:
    checkin = {
        "population": "movies",
        "example_count": 42,
        "task": "training",
        "conditions": {"idle": True, "charging": True, "unmetered": False},
    }
    sent = {
        "method": "POST",
        "authorization": TOKEN,
        "path": "/v1/populations/movies/checkin",
        "json": {"example_count": 42, "task": "training", "conditions": checkin["conditions"]},
    }
    offsite = {**assignment(), "report_url": "https://elsewhere.test/v1/steal"}
    bad_config = {**assignment(), "task_config": {"max_examples": -1}}
    secure_without_url = {**assignment("secure")}
    accepted = {"round_id": 3, "round_status": "open", "reported": 1, "target": 10}
    delta = np.zeros((12, 4), dtype=np.float32)
    delta[[2, 7]] = np.asarray([[0.5, -0.25, 0.0, 1.0], [0.0, 0.0, 0.0, -2.0]], dtype=np.float32)
    return [
        {
            "name": "check-in: accepted",
            "op": "request.checkin",
            "args": {**checkin, "answer": assignment()},
            "expect": {"request": sent, "accepted": True},
        },
        {
            "name": "check-in: rejected",
            "op": "request.checkin",
            "args": {
                **checkin,
                "answer": {"accepted": False, "reason": "no round open", "retry_after_seconds": 60.0},
            },
            "expect": {"request": sent, "accepted": False},
        },
        {
            "name": "check-in: a report URL on another origin",
            "op": "request.checkin",
            "args": {**checkin, "answer": offsite},
            "expect": {"request": sent, "error": "message"},
        },
        {
            "name": "check-in: an unusable task config",
            "op": "request.checkin",
            "args": {**checkin, "answer": bad_config},
            "expect": {"request": sent, "error": "message"},
        },
        {
            "name": "check-in: a secure round without secure_url",
            "op": "request.checkin",
            "args": {**checkin, "answer": secure_without_url},
            "expect": {"request": sent, "error": "message"},
        },
        {
            "name": "check-in: an answer missing round_id",
            "op": "request.checkin",
            "args": {**checkin, "answer": {k: v for k, v in assignment().items() if k != "round_id"}},
            "expect": {"request": sent, "error": "message"},
        },
        {
            "name": "report: a training delta, row-sparse",
            "op": "request.report_training",
            "args": {
                "assignment": assignment(),
                "delta": {"item_embeddings": tensor_json(delta)},
                "num_examples": 17,
                "metrics": {"loss": 0.75, "rmse": 0.5},
                "answer": accepted,
            },
            "expect": {
                "request": {
                    "method": "POST",
                    "authorization": TOKEN,
                    "path": "/v1/assignments/a-0001/report",
                    "content_type": "application/octet-stream",
                    "body": {
                        "$sparse_delta": {
                            "tensors": {"item_embeddings": sparse_json(sparse_rows(delta))},
                            "metadata": {
                                "num_examples": "17",
                                "metrics": json.dumps({"loss": 0.75, "rmse": 0.5}),
                            },
                        }
                    },
                }
            },
        },
        {
            "name": "report: an evaluation",
            "op": "request.report_evaluation",
            "args": {
                "assignment": {**assignment(), "kind": "evaluation"},
                "num_examples": 9,
                "metrics": {"loss": 1.25},
                "answer": accepted,
            },
            "expect": {
                "request": {
                    "method": "POST",
                    "authorization": TOKEN,
                    "path": "/v1/assignments/a-0001/report",
                    "json": {"num_examples": 9, "metrics": {"loss": 1.25}},
                }
            },
        },
    ]


def generate(out: Path) -> None:
    manifest = json.loads((MODEL / "manifest.json").read_text())
    blobs: dict[str, bytes] = {}
    cases = [
        *manifest_cases(manifest),
        *task_config_cases(),
        *payload_cases(manifest, blobs),
        *request_cases(),
    ]
    (out / "blobs").mkdir(parents=True, exist_ok=True)
    for name, data in sorted(blobs.items()):
        (out / "blobs" / name).write_bytes(data)
    (out / "cases.json").write_text(json.dumps(cases, indent=1) + "\n")
