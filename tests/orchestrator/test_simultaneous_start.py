"""Replicas started together on an empty PostgreSQL database all come up (a container orchestrator
starts every replica at once; none may lose a race for the schema and exit)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from orchestrator.local import PROJECT_ROOT, free_port
from tests.orchestrator.conftest import ADMIN_TOKEN, POSTGRES_URL, fresh_postgres_database

REPLICAS = 12


@pytest.mark.serial  # twelve server processes at once: alone, so that their start-up race is the one tested
@pytest.mark.skipif(not POSTGRES_URL, reason="needs a PostgreSQL server: set TEST_POSTGRES_URL (CI does)")
def test_twelve_servers_started_at_once_on_an_empty_postgresql_all_come_up(tmp_path: Path) -> None:
    with fresh_postgres_database() as url, contextlib.ExitStack() as stack:
        env = {**os.environ, "ORCHESTRATOR_ADMIN_TOKEN": ADMIN_TOKEN, "ORCHESTRATOR_DATABASE_URL": url}
        ports = [free_port() for _ in range(REPLICAS)]
        processes: list[subprocess.Popen[bytes]] = []
        for i, port in enumerate(ports):
            log = stack.enter_context(open(tmp_path / f"server-{i}.log", "wb"))
            process = subprocess.Popen(
                [sys.executable, "-m", "orchestrator", "serve", "--port", str(port)],
                cwd=PROJECT_ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
            stack.callback(_stop, process)
            processes.append(process)

        healthy: set[int] = set()
        deadline = time.monotonic() + 120
        while len(healthy) < REPLICAS and time.monotonic() < deadline:
            for i, (process, port) in enumerate(zip(processes, ports, strict=True)):
                if i in healthy:
                    continue
                if process.poll() is not None:
                    log_text = (tmp_path / f"server-{i}.log").read_text(errors="replace")[-1500:]
                    pytest.fail(f"server {i} exited with code {process.returncode}: {log_text}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        healthy.add(i)
            time.sleep(0.2)
        assert len(healthy) == REPLICAS, f"only {len(healthy)} of {REPLICAS} servers came up within 120 s"


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
