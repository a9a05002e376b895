"""Hostile input against a real server on loopback: reports a real device built, then mutated;
protocol and authentication misuse; oversized, deep and out-of-range input; rate limits.

Each refusal is the right 4xx with a message that says what was expected, and leaves the model,
its versions and the round's counters as they were (a malformed report of the caller's own
assignment is recorded as that round's one more `invalid`, and a late one as one more `late`).
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
from safetensors.numpy import load, save

from contracts.params import decode_params, encode_sparse_delta, read_metadata
from contracts.task_config import TaskConfig
from device_runtime.client_task import Task, run_training_task
from device_runtime.example_store import Event, ExampleStore
from device_runtime.task_environment import Environment
from model_export.config import ModelConfig
from model_runtime.tflite_model import TFLiteModel
from orchestrator.app import create_app
from orchestrator.local import PROJECT_ROOT
from orchestrator.settings import AdminTokenError, Settings
from tests.conftest import BIASED
from tests.orchestrator.conftest import ADMIN_TOKEN, OCTETS, Server, admin_create_population

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
EXAMPLES = 40  # what each test device checks in with
MAX_REPORT_BYTES = 256 * 1024  # the module's server: small, so that oversized reports are cheap


# ---- a server, a population, and a report built by a real device ---------------------------------


class Live:
    def __init__(self, server: Server, report: bytes) -> None:
        self.server, self.url, self.report = server, server.url, report
        self.http = httpx.Client(base_url=server.url, timeout=30)

    def enroll(self) -> dict[str, str]:
        response = self.http.post("/v1/devices")
        assert response.status_code == 201, response.text
        return {"Authorization": f"Bearer {response.json()['token']}"}

    def checkin(
        self, device: dict[str, str], population: str = "p", task: str = "training"
    ) -> dict[str, Any]:
        response = self.http.post(
            f"/v1/populations/{population}/checkin",
            json={"example_count": EXAMPLES, "task": task},
            headers=device,
        )
        assert response.status_code == 200 and response.json()["accepted"], response.text
        return dict(response.json())

    def state(self, population: str = "p") -> dict[str, Any]:
        """Everything a refusal must leave alone: the population (its current version and open
        rounds with their counters, weights and metrics), every round, and the current model."""
        status = self.http.get(f"/v1/admin/populations/{population}", headers=ADMIN).json()
        rounds = self.http.get(f"/v1/admin/populations/{population}/rounds", headers=ADMIN).json()
        device = self.enroll()
        version = status["current_version"]
        params = self.http.get(f"/v1/populations/{population}/models/{version}/global", headers=device)
        return {"status": status, "rounds": rounds, "params": params.content}


def with_counter(state: dict[str, Any], counter: str, by: int = 1) -> dict[str, Any]:
    """`state` with one counter of its (only) open training round moved by `by`."""
    moved = json.loads(json.dumps({k: v for k, v in state.items() if k != "params"}))
    for r in [*moved["status"]["open_rounds"], *moved["rounds"]]:
        if r["kind"] == "training" and r["status"] == "open":
            r["counters"][counter] += by
    return {**moved, "params": state["params"]}


def real_report(model_dir: Path, tmp: Path, global_params: bytes) -> bytes:
    """A training report as a device makes it: the TFLite model trained on its own examples."""
    rng = np.random.default_rng(0)
    store = ExampleStore(tmp / "device.sqlite", BIASED.features())
    store.add(
        Event({"item": int(i), "label": float(rng.integers(1, 6))}, float(t))
        for t, i in enumerate(rng.integers(0, 200, 60))
    )
    model = TFLiteModel(model_dir)
    result = run_training_task(
        model,
        Environment.of(store),
        decode_params(global_params, model.manifest.global_params, "params"),
        Task(TaskConfig()),
    )
    assert result.delta is not None, result.message
    num_examples = min(result.num_examples, EXAMPLES)
    metadata = {"num_examples": str(num_examples), "metrics": json.dumps(result.metrics)}
    return encode_sparse_delta(result.delta, metadata)


@pytest.fixture(scope="module")
def live(export: Callable[[ModelConfig], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("hostile")
    model_dir = export(BIASED)
    server = Server(tmp / "orchestrator.sqlite", settings={"max_report_bytes": MAX_REPORT_BYTES}).start()
    try:
        # Rounds of 50: no test here fills one, so each sees the same open round.
        created = admin_create_population(server.url, model_dir, "p", json.dumps({"target_reports": 50}))
        assert created.status_code == 201, created.text
        device = {"Authorization": f"Bearer {httpx.post(f'{server.url}/v1/devices').json()['token']}"}
        params = httpx.get(f"{server.url}/v1/populations/p/models/0/global", headers=device).content
        yield Live(server, real_report(model_dir, tmp, params))
    finally:
        server.stop()


def test_the_unmutated_report_is_accepted(live: Live) -> None:
    device = live.enroll()
    assignment = live.checkin(device)
    before = live.state()

    response = live.http.post(assignment["report_url"], content=live.report, headers={**device, **OCTETS})

    assert response.status_code == 200, response.text
    assert (
        with_counter(before, "reported")["status"]["open_rounds"][0]["counters"]
        == (live.state()["status"]["open_rounds"][0]["counters"])
    )


# ---- reports built by a real device, then mutated ---------------------------------------------------

Parts = dict[str, np.ndarray]
Mutation = Callable[[Parts, dict[str, str]], tuple[Parts, dict[str, str]]]


def _set_metadata(**values: str) -> Mutation:
    return lambda parts, meta: (parts, {**meta, **values})


def _drop_metadata(key: str) -> Mutation:
    return lambda parts, meta: (parts, {k: v for k, v in meta.items() if k != key})


def _set_part(key: str, change: Callable[[np.ndarray], np.ndarray]) -> Mutation:
    return lambda parts, meta: ({**parts, key: change(parts[key])}, meta)


def _without(name: str) -> Mutation:
    return lambda parts, meta: ({k: v for k, v in parts.items() if not k.startswith(f"{name}/")}, meta)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _with_nan(values: np.ndarray) -> np.ndarray:
    out = values.copy()
    out.flat[0] = np.nan
    return out


EXTRA_TENSOR: Mutation = lambda parts, meta: (  # noqa: E731
    {
        **parts,
        "user_embedding/rows": np.arange(1, dtype=np.int32),
        "user_embedding/values": np.ones((1, 16), np.float32),
        "user_embedding/shape": np.array([1, 16], np.int64),
    },
    meta,
)

MUTATIONS: dict[str, tuple[Mutation, str]] = {
    "an unknown metadata key": (_set_metadata(user_id="42"), "report metadata must be 'num_examples'"),
    "no num_examples": (_drop_metadata("num_examples"), "report metadata must be 'num_examples'"),
    "num_examples not an integer": (_set_metadata(num_examples="1.5"), "'num_examples' \\(an integer\\)"),
    "num_examples of 2**63": (
        _set_metadata(num_examples=str(2**63)),
        r"num_examples \d+ is outside \[1, 40\]",
    ),
    "num_examples above the check-in": (_set_metadata(num_examples="41"), r"outside \[1, 40\]"),
    "num_examples of 0": (_set_metadata(num_examples="0"), r"outside \[1, 40\]"),
    "metrics nested 5,000 deep": (_set_metadata(metrics=_nested(5000)), "nests deeper than 16 levels"),
    "metrics nested 20 deep": (_set_metadata(metrics=_nested(20)), "nests deeper than 16 levels"),
    "metrics not JSON": (_set_metadata(metrics="{"), "not valid JSON"),
    "metrics a list": (_set_metadata(metrics="[1, 2]"), "metrics must be an object"),
    "a metric of 10**400": (
        _set_metadata(metrics='{"loss_sum": 1' + "0" * 400 + "}"),
        "magnitude <= 1e\\+12",
    ),
    "a metric that is NaN": (_set_metadata(metrics='{"loss_sum": NaN}'), "finite number"),
    "a metric named with JSON": (_set_metadata(metrics='{"a\\"b": 1}'), "must be 1-64 ASCII letters"),
    "65 metrics": (_set_metadata(metrics=json.dumps({f"m{i}": 1 for i in range(65)})), "at most 64 numbers"),
    "a 70 KB header": (_set_metadata(padding="x" * 70_000), "header claims \\d+ bytes; the limit is 65536"),
    "float64 values": (
        _set_part("item_embeddings/values", lambda v: v.astype(np.float64)),
        "item_embeddings/values must be float32",
    ),
    "int64 rows": (_set_part("item_embeddings/rows", lambda r: r.astype(np.int64)), "rows must be int32"),
    "a row beyond the catalog": (
        _set_part("item_embeddings/rows", lambda r: np.append(r[:-1], 10_000).astype(np.int32)),
        "rows must lie in \\[0, 200\\)",
    ),
    "rows out of order": (_set_part("item_embeddings/rows", lambda r: r[::-1].copy()), "strictly increasing"),
    "values of a row that is not listed": (
        _set_part("item_embeddings/rows", lambda r: r[:-1].copy()),
        "item_embeddings",
    ),
    "a NaN value": (_set_part("item_embeddings/values", _with_nan), "non-finite values"),
    "another model's shape": (
        _set_part("item_embeddings/shape", lambda s: np.array([300, 16], np.int64)),
        "has shape \\[300, 16\\], expected float32\\[200, 16\\]",
    ),
    "a negative shape": (_set_part("item_embeddings/shape", lambda s: -s), "sizes >= 0"),
    "a tensor missing": (_without("item_bias"), "missing \\['item_bias'\\]"),
    "a local tensor added": (EXTRA_TENSOR, "unexpected \\['user_embedding'\\]"),
    "a delta beyond the norm bound": (
        _set_part("item_embeddings/values", lambda v: np.full_like(v, 1000.0)),
        "update norm .* exceeds the bound 1000",
    ),
}


def mutate(report: bytes, mutation: Mutation) -> bytes:
    parts, metadata = mutation(dict(load(report)), read_metadata(report))
    return save(parts, metadata=metadata)


@pytest.mark.parametrize("name", MUTATIONS)
def test_a_mutated_report_is_refused_and_changes_nothing(live: Live, name: str) -> None:
    mutation, expected = MUTATIONS[name]
    device = live.enroll()
    assignment = live.checkin(device)
    before = live.state()

    response = live.http.post(
        assignment["report_url"], content=mutate(live.report, mutation), headers={**device, **OCTETS}
    )

    assert response.status_code == 422, response.text
    assert re.search(expected, response.json()["detail"]), response.json()["detail"]
    assert live.state() == with_counter(before, "invalid")


@pytest.mark.parametrize(
    ("name", "body", "expected"),
    [
        ("empty", b"", "not a valid safetensors payload"),
        ("truncated", None, "not a valid safetensors"),
        ("JSON instead of tensors", b'{"num_examples": 10}', "not a valid safetensors payload"),
        ("a header length of 2**64 - 1", b"\xff" * 8 + b"{}", "header claims \\d+ bytes; the limit is 65536"),
    ],
)
def test_a_report_that_is_not_safetensors_is_refused(
    live: Live, name: str, body: bytes | None, expected: str
) -> None:
    device = live.enroll()
    assignment = live.checkin(device)
    before = live.state()

    content = live.report[: len(live.report) - 100] if body is None else body
    response = live.http.post(assignment["report_url"], content=content, headers={**device, **OCTETS})

    assert response.status_code == 422, response.text
    assert re.search(expected, response.json()["detail"]), response.json()["detail"]
    assert live.state() == with_counter(before, "invalid")


# ---- protocol misuse -----------------------------------------------------------------------------


def test_another_devices_assignment_cannot_be_reported_or_aborted(live: Live) -> None:
    owner, thief = live.enroll(), live.enroll()
    assignment = live.checkin(owner)
    before = live.state()

    report = live.http.post(assignment["report_url"], content=live.report, headers={**thief, **OCTETS})
    abort = live.http.post(assignment["abort_url"], headers=thief)
    unknown = live.http.post(
        "/v1/assignments/0123456789abcdef/report", content=live.report, headers={**thief, **OCTETS}
    )

    assert (report.status_code, abort.status_code, unknown.status_code) == (403, 403, 404)
    assert "belongs to another device" in report.json()["detail"]
    assert live.state() == before


def test_a_replayed_report_is_refused(live: Live) -> None:
    device = live.enroll()
    assignment = live.checkin(device)
    first = live.http.post(assignment["report_url"], content=live.report, headers={**device, **OCTETS})
    after_first = live.state()

    replay = live.http.post(assignment["report_url"], content=live.report, headers={**device, **OCTETS})
    abort = live.http.post(assignment["abort_url"], headers=device)

    assert first.status_code == 200, first.text
    assert replay.status_code == abort.status_code == 409
    assert "already reported" in replay.json()["detail"]
    assert live.state() == after_first


def test_a_report_after_the_round_committed_is_late_and_moves_nothing(
    live: Live, export: Callable[..., Path]
) -> None:
    created = admin_create_population(live.url, export(BIASED), "once", json.dumps({"target_reports": 1}))
    assert created.status_code == 201, created.text
    first, second = live.enroll(), live.enroll()
    a, b = live.checkin(first, "once"), live.checkin(second, "once")
    assert (
        live.http.post(a["report_url"], content=live.report, headers={**first, **OCTETS}).json()[
            "round_status"
        ]
        == "committed"
    )
    before = live.state("once")

    late = live.http.post(b["report_url"], content=live.report, headers={**second, **OCTETS})

    assert late.status_code == 409 and "late" in late.json()["detail"]
    assert before["status"]["current_version"] == 1
    committed_round = next(r for r in live.state("once")["rounds"] if r["id"] == a["round_id"])
    assert committed_round["counters"]["late"] == 1
    after = live.state("once")

    def model_and_state(status: dict[str, Any]) -> dict[str, Any]:  # the recent rounds count it late
        return {k: v for k, v in status.items() if k != "recent_rounds"}

    assert model_and_state(after["status"]) == model_and_state(before["status"])
    assert after["params"] == before["params"]


def test_an_evaluation_report_must_be_json_of_bounded_depth(live: Live) -> None:
    opened = live.http.post("/v1/admin/populations/p/evaluations", headers=ADMIN)
    assert opened.status_code in (201, 409), opened.text  # 409: another test opened it
    device = live.enroll()
    assignment = live.checkin(device, task="evaluation")

    as_tensors = live.http.post(assignment["report_url"], content=live.report, headers=device)
    deep = live.http.post(
        assignment["report_url"],
        content=_nested(100).encode(),
        headers={**device, "Content-Type": "application/json"},
    )

    # The wrong content type is refused before anything is read, and leaves the assignment open.
    assert as_tensors.status_code == 415 and "Content-Type application/json" in as_tensors.json()["detail"]
    assert deep.status_code == 422 and "nests deeper" in deep.json()["detail"]


def test_an_oversized_report_is_refused_declared_or_streamed(live: Live) -> None:
    device = live.enroll()
    assignment = live.checkin(device)
    before = live.state()
    big = live.report + b"\0" * MAX_REPORT_BYTES

    declared = live.http.post(assignment["report_url"], content=big, headers={**device, **OCTETS})
    streamed = live.http.post(
        assignment["report_url"], content=iter([big[:100_000], big[100_000:]]), headers={**device, **OCTETS}
    )

    assert declared.status_code == streamed.status_code == 413
    assert f"limit of {MAX_REPORT_BYTES}" in declared.json()["detail"]
    assert f"limit of {MAX_REPORT_BYTES}" in streamed.json()["detail"]
    assert live.state() == before  # the assignment can still report
    assert (
        live.http.post(
            assignment["report_url"], content=live.report, headers={**device, **OCTETS}
        ).status_code
        == 200
    )


# ---- authentication misuse -----------------------------------------------------------------------


def test_device_routes_refuse_missing_forged_and_admin_tokens(live: Live) -> None:
    owner = live.enroll()
    assignment = live.checkin(owner)
    device_id = owner["Authorization"].removeprefix("Bearer ").split(".")[0]
    before = live.state()
    tokens = {
        "missing": {},
        "no token": {"Authorization": "Bearer"},
        "not bearer": {"Authorization": f"Basic {ADMIN_TOKEN}"},
        "forged secret": {"Authorization": f"Bearer {device_id}.forged"},
        "unknown device": {"Authorization": "Bearer 0123456789abcdef0123456789abcdef.secret"},
        "admin token": ADMIN,
    }

    answers = {
        name: (
            live.http.post(
                "/v1/populations/p/checkin", json={"example_count": 5}, headers=headers
            ).status_code,
            live.http.post(
                assignment["report_url"], content=live.report, headers={**headers, **OCTETS}
            ).status_code,
            live.http.post(assignment["abort_url"], headers=headers).status_code,
            live.http.get("/v1/populations/p/manifest", headers=headers).status_code,
        )
        for name, headers in tokens.items()
    }

    # The admin token acts as no device; it reads the manifest (and the global parameters) only,
    # so that an operator downloads the trained model without enrolling a device.
    expected = {name: (401, 401, 401, 200 if name == "admin token" else 401) for name in tokens}
    assert answers == expected
    assert live.state() == before


def test_admin_routes_refuse_empty_well_known_and_device_tokens(live: Live) -> None:
    tokens = {
        "missing": ({}, 401),
        "no token": ({"Authorization": "Bearer"}, 401),
        "well known": ({"Authorization": "Bearer change-me"}, 403),
        "one character off": ({"Authorization": f"Bearer {ADMIN_TOKEN[:-1]}x"}, 403),
        "a device's": (live.enroll(), 403),
    }

    answers = {
        name: live.http.get("/v1/admin/populations", headers=h).status_code for name, (h, _) in tokens.items()
    }
    upload = live.http.post(
        "/v1/admin/populations",
        content=b"x" * 1000,
        headers={"Content-Type": "multipart/form-data; boundary=b"},
    )

    empty = raw_post(
        live.url, "/v1/admin/populations", {"Authorization": "Bearer ", "Content-Length": "0"}, iter([])
    )

    assert answers == {name: status for name, (_, status) in tokens.items()}
    assert upload.status_code == 401
    assert empty[0] == 401  # an empty bearer is no token, whatever the configured one


@pytest.mark.parametrize(
    "token", [None, "", "   ", "change-me", "test-admin-token", "short-but-random-Zq8", "admin" * 2]
)
def test_a_server_without_a_real_admin_secret_does_not_start(token: str | None) -> None:
    with pytest.raises(AdminTokenError, match="ORCHESTRATOR_ADMIN_TOKEN"):
        create_app(Settings(database_url="sqlite://", admin_token=token))  # type: ignore[arg-type]


def test_serve_without_an_admin_token_exits_with_a_message(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "ORCHESTRATOR_DATABASE_URL": f"sqlite:///{tmp_path / 'x.sqlite'}"}

    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "serve"],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        timeout=60,
    )

    assert done.returncode == 2
    assert b"set ORCHESTRATOR_ADMIN_TOKEN" in done.stderr and b"secrets.token_urlsafe" in done.stderr


# ---- bodies: authenticated first, bounded while streaming --------------------------------------


def raw_post(url: str, path: str, headers: dict[str, str], chunks: Iterator[bytes]) -> tuple[int, bytes, int]:
    """POST over a plain socket: send `chunks` until the server answers; (status, body, bytes sent)."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    head = f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in headers.items()
    )
    sock.sendall((head + "\r\n").encode())
    sent = 0
    answer = b""
    sock.settimeout(0.05)
    for chunk in chunks:
        with contextlib.suppress(TimeoutError):
            answer += sock.recv(65536)
        if answer:
            break
        try:
            sock.sendall(chunk)
        except (TimeoutError, OSError):
            break
        sent += len(chunk)
    sock.settimeout(10)
    try:
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < int(
            re.search(rb"(?i)content-length: (\d+)", answer).group(1)  # type: ignore[union-attr]
        ):
            more = sock.recv(65536)
            if not more:
                break
            answer += more
    except (AttributeError, OSError):
        pass
    sock.close()
    status = int(answer.split(b" ", 2)[1]) if answer else 0
    return status, answer.partition(b"\r\n\r\n")[2], sent


