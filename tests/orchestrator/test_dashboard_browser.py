"""The dashboard in a real browser: Debian's Chromium, headless, driven by Playwright, against a
real orchestrator on loopback with real devices (device_runtime agents, real TFLite) training.

The browser comes from the system (`apt-get install chromium`; .ci/run installs it), never from
Playwright's own download. Without it the test is skipped, except where FEDRECON_REQUIRE_BROWSER=1
(CI), where it fails. FEDRECON_DASHBOARD_SCREENSHOTS=<folder> keeps the screenshots it takes
there (the docs' are made so: docs/images/dashboard-*.png).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from device_runtime.agent import DeviceAgent
from device_runtime.example_store import Event, ExampleStore
from device_runtime.orchestrator_client import OrchestratorClient
from model_export.config import ModelConfig
from orchestrator.dashboard import sessions
from tests.conftest import BIASED, DEVICE_POLICY
from tests.orchestrator.conftest import ADMIN_TOKEN, Server, admin_create_population

CHROMIUM = Path("/usr/bin/chromium")
DEVICES = 5
TARGET = 3
SETTINGS = {
    "target_reports": TARGET,
    "min_reports": 3,
    "round_duration_seconds": 3,
    "min_examples": 5,
    "evaluation_every": 2,
    "evaluation_target_reports": 3,
    "min_evaluation_reports": 3,
    "evaluation_round_duration_seconds": 3,
    "task_config": {"update_learning_rate": 0.5, "reconstruction_learning_rate": 0.1},
    # Epsilon spent against a budget, for the privacy chart (a stated population of 1,000).
    "differential_privacy": {
        "clip_norm": 1.0,
        "noise_multiplier": 0.3,
        "population_size": 1000,
        "epsilon_budget": 20.0,
    },
}


def _browser_or_skip() -> Any:
    """Playwright's sync API, or a skip (a failure under FEDRECON_REQUIRE_BROWSER=1)."""
    missing = None
    if not CHROMIUM.exists():
        missing = f"no Chromium at {CHROMIUM} (apt-get install -y chromium)"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing = missing or "the playwright package is not installed (./dev setup)"
    if missing:
        if os.environ.get("FEDRECON_REQUIRE_BROWSER") == "1":
            pytest.fail(f"FEDRECON_REQUIRE_BROWSER=1 but {missing}")
        pytest.skip(f"the dashboard's browser test needs a browser: {missing}")
    return sync_playwright


def _store(path: Path, seed: int) -> ExampleStore:
    """A device's own examples: 30 ratings of random items of the model's catalog."""
    rng = np.random.default_rng(seed)
    store = ExampleStore(path, BIASED.features())
    items = rng.choice(BIASED.num_items, 30, replace=False)
    store.add(
        Event({"item": int(item), "label": float(rng.integers(1, 6))}, float(t))
        for t, item in enumerate(items)
    )
    return store


@contextlib.contextmanager
def devices_training(url: str, folder: Path) -> Iterator[None]:
    """Devices that keep taking part (training, and evaluation when a round is open) until the
    block ends, on their own event loop in a thread."""
    stop = threading.Event()
    failures: list[BaseException] = []

    async def run() -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            agents = []
            for i in range(DEVICES):
                client = OrchestratorClient(url, http=http)
                await client.enroll()
                store = _store(folder / f"device-{i}.sqlite", seed=i)
                agents.append(DeviceAgent(client, store, folder / "cache", "movies", policy=DEVICE_POLICY))
            while not stop.is_set():
                for task in ("training", "evaluation"):
                    await asyncio.gather(*(a.participate(task) for a in agents))
                await asyncio.sleep(0.3)

    def thread() -> None:
        try:
            asyncio.run(run())
        except BaseException as error:  # reported by the test, not lost in the thread
            failures.append(error)

    worker = threading.Thread(target=thread, daemon=True)
    worker.start()
    try:
        yield
    finally:
        stop.set()
        worker.join(timeout=60)
    assert not failures, failures


