"""One device's HTTP exchanges with the real orchestrator, recorded over loopback.

The orchestrator runs as operators run it (`orchestrator.local.LocalOrchestrator`, SQLite), with a
population of the kit's model; the Python device's client goes through a transport that keeps
each request and its answer. A case replays the recorded answers to the port, which must send
the recorded requests (the ids and the token in them come from those answers)."""

from __future__ import annotations

import asyncio
import base64
import json
import tempfile
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from conformance import secure_flow
from conformance.generate_wire import MODEL
from conformance.port import of_bytes, to_bytes
from conformance.tensors import sparse_json, tensor_json
from contracts.manifest import Manifest
from contracts.params import sparse_rows
from device_runtime.orchestrator_client import OrchestratorClient
from orchestrator.local import LocalOrchestrator
from secure_aggregation import crypto
from secure_aggregation.device import SHARE_ENCRYPTION, share_aad
from secure_aggregation.identity import SignedAdvertisement
from secure_aggregation.messages import b64
from secure_aggregation.quantization import Layout
from secure_aggregation.view import roster_digest

SETTINGS = {"target_reports": 2, "min_examples": 1}
SECURE_POPULATION = "secure-movies"
SECURE_DEVICES = ("device-1", "device-2", "device-3", "device-4")  # the first one's view is the case
# t - 1 for the round below: t = max(2, ceil(threshold 0.5 x 3 neighbours)) = 2.
SHAMIR_COEFFICIENTS = 1
SECURE_POLICY = {"min_summands": 3, "min_threshold": 0.25}
# The smallest secure round the settings allow: four devices, each sharing with the other three.
SECURE_SETTINGS = {
    "target_reports": len(SECURE_DEVICES),
    "oversampling": 1.0,
    "min_reports": 3,
    "min_examples": 1,
    "aggregation": "secure",
    "secure": {
        "clip_norm": 1.0,
        "bits": 24,
        "neighbours": 0,
        "threshold": 0.5,
        # Each phase closes once all four sent; the deadlines only bound a stuck recording.
        "advertise_seconds": 60,
        "share_keys_seconds": 60,
        "masked_input_seconds": 60,
        "unmasking_seconds": 60,
        "straggler_wait": None,
    },
}


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


def _create_population(url: str, admin_token: str, population: str, settings: dict[str, Any]) -> None:
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
        data={"name": population, "settings": json.dumps(settings)},
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


def record() -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """The plaintext flows, and the secure round (its inputs and first device's exchanges)."""
    # The server checks advertisements' certificates as a production one does.
    authority_key = base64.b64encode(secure_flow.authority().public_key).decode()
    with (
        tempfile.TemporaryDirectory() as folder,
        LocalOrchestrator(
            f"sqlite:///{folder}/orchestrator.sqlite", settings={"enrollment_authority_key": authority_key}
        ) as server,
    ):
        _create_population(server.url, server.admin_token, "movies", SETTINGS)
        _create_population(server.url, server.admin_token, SECURE_POPULATION, SECURE_SETTINGS)
        flows = asyncio.run(_flows(server.url, Path(folder) / "cache"))
        return flows, asyncio.run(_secure_round(server.url))


DELTA_ROWS = [1, 5]


def secure_inputs(name: str, token: str) -> dict[str, Any]:
    """What device `name` knows before its secure round (blobs as bytes)."""
    manifest = (MODEL / "manifest.json").read_bytes()
    length = Layout.of(Manifest.from_json(json.loads(manifest)).global_params).length
    device = secure_flow.Device(name, SHAMIR_COEFFICIENTS, length)
    return {
        "token": token,
        "population": SECURE_POPULATION,
        "example_count": 7,
        "task": "training",
        "conditions": {"idle": True},
        "privacy_policy": SECURE_POLICY,
        "identity": device.identity_json(),
        "draws": device.draws_json(),
        "update": device.update(),
        "globals": of_bytes((MODEL / "global_params.safetensors").read_bytes()),
        "manifest": of_bytes(manifest),
    }


