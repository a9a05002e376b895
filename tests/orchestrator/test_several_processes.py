"""The round state machine's invariants under concurrent devices, whatever the deployment: one
server process on SQLite, and (with TEST_POSTGRES_URL) two server processes on one PostgreSQL.

Many devices check in (some twice at once), report (some twice at once, some late), abort or
vanish, over their own connections, so that requests of one round land in different processes.
Then the database itself is asked (tests/orchestrator/ledger.py): no device has two assignments in a
round, no report counts twice, a round commits once, no round accepts beyond its capacity, model
versions are consecutive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from contracts.manifest import load_manifest
from contracts.params import encode_sparse_delta
from model_export.config import ModelConfig
from orchestrator.local import LocalOrchestrator
from tests.conftest import BIASED
from tests.orchestrator.conftest import (
    ADMIN_TOKEN,
    OCTETS,
    POSTGRES_URL,
    admin_create_population,
    fresh_postgres_database,
)
from tests.orchestrator.ledger import check_ledger
from tests.orchestrator.test_observability import scrape, total

DEVICES = 48
# The load runs at least this long, and then until MIN_COMMITTED rounds have committed (a busy
# machine commits fewer a second), within a generous deadline.
LOAD_SECONDS = 10.0
MIN_COMMITTED = 3
DEADLINE_SECONDS = 300.0
SETTINGS = {"target_reports": 4, "oversampling": 1.5, "round_duration_seconds": 2.0, "retry_after_seconds": 0}
DEPLOYMENTS = ["sqlite, 1 process"] + (["postgresql, 2 processes"] if POSTGRES_URL else [])


@dataclass
class Deployment:
    server: LocalOrchestrator
    database_url: str
    log_path: Path


@pytest.fixture(params=DEPLOYMENTS)
def deployment(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Deployment]:
    with contextlib.ExitStack() as stack:
        if request.param.startswith("sqlite"):
            url, workers = f"sqlite:///{tmp_path / 'orchestrator.sqlite'}", 1
        else:
            url, workers = stack.enter_context(fresh_postgres_database()), 2
        log_path = tmp_path / "server.log"
        server = LocalOrchestrator(
            url, ADMIN_TOKEN, log_path=log_path, workers=workers, env={"ORCHESTRATOR_LOG_LEVEL": "debug"}
        )
        stack.callback(server.stop)
        yield Deployment(server.start(), url, log_path)


TRANSPORT_ERROR = 0  # Seen.statuses' key for a request whose connection closed before an answer


@dataclass
class Seen:
    """What the devices were told."""

    assignments: dict[tuple[str, int], set[str]] = field(default_factory=dict)  # (device, round) -> ids
    reports_accepted: dict[str, int] = field(default_factory=dict)  # assignment -> 200 answers
    statuses: dict[int, int] = field(default_factory=dict)
    unanswered_reports: int = 0  # reports whose connection closed: the server may have counted them

    def status(self, code: int) -> None:
        self.statuses[code] = self.statuses.get(code, 0) + 1


async def device(url: str, body: bytes, seen: Seen, rng: random.Random, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        token = (await http.post("/v1/devices")).json()["token"]
        headers = {"Authorization": f"Bearer {token}"}

        async def post(path: str, **kwargs: Any) -> httpx.Response | None:
            # A connection the server closed as the request went out (its keep-alive timer, on a
            # loaded machine) is what a device meets and retries, as the device runtime's client
            # does; whether the server processed it is left open, which the invariants allow.
            try:
                return await http.post(path, **kwargs)
            except httpx.TransportError:
                seen.status(TRANSPORT_ERROR)
                return None

        async def checkin() -> httpx.Response | None:
            return await post("/v1/populations/p/checkin", json={"example_count": 50}, headers=headers)

        while not stop.is_set():
            # Sometimes the same check-in twice at once (a client retrying): one assignment at most.
            sent = await asyncio.gather(*[checkin() for _ in range(2 if rng.random() < 0.3 else 1)])
            answers = [a for a in sent if a is not None]
            for answer in answers:
                seen.status(answer.status_code)
            accepted = [a.json() for a in answers if a.status_code == 200 and a.json().get("accepted", True)]
            accepted = [a for a in accepted if "assignment_id" in a]
            if not accepted:
                await asyncio.sleep(rng.uniform(0.05, 0.2))
                continue
            for a in accepted:
                seen.assignments.setdefault((token, a["round_id"]), set()).add(a["assignment_id"])
            assignment = accepted[0]
            fate = rng.random()
            await asyncio.sleep(rng.uniform(0, 0.3) if fate < 0.9 else 2.5)  # some past the deadline
            if fate < 0.1:
                aborted = await post(assignment["abort_url"], headers=headers)
                if aborted is not None:
                    seen.status(aborted.status_code)
            elif fate < 0.15:
                pass  # vanishes: the deadline drops it
            else:
                # Sometimes the same report twice at once (a replay): it counts once at most.
                copies = 2 if rng.random() < 0.3 else 1
                reported = await asyncio.gather(
                    *[
                        post(assignment["report_url"], content=body, headers={**headers, **OCTETS})
                        for _ in range(copies)
                    ]
                )
                seen.unanswered_reports += sum(a is None for a in reported)
                for answer in [a for a in reported if a is not None]:
                    seen.status(answer.status_code)
                    if answer.status_code == 200:
                        ids = assignment["assignment_id"]
                        seen.reports_accepted[ids] = seen.reports_accepted.get(ids, 0) + 1


def rounds_of(url: str) -> list[dict[str, object]]:
    answer = httpx.get(
        f"{url}/v1/admin/populations/p/rounds",
        params={"limit": 1000},
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    return list(answer.json())


async def stop_once_enough_committed(url: str, stop: asyncio.Event) -> None:
    started = time.monotonic()
    await asyncio.sleep(LOAD_SECONDS)
    while time.monotonic() - started < DEADLINE_SECONDS:
        listed = await asyncio.to_thread(rounds_of, url)
        if sum(r["status"] == "committed" for r in listed) >= MIN_COMMITTED:
            break
        await asyncio.sleep(0.5)
    stop.set()


async def load(url: str, body: bytes) -> Seen:
    seen, stop = Seen(), asyncio.Event()
    await asyncio.gather(
        stop_once_enough_committed(url, stop),
        *(device(url, body, seen, random.Random(i), stop) for i in range(DEVICES)),
    )
    return seen


def wait_until_closed(url: str, opened_by: float) -> None:
    """Until every round opened by `opened_by` (wall clock) has closed: its deadline passed and
    the server's ticker closed it (dropping what was still out), however slowly."""
    deadline = time.monotonic() + DEADLINE_SECONDS
    while any(r["status"] == "open" and float(str(r["opened_at"])) <= opened_by for r in rounds_of(url)):
        assert time.monotonic() < deadline, "the rounds the load left open did not close"
        time.sleep(0.2)


