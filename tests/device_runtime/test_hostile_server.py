"""A device against a server that answers garbage: every bad answer becomes an explicit outcome
with a clear detail, an assignment the device holds is aborted on its own orchestrator, the token
goes nowhere else, the model cache heals, and the example store is untouched."""

from __future__ import annotations

import asyncio
import copy
import gzip
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load, save

from contracts.features import Examples
from contracts.manifest import MANIFEST_FILE, MODEL_FILE, Manifest
from contracts.params import SparseTensor, decode_params, encode_params, encode_sparse_delta
from device_runtime.agent import DeviceAgent, Participation
from device_runtime.example_store import Event, ExampleStore
from device_runtime.orchestrator_client import OrchestratorClient
from device_runtime.protocol_errors import InvalidAnswer
from device_runtime.task_runner import TaskRunner
from model_export.config import ModelConfig
from orchestrator.local import free_port
from tests.conftest import DEVICE_POLICY, SMALL
from tests.device_runtime.hostile_orchestrator import (
    ASSIGNMENT_ID,
    POPULATION,
    TOKEN,
    Answer,
    HostileOrchestrator,
    json_answer,
)

BINARY = "application/octet-stream"


@pytest.fixture(scope="module")
def server(export: Callable[[ModelConfig], Path]) -> Iterator[HostileOrchestrator]:
    with HostileOrchestrator(export(SMALL)) as running:
        yield running


@pytest.fixture(scope="module")
def other(export: Callable[[ModelConfig], Path]) -> Iterator[HostileOrchestrator]:
    """A second server on another port: it must never hear from the device."""
    with HostileOrchestrator(export(SMALL)) as running:
        yield running


@pytest.fixture(scope="module")
def runner() -> Iterator[TaskRunner]:
    with TaskRunner(1) as running:
        yield running


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ExampleStore]:
    rng = np.random.default_rng(0)
    items, ratings = rng.integers(0, SMALL.num_items, 40), rng.integers(1, 6, 40)
    with ExampleStore(tmp_path / "device.sqlite", SMALL.features()) as opened:
        opened.add(
            Event({"item": int(i), "label": float(r)}, float(t))
            for t, (i, r) in enumerate(zip(items, ratings, strict=True))
        )
        yield opened


def participate(
    server: HostileOrchestrator, store: ExampleStore, runner: TaskRunner, cache_dir: Path
) -> Participation:
    async def once() -> Participation:
        client = OrchestratorClient(server.url, TOKEN, attempts=2, backoff_seconds=0.01, timeout_seconds=1.0)
        try:
            return await DeviceAgent(
                client, store, cache_dir, POPULATION, runner=runner, policy=DEVICE_POLICY
            ).participate()
        finally:
            await client.aclose()

    return asyncio.run(once())


def aborted(server: HostileOrchestrator) -> bool:
    """Whether the assignment's abort reached the server, with the device's token."""
    return any(
        r.path == f"/v1/assignments/{ASSIGNMENT_ID}/abort" and r.authorization == f"Bearer {TOKEN}"
        for r in server.seen("abort")
    )


# ---- the crafted answers ---------------------------------------------------------------


def manifest_with(server: HostileOrchestrator, **changes: Any) -> dict[str, Any]:
    return {**server.manifest, **changes}


def renamed_output(server: HostileOrchestrator) -> dict[str, Any]:
    """The manifest with an output of `evaluate` under another name than the model gives it."""
    manifest: dict[str, Any] = copy.deepcopy(server.manifest)
    for output in manifest["signatures"]["evaluate"]["outputs"]:
        if output["name"] == "loss_sum":
            output["name"] = "loss_total"
    return manifest


def params_answer(server: HostileOrchestrator, change: Callable[[dict[str, np.ndarray]], None]) -> Answer:
    specs = Manifest.from_json(server.manifest).global_params
    params = decode_params(server.global_params, specs, "global parameters")
    change(params)
    return Answer(save(params), content_type=BINARY)


def set_nan(params: dict[str, np.ndarray]) -> None:
    params["item_embeddings"][3, 1] = np.nan


def grow(params: dict[str, np.ndarray]) -> None:
    params["item_embeddings"] = np.zeros((SMALL.num_items + 1, SMALL.embedding_dim), np.float32)