async def _secure_round(url: str) -> dict[str, Any]:
    """Four certified devices through one secure round; the first one's inputs and exchanges."""
    recorder = Recorder()

    async def device(name: str) -> dict[str, Any]:
        transport = recorder if name == SECURE_DEVICES[0] else httpx.AsyncHTTPTransport()
        async with httpx.AsyncClient(transport=transport, timeout=30.0) as http:
            client = OrchestratorClient(url, http=http, attempts=1)
            await client.enroll()
            assert client.token is not None
            inputs = secure_inputs(name, client.token)
            outcome = await secure_flow.secure_round(client, inputs)
            if outcome.status != "reported":
                raise RuntimeError(f"{name} left the secure round: {outcome}")
            return inputs

    inputs = await asyncio.gather(*(device(name) for name in SECURE_DEVICES))
    # The flow starts at the check-in (enrolling is a flow of its own).
    return {"inputs": inputs[0], "exchanges": recorder.exchanges[1:]}


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


def _states(value: Any) -> list[dict[str, Any]]:
    """The secure round's states in an answer (the state itself, or a message's `state`)."""
    if not isinstance(value, dict):
        return []
    return [value] if "phase" in value else _states(value.get("state"))


def secure_case(recorded: dict[str, Any], blobs: Path) -> dict[str, Any]:
    """The secure round's case; each share ciphertext (its nonce is random) checked by what it
    decrypts to under the holder's agreed key and the round's associated data."""
    inputs = dict(recorded["inputs"])
    for name, file in (("globals", "secure-round-globals.bin"), ("manifest", "secure-round-manifest.json")):
        (blobs / file).write_bytes(to_bytes(inputs[name]))
        inputs[name] = {"$file": f"blobs/{file}"}
    exchanges = recorded["exchanges"]
    context = exchanges[0]["answer"]["json"]["secure_parameters"]["context"]
    states = [s for e in exchanges for s in _states(e["answer"].get("json"))]
    [entries] = {json.dumps(s["roster"], sort_keys=True) for s in states if "roster" in s}
    roster = {int(i): SignedAdvertisement.from_json(a).keys for i, a in json.loads(entries).items()}
    digest = roster_digest(context, roster)
    private = crypto.private_from_bytes(to_bytes(inputs["draws"]["encryption_private"]))
    index = next(e["answer"]["json"]["index"] for e in exchanges if e["request"]["path"].endswith("/keys"))
    requests = []
    for exchange in exchanges:
        request = json.loads(json.dumps(exchange["request"]))
        if request["path"].endswith("/shares"):
            for holder, entry in request["json"].items():
                agreed = crypto.agree(private, roster[int(holder)].encryption_key, SHARE_ENCRYPTION, context)
                aad = share_aad(context, digest, int(index), int(holder))
                sealed = base64.b64decode(entry["ciphertext"])
                plaintext = AESGCM(agreed).decrypt(
                    sealed[: crypto.NONCE_BYTES], sealed[crypto.NONCE_BYTES :], aad
                )
                entry["ciphertext"] = {
                    "$decrypts": {"key": b64(agreed), "aad": b64(aad), "plaintext": b64(plaintext)}
                }
        requests.append(request)
    return {
        "name": "http: secure round",
        "op": "http.flow",
        "args": {"flow": "secure round", "inputs": inputs, "answers": [e["answer"] for e in exchanges]},
        "expect": {"requests": requests},
    }


def generate(out: Path) -> None:
    for old in (out / "blobs").glob("*"):
        old.unlink()
    (out / "cases.json").parent.mkdir(parents=True, exist_ok=True)
    flows, secure = record()
    written = [*cases(flows, out / "blobs"), secure_case(secure, out / "blobs")]
    (out / "cases.json").write_text(json.dumps(written, indent=1) + "\n")