def test_invariants_hold_under_concurrent_devices(
    deployment: Deployment, export: Callable[[ModelConfig], Path]
) -> None:
    model_dir = export(BIASED)
    created = admin_create_population(deployment.server.url, model_dir, "p", json.dumps(SETTINGS))
    assert created.status_code == 201, created.text
    rng = np.random.default_rng(0)
    delta = {
        s.name: (rng.normal(0, 0.01, s.shape) * (rng.random(s.shape) < 0.2)).astype(np.float32)
        for s in load_manifest(model_dir).global_params
    }
    body = encode_sparse_delta(delta, {"num_examples": "20", "metrics": "{}"})

    seen = asyncio.run(load(deployment.server.url, body))
    wait_until_closed(deployment.server.url, time.time())  # every round the load left open
    samples = scrape(deployment.server.url)

    assert not [s for s in seen.statuses if s >= 500], seen.statuses
    # A closed connection now and then is the network's; a server that drops many is not healthy.
    assert seen.statuses.get(TRANSPORT_ERROR, 0) * 10 < sum(seen.statuses.values()), seen.statuses
    ledger = check_ledger(deployment.database_url, load_manifest(model_dir))

    assert len(ledger.committed) >= 3, "the load should commit several rounds"
    # As the devices saw it: one assignment per device and round, one 200 per report at most.
    assert all(len(ids) == 1 for ids in seen.assignments.values())
    assert set(seen.reports_accepted.values()) == {1}
    assert sum(ledger.reports.values()) == ledger.reported_assignments
    answered = sum(seen.reports_accepted.values())
    assert answered <= ledger.reported_assignments <= answered + seen.unanswered_reports
    # /metrics adds up every process's counts.
    accepted = sum(r.accepted for r in ledger.rounds)
    assert total(samples, "orchestrator_checkins_total", answer="accepted") == accepted
    assert total(samples, "orchestrator_reports_total", outcome="accepted") == sum(ledger.reports.values())
    # With several processes, the requests were in fact answered by several of them.
    pids = {
        line["pid"]
        for line in map(json.loads, deployment.log_path.read_text().splitlines())
        if line["message"] == "request"
    }
    assert len(pids) == deployment.server.workers
