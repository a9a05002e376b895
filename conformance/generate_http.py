"""One device's HTTP exchanges with the real orchestrator, recorded over loopback.

The orchestrator runs as operators run it (`orchestrator.local.LocalOrchestrator`, SQLite), with a
population of the kit's model; the Python device's client goes through a transport that keeps
each request and its answer. A case replays the recorded answers to the port, which must send
the recorded requests (the ids and the token in them come from those answers)."""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from conformance.generate_wire import MODEL
from conformance.port import of_bytes, to_bytes
from conformance.tensors import sparse_json, tensor_json
from contracts.params import sparse_rows
from device_runtime.orchestrator_client import OrchestratorClient
from orchestrator.local import LocalOrchestrator

SETTINGS = {"target_reports": 2, "min_examples": 1}


class Recorder(httpx.AsyncBaseTransport):
    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.exchanges: list[dict[str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        body = await response.aread()
        await response.aclose()
        sent: dict[str, Any] = {"method": request.method, "path": request.url.path}
        if "authorization" in request.headers:
            sent["authorization"] = request.headers["authorization"]
        kind = request.headers.get("content-type", "")
        if kind == "application/json":
            sent["json"] = json.loads(request.content)
        elif request.content:
            sent["content_type"] = kind
            sent["body"] = of_bytes(request.content)
        answer_kind = response.headers.get("content-type", "")
        answer: dict[str, Any] = {"status": response.status_code}
        if answer_kind.startswith("application/json"):
            answer["json"] = json.loads(body)
        else:
            answer["content_type"] = answer_kind
            answer["body"] = of_bytes(body)
        self.exchanges.append({"request": sent, "answer": answer})
        return httpx.Response(response.status_code, headers=response.headers, content=body)


def _create_population(url: str, admin_token: str) -> None:
    files = {
        part: (name, (MODEL / name).read_bytes())
        for part, name in (
            ("model", "model.tflite"),
            ("manifest", "manifest.json"),
            ("global_params", "global_params.safetensors"),
        )
    }
    created = httpx.post(
        f"{url}/v1/admin/populations",
        data={"name": "movies", "settings": json.dumps(SETTINGS)},
        files=files,
        headers={"Authorization": f"Bearer {admin_token}"},
        timeout=60,
    )
    if created.status_code != 201:
        raise RuntimeError(f"creating the population failed: {created.status_code} {created.text[:300]}")


async def _flows(url: str, folder: Path) -> dict[str, list[dict[str, Any]]]:
    flows: dict[str, list[dict[str, Any]]] = {}

    async def flow(name: str, client: OrchestratorClient, recorder: Recorder, step: Any) -> Any:
        before = len(recorder.exchanges)
        got = await step
        flows[name] = recorder.exchanges[before:]
        return got

    for device in ("a", "b"):
        recorder = Recorder()
        http = httpx.AsyncClient(transport=recorder, timeout=5.0)
        client = OrchestratorClient(url, http=http, attempts=1)
        prefix = "" if device == "a" else "abort: "
        await flow(f"{prefix}enrol", client, recorder, client.enroll())
        assignment = await flow(
            f"{prefix}check in", client, recorder, client.checkin("movies", 7, "training", {"idle": True})
        )
        if device == "b":
            await flow("abort", client, recorder, client.abort(assignment))
        else:
            await flow("download", client, recorder, _download(client, assignment, folder))
            delta = np.zeros((12, 4), np.float32)
            delta[DELTA_ROWS] = 0.25
            await flow(
                "report",
                client,
                recorder,
                client.report_training(assignment, {"item_embeddings": delta}, 7, {"loss": 0.5}),
            )
        await http.aclose()
    return flows


async def _download(client: OrchestratorClient, assignment: Any, folder: Path) -> None:
    await client.model_dir(assignment, folder)
    await client.global_params(assignment)


def record() -> dict[str, list[dict[str, Any]]]:
    with (
        tempfile.TemporaryDirectory() as folder,
        LocalOrchestrator(f"sqlite:///{folder}/orchestrator.sqlite") as server,
    ):
        _create_population(server.url, server.admin_token)
        return asyncio.run(_flows(server.url, Path(folder) / "cache"))


DELTA_ROWS = [1, 5]


def cases(flows: dict[str, list[dict[str, Any]]], blobs: Path) -> list[dict[str, Any]]:
    """Each flow's case: the recorded answers in, the recorded requests expected out."""
    token = "Bearer " + flows["enrol"][0]["answer"]["json"]["token"]
    assignment = flows["check in"][0]["answer"]["json"]
    abort_token = "Bearer " + flows["abort: enrol"][0]["answer"]["json"]["token"]
    delta = np.zeros((12, 4), np.float32)
    delta[DELTA_ROWS] = 0.25
    inputs: dict[str, dict[str, Any]] = {
        "enrol": {"token": None},
        "check in": {
            "token": token.removeprefix("Bearer "),
            "population": "movies",
            "example_count": 7,
            "task": "training",
            "conditions": {"idle": True},
        },
        "download": {"token": token.removeprefix("Bearer "), "assignment": assignment},
        "report": {
            "token": token.removeprefix("Bearer "),
            "assignment": assignment,
            "delta": {"item_embeddings": tensor_json(delta)},
            "num_examples": 7,
            "metrics": {"loss": 0.5},
        },
        "abort": {
            "token": abort_token.removeprefix("Bearer "),
            "assignment": flows["abort: check in"][0]["answer"]["json"],
        },
    }
    out = []
    blobs.mkdir(parents=True, exist_ok=True)
    for name, given in inputs.items():
        answers, requests = [], []
        for i, exchange in enumerate(flows[name]):
            answer = dict(exchange["answer"])
            if "body" in answer:
                file = f"{name.replace(' ', '-')}-{i}.bin"
                (blobs / file).write_bytes(to_bytes(answer["body"]))
                answer["body"] = {"$file": f"blobs/{file}"}
            answers.append(answer)
            request = dict(exchange["request"])
            if name == "report":
                request["body"] = {
                    "$sparse_delta": {
                        "tensors": {"item_embeddings": sparse_json(sparse_rows(delta))},
                        "metadata": {"num_examples": "7", "metrics": json.dumps({"loss": 0.5})},
                    }
                }
            requests.append(request)
        out.append(
            {
                "name": f"http: {name}",
                "op": "http.flow",
                "args": {"flow": name, "inputs": given, "answers": answers},
                "expect": {"requests": requests},
            }
        )
    return out


def generate(out: Path) -> None:
    for old in (out / "blobs").glob("*.bin"):
        old.unlink()
    (out / "cases.json").parent.mkdir(parents=True, exist_ok=True)
    (out / "cases.json").write_text(json.dumps(cases(record(), out / "blobs"), indent=1) + "\n")
