"""The HTTP surface: authentication, malformed requests, the CLI, and a client that outlives a down server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from contracts.manifest import load_manifest
from contracts.params import encode_sparse_delta
from contracts.task_config import TaskConfig
from device_runtime.orchestrator_client import OrchestratorClient
from device_runtime.protocol_errors import ProtocolError, ServerUnavailable
from model_export.config import ModelConfig
from orchestrator.local import free_port
from tests.conftest import BIASED, ROOT
from tests.orchestrator.conftest import ADMIN_TOKEN, OCTETS, Server, admin_create_population


def enroll(url: str) -> str:
    response = httpx.post(f"{url}/v1/devices", timeout=10)
    assert response.status_code == 201
    return str(response.json()["token"])


@pytest.fixture
def population(server: Server, export: Callable[[ModelConfig], Path]) -> str:
    created = admin_create_population(
        server.url, export(BIASED), "p", json.dumps({"target_reports": 2, "min_examples": 3})
    )
    assert created.status_code == 201, created.text
    return "p"


def test_docs_and_openapi_are_served(server: Server) -> None:
    assert httpx.get(f"{server.url}/docs", timeout=10).status_code == 200
    paths = httpx.get(f"{server.url}/openapi.json", timeout=10).json()["paths"]
    assert {
        "/v1/devices",
        "/v1/populations/{population}/checkin",
        "/v1/assignments/{assignment_id}/report",
    } <= set(paths)


def test_authentication_is_required_and_checked(server: Server, population: str) -> None:
    url = f"{server.url}/v1/populations/{population}/checkin"
    body = {"example_count": 10}

    missing = httpx.post(url, json=body, timeout=10)
    wrong = httpx.post(url, json=body, headers={"Authorization": "Bearer abc.def"}, timeout=10)
    not_admin = httpx.get(
        f"{server.url}/v1/admin/populations",
        headers={"Authorization": f"Bearer {enroll(server.url)}"},
        timeout=10,
    )

    assert (missing.status_code, wrong.status_code, not_admin.status_code) == (401, 401, 403)
    assert "Authorization" in missing.json()["detail"]


def test_malformed_checkins_say_what_was_expected(server: Server, population: str) -> None:
    headers = {"Authorization": f"Bearer {enroll(server.url)}"}
    url = f"{server.url}/v1/populations/{population}/checkin"

    negative = httpx.post(url, json={"example_count": -1}, headers=headers, timeout=10)
    extra = httpx.post(url, json={"example_count": 5, "items": [1, 2, 3]}, headers=headers, timeout=10)
    unknown = httpx.post(
        f"{server.url}/v1/populations/nope/checkin", json={"example_count": 5}, headers=headers, timeout=10
    )
    too_few = httpx.post(url, json={"example_count": 2}, headers=headers, timeout=10)
    json_headers = {**headers, "Content-Type": "application/json"}
    not_a_number = httpx.post(url, content=b'{"example_count": NaN}', headers=json_headers, timeout=10)

    assert negative.status_code == 422 and "greater than or equal to 0" in negative.text
    assert not_a_number.status_code == 422, not_a_number.text  # was a 500: NaN cannot be echoed as JSON
    # One body for every refusal: a line in `detail`, and for a validation failure each part in `errors`.
    assert not_a_number.json()["detail"].startswith("invalid request: body.example_count: ")
    (problem,) = not_a_number.json()["errors"]
    assert problem["loc"] == ["body", "example_count"] and problem["input"] == "nan"
    assert extra.status_code == 422 and "items" in extra.text  # examples are never accepted
    assert unknown.status_code == 404
    assert too_few.status_code == 200 and too_few.json()["accepted"] is False
    assert int(too_few.headers["Retry-After"]) >= 1


def test_a_json_body_that_is_not_utf8_is_refused_as_content(server: Server, population: str) -> None:
    # FastAPI answers a body json.loads cannot decode (not UTF-8) with a bare 400 "There was an
    # error parsing the body", which no route documents; it is content the route cannot take.
    not_utf8 = b'{"example_count": "\xc9\xfe"}'
    checkin = httpx.post(
        f"{server.url}/v1/populations/{population}/checkin",
        content=not_utf8,
        headers={"Authorization": f"Bearer {enroll(server.url)}", "Content-Type": "application/json"},
        timeout=10,
    )
    declared = httpx.post(  # FastAPI's own body handling rather than the route's shortcut
        f"{server.url}/v1/populations/{population}/checkin",
        content=b"\xff",
        headers={
            "Authorization": f"Bearer {enroll(server.url)}",
            "Content-Type": "application/json; charset=utf-8",
        },
        timeout=10,
    )

    assert checkin.status_code == declared.status_code == 422, (checkin.text, declared.text)
    assert checkin.json()["detail"] == (
        "invalid request: body: not UTF-8 (byte 19 is 0xc9); expected a JSON document in UTF-8"
    )
    assert declared.json()["errors"][0]["loc"] == ["body"]
    assert "byte 0 is 0xff" in declared.json()["detail"]


def test_a_checkin_gets_the_same_answer_however_its_json_is_declared(server: Server, population: str) -> None:
    # A plain `application/json` check-in takes the route's shortcut; any other JSON content
    # type goes through FastAPI's own body handling.
    headers = {"Authorization": f"Bearer {enroll(server.url)}"}
    url = f"{server.url}/v1/populations/{population}/checkin"
    body = json.dumps({"example_count": 10}).encode()

    plain = httpx.post(url, content=body, headers={**headers, "Content-Type": "application/json"}, timeout=10)
    declared = httpx.post(
        url, content=body, headers={**headers, "Content-Type": "application/json; charset=utf-8"}, timeout=10
    )
    other_device = httpx.post(
        url,
        content=body,
        headers={
            "Authorization": f"Bearer {enroll(server.url)}",
            "Content-Type": "application/json; charset=utf-8",
        },
        timeout=10,
    )

    assert plain.status_code == declared.status_code == other_device.status_code == 200
    assert plain.headers["content-type"] == declared.headers["content-type"] == "application/json"
    first, again, other = plain.json(), declared.json(), other_device.json()
    assert first["accepted"] and again == {**first, "seconds_left": again["seconds_left"]}
    assert other["accepted"] and set(other) == set(first) and other["assignment_id"] != first["assignment_id"]


def test_report_errors_over_http(server: Server, population: str) -> None:
    token = enroll(server.url)
    headers = {"Authorization": f"Bearer {token}"}
    assignment = httpx.post(
        f"{server.url}/v1/populations/{population}/checkin",
        json={"example_count": 10},
        headers=headers,
        timeout=10,
    ).json()

    unknown = httpx.post(
        f"{server.url}/v1/assignments/nope/report", content=b"x", headers={**headers, **OCTETS}, timeout=10
    )
    other = httpx.post(
        f"{server.url}{assignment['report_url']}",
        content=b"x",
        headers={"Authorization": f"Bearer {enroll(server.url)}"},
        timeout=10,
    )
    garbage = httpx.post(
        f"{server.url}{assignment['report_url']}",
        content=b"\x00" * 100,
        headers={**headers, **OCTETS},
        timeout=10,
    )
    after = httpx.post(
        f"{server.url}{assignment['report_url']}",
        content=b"\x00" * 100,
        headers={**headers, **OCTETS},
        timeout=10,
    )

    assert (unknown.status_code, other.status_code, garbage.status_code, after.status_code) == (
        404,
        403,
        422,
        409,
    )
    assert "safetensors" in garbage.json()["detail"]
    status = httpx.get(
        f"{server.url}/v1/admin/populations/{population}",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=10,
    ).json()
    assert status["open_rounds"][0]["counters"]["invalid"] == 1
    assert status["current_version"] == 0


def test_an_abandoned_round_says_why_in_the_rounds_listing_and_the_status(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    settings = {"target_reports": 2, "min_reports": 2, "round_duration_seconds": 1}
    created = admin_create_population(server.url, export(BIASED), "idle", json.dumps(settings))
    assert created.status_code == 201, created.text
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the server's ticker closes the round at its deadline
        listed = httpx.get(f"{server.url}/v1/admin/populations/idle/rounds", headers=admin, timeout=10)
        closed = [r for r in listed.json() if r["status"] != "open"]
        if closed:
            break
        time.sleep(0.2)
    status = httpx.get(f"{server.url}/v1/admin/populations/idle", headers=admin, timeout=10).json()

    first = closed[-1]
    assert first["status"] == "abandoned"
    assert (first["stopped_phase"], first["devices_had"], first["devices_needed"], first["ended_by"]) == (
        "reporting",
        0,
        2,
        "deadline",
    )
    assert "no device checked in" in first["close_reason"]
    (shown,) = [r for r in status["recent_rounds"] if r["id"] == first["id"]]
    assert shown["close_reason"] == first["close_reason"]
    assert all(r["close_reason"] == "" for r in status["open_rounds"])
    assert status["idle_rounds"] >= 1  # no device came: the population backs off (idle_backoff)


def test_an_operator_opens_an_evaluation_round_for_as_long_as_it_asks(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    # Prepare: a population whose evaluation rounds take reports for 10 s
    settings = {"target_reports": 2, "evaluation_round_duration_seconds": 10}
    created = admin_create_population(server.url, export(BIASED), "p", json.dumps(settings))
    assert created.status_code == 201, created.text
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    url = f"{server.url}/v1/admin/populations/p/evaluations"

    # Execute: durations out of range, then a day (devices that take part only at night)
    zero = httpx.post(url, params={"duration_seconds": 0}, headers=admin, timeout=10)
    text = httpx.post(url, params={"duration_seconds": "a day"}, headers=admin, timeout=10)
    opened = httpx.post(url, params={"duration_seconds": 86_400}, headers=admin, timeout=10)

    # Assert: the refusals are one line each and open nothing; the round has its own deadline
    assert (zero.status_code, text.status_code) == (422, 422)
    assert "duration_seconds" in zero.json()["detail"] and "\n" not in zero.json()["detail"]
    assert opened.status_code == 201, opened.text
    round_ = opened.json()
    assert round_["deadline"] - round_["opened_at"] == pytest.approx(86_400)
    rounds_url = f"{server.url}/v1/admin/populations/p/rounds"
    listed = httpx.get(rounds_url, params={"kind": "evaluation"}, headers=admin, timeout=10)
    assert [r["id"] for r in listed.json()] == [round_["id"]]


def test_artifact_and_params_downloads(
    server: Server, population: str, export: Callable[[ModelConfig], Path]
) -> None:
    headers = {"Authorization": f"Bearer {enroll(server.url)}"}
    assignment = httpx.post(
        f"{server.url}/v1/populations/{population}/checkin",
        json={"example_count": 10},
        headers=headers,
        timeout=10,
    ).json()

    artifact = httpx.get(f"{server.url}{assignment['artifact_url']}", timeout=10)
    params = httpx.get(f"{server.url}{assignment['params_url']}", headers=headers, timeout=10)
    missing = httpx.get(
        f"{server.url}/v1/populations/{population}/models/99/global", headers=headers, timeout=10
    )

    assert artifact.content == (export(BIASED) / "model.tflite").read_bytes()
    assert "immutable" in artifact.headers["Cache-Control"]
    assert params.content == (export(BIASED) / "global_params.safetensors").read_bytes()
    assert missing.status_code == 404
    assert "has no model version 99; the current version is 0" in missing.json()["detail"]


def test_a_pruned_model_version_is_a_404_that_says_so(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    settings = {"target_reports": 1, "keep_model_versions": 1}
    assert admin_create_population(server.url, export(BIASED), "q", json.dumps(settings)).status_code == 201
    manifest = load_manifest(export(BIASED))
    zero = {s.name: np.zeros(s.shape, np.float32) for s in manifest.global_params}
    body = encode_sparse_delta(zero, {"num_examples": "5", "metrics": "{}"})
    for _ in range(2):
        headers = {"Authorization": f"Bearer {enroll(server.url)}"}
        assignment = httpx.post(
            f"{server.url}/v1/populations/q/checkin", json={"example_count": 10}, headers=headers, timeout=10
        ).json()
        sent = httpx.post(
            f"{server.url}{assignment['report_url']}", content=body, headers={**headers, **OCTETS}, timeout=10
        )
        assert sent.status_code == 200, sent.text

    def download(version: int) -> httpx.Response:
        return httpx.get(
            f"{server.url}/v1/populations/q/models/{version}/global", headers=headers, timeout=10
        )

    assert [download(v).status_code for v in (0, 2)] == [200, 200]
    pruned = download(1)
    assert pruned.status_code == 404
    assert "model version 1 of population 'q' was pruned" in pruned.json()["detail"]
    assert "the current version is 2" in pruned.json()["detail"]


def test_duplicate_population_and_bad_uploads(
    server: Server, population: str, export: Callable[[ModelConfig], Path], tmp_path: Path
) -> None:
    again = admin_create_population(server.url, export(BIASED), population, "{}")
    bad_settings = admin_create_population(server.url, export(BIASED), "q", json.dumps({"oversampling": 0.5}))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for name in ("model.tflite", "manifest.json", "global_params.safetensors"):
        (corrupt / name).write_bytes((export(BIASED) / name).read_bytes())
    (corrupt / "model.tflite").write_bytes(b"garbage")
    bad_model = admin_create_population(server.url, corrupt, "r", "{}")

    assert again.status_code == 409
    assert bad_settings.status_code == 422 and "oversampling" in bad_settings.text
    assert bad_model.status_code == 422 and "sha256" in bad_model.text


def test_cli_creates_a_population_and_prints_status(
    export: Callable[[ModelConfig], Path], tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'cli.sqlite'}"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "orchestrator", "--database-url", url, *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )

    created = cli(
        "create-population",
        "movies",
        "--model-dir",
        str(export(BIASED)),
        "--settings",
        '{"target_reports": 4}',
    )
    status = cli("status", "movies")
    missing_dir = cli("create-population", "x", "--model-dir", str(tmp_path / "nope"))
    unknown = cli("status", "nope")
    no_file = cli("create-population", "y", "--model-dir", str(export(BIASED)), "--settings", "@missing.json")
    contradicting = cli(  # the secure aggregation tutorial names this refusal
        "create-population",
        "z",
        "--model-dir",
        str(export(BIASED)),
        "--settings",
        '{"target_reports": 4, "min_reports": 2, "aggregation": "secure"}',
    )

    assert created.returncode == 0, created.stderr
    assert json.loads(status.stdout)["settings"]["target_reports"] == 4
    assert missing_dir.returncode == 2 and "not an exported model directory" in missing_dir.stderr
    assert unknown.returncode == 2 and "no population" in unknown.stderr
    assert no_file.returncode == 2, no_file.stderr
    assert no_file.stderr.splitlines() == [
        "error: --settings @missing.json: cannot read missing.json: No such file or directory "
        "(expected a JSON file)"
    ]
    assert contradicting.returncode == 2
    assert contradicting.stderr.splitlines() == [  # one line, without pydantic's echo of the input
        "error: invalid settings: secure aggregation needs min_reports >= 3 (a sum of one or two inputs "
        "reveals them), got 2"
    ]


def test_client_waits_for_a_server_that_is_down_then_gives_up_clearly(tmp_path: Path) -> None:
    port = free_port()

    async def enroll_while_starting() -> str:
        client = OrchestratorClient(f"http://127.0.0.1:{port}", attempts=12, backoff_seconds=0.5)
        try:
            return await client.enroll()
        finally:
            await client.aclose()

    async def nobody_home() -> None:
        client = OrchestratorClient(f"http://127.0.0.1:{free_port()}", attempts=3, backoff_seconds=0.01)
        try:
            await client.enroll()
        finally:
            await client.aclose()

    late = Server(tmp_path / "late.sqlite", port=port)

    async def both() -> str:
        task = asyncio.create_task(enroll_while_starting())
        await asyncio.sleep(1.0)
        await asyncio.to_thread(late.start)
        return await task

    started = time.time()
    try:
        device_id = asyncio.run(both())
    finally:
        late.stop()
    assert len(device_id) == 32 and time.time() - started < 120
    with pytest.raises(ServerUnavailable, match="after 3 attempts"):
        asyncio.run(nobody_home())


def test_protocol_errors_carry_the_servers_reason(server: Server) -> None:
    async def bad() -> None:
        client = OrchestratorClient(server.url)
        try:
            await client.enroll()
            await client.checkin("nope", 5)
        finally:
            await client.aclose()

    with pytest.raises(ProtocolError, match="404: no population 'nope'"):
        asyncio.run(bad())


def test_an_adaptive_dp_population_sends_each_round_its_clip_norm_and_shows_its_privacy(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    # No noise, so the clip norm's step is exact: one unclipped report against a target of 0.5.
    dp = {
        "clip_norm": 10.0,
        "noise_multiplier": 0.0,
        "population_size": 100,
        "target_unclipped_quantile": 0.5,
        "clipped_count_stddev": 0.0,
    }
    model_dir = export(BIASED)
    settings = json.dumps({"target_reports": 1, "differential_privacy": dp})
    assert admin_create_population(server.url, model_dir, "dp", settings).status_code == 201
    manifest = load_manifest(model_dir)
    delta = {s.name: np.full(s.shape, 0.01, np.float32) for s in manifest.global_params}
    body = encode_sparse_delta(delta, {"num_examples": "5", "metrics": json.dumps({"dp_within_clip": 1.0})})

    def checkin() -> tuple[dict[str, Any], dict[str, str]]:
        headers = {"Authorization": f"Bearer {enroll(server.url)}"}
        url = f"{server.url}/v1/populations/dp/checkin"
        return httpx.post(url, json={"example_count": 10}, headers=headers, timeout=10).json(), headers

    first, headers = checkin()
    reported = httpx.post(
        f"{server.url}{first['report_url']}", content=body, headers={**headers, **OCTETS}, timeout=10
    )
    second, _ = checkin()
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    status = httpx.get(f"{server.url}/v1/admin/populations/dp", headers=admin, timeout=10).json()

    assert reported.status_code == 200, reported.text
    assert first["task_config"]["clip_norm"] == 10.0 and first["task_config"]["report_within_clip"]
    assert second["task_config"]["clip_norm"] == pytest.approx(10.0 * np.exp(-0.1))
    assert status["training_rounds_committed"] == 1
    assert (
        status["privacy"]["epsilon"] is None
        and "no differential privacy guarantee" in status["privacy"]["message"]
    )


def test_a_check_in_after_the_privacy_budget_is_spent_is_a_200_rejection_for_a_day_as_documented(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    # Prepare: a budget of exactly one round, spent by one device's report.
    from orchestrator.aggregation.differential_privacy import epsilon

    model_dir = export(BIASED)
    dp = {"clip_norm": 1.0, "noise_multiplier": 1.0, "population_size": 100}
    budget = epsilon(1.0, 1 / 100, 1, 1e-5)
    settings = json.dumps({"target_reports": 1, "differential_privacy": {**dp, "epsilon_budget": budget}})
    assert admin_create_population(server.url, model_dir, "dp", settings).status_code == 201
    manifest = load_manifest(model_dir)
    zero = {s.name: np.zeros(s.shape, np.float32) for s in manifest.global_params}
    headers = {"Authorization": f"Bearer {enroll(server.url)}"}
    url = f"{server.url}/v1/populations/dp/checkin"
    first = httpx.post(url, json={"example_count": 10}, headers=headers, timeout=10).json()
    body = encode_sparse_delta(zero, {"num_examples": "5", "metrics": "{}"})
    binary = {**headers, "Content-Type": "application/octet-stream"}
    assert httpx.post(
        f"{server.url}{first['report_url']}", content=body, headers=binary, timeout=10
    ).is_success

    # Execute
    again = httpx.post(
        url, json={"example_count": 10}, headers={"Authorization": f"Bearer {enroll(server.url)}"}, timeout=10
    )
    documented = httpx.get(f"{server.url}/openapi.json", timeout=10).json()

    # Assert: the behaviour, and the documentation says the same (and no 409 for it).
    assert again.status_code == 200 and again.headers["Retry-After"] == "86400"
    assert again.json()["accepted"] is False and "privacy budget spent" in again.json()["reason"]
    description = documented["paths"]["/v1/populations/{population}/checkin"]["post"]["description"]
    assert (
        "privacy budget" in description and "Retry-After: 86400" in description and "409" not in description
    )
    settings_doc = json.dumps(documented["components"]["schemas"])
    assert "Retry-After 86400" in settings_doc or "Retry-After: 86400" in settings_doc


def test_a_device_reads_the_populations_task_config_to_serve_as_training_does(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    # Prepare: a population whose devices reconstruct otherwise than the export's defaults
    task = {"reconstruction_learning_rate": 0.25, "negatives_per_positive": 7}
    created = admin_create_population(server.url, export(BIASED), "p", json.dumps({"task_config": task}))
    assert created.status_code == 201, created.text

    async def read() -> TaskConfig:
        client = OrchestratorClient(server.url)
        try:
            await client.enroll()
            return await client.task_config("p")
        finally:
            await client.aclose()

    # Execute
    found = asyncio.run(read())
    anonymous = httpx.get(f"{server.url}/v1/populations/p/task-config", timeout=10)
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    unknown = httpx.get(f"{server.url}/v1/populations/nope/task-config", headers=admin, timeout=10)

    # Assert: the population's settings, parsed as the device's task; a token is needed; 404 names it
    assert (found.reconstruction_learning_rate, found.negatives_per_positive) == (0.25, 7)
    assert anonymous.status_code == 401
    assert unknown.status_code == 404 and "no population 'nope'" in unknown.json()["detail"]
