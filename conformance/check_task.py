"""Checks of the task: the exported model's signature calls replayed on the port's interpreter,
and the delta the port's FedRecon task reports, each within the vectors' tolerance."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load

from conformance.outcome import Outcome, run
from conformance.port import Port
from conformance.vectors import read_json


def _expected(spec: dict[str, Any]) -> np.ndarray:
    return np.asarray(spec["values"], dtype=spec["dtype"]).reshape(spec["shape"])


def _close(what: str, got: Any, expected: np.ndarray, tolerance: dict[str, float]) -> str | None:
    got = np.asarray(got)
    if got.shape != expected.shape:
        return f"{what}: shape {list(got.shape)}, expected {list(expected.shape)}"
    if expected.dtype.kind in "iu":  # ranked item indices, counts: exact
        return (
            None if np.array_equal(got, expected) else f"{what}: {got.tolist()}, expected {expected.tolist()}"
        )
    if not np.allclose(got, expected, rtol=tolerance["rtol"], atol=tolerance["atol"]):
        worst = float(np.max(np.abs(got.astype(np.float64) - expected)))
        return f"{what}: differs by up to {worst:.3g} (rtol {tolerance['rtol']}, atol {tolerance['atol']})"
    return None


def _replayed(port: Port, model_dir: Path, task: dict[str, Any], index: int) -> str | None:
    calls = [{"signature": c["signature"], "inputs": c["inputs"]} for c in task["calls"][: index + 1]]
    outputs = port.replay_signatures(model_dir, calls)[index]
    call = task["calls"][index]
    if sorted(outputs) != sorted(call["outputs"]):
        return f"outputs {sorted(outputs)}, expected {sorted(call['outputs'])}"
    problems = (_close(n, outputs[n], _expected(s), task["tolerance"]) for n, s in call["outputs"].items())
    return next((p for p in problems if p), None)


def _delta(port: Port, root: Path, task: dict[str, Any]) -> str | None:
    folder = root / "task"
    blob = port.task_delta(folder / task["model"], (folder / task["globals"]).read_bytes(), task)
    try:
        got, expected = load(blob), load((folder / task["delta"]).read_bytes())
    except (SafetensorError, ValueError) as error:
        return f"the delta is not a safetensors blob: {error}"
    if sorted(got) != sorted(expected):
        return f"delta tensors {sorted(got)}, expected {sorted(expected)}"
    problems = (_close(n, got[n], expected[n], task["tolerance"]) for n in sorted(expected))
    return next((p for p in problems if p), None)


def checks(port: Port, root: Path) -> list[Outcome]:
    task = read_json(root / "task" / "task.json")
    model_dir = root / "task" / task["model"]
    out = [
        run(f"task/call{i}_{c['signature']}", _replayed, port, model_dir, task, i)
        for i, c in enumerate(task["calls"])
    ]
    out.append(run("task/delta", _delta, port, root, task))
    return out