def test_a_300_mb_body_from_a_bogus_token_is_refused_without_being_read(live: Live) -> None:
    declared = {"Content-Type": "application/json", "Content-Length": str(300 * 2**20)}
    started = time.monotonic()

    bogus = raw_post(
        live.url, "/v1/populations/p/checkin", {**declared, "Authorization": "Bearer a.b"}, iter([b"{"])
    )
    too_big = raw_post(live.url, "/v1/populations/p/checkin", {**declared, **live.enroll()}, iter([b"{"]))

    assert bogus[0] == 401 and b"unknown device or wrong token" in bogus[1]
    assert too_big[0] == 413 and b"limit of 65536" in too_big[1]
    assert time.monotonic() - started < 5  # answered on the headers, not after 300 MB


def test_a_streamed_body_is_cut_off_at_the_routes_limit(live: Live) -> None:
    headers = {"Content-Type": "application/json", "Transfer-Encoding": "chunked", **live.enroll()}
    chunk = b"x" * 16384
    chunks = (b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(64 * 64))  # up to 64 MB

    status, body, sent = raw_post(live.url, "/v1/populations/p/checkin", headers, chunks)

    assert status == 413 and b"limit of 65536" in body
    assert sent < 16 * 2**20  # the server stopped reading long before the end


# ---- numbers, documents and settings out of range ------------------------------------------------


