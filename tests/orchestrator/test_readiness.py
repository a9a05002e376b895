"""A server restarted on a database with history does its start-up work (the rounds whose deadline
passed while it was down, each population's settings and model parsed) before it answers, so the
first requests once it answers are served, not 503 "database busy"; `/health` is liveness and
`/health/ready` readiness. Over real HTTP against a real server on a real SQLite file."""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from model_export.config import ModelConfig
from tests.conftest import BIASED
from tests.orchestrator.conftest import ADMIN_TOKEN, Server, admin_create_population

POPULATIONS = 30
SETTINGS = json.dumps({"target_reports": 3, "min_reports": 3, "round_duration_seconds": 1})


def enroll(url: str) -> str:
    answer = httpx.post(f"{url}/v1/devices", timeout=30)
    assert answer.status_code == 201, answer.text
    return str(answer.json()["token"])


def checkin(url: str, population: str, token: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/populations/{population}/checkin",
        json={"example_count": 20},
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
    )


def newest_deadline(url: str, population: str) -> float:
    answer = httpx.get(
        f"{url}/v1/admin/populations/{population}/rounds",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    return max(float(r["deadline"]) for r in answer.json())


def test_the_first_requests_after_a_restart_with_history_are_served(
    tmp_path: Path, export: Callable[[ModelConfig], Path]
) -> None:
    # Prepare: populations whose rounds have devices in them, their deadlines a second away.
    names = [f"p{i}" for i in range(POPULATIONS)]
    server = Server(tmp_path / "orchestrator.sqlite")
    with server:
        for name in names:
            created = admin_create_population(server.url, export(BIASED), name, SETTINGS)
            assert created.status_code == 201, created.text
        # Two devices a population (a device's check-ins are rate limited).
        tokens = {name: [enroll(server.url) for _ in range(2)] for name in names}
        for name in names:
            assert [checkin(server.url, name, token).status_code for token in tokens[name]] == [200, 200]
        deadline = max(newest_deadline(server.url, name) for name in names)
    while time.time() <= deadline + 0.5:  # every round's deadline passes while the server is down
        time.sleep(0.1)

    # Execute: the first requests as soon as the restarted server answers.
    with server:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            first = list(pool.map(lambda name: checkin(server.url, name, tokens[name][0]), names))
        enrolled = httpx.post(f"{server.url}/v1/devices", timeout=30)
        ready = httpx.get(f"{server.url}/health/ready", timeout=30)
        live = httpx.get(f"{server.url}/health", timeout=30)

    # Check
    assert [c.status_code for c in first] == [200] * POPULATIONS, [
        c.text for c in first if c.status_code != 200
    ]
    assert enrolled.status_code == 201, enrolled.text
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}, ready.text
    assert live.status_code == 200 and live.json() == {"status": "ok"}, live.text
