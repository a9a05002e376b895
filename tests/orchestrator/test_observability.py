"""What an operator sees of a simulated run: /metrics moves as the run did, and the JSON log lines
name populations, rounds and assignments but never a token, a parameter or an example."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from safetensors.numpy import load

from android_sim.run import run_async
from device_runtime.orchestrator_client import OrchestratorClient
from model_export.config import ModelConfig
from orchestrator.local import LocalOrchestrator
from tests.android_sim.test_run import small, work  # noqa: F401  (work: the fixture)
from tests.conftest import BIASED, ROOT
from tests.orchestrator.conftest import ADMIN_TOKEN, admin_create_population

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str, token: str = ADMIN_TOKEN) -> Samples:
    response = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert response.status_code == 200, response.text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def admin_rounds(url: str, population: str) -> list[dict[str, Any]]:
    response = httpx.get(
        f"{url}/v1/admin/populations/{population}/rounds",
        params={"limit": 1000},
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=10,
    )
    assert response.status_code == 200, response.text
    return list(response.json())


def settled(url: str, population: str) -> tuple[Samples, list[dict[str, Any]]]:
    """/metrics and the rounds as one consistent picture: the server's deadline ticker may still
    close a round, so scrape between two identical readings of the rounds."""
    for _ in range(20):
        before = admin_rounds(url, population)
        samples = scrape(url)
        if admin_rounds(url, population) == before:
            return samples, before
    raise AssertionError("the rounds kept changing")


@dataclass
class Observed:
    """A server that logs at debug (a line per request too), and what the devices sent it."""

    server: LocalOrchestrator
    tokens: set[str] = field(default_factory=set)
    bodies: list[bytes] = field(default_factory=list)


@pytest.fixture
def observed(work: Path, monkeypatch: pytest.MonkeyPatch) -> Observed:  # noqa: F811
    server = LocalOrchestrator(
        f"sqlite:///{work / 'server.sqlite'}",
        ADMIN_TOKEN,
        log_path=work / "server.log",
        env={"ORCHESTRATOR_LOG_LEVEL": "debug"},
    )
    seen = Observed(server)
    request = OrchestratorClient._request

    async def recording_request(
        self: OrchestratorClient, method: str, path: str, **kwargs: Any
    ) -> httpx.Response:
        if isinstance(kwargs.get("content"), bytes):
            seen.bodies.append(kwargs["content"])
        response = await request(self, method, path, **kwargs)
        if path == "/v1/devices":  # enrollment: the device's token
            seen.tokens.add(response.json()["token"])
        return response

    monkeypatch.setattr(OrchestratorClient, "_request", recording_request)
    return seen


def test_metrics_move_as_a_simulated_run_did(observed: Observed, work: Path) -> None:  # noqa: F811
    server = observed.server
    config = small(
        work, orchestrator_url=server.url, admin_token=ADMIN_TOKEN, population="observed", rounds=3
    )
    with server.start():
        before = scrape(server.url)

        asyncio.run(run_async(config, Console(width=120)))
        after, rounds = settled(server.url, "observed")

    def moved(name: str, **labels: str) -> float:
        return total(after, name, population="observed", **labels) - total(before, name, **labels)

    def summed(counter: str) -> int:
        return sum(r["counters"][counter] for r in rounds)

    committed = [r for r in rounds if r["status"] == "committed"]
    committed_training = [r for r in committed if r["kind"] == "training"]
    assert len(committed_training) >= 3
    assert moved("orchestrator_rounds_total", transition="opened") == len(rounds)
    assert moved("orchestrator_rounds_total", transition="committed") == len(committed)
    assert moved("orchestrator_rounds_total", transition="abandoned") == sum(
        r["status"] == "abandoned" for r in rounds
    )
    assert moved("orchestrator_aggregation_duration_seconds_count") == len(committed_training)
    assert moved("orchestrator_checkins_total", answer="accepted") == summed("accepted")
    assert moved("orchestrator_checkins_total", answer="full") == summed("rejected_capacity")
    assert moved("orchestrator_checkins_total", answer="too_few_examples") == summed("rejected_min_examples")
    assert summed("rejected_min_examples") > 0  # the run has devices under min_examples
    assert moved("orchestrator_reports_total", outcome="accepted") == summed("reported")
    assert moved("orchestrator_reports_total", outcome="late") == summed("late")
    assert moved("orchestrator_reports_total", outcome="invalid") == summed("invalid")
    assert moved("orchestrator_aborts_total") == summed("aborted")
    assert moved("orchestrator_assignments_dropped_total") == summed("dropped")
    reports_ok = total(
        after,
        "orchestrator_http_requests_total",
        route="/v1/assignments/{assignment_id}/report",
        status="200",
    )
    assert reports_ok == summed("reported")
    assert total(after, "orchestrator_http_request_duration_seconds_count", method="POST") > 0
    assert not [
        k
        for k, v in after.items()
        if k[0] == "orchestrator_http_requests_total" and v and dict(k[1])["status"].startswith("5")
    ]


def test_the_rounds_counter_is_the_admin_apis_rounds_while_rounds_open_and_close(
    work: Path,  # noqa: F811
    export: Callable[[ModelConfig], Path],
) -> None:
    # Rounds of 0.3 s that nobody fills: the deadline ticker abandons one and opens the next
    # about three times a second, in its own thread, while the test scrapes.
    settings = json.dumps({"target_reports": 2, "min_reports": 2, "round_duration_seconds": 0.3})
    with LocalOrchestrator(f"sqlite:///{work / 'server.sqlite'}", ADMIN_TOKEN, tick_seconds=0.05) as server:
        created = admin_create_population(server.url, export(BIASED), "ticking", settings)
        assert created.status_code == 201, created.text
        compared, listed = 0, list[dict[str, Any]]()
        deadline = time.monotonic() + 120
        while (compared < 20 or not any(r["status"] == "abandoned" for r in listed)) and (
            time.monotonic() < deadline
        ):
            samples, listed = settled(server.url, "ticking")
            for transition, status in (
                ("opened", None),
                ("committed", "committed"),
                ("abandoned", "abandoned"),
            ):
                expected = sum(status is None or r["status"] == status for r in listed)
                assert total(
                    samples, "orchestrator_rounds_total", population="ticking", transition=transition
                ) == (expected), (transition, listed)
            compared += 1

    assert compared >= 20
    assert sum(r["status"] == "abandoned" for r in listed) >= 1


def test_logs_name_rounds_and_assignments_but_no_secrets(observed: Observed, work: Path) -> None:  # noqa: F811
    server = observed.server
    config = small(work, orchestrator_url=server.url, admin_token=ADMIN_TOKEN, population="logged", rounds=2)
    with server.start():
        asyncio.run(run_async(config, Console(width=120)))
        tokens = sorted(observed.tokens)
        population = httpx.get(
            f"{server.url}/v1/admin/populations/logged", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        ).json()
        version = population["current_version"]
        params = httpx.get(
            f"{server.url}/v1/populations/logged/models/{version}/global",
            headers={"Authorization": f"Bearer {tokens[0]}"},
        ).content

    log = (work / "server.log").read_bytes()
    lines = [json.loads(line) for line in log.decode().splitlines()]
    assert all({"time", "level", "logger", "message", "pid"} <= set(line) for line in lines)
    committed = [line for line in lines if line["message"] == "round committed"]
    assert len(committed) >= 2 and all(isinstance(line["round_id"], int) for line in committed)
    assert all(line["population"] == "logged" for line in committed)
    reports = [line for line in lines if line.get("route") == "/v1/assignments/{assignment_id}/report"]
    assert reports and all(len(line["assignment_id"]) == 32 for line in reports)
    # No credential, whole or its secret half.
    assert len(tokens) == 60  # every device of the run
    assert ADMIN_TOKEN.encode() not in log
    for token in tokens:
        assert token.encode() not in log and token.partition(".")[2].encode() not in log
    # No parameters, neither the model's nor the deltas the devices sent: not their bytes, nor
    # those bytes in hex or base64, nor their values as text, nor a report's metadata.
    assert len(observed.bodies) >= 2 * 6
    for blob in [params, *observed.bodies]:
        assert_not_in_log(load(blob), log)
        metadata = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")]).get("__metadata__", {})
        assert all(value.encode() not in log for value in metadata.values() if len(value) > 8)


def assert_not_in_log(tensors: dict[str, np.ndarray], log: bytes) -> None:
    for name, tensor in tensors.items():
        raw = np.ascontiguousarray(tensor).tobytes()
        for start in range(0, min(len(raw), 2048) - 16, 16):
            chunk = raw[start : start + 16]
            assert chunk not in log and chunk.hex().encode() not in log, name
            assert base64.b64encode(chunk)[:20] not in log, name
        if tensor.dtype == np.float32:
            values = [
                v for v in tensor.ravel()[:100] if len(str(v)) >= 8
            ]  # too short a text could be anything
            assert not [v for v in values if str(v).encode() in log or repr(float(v)).encode() in log], name


def test_metrics_take_the_metrics_token_or_the_admin_token(tmp_path: Path) -> None:
    server = LocalOrchestrator(
        f"sqlite:///{tmp_path / 'server.sqlite'}",
        ADMIN_TOKEN,
        env={"ORCHESTRATOR_METRICS_TOKEN": "scraper-secret"},
    )
    with server.start():
        device = httpx.post(f"{server.url}/v1/devices", timeout=10).json()["token"]

        def get(path: str, token: str | None) -> int:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            return httpx.get(f"{server.url}{path}", headers=headers, timeout=10).status_code

        answers = {
            "none": get("/metrics", None),
            "device": get("/metrics", device),
            "metrics": get("/metrics", "scraper-secret"),
            "admin": get("/metrics", ADMIN_TOKEN),
            "metrics token on the admin API": get("/v1/admin/populations", "scraper-secret"),
        }

    assert answers == {
        "none": 401,
        "device": 403,
        "metrics": 200,
        "admin": 200,
        "metrics token on the admin API": 403,
    }


def test_several_processes_need_postgresql(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'server.sqlite'}"

    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "--database-url", url, "serve", "--workers", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert done.returncode == 2
    assert "--workers 2 needs a PostgreSQL database" in done.stderr and "Traceback" not in done.stderr


def test_a_library_warning_is_a_json_line_too() -> None:
    # Prepare: a process configured as the server configures its workers.
    script = (
        "import logging, logging.config\n"
        "from orchestrator.observability.logs import log_config\n"
        "logging.config.dictConfig(log_config('info', 'warning'))\n"
        "logging.getLogger('psycopg').warning('error ignored terminating %s', 'pipeline')\n"
    )

    # Execute
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )

    # Assert: one JSON object, not logging's raw last-resort text.
    (line,) = done.stderr.splitlines()
    record = json.loads(line)
    assert (record["logger"], record["level"], record["message"]) == (
        "psycopg",
        "warning",
        "error ignored terminating pipeline",
    )