def test_checkins_out_of_range_are_refused_with_the_limit(live: Live) -> None:
    device = live.enroll()
    url = "/v1/populations/p/checkin"
    before = live.state()

    huge = live.http.post(url, json={"example_count": 2**63}, headers=device)
    overflow = live.http.post(
        url, content=b'{"example_count": 1e400}', headers={**device, "Content-Type": "application/json"}
    )
    many = live.http.post(
        url, json={"example_count": 5, "conditions": {f"c{i}": True for i in range(33)}}, headers=device
    )
    deep = live.http.post(
        url, content=_nested(5000).encode(), headers={**device, "Content-Type": "application/json"}
    )
    deep_charset = live.http.post(
        url,
        content=_nested(5000).encode(),
        headers={**device, "Content-Type": "application/json; charset=utf-8"},
    )

    assert huge.status_code == 422 and "less than or equal to 2147483647" in huge.text
    assert overflow.status_code == 422 and overflow.json()["errors"][0]["input"] == "inf"
    assert many.status_code == 422 and "at most 32" in many.text
    assert deep.status_code == deep_charset.status_code == 422
    assert "nests deeper than 16" in deep.text and "nests deeper than 16" in deep_charset.text
    assert live.state() == before


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ('{"target_reports": 9223372036854775808}', "less than or equal to 1000000"),
        ('{"round_duration_seconds": Infinity}', "finite number"),
        ('{"oversampling": 1e308}', "less than or equal to 100"),
        ('{"task_config": {"max_examples": 4294967296}}', r"max_examples must be in \[0, 1000000\]"),
        ('{"task_config": {"update_learning_rate": 1e300}}', r"update_learning_rate must be in \[0, 1000\]"),
        ('{"server_optimizer": {"name": "sgd", "learning_rate": 1e300}}', "at most 1e\\+12"),
        ('{"robust_aggregation": "mean"}', "'none', 'trimmed_mean' or 'median'"),
        (json.dumps({"task_config": json.loads(_nested(20))}), "nests deeper than 16"),
        (_nested(5000), "nests deeper than 16"),
    ],
)
def test_population_settings_out_of_range_are_refused(
    live: Live, export: Callable[..., Path], settings: str, expected: str
) -> None:
    response = admin_create_population(live.url, export(BIASED), "bad", settings)

    assert response.status_code == 422, response.text
    assert re.search(expected, response.text), response.text
    assert live.http.get("/v1/admin/populations/bad", headers=ADMIN).status_code == 404


