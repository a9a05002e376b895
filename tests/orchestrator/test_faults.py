"""Faults under a running fleet: the server SIGKILLed and restarted on the same port and database,
the SQLite file held locked by another connection, one of two server processes on PostgreSQL
killed, PostgreSQL itself stopped and started. Each time the run finishes, nothing committed is
lost, nothing counts twice (the ledger's invariants, tests/orchestrator/ledger.py), and the devices
waited out the fault by their retry windows (503 with Retry-After, a refused connection) rather
than giving up. And a device told 429 comes back after the window instead of taking it as a
refusal."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from android_sim.run import run_async
from android_sim.run_config import RunResult
from android_sim.session import SIMULATED_FLEET_LIMITS
from contracts.manifest import load_manifest
from contracts.protocol import Assignment, Rejection
from device_runtime import orchestrator_client
from device_runtime.agent import DeviceAgent, Participation
from device_runtime.example_store import ExampleStore
from device_runtime.orchestrator_client import OrchestratorClient
from device_runtime.protocol_errors import RetryLater
from orchestrator.local import LocalOrchestrator
from tests.android_sim.test_run import small, work  # noqa: F401  (work: the fixture)
from tests.conftest import DEVICE_POLICY
from tests.orchestrator.conftest import (
    ADMIN_TOKEN,
    POSTGRES_URL,
    admin_create_population,
    fresh_postgres_database,
)
from tests.orchestrator.ledger import check_ledger


@pytest.fixture
def retries(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float]]:
    """Every pause a device took before trying a request again: (why, seconds)."""
    seen: list[tuple[str, float]] = []
    wait = orchestrator_client._wait_before_retry

    async def recording(seconds: float, reason: str) -> None:
        seen.append((reason, seconds))
        await wait(seconds, reason)

    monkeypatch.setattr(orchestrator_client, "_wait_before_retry", recording)
    return seen


@dataclass
class FleetRun:
    """A simulated run against `server` in a thread of its own, while the test breaks things."""

    server: LocalOrchestrator
    work: Path
    rounds: int
    result: list[RunResult | BaseException] = field(default_factory=list)

    def __post_init__(self) -> None:
        config = small(
            self.work,
            orchestrator_url=self.server.url,
            admin_token=ADMIN_TOKEN,
            population="faults",
            rounds=self.rounds,
        )

        def run() -> None:
            try:
                self.result.append(asyncio.run(run_async(config, Console(width=120, quiet=True))))
            except BaseException as e:
                self.result.append(e)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def committed(self) -> int:
        """Training rounds committed so far; -1 while the server does not answer."""
        with contextlib.suppress(httpx.HTTPError, KeyError):
            answer = httpx.get(
                f"{self.server.url}/v1/admin/populations/faults",
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                timeout=5,
            )
            if answer.status_code == 200:
                return int(answer.json()["training_rounds_committed"])
        return -1

    def wait_for_commits(self, count: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.committed() < count:
            assert self.thread.is_alive(), self.result
            assert time.monotonic() < deadline, f"fewer than {count} rounds committed in {timeout:.0f} s"
            time.sleep(0.2)

    def finish(self) -> RunResult:
        self.thread.join(timeout=180)
        assert not self.thread.is_alive(), "the run did not finish"
        (outcome,) = self.result
        if isinstance(outcome, BaseException):
            raise outcome
        assert outcome.rounds_committed >= self.rounds
        return outcome


def versions(database: Path) -> dict[int, bytes]:
    with contextlib.closing(sqlite3.connect(database)) as db:
        return dict(db.execute("SELECT version, params FROM model_versions"))


def test_a_fleet_outlasts_a_locked_database_and_a_killed_server(
    work: Path,  # noqa: F811
    retries: list[tuple[str, float]],
) -> None:
    # Prepare: a fleet training against a real server on an SQLite file
    database = work / "server.sqlite"
    server = LocalOrchestrator(
        f"sqlite:///{database}", ADMIN_TOKEN, log_path=work / "server.log", settings=SIMULATED_FLEET_LIMITS
    )
    with contextlib.ExitStack() as stack:
        stack.callback(server.stop)
        server.start()
        fleet = FleetRun(server, work, rounds=4)
        fleet.wait_for_commits(1)

        # Execute: another connection holds the write lock for 4 s ...
        with contextlib.closing(sqlite3.connect(database, isolation_level=None)) as other:
            other.execute("BEGIN IMMEDIATE")
            time.sleep(4.0)
            other.execute("ROLLBACK")
        locked_out = [seconds for reason, seconds in retries if reason.startswith("503")]
        fleet.wait_for_commits(fleet.committed() + 1)
        # ... then the server dies mid-run and comes back on the same port and database.
        server.kill()
        before_kill = versions(database)
        time.sleep(1.0)
        server.start()
        result = fleet.finish()

    # Assert: the run finished, nothing committed was lost, nothing counted twice
    assert result.rounds_committed >= 4
    ledger = check_ledger(f"sqlite:///{database}", load_manifest(work / "model"))
    after = versions(database)
    assert {v: after[v] for v in before_kill} == before_kill
    assert ledger.population.current_version >= max(before_kill)
    # The devices waited out both faults: the lock's 503s no sooner than their Retry-After (1 s),
    # the dead server's refused connections with backoff; none gave up on the server.
    assert locked_out and min(locked_out) >= 1.0
    assert any(reason.startswith("ConnectError") for reason, _ in retries)
    outcomes = result.summary["fleet"]["device_side_outcomes"]
    assert not [k for k in outcomes if k.endswith("/unreachable")], outcomes


def worker_pids(parent: int) -> list[int]:
    """The server's worker processes (uvicorn spawns them as multiprocessing children)."""
    found = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError):
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"spawn_main" in cmdline:
                found.append(int(proc.name))
    return found


