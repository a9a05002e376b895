"""`python -m orchestrator serve` as a child process: for the simulator, tests and benchmarks.

It runs exactly as an operator would run it (its own process, real HTTP on loopback, the
database URL and admin token from the environment), so whatever talks to it exercises the
real server. Without an admin token it makes a fresh random one (`admin_token`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Self

import httpx

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalOrchestrator:
    def __init__(
        self,
        database_url: str,
        admin_token: str | None = None,
        *,
        port: int | None = None,
        tick_seconds: float = 0.2,
        log_path: Path | None = None,
        settings: Mapping[str, object] | None = None,
        workers: int = 1,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """`settings`: more orchestrator.settings.Settings fields, passed as ORCHESTRATOR_* variables."""
        self.database_url = database_url
        self.admin_token = admin_token or secrets.token_urlsafe(32)
        self.settings = dict(settings or {})
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tick_seconds = tick_seconds
        self.log_path = log_path
        self.workers = workers
        self.env = dict(env or {})
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self, timeout_seconds: float = 300.0) -> Self:
        env = {
            **os.environ,
            "ORCHESTRATOR_ADMIN_TOKEN": self.admin_token,
            "ORCHESTRATOR_DATABASE_URL": self.database_url,
            "ORCHESTRATOR_TICK_SECONDS": str(self.tick_seconds),
            **{f"ORCHESTRATOR_{name.upper()}": str(value) for name, value in self.settings.items()},
            **self.env,
        }
        # A file, not a pipe: a long run must never block the server on a full pipe.
        self._log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "orchestrator",
                "serve",
                "--port",
                str(self.port),
                "--workers",
                str(self.workers),
            ],
            cwd=PROJECT_ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self._log or subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = self.log_path.read_text(errors="replace")[-2000:] if self.log_path else ""
                raise RuntimeError(f"the orchestrator exited with code {self.process.returncode}: {log}")
            # Readiness, not the OpenAPI document: that one is built on its first request, and on a
            # CPU-starved machine (CI at a load of 20) building it outlasts a short timeout every try.
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/health/ready", timeout=10).status_code == 200:
                    return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the orchestrator did not answer at {self.url} within {timeout_seconds:.0f} s")

    def kill(self) -> None:
        """SIGKILL: no shutdown hooks, no flush; what a crash of the server process does."""
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)
        self._close_log()

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_log()

    def _close_log(self) -> None:
        if self._log:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        # `with server.start():` is the usual form: entering must not start a second server,
        # whose predecessor nobody would stop.
        if self.process is not None and self.process.poll() is None:
            return self
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
