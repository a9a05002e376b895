"""The adapter contract: one call, JSON in and JSON out, that a port under test answers.

A case names an operation (`op`) and its arguments; the port answers with a JSON object, or with
`{"error": CLASS, "message": ...}` when it refuses the input (CLASS one of `ERROR_CLASSES`). Bytes
travel as `{"$bytes": base64}` in both directions. A port in another language speaks the same calls
as JSON lines over a subprocess's stdin and stdout (`CommandPort`).
"""

from __future__ import annotations

import base64
import json
import subprocess
from typing import Any, Protocol

# What a refusal names: the part of the contract the input broke.
ERROR_CLASSES = ("manifest", "task_config", "params", "message", "protocol", "shamir")


class Port(Protocol):
    def call(self, op: str, args: dict[str, Any]) -> dict[str, Any]: ...


def to_bytes(value: Any) -> bytes:
    if not isinstance(value, dict) or set(value) != {"$bytes"}:
        raise ValueError(f'expected {{"$bytes": base64}}, got {str(value)[:80]}')
    return base64.b64decode(value["$bytes"], validate=True)


def of_bytes(data: bytes) -> dict[str, str]:
    return {"$bytes": base64.b64encode(data).decode()}


def refusal(error: str, message: str) -> dict[str, Any]:
    return {"error": error, "message": message}


class CommandPort:
    """A port run as a command: one JSON line `{"op", "args"}` in, one JSON line answer out."""

    def __init__(self, command: list[str]) -> None:
        self._process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )

    def call(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(json.dumps({"op": op, "args": args}) + "\n")
        self._process.stdin.flush()
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(
                f"the port's command exited (status {self._process.poll()}) without answering {op}"
            )
        answer = json.loads(line)
        if not isinstance(answer, dict):
            raise RuntimeError(f"the port answered {op} with {type(answer).__name__}, expected a JSON object")
        return answer

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        self._process.wait(timeout=10)