def widen(params: dict[str, np.ndarray]) -> None:
    params["item_embeddings"] = params["item_embeddings"].astype(np.float64)


def task_config(server: HostileOrchestrator, **changes: Any) -> Answer:
    return json_answer(server.assignment(task_config={**server.assignment()["task_config"], **changes}))


@dataclass(frozen=True)
class Case:
    name: str
    route: str
    answers: Callable[[HostileOrchestrator], list[Answer]]
    status: str
    detail: str  # a regular expression the detail must match
    aborts: bool  # whether the device held an assignment it must abort


def one(answer: Callable[[HostileOrchestrator], Answer]) -> Callable[[HostileOrchestrator], list[Answer]]:
    return lambda s: [answer(s)]


BAD = "invalid_answer"
CASES = [
    # -- the check-in answer: before or while an assignment is handed out
    Case(
        "checkin html",
        "checkin",
        one(lambda s: Answer(b"<html>oops</html>")),
        BAD,
        r"check-in answer is not JSON .*expected a JSON object",
        False,
    ),
    Case(
        "checkin content type",
        "checkin",
        one(lambda s: json_answer(s.assignment(), content_type="text/html")),
        BAD,
        r"Content-Type 'text/html; charset=utf-8'; expected application/json",
        False,
    ),
    Case(
        "checkin array",
        "checkin",
        one(lambda s: json_answer([1, 2])),
        BAD,
        r"is a JSON list; expected a JSON object",
        False,
    ),
    Case(
        "checkin no accepted",
        "checkin",
        one(lambda s: json_answer({"reason": "x"})),
        BAD,
        r"accepted=None; expected true \(an assignment\) or false",
        False,
    ),
    Case(
        "checkin deeply nested",
        "checkin",
        one(lambda s: Answer(b"[" * 100_000 + b"]" * 100_000)),
        BAD,
        r"not JSON \(RecursionError",
        False,
    ),
    Case(
        "checkin endless",
        "checkin",
        one(lambda s: Answer(b" " * 65_536, chunks=1_000)),
        BAD,
        r"longer than 1048576 bytes",
        False,
    ),
    Case(
        "checkin gzip lie",
        "checkin",
        one(lambda s: Answer(b"not gzip", headers={"Content-Encoding": "gzip"})),
        BAD,
        r"the answer is unreadable \(DecodingError",
        False,
    ),
    Case(
        "checkin redirect",
        "checkin",
        one(lambda s: Answer(status=307, headers={"Location": "http://10.0.0.1/x"})),
        BAD,
        r"answered 307 \(a redirect to 'http://10.0.0.1/x'\); the protocol has no redirects",
        False,
    ),
    Case(
        "checkin 404",
        "checkin",
        one(lambda s: json_answer({"detail": "no population 'p'"}, 404)),
        "refused",
        r"404: no population 'p'",
        False,
    ),
    Case(
        "checkin 500",
        "checkin",
        one(lambda s: Answer(b"boom", 500, "text/plain")),
        "unreachable",
        r"failed after 2 attempts \(500: boom\)",
        False,
    ),
    Case(
        "rejection extra field",
        "checkin",
        one(lambda s: json_answer({"accepted": False, "reason": "full", "retry_after_seconds": 5, "x": 1})),
        BAD,
        r"unexpected fields \['x'\]",
        False,
    ),
    Case(
        "rejection NaN retry",
        "checkin",
        one(lambda s: Answer(b'{"accepted": false, "reason": "full", "retry_after_seconds": NaN}')),
        BAD,
        r"retry_after_seconds is nan; expected a finite number in \[0, 2.592e\+06\]",
        False,
    ),
    Case(
        "rejection endless retry",
        "checkin",
        one(lambda s: json_answer({"accepted": False, "reason": "full", "retry_after_seconds": 1e12})),
        BAD,
        r"retry_after_seconds is 1000000000000.0; expected a finite number",
        False,
    ),
    Case(
        "assignment missing field",
        "checkin",
        one(lambda s: json_answer(s.assignment(report_url=...))),
        BAD,
        r"lacks fields \['report_url'\] and has unexpected fields \[\]",
        True,
    ),
    Case(
        "assignment with a null required URL",
        "checkin",
        one(lambda s: json_answer(s.assignment(report_url=None))),
        BAD,
        r"report_url is None; expected a string",
        True,
    ),
    Case(
        "assignment extra field",
        "checkin",
        one(lambda s: json_answer(s.assignment(surprise=1))),
        BAD,
        r"unexpected fields \['surprise'\]",
        True,
    ),
    Case(
        "round id as text",
        "checkin",
        one(lambda s: json_answer(s.assignment(round_id="1"))),
        BAD,
        r"round_id is '1'; expected a 64-bit integer",
        True,
    ),
    Case(
        "round id beyond 64 bits",
        "checkin",
        one(lambda s: json_answer(s.assignment(round_id=2**64))),
        BAD,
        r"round_id is 18446744073709551616; expected a 64-bit integer",
        True,
    ),
    Case(
        "negative model version",
        "checkin",
        one(lambda s: json_answer(s.assignment(model_version=-1))),
        BAD,
        r"model_version is -1; expected an integer >= 0",
        True,
    ),
    Case(
        "unknown kind",
        "checkin",
        one(lambda s: json_answer(s.assignment(kind="mining"))),
        BAD,
        r"kind is 'mining'; expected 'training' or 'evaluation'",
        True,
    ),
    Case(
        "deadline infinite",
        "checkin",
        one(lambda s: Answer(json.dumps(s.assignment(deadline=float("inf"))).encode())),
        BAD,
        r"deadline is inf; expected a finite",
        True,
    ),
    Case(
        "path in the model address",
        "checkin",
        one(lambda s: json_answer(s.assignment(artifact_sha256="../../../etc/passwd"))),
        BAD,
        r"artifact_sha256 is '../../../etc/passwd'; expected a string matching \^\[0-9a-f\]\{64\}\$",
        True,
    ),
    Case(
        "unusable assignment id",
        "checkin",
        one(lambda s: json_answer(s.assignment(assignment_id="../x"))),
        BAD,
        r"assignment_id is '../x'; expected a string matching",
        False,
    ),
    Case(
        "steps beyond 32 bits",
        "checkin",
        one(lambda s: task_config(s, update_max_steps=2**32 + 5)),
        BAD,
        r"task_config is not usable: .*update_max_steps must be in \[0, 10000\], got 4294967301",
        True,
    ),
    Case(
        "absurd steps",
        "checkin",
        one(lambda s: task_config(s, reconstruction_max_steps=50_000)),
        BAD,
        r"reconstruction_max_steps must be in \[0, 10000\], got 50000",
        True,
    ),
    Case(
        "rate beyond float32",
        "checkin",
        one(lambda s: task_config(s, update_learning_rate=1e39)),
        BAD,
        r"update_learning_rate must be in \[0, 1000\], got 1e\+39",
        True,
    ),
    Case(
        "NaN rate",
        "checkin",
        one(
            lambda s: Answer(
                json.dumps(s.assignment(task_config={"update_learning_rate": float("nan")})).encode()
            )
        ),
        BAD,
        r"update_learning_rate must be finite, got nan",
        True,
    ),
    Case(
        "unknown task field",
        "checkin",
        one(lambda s: task_config(s, mine_bitcoin=1)),
        BAD,
        r"unknown task config fields \['mine_bitcoin'\]",
        True,
    ),
    # -- the manifest
    Case(
        "manifest not JSON",
        "manifest",
        one(lambda s: Answer(b"\xff\xfe", content_type="application/json")),
        BAD,
        r"the model's manifest is not JSON",
        True,
    ),
    Case(
        "manifest of another model",
        "manifest",
        one(
            lambda s: json_answer(
                manifest_with(s, model={"file": MODEL_FILE, "sha256": "0" * 64, "bytes": 10})
            )
        ),
        BAD,
        r"manifest describes a model with sha256 000000000000\.\.\.; expected",
        True,
    ),
    Case(
        "manifest without signatures",
        "manifest",
        one(lambda s: json_answer(manifest_with(s, signatures={}))),
        BAD,
        r"manifest is not valid: manifest lacks required signatures",
        True,
    ),
    Case(
        "manifest disagrees with the model",
        "manifest",
        one(lambda s: json_answer(manifest_with(s, batch_size=s.manifest["batch_size"] + 1))),
        BAD,
        r"'reconstruct' inputs disagree with the manifest's features, parameters and task at "
        r"\['item', 'item_embeddings', 'label', 'weights'\]",
        True,
    ),
    Case(
        "manifest names outputs the model lacks",
        "manifest",
        one(lambda s: json_answer(renamed_output(s))),
        BAD,
        r"signature 'evaluate' outputs disagree with the manifest's features, parameters and task at "
        r"\['loss_sum', 'loss_total'\]",
        True,
    ),
    Case(
        "manifest understates the model",
        "manifest",
        one(lambda s: json_answer(manifest_with(s, model={**s.manifest["model"], "bytes": 100}))),
        BAD,
        r"declares \d+ bytes; expected at most 100",
        True,
    ),
    # -- the model file
    Case(
        "model of other bytes",
        "artifact",
        one(lambda s: Answer(s.model[::-1], content_type=BINARY)),
        BAD,
        r"has sha256 [0-9a-f]{12}\.\.\., expected [0-9a-f]{12}\.\.\. \(its address\); not cached",
        True,
    ),
    Case(
        "model truncated",
        "artifact",
        one(lambda s: Answer(s.model[:1000], content_type=BINARY)),
        BAD,
        r"; not cached",
        True,
    ),
    Case(
        "model as text",
        "artifact",
        one(lambda s: Answer(s.model, content_type="text/plain")),
        BAD,
        r"the model came as Content-Type 'text/plain; charset=utf-8'; expected application/octet-stream",
        True,
    ),
    Case(
        "model gone",
        "artifact",
        one(lambda s: json_answer({"detail": "no artifact"}, 404)),
        "refused",
        r"404: no artifact",
        True,
    ),
    # -- the global parameters
    Case(
        "params garbage",
        "global",
        one(lambda s: Answer(b"\x00" * 7, content_type=BINARY)),
        BAD,
        r"global parameters: not a valid safetensors payload",
        True,
    ),
    Case(
        "params wrong shape",
        "global",
        one(lambda s: params_answer(s, grow)),
        BAD,
        r"global parameters: tensor 'item_embeddings' is float32\[61, 8\], expected float32\[60, 8\]",
        True,
    ),
    Case(
        "params wrong dtype",
        "global",
        one(lambda s: params_answer(s, widen)),
        BAD,
        r"global parameters.*item_embeddings.*float64.*float32",
        True,
    ),
    Case(
        "params non-finite",
        "global",
        one(lambda s: params_answer(s, set_nan)),
        BAD,
        r"item_embeddings' has 1 non-finite values",
        True,
    ),
    Case(
        "params missing",
        "global",
        one(lambda s: Answer(encode_params({"x": np.zeros(1, np.float32)}), content_type=BINARY)),
        BAD,
        r"missing",
        True,
    ),
    Case(
        "params stall",
        "global",
        one(lambda s: Answer(s.global_params, content_type=BINARY, delay_seconds=3)),
        "unreachable",
        r"failed after 2 attempts \(ReadTimeout",
        True,
    ),
    # -- the report's answer
    Case(
        "report answer garbage",
        "report",
        one(lambda s: Answer(gzip.compress(b"{}"), content_type=BINARY)),
        BAD,
        r"the report answer came as Content-Type 'application/octet-stream'; expected application/json",
        True,
    ),
    Case(
        "report answer with a negative round id",
        "report",
        one(lambda s: json_answer({"round_id": -1, "round_status": "open", "reported": 1, "target": 10})),
        BAD,
        r"the report answer: round_id is -1; expected an integer >= 0",
        True,
    ),
    Case(
        "report late",
        "report",
        one(lambda s: json_answer({"detail": "the round closed (late)"}, 409)),
        "refused",
        r"409: the round closed \(late\)",
        False,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_malformed_answer_is_an_outcome_with_an_abort_and_the_store_intact(
    case: Case, server: HostileOrchestrator, store: ExampleStore, runner: TaskRunner, tmp_path: Path
) -> None:
    server.reset()
    server.craft(case.route, *case.answers(server))
    before = list(store.iter_events())

    participation = participate(server, store, runner, tmp_path / "cache")

    assert participation.status == case.status, participation.detail
    assert re.search(case.detail, participation.detail), participation.detail
    assert aborted(server) == case.aborts, (participation.detail, server.requests)
    assert list(store.iter_events()) == before and store.integrity_ok()


def test_an_honest_server_gets_a_report(
    server: HostileOrchestrator, store: ExampleStore, runner: TaskRunner, tmp_path: Path
) -> None:
    server.reset()

    participation = participate(server, store, runner, tmp_path / "cache")

    assert participation.status == "reported", participation.detail
    assert [r.route for r in server.requests] == ["checkin", "manifest", "artifact", "global", "report"]
    assert all(r.authorization == f"Bearer {TOKEN}" for r in server.requests)


def test_a_model_that_does_not_match_is_not_cached(
    server: HostileOrchestrator, store: ExampleStore, runner: TaskRunner, tmp_path: Path
) -> None:
    server.reset()
    server.craft("artifact", Answer(server.model[:-10], content_type=BINARY))
    cached = tmp_path / "cache" / server.sha256 / MODEL_FILE

    refused = participate(server, store, runner, tmp_path / "cache")

    assert refused.status == "invalid_answer", refused.detail
    assert not cached.exists()
    assert not list((tmp_path / "cache").rglob("*.tmp"))  # no temporary file left behind


def flip_a_byte(path: Path) -> None:
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    path.write_bytes(bytes(blob))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = [
    ("model corrupted", MODEL_FILE, flip_a_byte),
    ("model truncated", MODEL_FILE, truncate),
    ("manifest corrupted", MANIFEST_FILE, flip_a_byte),
    ("manifest truncated", MANIFEST_FILE, truncate),
]


@pytest.mark.parametrize(("file", "damage"), [d[1:] for d in DAMAGE], ids=[d[0] for d in DAMAGE])
def test_a_damaged_cache_is_downloaded_again_and_the_device_still_trains(
    file: str,
    damage: Callable[[Path], None],
    server: HostileOrchestrator,
    store: ExampleStore,
    runner: TaskRunner,
    tmp_path: Path,
) -> None:
    server.reset()
    first = participate(server, store, runner, tmp_path / "cache")
    cached = tmp_path / "cache" / server.sha256
    damage(cached / file)
    server.reset()

    second = participate(server, store, runner, tmp_path / "cache")

    assert first.status == second.status == "reported", second.detail
    route = "artifact" if file == MODEL_FILE else "manifest"
    assert len(server.seen(route)) == 1  # downloaded again, once
    assert (cached / MODEL_FILE).read_bytes() == server.model
    assert json.loads((cached / MANIFEST_FILE).read_text()) == server.manifest


def foreign(server: HostileOrchestrator, other: HostileOrchestrator) -> list[tuple[str, str]]:
    sha = server.sha256
    return [
        ("artifact_url", f"{other.url}/v1/artifacts/{sha}"),  # another port
        ("params_url", f"//127.0.0.1:{other.port}/v1/populations/{POPULATION}/models/0/global"),
        ("manifest_url", f"{other.url}/v1/populations/{POPULATION}/manifest"),
        ("report_url", f"{other.url}/v1/assignments/{ASSIGNMENT_ID}/report"),
        ("abort_url", f"{other.url}/v1/assignments/{ASSIGNMENT_ID}/abort"),
        ("artifact_url", f"https://127.0.0.1:{server.port}/v1/artifacts/{sha}"),  # another scheme
        ("artifact_url", f"http://localhost:{server.port}/v1/artifacts/{sha}"),  # another host name
        ("artifact_url", f"http://127.0.0.1:{server.port}@127.0.0.1:{other.port}/v1/artifacts/{sha}"),
    ]


def test_credentials_go_only_to_the_devices_own_orchestrator(
    server: HostileOrchestrator,
    other: HostileOrchestrator,
    store: ExampleStore,
    runner: TaskRunner,
    tmp_path: Path,
) -> None:
    for name, url in foreign(server, other):
        server.reset()
        other.reset()
        server.craft("checkin", json_answer(server.assignment(**{name: url})))

        participation = participate(server, store, runner, tmp_path / "cache")

        assert participation.status == "invalid_answer", (name, url, participation.detail)
        assert re.search(
            rf"the assignment's {name} '.*' points at .*, not at this device's orchestrator "
            rf"http://127.0.0.1:{server.port}; a device sends requests and its token only to its own",
            participation.detail,
        ), participation.detail
        assert other.requests == []  # no request at all, so never the token
        assert [r.route for r in server.requests] == ["checkin", "abort"] and aborted(server)


def test_a_redirect_elsewhere_is_not_followed(
    server: HostileOrchestrator,
    other: HostileOrchestrator,
    store: ExampleStore,
    runner: TaskRunner,
    tmp_path: Path,
) -> None:
    server.reset()
    other.reset()
    server.craft(
        "artifact", Answer(status=302, headers={"Location": f"{other.url}/v1/artifacts/{server.sha256}"})
    )

    participation = participate(server, store, runner, tmp_path / "cache")

    assert participation.status == "invalid_answer" and "302" in participation.detail
    assert other.requests == [] and aborted(server)


def test_a_server_that_fails_then_recovers_is_retried_with_backoff(
    server: HostileOrchestrator, store: ExampleStore, runner: TaskRunner, tmp_path: Path
) -> None:
    server.reset()
    server.craft(
        "global", Answer(b"busy", 503, "text/plain"), Answer(server.global_params, content_type=BINARY)
    )

    participation = participate(server, store, runner, tmp_path / "cache")

    assert participation.status == "reported", participation.detail
    assert len(server.seen("global")) == 2 and not server.seen("abort")


def test_a_server_that_is_down_is_an_outcome(store: ExampleStore, runner: TaskRunner, tmp_path: Path) -> None:
    port = free_port()  # nobody listens there

    async def once() -> Participation:
        client = OrchestratorClient(f"http://127.0.0.1:{port}", TOKEN, attempts=2, backoff_seconds=0.01)
        try:
            return await DeviceAgent(
                client, store, tmp_path, POPULATION, runner=runner, policy=DEVICE_POLICY
            ).participate()
        finally:
            await client.aclose()

    participation = asyncio.run(once())

    assert participation.status == "unreachable"
    assert re.search(
        rf"POST http://127.0.0.1:{port}/v1/populations/p/checkin failed after 2 attempts \(ConnectError",
        participation.detail,
    ), participation.detail


ENROLLMENTS = [
    ({"device_id": "d1", "token": "two words"}, r"token is 'two words'; expected a string matching"),
    ({"device_id": "d1", "token": "t\r\nX-Evil: 1"}, r"token is 't\\r\\nX-Evil: 1'"),
    ({"device_id": "d1"}, r"lacks fields \['token'\]"),
    ({"device_id": 7, "token": "t"}, r"device_id is 7; expected a string matching"),
]


@pytest.mark.parametrize(("answer", "message"), ENROLLMENTS)
def test_a_malformed_enrollment_is_refused_and_no_token_kept(
    answer: dict[str, Any], message: str, server: HostileOrchestrator
) -> None:
    server.reset()
    server.craft("enroll", json_answer(answer, 201))

    async def enroll() -> OrchestratorClient:
        client = OrchestratorClient(server.url)
        try:
            with pytest.raises(InvalidAnswer, match=message):
                await client.enroll()
            return client
        finally:
            await client.aclose()

    assert asyncio.run(enroll()).token is None


CENTRAL_URL = f"/v1/assignments/{ASSIGNMENT_ID}/central-examples"


def _central_with(server: HostileOrchestrator, **columns: np.ndarray) -> Answer:
    examples = Examples(
        {"item": np.arange(3, dtype=np.int32), "label": np.full(3, 5.0, np.float32), **columns}
    )
    return Answer(
        save({k: np.ascontiguousarray(v) for k, v in examples.columns.items()}), content_type=BINARY
    )


CENTRAL_CASES: list[tuple[str, Callable[[HostileOrchestrator], Answer], str]] = [
    ("garbage", lambda s: Answer(b"\x01" * 40, content_type=BINARY), r"not valid safetensors|header"),
    ("json", lambda s: json_answer({"item": [1]}), r"Content-Type"),
    ("item outside", lambda s: _central_with(s, item=np.full(3, SMALL.num_items, np.int32)), r"outside"),
    ("extra feature", lambda s: _central_with(s, user=np.zeros(3, np.int32)), r"unexpected \['user'\]"),
    ("label NaN", lambda s: _central_with(s, label=np.full(3, np.nan, np.float32)), r"NaN"),
    (
        "too many",
        lambda s: Answer(s.central_examples(SMALL.batch_size * SMALL.max_batches + 1), content_type=BINARY),
        r"expected at most",
    ),
    (
        "endless",
        lambda s: Answer(b"\0" * 65536, content_type=BINARY, chunks=100),
        r"larger than|exceeds|bytes",
    ),
]


@pytest.mark.parametrize("name,answer,detail", CENTRAL_CASES, ids=[c[0] for c in CENTRAL_CASES])
def test_malformed_central_examples_are_an_outcome_with_an_abort(
    name: str,
    answer: Callable[[HostileOrchestrator], Answer],
    detail: str,
    server: HostileOrchestrator,
    store: ExampleStore,
    runner: TaskRunner,
    tmp_path: Path,
) -> None:
    server.reset()
    server.craft("checkin", json_answer(server.assignment(central_examples_url=CENTRAL_URL)))
    server.craft("central", answer(server))
    before = list(store.iter_events())

    participation = participate(server, store, runner, tmp_path / "cache")

    assert participation.status == BAD, participation.detail
    assert re.search(detail, participation.detail), participation.detail
    assert aborted(server) and not server.seen("report")
    assert list(store.iter_events()) == before and store.integrity_ok()


def test_honest_central_examples_are_trained_on_and_reported_as_usual(
    server: HostileOrchestrator, store: ExampleStore, runner: TaskRunner, tmp_path: Path
) -> None:
    server.reset()
    server.craft("checkin", json_answer(server.assignment(central_examples_url=CENTRAL_URL)))

    participation = participate(server, store, runner, tmp_path / "cache")

    assert participation.status == "reported", participation.detail
    assert [r.route for r in server.requests] == [
        "checkin",
        "manifest",
        "artifact",
        "global",
        "central",
        "report",
    ]


GRADIENT_URL = f"/v1/assignments/{ASSIGNMENT_ID}/central-gradient"


def _gradient_with(server: HostileOrchestrator, **changes: SparseTensor | None) -> Answer:
    """The honest central gradient with some tensors replaced (None: left out)."""
    gradient = {**server.central_gradient(), **changes}
    return Answer(
        encode_sparse_delta({k: v for k, v in gradient.items() if v is not None}), content_type=BINARY
    )


def _item_rows(server: HostileOrchestrator, rows: list[int], value: float = 0.01) -> SparseTensor:
    spec = next(s for s in Manifest.from_json(server.manifest).global_params if s.row_sparse is not None)
    return SparseTensor(
        spec.shape, np.asarray(rows, np.int32), np.full((len(rows), *spec.shape[1:]), value, np.float32)
    )


def _item_name(server: HostileOrchestrator) -> str:
    return next(s.name for s in Manifest.from_json(server.manifest).global_params if s.row_sparse is not None)


def _raw_rows(server: HostileOrchestrator, rows: list[int], dtype: type = np.float32) -> Answer:
    """The item embeddings' gradient written by hand, past SparseTensor's own checks."""
    name = _item_name(server)
    shape = next(s.shape for s in Manifest.from_json(server.manifest).global_params if s.name == name)
    blob = encode_sparse_delta({k: v for k, v in server.central_gradient().items() if k != name})
    tensors = {
        **load(blob),
        f"{name}/rows": np.asarray(rows, np.int32),
        f"{name}/values": np.zeros((len(rows), *shape[1:]), dtype),
        f"{name}/shape": np.asarray(shape, np.int64),
    }
    return Answer(save(tensors), content_type=BINARY)


GRADIENT_CASES: list[tuple[str, Callable[[HostileOrchestrator], Answer], str]] = [
    ("garbage", lambda s: Answer(b"\x01" * 40, content_type=BINARY), r"not a valid safetensors"),
    ("json", lambda s: json_answer({"item_embeddings": [1]}), r"Content-Type"),
    (
        "row outside",
        lambda s: _raw_rows(s, [0, SMALL.num_items]),
        r"rows must lie in",
    ),
    (
        "rows repeated",
        lambda s: _raw_rows(s, [3, 3]),
        r"strictly increasing",
    ),
    (
        "float64 values",
        lambda s: _raw_rows(s, [0, 1], np.float64),
        r"must be float32",
    ),
    ("NaN", lambda s: _gradient_with(s, **{_item_name(s): _item_rows(s, [1, 2], np.nan)}), r"non-finite"),
    ("a global missing", lambda s: _gradient_with(s, **{_item_name(s): None}), r"missing|lacks|expected"),
    (
        "an unknown tensor",
        lambda s: _gradient_with(s, bogus=SparseTensor((3,), np.zeros(0, np.int32), np.zeros(0, np.float32))),
        r"bogus",
    ),
    (
        "endless",
        lambda s: Answer(b"\0" * 65536, content_type=BINARY, chunks=200),
        r"larger than|exceeds|bytes",
    ),
]


@pytest.mark.parametrize("name,answer,detail", GRADIENT_CASES, ids=[c[0] for c in GRADIENT_CASES])
def test_a_malformed_central_gradient_is_an_outcome_with_an_abort(
    name: str,
    answer: Callable[[HostileOrchestrator], Answer],
    detail: str,
    server: HostileOrchestrator,
    store: ExampleStore,
    runner: TaskRunner,
    tmp_path: Path,
) -> None:
    server.reset()
    server.craft(
        "checkin",
        json_answer(server.assignment(central_gradient_url=GRADIENT_URL, central_gradient_weight=0.5)),
    )
    server.craft("gradient", answer(server))
    before = list(store.iter_events())

    participation = participate(server, store, runner, tmp_path / "cache")

    assert participation.status == BAD, participation.detail
    assert re.search(detail, participation.detail), participation.detail
    assert aborted(server) and not server.seen("report")
    assert list(store.iter_events()) == before and store.integrity_ok()


def test_a_gradient_url_without_its_weight_is_an_invalid_answer(
    server: HostileOrchestrator, store: ExampleStore, runner: TaskRunner, tmp_path: Path
) -> None:
    server.reset()
    server.craft("checkin", json_answer(server.assignment(central_gradient_url=GRADIENT_URL)))

    participation = participate(server, store, runner, tmp_path / "cache")

    assert participation.status == BAD, participation.detail
    assert "central_gradient_weight" in participation.detail
    assert not server.seen("gradient") and not server.seen("report")


def test_an_honest_central_gradient_is_trained_with_and_reported_as_usual(
    server: HostileOrchestrator, store: ExampleStore, runner: TaskRunner, tmp_path: Path
) -> None:
    server.reset()
    server.craft(
        "checkin",
        json_answer(server.assignment(central_gradient_url=GRADIENT_URL, central_gradient_weight=0.5)),
    )

    participation = participate(server, store, runner, tmp_path / "cache")

    assert participation.status == "reported", participation.detail
    assert [r.route for r in server.requests] == [
        "checkin",
        "manifest",
        "artifact",
        "global",
        "gradient",
        "report",
    ]
    assert participation.central_bytes == len(encode_sparse_delta(server.central_gradient()))


def test_a_central_gradient_the_server_cannot_give_leaves_a_plain_update(
    server: HostileOrchestrator, store: ExampleStore, runner: TaskRunner, tmp_path: Path
) -> None:
    # Prepare: the orchestrator's answer for a version whose central gradient is not finite.
    server.reset()
    server.craft(
        "checkin",
        json_answer(server.assignment(central_gradient_url=GRADIENT_URL, central_gradient_weight=0.5)),
    )
    detail = "the centralized data's gradient is not finite at this model version"
    server.craft("gradient", json_answer({"detail": detail}, status=503))

    # Execute
    participation = participate(server, store, runner, tmp_path / "cache")

    # Assert: retried, then trained without it and reported; nothing counted as downloaded.
    assert participation.status == "reported", participation.detail
    assert len(server.seen("gradient")) == 2 and server.seen("report")
    assert participation.central_bytes == 0
