"""A real HTTP server on loopback that speaks the device protocol for one population and one model:
honestly by default, and with a crafted answer on any route a test names.

It is not the orchestrator (that one is tested against real devices elsewhere): it is the
server a device must survive, one that answers garbage, lies about its model, points elsewhere,
redirects, stalls or fails. Every request it receives is recorded, so a test can say what reached
it (an abort, a token) and what did not.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from contracts.features import Examples
from contracts.manifest import INITIAL_GLOBAL_FILE, MANIFEST_FILE, MODEL_FILE, Manifest
from contracts.mixing import encode_examples
from contracts.params import SparseTensor, encode_sparse_delta, row_shape
from contracts.task_config import TaskConfig
from orchestrator.local import free_port

POPULATION = "p"
ASSIGNMENT_ID = "a1b2c3"
TOKEN = "device-token-0123456789"


@dataclass(frozen=True)
class Answer:
    """What a route answers. `chunks` > 0 streams `body` that many times with no Content-Length."""

    body: bytes = b""
    status: int = 200
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    delay_seconds: float = 0.0
    chunks: int = 0


def json_answer(data: Any, status: int = 200, content_type: str = "application/json") -> Answer:
    return Answer(json.dumps(data).encode(), status, content_type)


@dataclass(frozen=True)
class Seen:
    route: str
    method: str
    path: str
    authorization: str | None


class HostileOrchestrator:
    def __init__(self, model_dir: Path) -> None:
        self.model = (model_dir / MODEL_FILE).read_bytes()
        self.manifest = json.loads((model_dir / MANIFEST_FILE).read_text())
        self.global_params = (model_dir / INITIAL_GLOBAL_FILE).read_bytes()
        self.sha256 = Manifest.from_json(self.manifest).model_sha256
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.requests: list[Seen] = []
        # route -> answers, used in order; the last one stays.
        self._crafted: dict[str, list[Answer]] = {}
        routes = [
            Route("/v1/devices", self._handle, methods=["POST"], name="enroll"),
            Route(f"/v1/populations/{POPULATION}/checkin", self._handle, methods=["POST"], name="checkin"),
            Route("/v1/artifacts/{sha256}", self._handle, methods=["GET"], name="artifact"),
            Route(f"/v1/populations/{POPULATION}/manifest", self._handle, methods=["GET"], name="manifest"),
            Route(
                f"/v1/populations/{POPULATION}/models/{{version}}/global",
                self._handle,
                methods=["GET"],
                name="global",
            ),
            Route("/v1/assignments/{id}/report", self._handle, methods=["POST"], name="report"),
            Route("/v1/assignments/{id}/abort", self._handle, methods=["POST"], name="abort"),
            Route("/v1/assignments/{id}/central-examples", self._handle, methods=["GET"], name="central"),
            Route("/v1/assignments/{id}/central-gradient", self._handle, methods=["GET"], name="gradient"),
        ]
        config = uvicorn.Config(
            Starlette(routes=routes),
            host="127.0.0.1",
            port=self.port,
            log_level="error",
            timeout_graceful_shutdown=1,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    # ---- what a test sets and reads ----------------------------------------------------

    def craft(self, route: str, *answers: Answer) -> None:
        """Answer `route` with `answers` in turn (the last one from then on)."""
        self._crafted[route] = list(answers)

    def reset(self) -> None:
        self._crafted.clear()
        self.requests.clear()

    def seen(self, route: str) -> list[Seen]:
        return [r for r in self.requests if r.route == route]

    def assignment(self, **changes: Any) -> dict[str, Any]:
        """The honest check-in answer, with `changes` (a value of `...` removes the field)."""
        answer = {
            "accepted": True,
            "assignment_id": ASSIGNMENT_ID,
            "round_id": 1,
            "kind": "training",
            "deadline": time.time() + 60.0,
            "seconds_left": 60.0,
            "model_version": 0,
            "artifact_sha256": self.sha256,
            "artifact_url": f"/v1/artifacts/{self.sha256}",
            "params_url": f"/v1/populations/{POPULATION}/models/0/global",
            "manifest_url": f"/v1/populations/{POPULATION}/manifest",
            "report_url": f"/v1/assignments/{ASSIGNMENT_ID}/report",
            "abort_url": f"/v1/assignments/{ASSIGNMENT_ID}/abort",
            "task_config": TaskConfig.from_manifest(Manifest.from_json(self.manifest)).to_json(),
            # As the orchestrator answers for a plaintext round: no secure phases, secure_url null.
            "aggregation": "plaintext",
            "secure_url": None,
        }
        answer.update(changes)
        return {k: v for k, v in answer.items() if v is not ...}

    def central_examples(self, count: int = 3) -> bytes:
        """Example transfer's honest answer: `count` examples of the first items, top label."""
        manifest = Manifest.from_json(self.manifest)
        label = manifest.label_features[0]
        top = label.value_range[1] if label.value_range is not None else 1.0
        examples = Examples(
            {"item": np.arange(count, dtype=np.int32), label.name: np.full(count, top, np.float32)}
        )
        return encode_examples(examples, manifest.features)

    def central_gradient(self, rows: int = 2, value: float = 0.01) -> dict[str, SparseTensor]:
        """Gradient transfer's honest answer: every global, its first `rows` rows at `value`."""
        manifest = Manifest.from_json(self.manifest)
        gradient = {}
        for spec in manifest.global_params:
            by_row = row_shape(spec.shape)
            taken = np.arange(min(rows, by_row[0]), dtype=np.int32)
            gradient[spec.name] = SparseTensor(
                spec.shape, taken, np.full((len(taken), *by_row[1:]), value, np.float32)
            )
        return gradient

    # ---- serving -----------------------------------------------------------------------

    def _honest(self, route: str) -> Answer:
        binary = "application/octet-stream"
        acknowledged = {"round_id": 1, "round_status": "open", "reported": 1, "target": 10}
        honest: dict[str, Callable[[], Answer]] = {
            "enroll": lambda: json_answer({"device_id": "d" * 32, "token": TOKEN}, 201),
            "checkin": lambda: json_answer(self.assignment()),
            "artifact": lambda: Answer(self.model, content_type=binary),
            "manifest": lambda: json_answer(self.manifest),
            "global": lambda: Answer(self.global_params, content_type=binary),
            "report": lambda: json_answer(acknowledged),
            "abort": lambda: json_answer(acknowledged),
            "central": lambda: Answer(self.central_examples(), content_type=binary),
            "gradient": lambda: Answer(encode_sparse_delta(self.central_gradient()), content_type=binary),
        }
        return honest[route]()

    async def _handle(self, request: Request) -> Response:
        route = request.scope["route"].name
        await request.body()
        self.requests.append(
            Seen(route, request.method, request.url.path, request.headers.get("authorization"))
        )
        crafted = self._crafted.get(route)
        answer = (crafted.pop(0) if len(crafted) > 1 else crafted[0]) if crafted else self._honest(route)
        if answer.delay_seconds:
            await asyncio.sleep(answer.delay_seconds)
        if answer.chunks:

            async def stream() -> AsyncIterator[bytes]:
                for _ in range(answer.chunks):
                    yield answer.body

            return StreamingResponse(
                stream(), answer.status, headers=answer.headers, media_type=answer.content_type
            )
        return Response(answer.body, answer.status, headers=answer.headers, media_type=answer.content_type)

    def start(self) -> Self:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the hostile server did not start at {self.url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