def screenshot(page: Any, path: Path, full_page: bool = False) -> None:
    """A screenshot as PNG; in 256 colours (a third of the bytes) when kept for the docs."""
    page.screenshot(path=path, full_page=full_page)
    if os.environ.get("FEDRECON_DASHBOARD_SCREENSHOTS"):
        from PIL import Image

        with Image.open(path) as image:
            image.convert("RGB").quantize(256).save(path, optimize=True)


def admin_get(url: str, path: str) -> Any:
    answer = httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


def wait_for_rounds(
    url: str, done: Callable[[list[dict[str, Any]]], bool], why: str, population: str = "movies"
) -> None:
    """Until the population's rounds satisfy `done`, however slowly the machine runs them."""
    deadline = time.monotonic() + 120
    while not done(admin_get(url, f"/v1/admin/populations/{population}/rounds?limit=100")):
        assert time.monotonic() < deadline, f"waited 120 s for {why}"
        time.sleep(0.2)


def load_afresh(page: Any, url: str) -> None:
    """Load `url` in `page` anew. The dashboard refreshes itself (a meta refresh): a navigation of
    ours that meets one of its own is aborted (net::ERR_ABORTED), and is tried again."""
    from playwright.sync_api import Error

    deadline = time.monotonic() + 60
    while True:
        try:
            page.goto(url, wait_until="load")
            return
        except Error as error:
            if "ERR_ABORTED" not in str(error) or time.monotonic() > deadline:
                raise


def number(page: Any, selector: str) -> int:
    return int(page.locator(selector).inner_text().strip())


