"""Forwarded headers are believed only from the proxies the operator names, and the dashboard's
sign-in limit holds whatever X-Forwarded-For says: over real HTTP against a real server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from orchestrator.app import OVERALL_SIGN_INS
from orchestrator.local import PROJECT_ROOT
from tests.orchestrator.conftest import ADMIN_TOKEN, Server

WRONG = ADMIN_TOKEN[:-1] + ("x" if ADMIN_TOKEN[-1] != "x" else "y")
BURST = 2
LIMITS = {"dashboard_sign_in_burst": BURST, "dashboard_sign_in_interval_seconds": 3600}


def sign_ins(url: str, forwarded_for: list[str]) -> list[int]:
    """The status of one wrong sign-in per X-Forwarded-For value."""
    with httpx.Client(base_url=url, timeout=30) as client:
        return [
            client.post(
                "/dashboard/sign-in", data={"token": WRONG}, headers={"X-Forwarded-For": address}
            ).status_code
            for address in forwarded_for
        ]


def test_by_default_no_proxy_is_believed_so_a_new_header_each_time_buys_no_attempts(tmp_path: Path) -> None:
    with Server(tmp_path / "o.sqlite", settings=LIMITS) as server:
        statuses = sign_ins(server.url, [f"203.0.113.{i}" for i in range(BURST + 3)])

    # uvicorn alone trusts 127.0.0.1's header: each new value would be a fresh bucket (all 401).
    assert statuses == [401] * BURST + [429] * 3


def test_a_named_proxy_is_believed_and_the_overall_limit_still_holds(tmp_path: Path) -> None:
    settings = {**LIMITS, "forwarded_allow_ips": "127.0.0.1"}
    with Server(tmp_path / "o.sqlite", settings=settings) as server:
        same = sign_ins(server.url, ["198.51.100.1"] * (BURST + 1))
        overall = OVERALL_SIGN_INS * BURST
        fresh = sign_ins(server.url, [f"203.0.113.{i}" for i in range(overall + 2)])

    # The header names the client: one address meets its own limit...
    assert same == [401] * BURST + [429]
    # ...and a new address each time meets the overall one (BURST attempts were already spent).
    assert fresh == [401] * (overall - BURST) + [429] * (BURST + 2)


def test_behind_a_named_tls_proxy_the_session_cookie_is_secure(tmp_path: Path) -> None:
    with Server(tmp_path / "o.sqlite", settings={"forwarded_allow_ips": "127.0.0.1"}) as server:
        behind_tls = httpx.post(
            f"{server.url}/dashboard/sign-in",
            data={"token": ADMIN_TOKEN},
            headers={"X-Forwarded-Proto": "https"},
            timeout=30,
        )

    assert behind_tls.status_code == 303, behind_tls.text
    assert "secure" in {p.strip().lower() for p in behind_tls.headers["set-cookie"].split(";")}


def test_a_proxy_list_that_is_not_addresses_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "serve", "--forwarded-allow-ips", "10.0.0.1,proxy.example"],
        cwd=PROJECT_ROOT,
        env={
            "ORCHESTRATOR_ADMIN_TOKEN": ADMIN_TOKEN,
            "ORCHESTRATOR_DATABASE_URL": f"sqlite:///{tmp_path}/o.sqlite",
        },
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "'proxy.example' is not an IP address or network" in done.stderr
