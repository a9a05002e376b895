"""The dashboard's sign-in, session and CSRF defences, over real HTTP against a real server on
loopback (the browser's view is tests/orchestrator/test_dashboard_browser.py)."""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from contracts.protocol import RoundView
from model_export.config import ModelConfig
from orchestrator.dashboard import charts, overview, sessions
from tests.conftest import BIASED
from tests.orchestrator.conftest import ADMIN_TOKEN, Server, admin_create_population

SETTINGS = json.dumps({"target_reports": 2, "min_reports": 2, "round_duration_seconds": 30})


def signed_in(url: str) -> httpx.Client:
    client = httpx.Client(base_url=url, timeout=30)
    answer = client.post("/dashboard/sign-in", data={"token": ADMIN_TOKEN})
    assert answer.status_code == 303, answer.text
    return client


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]{64})"', page)
    assert found, page
    return found.group(1)


def paused(url: str) -> bool:
    answer = httpx.get(
        f"{url}/v1/admin/populations/movies", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
    )
    return answer.json()["paused_at"] is not None


@pytest.fixture
def movies(server: Server, export: Callable[[ModelConfig], Path]) -> Server:
    created = admin_create_population(server.url, export(BIASED), "movies", SETTINGS)
    assert created.status_code == 201, created.text
    return server


def test_root_redirects_and_pages_need_a_session(server: Server) -> None:
    anonymous = httpx.Client(base_url=server.url, timeout=30)

    root = anonymous.get("/")
    home = anonymous.get("/dashboard")
    page = anonymous.get("/dashboard/populations/movies")
    change = anonymous.post("/dashboard/populations/movies/pause", data={"csrf": "0" * 64})

    assert root.status_code == 303 and root.headers["location"] == "/dashboard"
    assert home.status_code == 200 and 'action="/dashboard/sign-in"' in home.text
    assert "script-src" not in home.headers["content-security-policy"]  # default-src 'none': no script
    assert "default-src 'none'" in home.headers["content-security-policy"]
    assert page.status_code == 303 and page.headers["location"] == "/dashboard"
    assert change.status_code == 401 and "sign in first" in change.text
    assert "/dashboard" not in json.dumps(anonymous.get("/openapi.json").json()["paths"])


def test_a_sign_in_sets_a_strict_http_only_cookie_and_never_echoes_the_token(server: Server) -> None:
    client = httpx.Client(base_url=server.url, timeout=30)

    answer = client.post("/dashboard/sign-in", data={"token": ADMIN_TOKEN})
    # No proxy is named (forwarded_allow_ips): a header saying "https" is not believed.
    claimed_tls = httpx.post(
        f"{server.url}/dashboard/sign-in",
        data={"token": ADMIN_TOKEN},
        headers={"X-Forwarded-Proto": "https"},
        timeout=30,
    )
    home = client.get("/dashboard")

    cookie = answer.headers["set-cookie"]
    flags = {part.strip().split("=")[0].lower() for part in cookie.split(";")}
    assert answer.headers["location"] == "/dashboard" and ADMIN_TOKEN not in answer.headers["location"]
    assert cookie.startswith(f"{sessions.COOKIE}=") and ADMIN_TOKEN not in cookie
    assert {"httponly", "max-age", "path"} <= flags and "secure" not in flags  # plain HTTP here
    assert "samesite=strict" in cookie.lower() and "max-age=28800" in cookie.lower()
    assert "secure" not in {p.strip().lower() for p in claimed_tls.headers["set-cookie"].split(";")}
    assert home.status_code == 200 and "Populations" in home.text
    assert ADMIN_TOKEN not in home.text and 'action="/dashboard/sign-out"' in home.text


def test_a_wrong_token_is_refused_and_sign_ins_are_rate_limited(tmp_path: Path) -> None:
    settings = {"dashboard_sign_in_burst": 3, "dashboard_sign_in_interval_seconds": 60}
    with Server(tmp_path / "o.sqlite", settings=settings) as server:
        client = httpx.Client(base_url=server.url, timeout=30)
        wrong = [client.post("/dashboard/sign-in", data={"token": ADMIN_TOKEN[:-1] + "x"}) for _ in range(3)]
        limited = client.post("/dashboard/sign-in", data={"token": ADMIN_TOKEN})

    assert [w.status_code for w in wrong] == [401, 401, 401]
    assert all("wrong admin token" in w.text and "set-cookie" not in w.headers for w in wrong)
    # The right token too, once the address has used its attempts: guessing is capped, not slowed.
    assert limited.status_code == 429 and "set-cookie" not in limited.headers
    assert "too many sign-in attempts" in limited.text and int(limited.headers["retry-after"]) >= 1