def test_an_operator_watches_rounds_commit_and_pauses_the_population_in_a_browser(
    export: Callable[[ModelConfig], Path], tmp_path: Path
) -> None:
    sync_playwright = _browser_or_skip()
    shots = Path(os.environ.get("FEDRECON_DASHBOARD_SCREENSHOTS") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    (tmp_path / "devices").mkdir()

    with Server(tmp_path / "orchestrator.sqlite") as server:
        created = admin_create_population(server.url, export(BIASED), "movies", json.dumps(SETTINGS))
        assert created.status_code == 201, created.text
        # A population no device takes part in: idle, not failing.
        quiet = {"round_duration_seconds": 1, "evaluation_every": 0}
        idle = admin_create_population(server.url, export(BIASED), "quiet", json.dumps(quiet))
        assert idle.status_code == 201, idle.text
        # The first rounds close empty at their deadlines (no devices yet): the charts show why.
        for name in ("movies", "quiet"):
            wait_for_rounds(
                server.url,
                lambda listed: any(r["status"] == "abandoned" for r in listed),
                f"a round of {name} to close",
                name,
            )
        with (
            devices_training(server.url, tmp_path / "devices"),
            sync_playwright() as playwright,
        ):
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            page = context.new_page()

            # Signing in: the root leads to the form; the token goes in the form's body only.
            page.goto(server.url + "/")
            assert page.url == server.url + "/dashboard"
            screenshot(page, shots / "dashboard-sign-in.png")
            page.fill("#token", "not-the-admin-token-" + "x" * 20)
            page.click("#sign-in")
            refused = page.locator("#error").inner_text()
            page.fill("#token", ADMIN_TOKEN)
            page.click("#sign-in")
            page.wait_for_selector("#populations")
            overview_html = page.content()
            (cookie,) = context.cookies()
            script_sees = page.evaluate("document.cookie")

            # Watching: the page refreshes itself, and committed rounds go up as devices report.
            page.click("text=movies")
            page.wait_for_selector("#committed")
            first = number(page, "#committed")
            deadline = time.monotonic() + 90
            while number(page, "#committed") < first + 2 and time.monotonic() < deadline:
                page.wait_for_timeout(1000)
            later = number(page, "#committed")
            screenshot(page, shots / "dashboard-population.png", full_page=True)
            running_html = page.content()
            # As Chromium lays them out: each round's mark apart from the next one in its lane.
            marks = page.eval_on_selector_all(
                "svg rect.round",
                "rs => rs.map(r => { const b = r.getBoundingClientRect();"
                " return [r.dataset.kind, b.x, b.width]; })",
            )
            accepted_parts = [
                int(cell.strip())
                for cell in page.locator("#accepted-parts tr:nth-child(2) td").all_inner_texts()
                if cell.strip()
            ]
            page.goto(server.url + "/dashboard/populations/quiet")
            quiet_html = page.content()
            quiet_privacy = page.locator("#privacy").bounding_box()
            page.goto(server.url + "/dashboard/populations/movies")

            # Pausing: no new rounds; the page says so.
            page.click("#pause")
            page.wait_for_selector("#resume")
            state = page.locator("#state").inner_text()
            paused_at = admin_get(server.url, "/v1/admin/populations/movies")["paused_at"]
            # The round open when it paused runs to its end.
            wait_for_rounds(
                server.url,
                lambda listed: not any(r["status"] == "open" and r["opened_at"] <= paused_at for r in listed),
                "the round open at the pause to close",
            )
            opened_after = [
                r["id"]
                for r in admin_get(server.url, "/v1/admin/populations/movies/rounds?limit=100")
                if r["opened_at"] > paused_at
            ]
            load_afresh(page, page.url)
            screenshot(page, shots / "dashboard-paused.png")
            paused_html = page.content()

            # A change without the session's CSRF token, with the session's cookie: refused.
            no_csrf = context.request.post(server.url + "/dashboard/populations/movies/resume", form={})
            wrong_csrf = context.request.post(
                server.url + "/dashboard/populations/movies/resume", form={"csrf": "0" * 64}
            )
            still_paused = admin_get(server.url, "/v1/admin/populations/movies")["paused_at"] is not None

            # Signing out ends the session: the same cookie opens nothing afterwards.
            page.click("#sign-out")
            page.wait_for_selector("#token")
            replayed = httpx.get(
                server.url + "/dashboard", cookies={sessions.COOKIE: cookie["value"]}, timeout=30
            )
            urls = page.url
            browser.close()

    assert refused == "wrong admin token"
    assert cookie["name"] == sessions.COOKIE and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert not cookie["secure"]  # plain HTTP on loopback; tests/orchestrator/test_dashboard.py: HTTPS
    assert cookie["expires"] > time.time() + 3600 and cookie["path"] == "/dashboard"
    assert script_sees == ""  # HttpOnly: no script reads the session
    for html in (overview_html, running_html, paused_html):
        assert ADMIN_TOKEN not in html and "<script" not in html
    assert ADMIN_TOKEN not in urls
    assert later >= first + 2, f"committed rounds stayed at {later} (from {first}) for 90 s"
    # The first round closed before a device came: grey, "no devices", not a red failure.
    assert "no devices: closed empty by deadline" in running_html and 'class="round idle"' in running_html
    by_lane: dict[str, list[tuple[float, float]]] = {}
    for kind, x, width in marks:
        by_lane.setdefault(kind, []).append((x, width))
    for lane in by_lane.values():
        lane.sort()
        assert all(x + w <= next_x + 0.01 for (x, w), (next_x, _) in itertools.pairwise(lane)), lane
    assert len(marks) >= later  # one mark per round: countable
    assert accepted_parts[0] == sum(accepted_parts[1:]), accepted_parts  # the funnel adds up
    versions = re.findall(r'class="version"[^>]*>([^<]+)<', running_html)
    assert versions and all(v.isdigit() for v in versions), versions
    for unit in ("time (UTC)", "duration (s)", "% of accepted", "model version", "devices"):
        assert unit in running_html, unit
    assert 'class="state idle"' in overview_html and "idle: no devices" in quiet_html
    assert 'class="round idle"' in quiet_html and 'class="round abandoned"' not in quiet_html
    assert "Privacy: epsilon" not in quiet_html and quiet_privacy and quiet_privacy["height"] < 40
    assert 'class="spent"' in running_html and " of 20 at delta " in running_html
    seen = re.search(r'id="devices-seen">(\d+) in all, (\d+) in the last 24 h', running_html)
    assert seen and TARGET <= int(seen[1]) == int(seen[2]) <= DEVICES, seen
    assert state == "paused" and paused_at is not None and opened_after == []
    assert no_csrf.status == 403 and wrong_csrf.status == 403 and still_paused
    assert 'action="/dashboard/sign-in"' in replayed.text
    for name in ("dashboard-sign-in.png", "dashboard-population.png", "dashboard-paused.png"):
        assert (shots / name).stat().st_size > 10_000
    shutil.rmtree(tmp_path / "devices", ignore_errors=True)


def sign_in(page: Any, url: str) -> None:
    page.goto(url + "/dashboard")
    page.fill("#token", ADMIN_TOKEN)
    page.click("#sign-in")
    page.wait_for_selector("#populations")


def test_an_operator_sees_a_buffered_populations_fill_staleness_and_versions_per_hour(
    export: Callable[[ModelConfig], Path], tmp_path: Path
) -> None:
    from tests.orchestrator.test_buffer_figures import staleness_mix
    from tests.orchestrator.test_buffered_rounds import buffered

    sync_playwright = _browser_or_skip()
    shots = Path(os.environ.get("FEDRECON_DASHBOARD_SCREENSHOTS") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    model_dir = export(BIASED)
    with Server(tmp_path / "orchestrator.sqlite") as server:
        # Over real HTTP: reports 0 and 1 versions stale counted, one 2 versions stale refused,
        # the open buffer holding one report of two.
        staleness_mix(server.url, model_dir)
        quiet = admin_create_population(
            server.url, model_dir, "quiet", buffered(buffer_size=4, concurrency=4)
        )
        assert quiet.status_code == 201, quiet.text
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
            page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
            sign_in(page, server.url)
            page.goto(server.url + "/dashboard/populations/p")
            page.wait_for_selector("#buffer-staleness")
            html = page.content()
            open_buffer = page.locator("#open-buffer").inner_text()
            bars = page.eval_on_selector_all(
                "#buffer-staleness rect.staleness",
                "rs => rs.map(r => [r.dataset.staleness, Number(r.dataset.count),"
                " r.getBoundingClientRect().height])",
            )
            hours = page.eval_on_selector_all(
                "#buffer-versions rect.hour", "rs => rs.map(r => Number(r.dataset.count))"
            )
            outcomes = page.eval_on_selector_all(
                "#buffer-outcomes rect.outcome",
                "rs => rs.map(r => [r.classList[1], Number(r.dataset.count)])",
            )
            page.locator("#buffer-fill").scroll_into_view_if_needed()
            screenshot(page, shots / "dashboard-buffered.png")
            page.goto(server.url + "/dashboard/populations/quiet")
            quiet_html = page.content()
            browser.close()

    assert re.fullmatch(r"1/2 reports, open for \d+(\.\d)? (s|min)", open_buffer), open_buffer
    assert "of 2 reports, open for" in html
    assert [(s, n) for s, n, _ in bars] == [("0", 3), ("1", 2)]
    assert bars[0][2] > bars[1][2] > 0  # drawn as tall as their counts
    assert sum(hours) == 2 and len(hours) == 24
    assert dict(outcomes) == {"counted": 5, "refused_stale": 1}
    assert "6 devices finished; 83% counted" in html
    ticks = re.findall(r'class="version"[^>]*>([^<]+)<', html)
    assert ticks and all(t.isdigit() for t in ticks), ticks
    for unit in ("staleness (versions behind)", "reports", "versions / hour", "hour (UTC)"):
        assert unit in html, unit
    assert "<script" not in html and ADMIN_TOKEN not in html
    # A buffered population no device came to: idle, not failing.
    assert 'id="buffer-idle"' in quiet_html and "idle: no report counted yet" in quiet_html
    assert "idle: no version committed in the last 24 h" in quiet_html
    assert "idle: no participation finished yet" in quiet_html
    assert (shots / "dashboard-buffered.png").stat().st_size > 10_000
