"""Run the kit's cases against a port and say, case by case, where it differs.

A case file (`vectors/<section>/cases.json`) is a list of `{"name", "op", "args", "expect"}`;
`{"$file": PATH}` in `args` is that blob (relative to the section's folder) as `{"$bytes": ...}`.
`expect` is `{"error": CLASS}` (the port must refuse, naming that class) or the answer, compared
field by field: numbers within the case's `tolerance` (absolute; 0 unless stated), everything
else exactly, and a value the port chooses at random (a nonce, a ciphertext) through a check
(`conformance/checks.py`) instead of byte for byte."""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conformance.checks import CHECKS
from conformance.port import Port

VECTORS = Path(__file__).resolve().parent / "vectors"
SECTIONS = ("wire", "secure", "task", "http")


@dataclass(frozen=True)
class Outcome:
    section: str
    case: str
    problem: str | None  # None: the port matched


def resolve(value: Any, folder: Path) -> Any:
    if isinstance(value, dict):
        if set(value) == {"$file"}:
            return {"$bytes": base64.b64encode((folder / value["$file"]).read_bytes()).decode()}
        return {k: resolve(v, folder) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v, folder) for v in value]
    return value


def differences(expected: Any, actual: Any, tolerance: float, path: str = "") -> str | None:
    """The first place `actual` differs from `expected`, or None."""
    where = path or "the answer"
    if isinstance(expected, dict) and len(expected) == 1 and next(iter(expected)) in CHECKS:
        check, spec = next(iter(expected.items()))
        return CHECKS[check](spec, actual, where)
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return f"{where}: expected an object, got {_shown(actual)}"
        missing = sorted(set(expected) - set(actual))
        if missing:
            return f"{where}: missing {missing}"
        extra = sorted(set(actual) - set(expected) - {"message"})
        if extra:
            return f"{where}: unexpected {extra}"
        for key in expected:
            found = differences(expected[key], actual[key], tolerance, f"{path}.{key}" if path else key)
            if found:
                return found
        return None
    if isinstance(expected, list):
        if not isinstance(actual, list):
            return f"{where}: expected a list of {len(expected)}, got {_shown(actual)}"
        # The first entry that differs says more than the count (a request sent out of order).
        for i, (e, a) in enumerate(zip(expected, actual, strict=False)):
            found = differences(e, a, tolerance, f"{where}[{i}]")
            if found:
                return found
        if len(actual) != len(expected):
            return f"{where}: expected a list of {len(expected)}, got {len(actual)}: {_shown(actual)}"
        return None
    if isinstance(expected, float) and isinstance(actual, int | float) and not isinstance(actual, bool):
        if math.isclose(expected, actual, rel_tol=0, abs_tol=tolerance):
            return None
        return f"{where}: expected {expected!r} (within {tolerance:g}), got {actual!r}"
    if type(expected) is not type(actual) or expected != actual:
        return f"{where}: expected {_shown(expected)}, got {_shown(actual)}"
    return None


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 120 else text[:117] + "..."


def check_case(port: Port, section: str, case: dict[str, Any], folder: Path) -> Outcome:
    name, expect = case["name"], case["expect"]
    try:
        answer = port.call(case["op"], resolve(case["args"], folder))
    except Exception as e:  # a port that crashes fails this case, not the run
        return Outcome(section, name, f"the port raised {type(e).__name__}: {e}")
    if "error" in expect and set(expect) <= {"error", "request"}:
        if answer.get("error") != expect["error"]:
            return Outcome(
                section, name, f"expected a refusal of class {expect['error']!r}, got {_shown(answer)}"
            )
        if "request" in expect:
            return Outcome(
                section, name, differences(expect["request"], answer.get("request"), 0.0, "request")
            )
        return Outcome(section, name, None)
    if "error" in answer:
        return Outcome(section, name, f"the port refused ({answer.get('error')}: {answer.get('message')})")
    return Outcome(section, name, differences(expect, answer, float(case.get("tolerance", 0.0))))


def run(port: Port, sections: tuple[str, ...] = SECTIONS, vectors: Path = VECTORS) -> list[Outcome]:
    outcomes = []
    for section in sections:
        folder = vectors / section
        path = folder / "cases.json"
        if not path.exists():
            continue
        for case in json.loads(path.read_text()):
            outcomes.append(check_case(port, section, case, folder))
    return outcomes