def test_query_and_path_numbers_out_of_range_are_refused(live: Live) -> None:
    device = live.enroll()

    offset = live.http.get("/v1/admin/populations/p/rounds", params={"offset": 2**63}, headers=ADMIN)
    version = live.http.get(f"/v1/populations/p/models/{2**63}/global", headers=device)

    assert offset.status_code == version.status_code == 422
    assert (
        "less than or equal to 2147483647" in offset.text
        and "less than or equal to 2147483647" in version.text
    )


# ---- rate limits ---------------------------------------------------------------------------------


def test_checkins_and_enrollments_beyond_their_rate_get_429_with_retry_after(tmp_path: Path) -> None:
    limits = {
        "enrollment_burst": 3,
        "enrollments_per_second": 0.01,
        "checkin_burst": 2,
        "checkins_per_second": 0.01,
    }
    with (
        Server(tmp_path / "limits.sqlite", settings=limits) as server,
        httpx.Client(base_url=server.url) as http,
    ):
        enrolled = [http.post("/v1/devices") for _ in range(4)]
        device = {"Authorization": f"Bearer {enrolled[0].json()['token']}"}
        other = {"Authorization": f"Bearer {enrolled[1].json()['token']}"}
        checkins = [
            http.post("/v1/populations/p/checkin", json={"example_count": 5}, headers=device)
            for _ in range(3)
        ]
        other_device = http.post("/v1/populations/p/checkin", json={"example_count": 5}, headers=other)

    assert [r.status_code for r in enrolled] == [201, 201, 201, 429]
    assert (
        "at most 3 at once" in enrolled[3].json()["detail"] and int(enrolled[3].headers["Retry-After"]) >= 1
    )
    assert [r.status_code for r in checkins] == [404, 404, 429]  # no population "p": the limit comes first
    assert "too many check-ins from this device" in checkins[2].json()["detail"]
    assert int(checkins[2].headers["Retry-After"]) >= 1
    assert other_device.status_code == 404  # one device's limit is its own


