"""Deliberately broken devices: the Python port with one fault each, which the kit must catch."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import numpy as np
from safetensors.numpy import load, save

from conformance.port import of_bytes, to_bytes
from conformance.python_port import OPS, Op, PythonPort
from conformance.secure_ops import masked_input
from secure_aggregation.device import pairwise_sign


def broken(op: str, fault: Any) -> PythonPort:
    """The Python port whose answer to `op` goes through `fault` first."""
    right: Op = OPS[op]

    return PythonPort({**OPS, op: lambda args: fault(right(args), args)})


def unsorted_rows(answer: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """The training report's delta with its rows in decreasing order (values kept with their rows)."""
    tensors = load(to_bytes(answer["request"]["body"]))
    for key in [k for k in tensors if k.endswith("/rows")]:
        name = key.removesuffix("/rows")
        tensors[key] = np.ascontiguousarray(tensors[key][::-1])
        tensors[f"{name}/values"] = np.ascontiguousarray(tensors[f"{name}/values"][::-1])
    blob = to_bytes(answer["request"]["body"])
    header = int.from_bytes(blob[:8], "little")
    metadata = json.loads(blob[8 : 8 + header]).get("__metadata__")
    answer["request"]["body"] = of_bytes(save(tensors, metadata=metadata))
    return answer


def without_task_field(answer: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """A check-in that leaves out `task` (the server would read it as training: still a fault)."""
    answer["request"]["json"].pop("task")
    return answer


def wrong_mask_sign() -> PythonPort:
    """A device that adds each pair's mask with the other sign (the pair no longer cancels)."""
    return PythonPort(
        {**OPS, "secure.masked_input": partial(masked_input, sign=lambda u, v: -pairwise_sign(u, v))}
    )


def shares_for_the_wrong_neighbour(answer: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """Each holder's entry carries the shares encrypted for the next holder."""
    if "shares" in answer:
        holders = sorted(answer["shares"], key=int)
        entries = [answer["shares"][h] for h in holders]
        answer["shares"] = dict(zip(holders, entries[1:] + entries[:1], strict=True))
    return answer


def without_authorization(answer: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """Requests sent without the device's bearer token (a field the server requires)."""
    for request in answer["requests"]:
        request.pop("authorization", None)
    return answer


def _secure_requests(answer: dict[str, Any], args: dict[str, Any]) -> list[dict[str, Any]]:
    return answer["requests"] if args["flow"] == "secure round" else []


def masked_input_before_shares(answer: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """A secure round's device that sends its masked input as soon as it has its roster index,
    before it shared keys (and before it knows which neighbours shared theirs)."""
    requests = _secure_requests(answer, args)
    masked = [r for r in requests if r["path"].endswith("/masked-input")]
    if masked:
        requests.remove(masked[0])
        keys = next(i for i, r in enumerate(requests) if r["path"].endswith("/keys"))
        requests.insert(keys + 1, masked[0])
    return answer


def unsigned_partner_statement(answer: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """A partner statement without its `signature` (the field its neighbours verify)."""
    for request in _secure_requests(answer, args):
        if request["path"].endswith("/partners"):
            request["json"].pop("signature")
    return answer


def signs_the_model_not_the_globals() -> PythonPort:
    """A device that hashes the model it downloaded where the digest its neighbours sign wants the
    globals: it runs the real driver, which then signs the wrong task inputs' digest."""
    right: Op = OPS["http.flow"]

    def flow(args: dict[str, Any]) -> dict[str, Any]:
        if args["flow"] == "secure round":
            inputs = args["inputs"]
            args = {**args, "inputs": {**inputs, "globals": inputs["manifest"]}}
        return right(args)

    return PythonPort({**OPS, "http.flow": flow})