@pytest.mark.skipif(not POSTGRES_URL, reason="needs a PostgreSQL server (TEST_POSTGRES_URL)")
def test_a_fleet_outlasts_a_killed_worker_process(
    work: Path,  # noqa: F811
    retries: list[tuple[str, float]],
) -> None:
    # Prepare: a fleet training against two server processes on one PostgreSQL
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(fresh_postgres_database())
        server = LocalOrchestrator(
            url, ADMIN_TOKEN, log_path=work / "server.log", settings=SIMULATED_FLEET_LIMITS, workers=2
        )
        stack.callback(server.stop)
        server.start()
        assert server.process is not None
        fleet = FleetRun(server, work, rounds=3)
        fleet.wait_for_commits(1)

        # Execute: one worker dies mid-run (the other goes on answering; uvicorn starts a new one)
        victim = worker_pids(server.process.pid)[0]
        os.kill(victim, signal.SIGKILL)
        result = fleet.finish()

        # Assert: the run finished, nothing counted twice, every committed version whole
        assert result.rounds_committed >= 3
        check_ledger(url, load_manifest(work / "model"))
        assert victim not in worker_pids(server.process.pid)


POSTGRES_STOP = os.environ.get("TEST_POSTGRES_STOP")  # shell commands (.ci/run sets them)
POSTGRES_START = os.environ.get("TEST_POSTGRES_START")


@pytest.mark.serial  # it stops the PostgreSQL server every other test shares
@pytest.mark.skipif(
    not (POSTGRES_URL and POSTGRES_STOP and POSTGRES_START),
    reason="needs a PostgreSQL server the test may stop and start (TEST_POSTGRES_STOP, TEST_POSTGRES_START)",
)
def test_a_fleet_outlasts_a_stopped_postgresql(
    work: Path,  # noqa: F811
    retries: list[tuple[str, float]],
) -> None:
    assert POSTGRES_STOP and POSTGRES_START
    # Prepare: a fleet training against one server process on PostgreSQL
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(fresh_postgres_database())
        server = LocalOrchestrator(
            url, ADMIN_TOKEN, log_path=work / "server.log", settings=SIMULATED_FLEET_LIMITS
        )
        stack.callback(server.stop)
        server.start()
        fleet = FleetRun(server, work, rounds=3)
        fleet.wait_for_commits(1)

        # Execute: the database goes away for 4 s, then comes back
        try:
            subprocess.run(POSTGRES_STOP, shell=True, check=True, capture_output=True, timeout=60)
            time.sleep(4.0)
        finally:
            subprocess.run(POSTGRES_START, shell=True, check=True, capture_output=True, timeout=60)
        result = fleet.finish()

        # Assert: the run finished, nothing counted twice, and the devices were told to come back (503)
        assert result.rounds_committed >= 3
        check_ledger(url, load_manifest(work / "model"))
    assert [seconds for reason, seconds in retries if reason.startswith("503")]
    outcomes = result.summary["fleet"]["device_side_outcomes"]
    assert not [k for k in outcomes if k.endswith("/unreachable")], outcomes


def test_a_rate_limited_device_comes_back_after_the_window(work: Path) -> None:  # noqa: F811
    # Prepare: a real server that takes one check-in per device, then one every 2 s
    server = LocalOrchestrator(
        f"sqlite:///{work / 'server.sqlite'}",
        ADMIN_TOKEN,
        settings={"checkin_burst": 1, "checkins_per_second": 0.5},
    )

    async def device() -> tuple[Assignment | Rejection, Participation, RetryLater, Assignment | Rejection]:
        client = OrchestratorClient(server.url)
        try:
            await client.enroll()
            first = await client.checkin("p", 0)
            with ExampleStore(work / "device.sqlite", load_manifest(work / "model").features) as store:
                limited = await DeviceAgent(
                    client, store, work / "cache", "p", policy=DEVICE_POLICY
                ).participate()
            with pytest.raises(RetryLater) as raised:
                await client.checkin("p", 0)
            await asyncio.sleep(raised.value.retry_after_seconds)
            return first, limited, raised.value, await client.checkin("p", 0)
        finally:
            await client.aclose()

    with server:
        created = admin_create_population(server.url, work / "model", "p", "{}")
        assert created.status_code == 201, created.text

        # Execute
        first, limited, raised, after = asyncio.run(device())

    # Assert: the 429 is a rejection with the server's window, not a refusal, and the window is honoured
    assert isinstance(first, Rejection)
    assert limited.status == "rejected" and "429" in limited.detail
    assert 1.0 <= limited.retry_after_seconds <= 2.0
    assert raised.status == 429 and raised.retry_after_seconds >= 1.0
    assert isinstance(after, Rejection)  # answered by the round logic again, not by the rate limit
