"""The Python device runtime's adapter: each operation of the kit answered by the runtime's own
functions (contracts/, secure_aggregation/, device_runtime/orchestrator_client.py).

The requests a device sends are captured from the real `OrchestratorClient`, whose HTTP transport
here answers with the case's recorded server answer instead of a network."""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from conformance.port import of_bytes, refusal, to_bytes
from conformance.secure_flow import secure_round
from conformance.secure_ops import SECURE_OPS
from conformance.task_ops import TASK_OPS
from conformance.tensors import sparse_json, tensor_json, tensor_of
from contracts.manifest import Manifest, ManifestError, TensorSpec
from contracts.params import ParamsError, decode_params, decode_sparse_delta
from contracts.protocol import Assignment
from contracts.task_config import TaskConfig
from device_runtime.orchestrator_client import OrchestratorClient
from device_runtime.protocol_errors import InvalidAnswer

BASE_URL = "http://orchestrator.test"
Op = Callable[[dict[str, Any]], dict[str, Any]]


def parse_manifest(args: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"manifest": Manifest.from_json(args["manifest"]).to_json()}
    except ManifestError as e:
        return refusal("manifest", str(e))


def parse_task_config(args: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"task_config": TaskConfig.from_json(args["task_config"]).to_json()}
    except ValueError as e:
        return refusal("task_config", str(e))


def decode_global_params(args: dict[str, Any]) -> dict[str, Any]:
    specs = [TensorSpec.from_json(s, "specs") for s in args["specs"]]
    try:
        params = decode_params(to_bytes(args["blob"]), specs, "the global parameters")
    except ParamsError as e:
        return refusal("params", str(e))
    return {"tensors": {name: tensor_json(value) for name, value in sorted(params.items())}}


def decode_delta(args: dict[str, Any]) -> dict[str, Any]:
    try:
        delta = decode_sparse_delta(to_bytes(args["blob"]))
    except ParamsError as e:
        return refusal("params", str(e))
    return {"tensors": {name: sparse_json(value) for name, value in delta.items()}}


class Exchange:
    """The requests the real client sends, each answered with the next of the given answers."""

    def __init__(self, answers: list[dict[str, Any]]) -> None:
        self.answers = list(answers)
        self.requests: list[dict[str, Any]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = request.content
        kind = request.headers.get("content-type", "")
        # The query (a long-poll's `wait`) is a hint a port may leave out: not compared.
        sent: dict[str, Any] = {"method": request.method, "path": request.url.path}
        if "authorization" in request.headers:
            sent["authorization"] = request.headers["authorization"]
        if kind == "application/json":
            sent["json"] = json.loads(body)
        elif body:
            sent["content_type"] = kind
            sent["body"] = of_bytes(body)
        self.requests.append(sent)
        if not self.answers:
            return httpx.Response(599, json={"detail": "the recorded exchange has no more answers"})
        answer = self.answers.pop(0)
        if "body" in answer:
            return httpx.Response(
                answer["status"],
                content=to_bytes(answer["body"]),
                headers={"content-type": answer["content_type"]},
            )
        return httpx.Response(answer.get("status", 200), json=answer.get("json", {}))

    def run(self, call: Callable[[OrchestratorClient], Any], token: str | None = "conformance-token") -> Any:
        async def go() -> Any:
            http = httpx.AsyncClient(transport=httpx.MockTransport(self.handle))
            client = OrchestratorClient(BASE_URL, token, http=http, attempts=1)
            try:
                return await call(client)
            finally:
                await http.aclose()

        return asyncio.run(go())


def checkin(args: dict[str, Any]) -> dict[str, Any]:
    """The check-in request a device sends, and whether it takes the server's answer."""
    exchange = Exchange([{"json": args["answer"]}])

    async def call(client: OrchestratorClient) -> Any:
        return await client.checkin(
            args["population"], args["example_count"], args["task"], args["conditions"]
        )

    try:
        got = exchange.run(call)
    except InvalidAnswer as e:
        return {"request": exchange.requests[0], **refusal("message", str(e))}
    return {"request": exchange.requests[0], "accepted": isinstance(got, Assignment)}


def _assignment(data: dict[str, Any]) -> Assignment:
    return Assignment(**{k: v for k, v in data.items() if k != "accepted"})


def report_training(args: dict[str, Any]) -> dict[str, Any]:
    exchange = Exchange([{"json": args["answer"]}])
    delta = {name: tensor_of(t) for name, t in args["delta"].items()}

    async def call(client: OrchestratorClient) -> Any:
        return await client.report_training(
            _assignment(args["assignment"]), delta, args["num_examples"], args["metrics"]
        )

    exchange.run(call)
    return {"request": exchange.requests[0]}


def report_evaluation(args: dict[str, Any]) -> dict[str, Any]:
    exchange = Exchange([{"json": args["answer"]}])

    async def call(client: OrchestratorClient) -> Any:
        return await client.report_evaluation(
            _assignment(args["assignment"]), args["num_examples"], args["metrics"]
        )

    exchange.run(call)
    return {"request": exchange.requests[0]}


async def _flow(client: OrchestratorClient, flow: str, inputs: dict[str, Any]) -> None:
    """One protocol flow as the device runs it (`inputs`: what it knows beforehand)."""
    if flow == "enrol":
        await client.enroll()
    elif flow == "check in":
        await client.checkin(
            inputs["population"], inputs["example_count"], inputs["task"], inputs["conditions"]
        )
    elif flow == "download":
        with tempfile.TemporaryDirectory() as cache:
            await client.model_dir(_assignment(inputs["assignment"]), Path(cache))
        await client.global_params(_assignment(inputs["assignment"]))
    elif flow == "report":
        delta = {name: tensor_of(t) for name, t in inputs["delta"].items()}
        await client.report_training(
            _assignment(inputs["assignment"]), delta, inputs["num_examples"], inputs["metrics"]
        )
    elif flow == "abort":
        await client.abort(_assignment(inputs["assignment"]))
    elif flow == "secure round":
        await secure_round(client, inputs)
    else:
        raise ValueError(f"no flow {flow!r}")


def http_flow(args: dict[str, Any]) -> dict[str, Any]:
    """The requests a device sends through one protocol flow, given the server's answers."""
    exchange = Exchange(args["answers"])

    async def call(client: OrchestratorClient) -> None:
        await _flow(client, args["flow"], args["inputs"])

    exchange.run(call, args["inputs"].get("token"))
    return {"requests": exchange.requests}


OPS: dict[str, Op] = {
    "manifest.parse": parse_manifest,
    "task_config.parse": parse_task_config,
    "params.decode": decode_global_params,
    "delta.decode": decode_delta,
    "request.checkin": checkin,
    "request.report_training": report_training,
    "request.report_evaluation": report_evaluation,
    **SECURE_OPS,
    **TASK_OPS,
    "http.flow": http_flow,
}


class PythonPort:
    """The reference device, as a `conformance.port.Port`."""

    def __init__(self, ops: dict[str, Op] | None = None) -> None:
        self.ops = OPS if ops is None else ops

    def call(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        handler = self.ops.get(op)
        if handler is None:
            return refusal("unsupported", f"no operation {op!r}")
        return handler(args)


def serve() -> None:
    """The adapter as a command (`CommandPort`): JSON lines in, JSON lines out."""
    import sys

    port = PythonPort()
    for line in sys.stdin:
        request = json.loads(line)
        print(json.dumps(port.call(request["op"], request["args"])), flush=True)


if __name__ == "__main__":
    serve()
