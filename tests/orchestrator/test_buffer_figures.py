"""A buffered population's figures over real HTTP: reports of staleness 0, 1 and one refused as
too stale; the admin API's `buffer`, the console's status and /metrics' staleness histogram and
buffer fill agree with each other and with the database's rows."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from model_export.config import ModelConfig
from orchestrator.console import render
from orchestrator.db import Round
from orchestrator.rounds.buffering import staleness_histogram
from orchestrator.service import buffer_figures
from tests.conftest import BIASED
from tests.orchestrator.conftest import ADMIN_TOKEN, Server, admin_create_population
from tests.orchestrator.test_buffered_rounds import Phone, body_for, buffered
from tests.orchestrator.test_several_processes import rounds_of

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def staleness_mix(url: str, model_dir: Path) -> None:
    """Versions 1 and 2 committed from reports 0 and 1 versions stale, one report 2 versions stale
    refused, and the open buffer holding one fresh report: staleness 0: 3 reports, 1: 2."""
    created = admin_create_population(
        url, model_dir, "p", buffered(buffer_size=2, concurrency=5, max_staleness=1)
    )
    assert created.status_code == 201, created.text
    body = body_for(model_dir)
    a, b, c, d, e = (Phone(url) for _ in range(5))
    for phone in (a, b, c, d, e):
        assert phone.checkin()["accepted"] is True
    assert a.report(body).status_code == 200
    assert b.report(body).json()["round_status"] == "committed"  # version 1: staleness 0, 0
    assert c.report(body).status_code == 200
    assert d.report(body).json()["round_status"] == "committed"  # version 2: staleness 1, 1
    stale = e.report(body)  # trained on version 0, now 2: refused
    assert stale.status_code == 409 and "versions behind" in stale.json()["detail"]
    a.checkin()
    assert a.assignment["model_version"] == 2
    assert a.report(body).json()["reported"] == 1  # the open buffer: 1/2, staleness 0


def metric_samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics", headers=ADMIN, timeout=30).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def database_staleness(database_url: str) -> dict[int, int]:
    """The reports by staleness summed over the population's rounds, read from the database."""
    engine = create_engine(database_url)
    try:
        with Session(engine) as session:
            total: dict[int, int] = {}
            for sums in session.scalars(select(Round.metrics).where(Round.kind == "training")):
                for s, n in staleness_histogram(sums or {}).items():
                    total[s] = total.get(s, 0) + n
            return total
    finally:
        engine.dispose()


def test_the_status_the_console_and_the_metrics_show_the_buffers(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    model_dir = export(BIASED)
    staleness_mix(server.url, model_dir)
    view = httpx.get(f"{server.url}/v1/admin/populations/p", headers=ADMIN, timeout=30).json()
    b = view["buffer"]
    assert (b["open_reports"], b["buffer_size"], b["window_versions"]) == (1, 2, 2)
    assert b["staleness_counts"] == [3, 2]
    assert (b["counted"], b["refused_stale"], b["expired"], b["invalid"]) == (5, 1, 0, 0)
    assert sum(b["versions_per_hour"]) == 2 and len(b["versions_per_hour"]) == buffer_figures.HOURS

    shown = render.population(view, rounds_of(server.url), time.time())
    assert f"buffer: #{b['open_round_id']} 1/2 reports, open for " in shown
    assert (
        "staleness (the newest 2 committed buffers and the open one): mean 0.40 versions; "
        "reports by staleness 0: 3, 1: 2"
    ) in shown
    assert (
        "finished participations: 6, counted 5 (83%), refused as too stale 1, dropped at their deadline 0, "
        "invalid or aborted 0"
    ) in shown
    assert "versions committed: " in shown and ", 2 in the last 24 h" in shown

    samples = metric_samples(server.url)
    population = (("population", "p"),)
    stored = database_staleness(server.database_url)
    assert stored == {0: 3, 1: 2}
    for le in ("0.0", "1.0", "2.0", "100.0", "+Inf"):
        key = ("orchestrator_report_staleness_versions_bucket", (("le", le), ("population", "p")))
        assert samples[key] == sum(n for s, n in stored.items() if le == "+Inf" or s <= float(le))
    assert samples[("orchestrator_report_staleness_versions_count", population)] == sum(stored.values())
    assert samples[("orchestrator_report_staleness_versions_sum", population)] == sum(
        s * n for s, n in stored.items()
    )
    assert samples[("orchestrator_buffer_reports", population)] == 1
    assert samples[("orchestrator_buffer_size_reports", population)] == 2
    assert (
        samples[
            (
                "orchestrator_reports_total",
                (("kind", "training"), ("outcome", "stale"), ("population", "p"), ("reason", "stale")),
            )
        ]
        == 1
    )


def test_a_synchronous_population_has_no_buffer_figures(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    created = admin_create_population(server.url, export(BIASED), "p", '{"target_reports": 2}')
    assert created.status_code == 201, created.text
    view = httpx.get(f"{server.url}/v1/admin/populations/p", headers=ADMIN, timeout=30).json()
    assert view["buffer"] is None
    assert "buffer:" not in render.population(view, [], time.time())
    assert not any(name.startswith("orchestrator_buffer") for name, _ in metric_samples(server.url))


def test_versions_per_hour_count_each_commit_in_its_whole_utc_hour() -> None:
    now = 1_800_000_000.0 + 0.5 * buffer_figures.HOUR  # half past an hour
    this_hour = now - 0.5 * buffer_figures.HOUR
    start, counts = buffer_figures.versions_per_hour(
        [
            this_hour,
            this_hour - 1,
            this_hour - 23 * buffer_figures.HOUR,
            this_hour - 23 * buffer_figures.HOUR - 1,
        ],
        now,
    )
    assert start == this_hour - 23 * buffer_figures.HOUR
    assert len(counts) == buffer_figures.HOURS and sum(counts) == 3  # the last is 24 h back: out
    assert (counts[0], counts[-2], counts[-1]) == (1, 1, 1)


def test_staleness_counts_fill_the_staleness_no_report_had_with_zeros() -> None:
    assert buffer_figures.staleness_counts({}) == []
    assert buffer_figures.staleness_counts({0: 2, 3: 1}) == [2, 0, 0, 1]