def test_a_hostile_page_can_neither_use_up_sign_ins_nor_post_changes(tmp_path: Path) -> None:
    # What a browser sends when a page of another origin submits a form to the dashboard.
    hostile = {"Sec-Fetch-Site": "cross-site"}
    settings = {"dashboard_sign_in_burst": 2, "dashboard_sign_in_interval_seconds": 60}
    with Server(tmp_path / "o.sqlite", settings=settings) as server:
        client = httpx.Client(base_url=server.url, timeout=30)
        forged = [
            client.post("/dashboard/sign-in", data={"token": t}, headers=hostile)
            for t in ("x", "y", "z", ADMIN_TOKEN)
        ]
        operator = signed_in(server.url)  # the address's attempts are all still there
        token = csrf_of(operator.get("/dashboard").text)
        sibling = operator.post(
            "/dashboard/sign-out", data={"csrf": token}, headers={"Sec-Fetch-Site": "same-site"}
        )
        still_in = operator.get("/dashboard")
        own = operator.post(
            "/dashboard/sign-out", data={"csrf": token}, headers={"Sec-Fetch-Site": "same-origin"}
        )

    for refused in (*forged, sibling):
        assert refused.status_code == 403 and "from another site" in refused.text
        assert "set-cookie" not in refused.headers
    assert 'action="/dashboard/sign-out"' in still_in.text
    assert own.status_code == 303


def test_a_session_expires(tmp_path: Path) -> None:
    with Server(tmp_path / "o.sqlite", settings={"dashboard_session_seconds": 1}) as server:
        client = signed_in(server.url)
        fresh = client.get("/dashboard")
        time.sleep(1.5)
        expired = client.get("/dashboard")
        change = client.post("/dashboard/sign-out", data={"csrf": csrf_of(fresh.text)})

    assert 'action="/dashboard/sign-out"' in fresh.text
    assert 'action="/dashboard/sign-in"' in expired.text
    assert 'action="/dashboard/sign-out"' not in expired.text
    assert change.status_code == 401


def test_changes_need_the_session_s_own_csrf_token(movies: Server) -> None:
    alice, bob = signed_in(movies.url), signed_in(movies.url)
    bobs_token = csrf_of(bob.get("/dashboard/populations/movies").text)
    alices_token = csrf_of(alice.get("/dashboard/populations/movies").text)

    missing = alice.post("/dashboard/populations/movies/pause")
    wrong = alice.post("/dashboard/populations/movies/pause", data={"csrf": "f" * 64})
    anothers = alice.post("/dashboard/populations/movies/pause", data={"csrf": bobs_token})
    paused_before = paused(movies.url)
    done = alice.post("/dashboard/populations/movies/pause", data={"csrf": alices_token})
    paused_after = paused(movies.url)
    resumed = alice.post("/dashboard/populations/movies/resume", data={"csrf": alices_token})

    for refused in (missing, wrong, anothers):
        assert refused.status_code == 403 and "CSRF token" in refused.text
    assert not paused_before
    assert done.status_code == 303 and done.headers["location"] == "/dashboard/populations/movies"
    assert paused_after and resumed.status_code == 303 and not paused(movies.url)


def test_signing_out_ends_the_session_for_a_stolen_copy_of_the_cookie_too(movies: Server) -> None:
    client = signed_in(movies.url)
    page = client.get("/dashboard/populations/movies")
    copy = httpx.Client(base_url=movies.url, cookies={sessions.COOKIE: client.cookies[sessions.COOKIE]})
    before = copy.get("/dashboard")

    out = client.post("/dashboard/sign-out", data={"csrf": csrf_of(page.text)})
    after = copy.get("/dashboard")
    change = copy.post("/dashboard/populations/movies/pause", data={"csrf": csrf_of(page.text)})

    assert 'action="/dashboard/sign-out"' in before.text
    assert out.status_code == 303 and "max-age=0" in out.headers["set-cookie"].lower()
    assert 'action="/dashboard/sign-in"' in after.text
    assert change.status_code == 401 and not paused(movies.url)


def test_the_population_page_shows_devices_seen_versions_and_rounds(movies: Server) -> None:
    client = signed_in(movies.url)

    page = client.get("/dashboard/populations/movies")
    missing = client.get("/dashboard/populations/nope")

    assert page.status_code == 200
    assert 'id="devices-seen">none yet' in page.text and "the export" in page.text
    assert "Rounds over time" in page.text and "<svg" in page.text and "Participation funnel" in page.text
    assert 'id="privacy">no differential privacy' in page.text  # a line, not an empty chart
    assert "Privacy: epsilon against the budget" not in page.text
    assert 'class="state idle"' in page.text and "idle: no devices" in page.text
    assert missing.status_code == 404 and "no population" in missing.text


def test_chart_text_from_the_database_is_escaped() -> None:
    hostile = RoundView(
        id=1,
        kind="training",
        status="abandoned",
        base_version=0,
        result_version=None,
        target=2,
        capacity=3,
        min_reports=2,
        opened_at=0.0,
        deadline=1.0,
        closed_at=1.0,
        counters={"reported": 0},
        total_weight=0.0,
        metrics={},
        close_reason='<script>alert("x")</script>',
        stopped_phase="reporting",
        ended_by="deadline",
    )

    svg = str(charts.rounds_over_time([hostile], now=2.0))

    assert "<script>" not in svg and "&lt;script&gt;" in svg


