"""Buffered asynchronous rounds (FedBuff) over real HTTP: devices check in while fewer than the
concurrency train, reports go into the buffer open when they arrive weighted by their staleness,
too stale ones are refused, and a buffer commits once at K reports however reports race (one
process on SQLite; with TEST_POSTGRES_URL, two processes on one PostgreSQL)."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from pydantic import ValidationError
from sqlalchemy import create_engine, text

from contracts.manifest import load_manifest
from contracts.params import encode_sparse_delta
from model_export.config import ModelConfig
from orchestrator.console import render
from orchestrator.populations.settings import PopulationSettings, settings_problems
from tests.conftest import BIASED
from tests.orchestrator.conftest import ADMIN_TOKEN, OCTETS, Server, admin_create_population
from tests.orchestrator.test_several_processes import Deployment, deployment, rounds_of

__all__ = ["deployment"]  # the fixture, shared with the synchronous rounds' invariants

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def body_for(model_dir: Path, num_examples: int = 20) -> bytes:
    rng = np.random.default_rng(0)
    delta = {
        s.name: (rng.normal(0, 0.01, s.shape) * (rng.random(s.shape) < 0.2)).astype(np.float32)
        for s in load_manifest(model_dir).global_params
    }
    return encode_sparse_delta(delta, {"num_examples": str(num_examples), "metrics": "{}"})


def buffered(**buffer: object) -> str:
    return json.dumps(
        {"rounds": "buffered", "buffered": buffer, "round_duration_seconds": 60.0, "retry_after_seconds": 0}
    )


class Phone:
    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=30)
        token = self.http.post("/v1/devices").json()["token"]
        self.headers = {"Authorization": f"Bearer {token}"}
        self.assignment: dict[str, Any] = {}

    def checkin(self) -> dict[str, Any]:
        answer = self.http.post("/v1/populations/p/checkin", json={"example_count": 50}, headers=self.headers)
        assert answer.status_code == 200, answer.text
        self.assignment = answer.json()
        return self.assignment

    def report(self, body: bytes) -> httpx.Response:
        return self.http.post(self.assignment["report_url"], content=body, headers={**self.headers, **OCTETS})


def training_round(url: str, round_id: int) -> dict[str, Any]:
    (found,) = [r for r in rounds_of(url) if r["id"] == round_id]
    return found


def test_reports_go_into_the_open_buffer_weighted_by_staleness(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    model_dir = export(BIASED)
    settings = buffered(buffer_size=2, concurrency=3, max_staleness=1, staleness_weighting="inverse_sqrt")
    created = admin_create_population(server.url, model_dir, "p", settings)
    assert created.status_code == 201, created.text
    body = body_for(model_dir)
    a, b, c, d = (Phone(server.url) for _ in range(4))
    for phone in (a, b, c):
        assert phone.checkin()["accepted"] is True
        assert phone.assignment["model_version"] == 0
    refused = d.checkin()
    assert refused["accepted"] is False
    assert refused["reason"] == "3 devices are training, as many as this population trains at once"

    first = a.report(body).json()
    assert (first["reported"], first["target"], first["round_status"]) == (1, 2, "open")
    second = b.report(body).json()
    assert second["round_status"] == "committed"  # K reports: a new version
    # C trained on version 0: its report goes into the next buffer, one version stale.
    third = c.report(body)
    assert third.status_code == 200, third.text
    assert third.json()["round_id"] != first["round_id"]
    assert third.json()["reported"] == 1
    buffer = training_round(server.url, third.json()["round_id"])
    assert buffer["base_version"] == 1
    assert buffer["total_weight"] == pytest.approx(20 / math.sqrt(2))
    assert buffer["metrics"]["staleness_mean"] == 1.0
    assert buffer["metrics"]["staleness_count_1"] == 1.0
    assert training_round(server.url, first["round_id"])["metrics"]["staleness_count_0"] == 2.0
    # The console shows the open buffer's fill and each buffer's staleness.
    view = httpx.get(f"{server.url}/v1/admin/populations/p", headers=ADMIN, timeout=30).json()
    shown = render.population(view, rounds_of(server.url), time.time())
    assert "buffer 1/2 reports" in shown
    assert "buffer: staleness mean 1.00 versions; reports by staleness 1: 1" in shown
    assert "buffer: staleness mean 0.00 versions; reports by staleness 0: 2" in shown
    # Nobody trains now: D is admitted, on the new version.
    assert d.checkin()["accepted"] is True
    assert d.assignment["model_version"] == 1


def test_a_report_past_the_maximum_staleness_is_refused_with_its_reason(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    model_dir = export(BIASED)
    created = admin_create_population(
        server.url, model_dir, "p", buffered(buffer_size=1, concurrency=3, max_staleness=1)
    )
    assert created.status_code == 201, created.text
    body = body_for(model_dir)
    a, b, c = (Phone(server.url) for _ in range(3))
    for phone in (a, b, c):
        phone.checkin()
    assert a.report(body).json()["round_status"] == "committed"  # version 1
    assert b.report(body).json()["round_status"] == "committed"  # one stale: version 2
    late = c.report(body)
    assert late.status_code == 409
    assert late.json()["detail"] == (
        "the report trained on version 0, 2 versions behind the current 2; this population adds "
        "reports at most 1 versions stale: check in again for the current version"
    )
    assert c.report(body).status_code == 409  # its assignment was dropped
    assert c.checkin()["model_version"] == 2  # and its place freed


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        (
            {
                "rounds": "buffered",
                "differential_privacy": {"clip_norm": 1.0, "noise_multiplier": 1.0, "population_size": 100},
            },
            "differential_privacy.max_participations is required with rounds: buffered",
        ),
        ({"rounds": "buffered", "buffered": {"staleness_weighting": "1/s"}}, "buffered.staleness_weighting"),
        ({"rounds": "buffered", "min_reports": 5, "buffered": {"buffer_size": 4}}, "min_reports (5) must be"),
    ],
)
def test_a_setting_buffered_rounds_cannot_run_is_refused_at_creation(
    settings: dict[str, object], problem: str
) -> None:
    with pytest.raises(ValidationError) as error:
        PopulationSettings.model_validate(settings)
    assert problem in settings_problems(error.value)


async def _phone(url: str, body: bytes, answers: dict[str, int], stop: asyncio.Event, seed: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        token = (await http.post("/v1/devices")).json()["token"]
        headers = {"Authorization": f"Bearer {token}"}
        while not stop.is_set():
            answer = (
                await http.post("/v1/populations/p/checkin", json={"example_count": 50}, headers=headers)
            ).json()
            if not answer.get("accepted", False):
                await asyncio.sleep(rng.uniform(0.01, 0.05))
                continue
            await asyncio.sleep(rng.uniform(0, 0.1))
            if rng.random() < 0.1:
                await http.post(answer["abort_url"], headers=headers)
                continue
            # Sometimes the same report twice at once (a replay): it counts once at most.
            copies = await asyncio.gather(
                *[
                    http.post(answer["report_url"], content=body, headers={**headers, **OCTETS})
                    for _ in range(2 if rng.random() < 0.3 else 1)
                ]
            )
            for copy in copies:
                assert copy.status_code < 500, copy.text
                if copy.status_code == 200:
                    answers[answer["assignment_id"]] = answers.get(answer["assignment_id"], 0) + 1


async def _load(url: str, body: bytes, versions: int) -> dict[str, int]:
    answers: dict[str, int] = {}
    stop = asyncio.Event()

    async def until_committed() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            listed = await asyncio.to_thread(rounds_of, url)
            if sum(r["status"] == "committed" for r in listed) >= versions:
                break
            await asyncio.sleep(0.2)
        stop.set()

    await asyncio.gather(until_committed(), *(_phone(url, body, answers, stop, i) for i in range(16)))
    return answers


def test_a_buffer_commits_once_at_k_reports_when_reports_race(
    deployment: Deployment, export: Callable[[ModelConfig], Path]
) -> None:
    model_dir = export(BIASED)
    url = deployment.server.url
    created = admin_create_population(
        url, model_dir, "p", buffered(buffer_size=3, concurrency=6, max_staleness=5)
    )
    assert created.status_code == 201, created.text

    answers = asyncio.run(_load(url, body_for(model_dir), versions=6))

    engine = create_engine(deployment.database_url)
    with engine.connect() as db:
        stored = db.execute(text("SELECT round_id, count(*) FROM reports GROUP BY round_id")).all()
        stale_into = db.execute(
            text(
                "SELECT count(*) FROM reports JOIN assignments ON assignments.id = reports.assignment_id "
                "WHERE assignments.round_id != reports.round_id"
            )
        ).scalar_one()
    engine.dispose()
    rounds: dict[Any, Any] = {r["id"]: r for r in rounds_of(url)}
    committed = [r for r in rounds.values() if r["status"] == "committed"]
    assert len(committed) >= 6
    # Each buffer committed once, at exactly K reports (its deadline is far), into the next version.
    assert all(r["counters"]["reported"] == 3 for r in committed)
    assert sorted(r["result_version"] for r in committed) == list(range(1, len(committed) + 1))
    # Every report answered 200 is stored once, in the buffer that counted it.
    assert set(answers.values()) == {1}
    assert sum(n for _, n in stored) == len(answers)
    assert all(rounds[round_id]["counters"]["reported"] == n for round_id, n in stored)
    assert stale_into > 0, "some reports should have gone into a later buffer than their round"
