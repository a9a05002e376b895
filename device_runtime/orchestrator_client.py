"""The device's side of the HTTP protocol (DESIGN.md, "Protocol").

Control messages are JSON; tensors are safetensors. What goes up: the example *count*, the
device's conditions, the delta of the global parameters (the rows it changed) with its
weight, and aggregate metrics. Never local parameters, never examples. Transport errors and 5xx answers are
retried with backoff, so a server that restarts or is slow does not lose the device.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from model_export.manifest import MANIFEST_FILE, MODEL_FILE
from model_export.params import Params, encode_sparse_delta


class ProtocolError(RuntimeError):
    """The server refused a request (4xx); `status` and the server's reason are kept."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class ServerUnavailable(RuntimeError):
    """No answer after all retries."""


@dataclass(frozen=True)
class Assignment:
    assignment_id: str
    round_id: int
    kind: str
    deadline: float
    seconds_left: float
    model_version: int
    artifact_sha256: str
    artifact_url: str
    params_url: str
    manifest_url: str
    report_url: str
    abort_url: str
    task_config: dict[str, Any]
    aggregation: str = "plaintext"  # "secure": take part through secure_url instead of report_url
    secure_url: str | None = None


@dataclass(frozen=True)
class Rejection:
    reason: str
    retry_after_seconds: float


class OrchestratorClient:
    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        http: httpx.AsyncClient | None = None,
        attempts: int = 8,
        backoff_seconds: float = 0.25,
        timeout_seconds: float = 30.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self._http = http or httpx.AsyncClient(timeout=timeout_seconds)
        self._owns_http = http is None
        self.attempts = attempts
        self.backoff_seconds = backoff_seconds

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = dict(kwargs.pop("headers", {}))
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        url = path if path.startswith("http") else f"{self.base_url}{path}"
        last: str = ""
        for attempt in range(self.attempts):
            try:
                response = await self._http.request(method, url, headers=headers, **kwargs)
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if response.status_code < 500:
                    if response.status_code >= 400:
                        raise ProtocolError(response.status_code, _detail(response))
                    return response
                last = f"{response.status_code}: {_detail(response)}"
            # Exponential backoff with jitter, so a restarting server is not hit by the whole fleet at once.
            await asyncio.sleep(self.backoff_seconds * (2 ** min(attempt, 6)) * (0.5 + random.random()))
        raise ServerUnavailable(f"{method} {url} failed after {self.attempts} attempts ({last})")

    async def enroll(self) -> str:
        data = (await self._request("POST", "/v1/devices")).json()
        self.token = str(data["token"])
        return str(data["device_id"])

    async def checkin(
        self,
        population: str,
        example_count: int,
        task: str = "training",
        conditions: Mapping[str, bool] | None = None,
    ) -> Assignment | Rejection:
        body = {"example_count": int(example_count), "task": task, "conditions": dict(conditions or {})}
        data = (await self._request("POST", f"/v1/populations/{population}/checkin", json=body)).json()
        if data.get("accepted"):
            data.pop("accepted")
            return Assignment(**data)
        return Rejection(str(data["reason"]), float(data["retry_after_seconds"]))

    async def model_dir(self, assignment: Assignment, cache_dir: Path) -> Path:
        """The assignment's model, downloaded once per artifact and checked against its sha256."""
        return await self.fetch_model(
            assignment.artifact_sha256, assignment.artifact_url, assignment.manifest_url, cache_dir
        )

    async def fetch_model(self, sha256: str, artifact_url: str, manifest_url: str, cache_dir: Path) -> Path:
        target = Path(cache_dir) / sha256
        if (target / MODEL_FILE).is_file() and (target / MANIFEST_FILE).is_file():
            return target
        blob = (await self._request("GET", artifact_url)).content
        if hashlib.sha256(blob).hexdigest() != sha256:
            raise ProtocolError(200, "the downloaded model does not match its sha256")
        manifest = (await self._request("GET", manifest_url)).json()
        target.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(target.name + f".tmp{random.getrandbits(32)}")
        staging.mkdir()
        (staging / MODEL_FILE).write_bytes(blob)
        (staging / MANIFEST_FILE).write_text(json.dumps(manifest))
        for name in (MODEL_FILE, MANIFEST_FILE):  # rename is atomic: no half-written model is ever seen
            (staging / name).replace(target / name)
        staging.rmdir()
        return target

    async def population_model(self, population: str, sha256: str, cache_dir: Path) -> Path:
        """A population's model outside any assignment (e.g. to serve recommendations)."""
        return await self.fetch_model(
            sha256, f"/v1/artifacts/{sha256}", f"/v1/populations/{population}/manifest", cache_dir
        )

    async def global_params_at(self, population: str, version: int) -> bytes:
        return (
            await self._request("GET", f"/v1/populations/{population}/models/{int(version)}/global")
        ).content

    async def global_params(self, assignment: Assignment) -> bytes:
        return (await self._request("GET", assignment.params_url)).content

    async def report_training(
        self, assignment: Assignment, delta: Params, num_examples: int, metrics: Mapping[str, float]
    ) -> dict[str, Any]:
        # Sparse: the rows the task changed (~150 of thousands), not the dense tensors, so an upload
        # is ~20x smaller and the server validates and stores it without scanning the whole model.
        body = encode_sparse_delta(
            delta, {"num_examples": str(int(num_examples)), "metrics": json.dumps(dict(metrics))}
        )
        response = await self._request(
            "POST", assignment.report_url, content=body, headers={"Content-Type": "application/octet-stream"}
        )
        return dict(response.json())

    async def report_evaluation(
        self, assignment: Assignment, num_examples: int, metrics: Mapping[str, float]
    ) -> dict[str, Any]:
        body = {"num_examples": int(num_examples), "metrics": dict(metrics)}
        return dict((await self._request("POST", assignment.report_url, json=body)).json())

    async def abort(self, assignment: Assignment) -> None:
        await self._request("POST", assignment.abort_url)

    # ---- secure aggregation: one message per phase (secure_aggregation package) ----

    def _secure_url(self, assignment: Assignment) -> str:
        if assignment.secure_url is None:
            raise ProtocolError(200, "this assignment's round does not use secure aggregation")
        return assignment.secure_url

    async def secure_state(self, assignment: Assignment) -> dict[str, Any]:
        """The secure round's phase and what this device needs for it."""
        return dict((await self._request("GET", self._secure_url(assignment))).json())

    async def secure_message(self, assignment: Assignment, phase: str, body: Any) -> dict[str, Any]:
        """A JSON message of the `keys`, `shares` or `unmasking` phase."""
        return dict(
            (await self._request("POST", f"{self._secure_url(assignment)}/{phase}", json=body)).json()
        )

    async def secure_masked_input(self, assignment: Assignment, body: bytes) -> dict[str, Any]:
        response = await self._request(
            "POST",
            f"{self._secure_url(assignment)}/masked-input",
            content=body,
            headers={"Content-Type": "application/octet-stream"},
        )
        return dict(response.json())


def _detail(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail")
    except (json.JSONDecodeError, AttributeError):
        detail = None
    return str(detail) if detail else response.text[:200]