def test_an_evaluation_rounds_interval_is_drawn_as_a_whisker_on_its_point() -> None:
    # Prepare: a committed evaluation round of version 3 whose accuracy has an interval
    evaluated = RoundView(
        id=9,
        kind="evaluation",
        status="committed",
        base_version=3,
        result_version=None,
        target=40,
        capacity=60,
        min_reports=5,
        opened_at=0.0,
        deadline=10.0,
        closed_at=5.0,
        counters={"reported": 40},
        total_weight=400.0,
        metrics={"accuracy": 0.87, "accuracy_low": 0.84, "accuracy_high": 0.9, "interval_groups": 8.0},
        close_reason="40 reports reached the target 40",
        stopped_phase=None,
        ended_by=None,
    )

    # Execute
    series = {s.name: s for s in overview.metric_series([evaluated])}
    svg = str(charts.metric(series["accuracy"]))

    # Assert: one chart for the accuracy (none for its bounds), its point with a whisker and the
    # interval in its tooltip
    assert set(series) == {"accuracy"} and series["accuracy"].intervals == {3: (0.84, 0.9)}
    # two axes, the version's tick and the whisker; the one version labelled 3, not 2.5 and 3.5
    assert "[95% interval 0.84, 0.9]" in svg and svg.count("<line") == 4
    assert re.findall(r'class="version"[^>]*>([^<]+)<', svg) == ["3"] and "model version" in svg


def a_round(**fields: object) -> RoundView:
    """A closed training round of version 0 with the fields given."""
    defaults: dict[str, object] = {
        "id": 1,
        "kind": "training",
        "status": "committed",
        "base_version": 0,
        "result_version": 1,
        "target": 3,
        "capacity": 4,
        "min_reports": 3,
        "opened_at": 0.0,
        "deadline": 10.0,
        "closed_at": 6.0,
        "counters": {},
        "total_weight": 0.0,
        "metrics": {},
    }
    return RoundView(**{**defaults, **fields})  # type: ignore[arg-type]


def test_a_round_no_device_came_to_is_grey_no_devices_and_not_a_failure() -> None:
    empty = a_round(
        id=1,
        status="abandoned",
        result_version=None,
        closed_at=10.0,
        counters={"checked_in": 0, "reported": 0},
        stopped_phase="reporting",
        ended_by="deadline",
        devices_had=0,
        devices_needed=1,
    )
    failed = a_round(
        id=2,
        status="abandoned",
        result_version=None,
        opened_at=10.0,
        closed_at=20.0,
        counters={"checked_in": 2, "accepted": 2, "reported": 1, "dropped": 1},
        stopped_phase="reporting",
        ended_by="deadline",
        devices_had=1,
        devices_needed=3,
    )

    svg = str(charts.rounds_over_time([empty, failed], now=20.0))

    assert charts.round_outcome(empty) == "no devices: closed empty by deadline"
    assert charts.round_outcome(failed) == "abandoned in reporting by deadline, 1 of 3 devices"
    assert svg.count('class="round idle"') == 1 and svg.count('class="round abandoned"') == 1
    assert overview.why_abandoned([empty, failed]) == [("in reporting by deadline", 1)]


def test_rounds_are_marks_apart_over_their_durations_in_a_lane_by_kind() -> None:
    rounds = [
        a_round(id=i, opened_at=10.0 * i, closed_at=10.0 * i + 10.0, counters={"reported": 3})
        for i in range(3)
    ] + [a_round(id=3, kind="evaluation", opened_at=5.0, closed_at=9.0, counters={"reported": 3})]

    svg = str(charts.rounds_over_time(rounds, now=30.0))

    marks = re.findall(r'<rect class="round committed" x="([\d.]+)" y="([\d.]+)" width="([\d.]+)"', svg)
    assert len(marks) == 4
    training = sorted((float(x), float(w)) for x, y, w in marks[:3])
    for (x, w), (next_x, _) in itertools.pairwise(training):
        assert x + w < next_x  # three countable marks, not one block
    assert marks[3][1] != marks[0][1]  # the evaluation round in its own lane
    assert "reports in 10 s" in svg and "reports in 4.0 s" in svg and "time (UTC)" in svg


def test_the_funnel_adds_up_with_the_devices_still_in_their_task() -> None:
    closed = a_round(
        id=1,
        counters={
            "checked_in": 10,
            "accepted": 8,
            "rejected_capacity": 1,
            "rejected_min_examples": 0,
            "reported": 5,
            "dropped": 1,
            "late": 1,
            "invalid": 0,
            "aborted": 1,
        },
    )
    open_ = a_round(
        id=2,
        status="open",
        result_version=None,
        closed_at=None,
        counters={"checked_in": 4, "accepted": 4, "reported": 1},
    )

    totals = overview.funnel([closed, open_])
    svg = str(charts.funnel(totals))

    assert totals["checked_in"] == sum(totals[k] for k in overview.CHECKED_IN) == 14
    assert totals["accepted"] == sum(totals[k] for k in overview.ACCEPTED) == 12
    assert (totals["in_task"], totals["outrun"], totals["refused_otherwise"]) == (3, 1, 1)
    assert "in task: 3" in svg and "devices" in svg