# ---- a database that is locked ---------------------------------------------------------------------


def exchange(sock: socket.socket, request: bytes) -> tuple[int, dict[str, str]]:
    """Send one HTTP/1.1 request on an open connection; (status, headers) of its answer."""
    sock.sendall(request)
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(65536)
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", "0")):
        body += sock.recv(65536)
    return int(lines[0].split(" ")[1]), headers


def test_a_locked_database_gets_503_while_health_answers_and_the_connection_survives(tmp_path: Path) -> None:
    import sqlite3
    from concurrent.futures import ThreadPoolExecutor

    database = tmp_path / "locked.sqlite"
    enroll = b"POST /v1/devices HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
    busy = 1.5  # how long a request waits for the lock before its 503
    settings = {"database_busy_seconds": busy}
    with Server(database, settings=settings) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        device = {"Authorization": f"Bearer {http.post('/v1/devices').json()['token']}"}
        keep_alive = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        locker = sqlite3.connect(database, isolation_level=None)
        locker.execute("BEGIN IMMEDIATE")  # another process's writer, stalled
        try:
            with ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(
                    httpx.post,
                    f"{server.url}/v1/populations/p/checkin",
                    json={"example_count": 5},
                    headers=device,
                    timeout=30,
                )
                time.sleep(0.1)  # the check-in is now waiting for the lock
                started = time.monotonic()
                health = http.get("/health")
                health_seconds = time.monotonic() - started
                checkin = waiting.result()
            locked = [http.get("/v1/admin/populations", headers=ADMIN)]
            on_keep_alive = exchange(keep_alive, enroll)
            locked_seconds = time.monotonic() - started
        finally:
            locker.rollback()
            locker.close()
        after = exchange(keep_alive, enroll)  # the same connection, after its 503
        keep_alive.close()

    assert health.status_code == 200 and health_seconds < busy / 2  # not behind the check-in's wait
    assert [r.status_code for r in [checkin, *locked]] == [503, 503]
    assert all(int(r.headers["Retry-After"]) >= 1 and "database" in r.json()["detail"] for r in locked)
    assert locked_seconds < 4 * busy  # each waited about database_busy_seconds, not 30 s as before
    assert on_keep_alive[0] == 503 and on_keep_alive[1].get("connection") != "close"
    assert after[0] == 201
