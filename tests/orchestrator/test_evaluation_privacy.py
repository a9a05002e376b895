"""What an evaluation round, and a DP population, release to a curious operator: attacks on the
operator's own views (the status, the admin routes, the console, the dashboard, /metrics) and on
what the server keeps (`orchestrator/rounds/release.py`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import HTTPException
from sqlalchemy import create_engine, select, text
from sqlalchemy.orm import Session, sessionmaker

from model_export.config import ModelConfig
from orchestrator.aggregation.differential_privacy import epsilon
from orchestrator.api.routes import admin
from orchestrator.db import Population, Report, Round
from orchestrator.populations.locks import lock_population
from orchestrator.populations.settings_changes import SettingsChangeError, change_settings
from orchestrator.rounds.lifecycle import EVALUATION, advance, open_round
from orchestrator.rounds.refusals import Refused
from orchestrator.service.population_creation import ExportedModel
from orchestrator.service.population_views import population_out
from tests.conftest import BIASED
from tests.orchestrator.conftest import ADMIN_TOKEN, Server, admin_create_population, make_population
from tests.orchestrator.test_dashboard import signed_in
from tests.orchestrator.test_rounds import checkin, delta_body, device, dp_settings, report

ROOT = Path(__file__).resolve().parents[2]
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
FLOOR = 5
SETTINGS = {
    "target_reports": 50,  # no training round commits: the evaluation is all there is to read
    "evaluation_target_reports": 10,
    "min_evaluation_reports": FLOOR,
    # Long enough for the operator's reads (a console process, the dashboard) on a loaded machine.
    "evaluation_round_duration_seconds": 15,
}


def loss_sum(device_number: int) -> float:
    """Each device's own figure: 7771.25, 7772.25, ...; any sum or mean of them starts 777 or
    is a sum of them, which FIGURES finds wherever it is printed."""
    return 7770.25 + device_number


def figures_of(devices: int) -> re.Pattern[str]:
    """One device's sums, the running sums of the first k, and their means over the examples."""
    sums = [sum(loss_sum(d) for d in range(1, k + 1)) for k in range(1, devices + 1)]
    means = [total / (10.0 * k) for k, total in enumerate(sums, start=1)]
    shown = {f"{v:{form}}" for v in [*sums, *means] for form in ("", "g", ".2f", ".4g")}
    return re.compile("(?<![0-9.])(" + "|".join(re.escape(s) for s in sorted(shown)) + ")(?![0-9])")


def evaluation_report(device_number: int) -> bytes:
    metrics = {
        "loss_sum": loss_sum(device_number),
        "squared_error_sum": 2.0 * device_number,
        "correct_sum": 1.0,
        "weight_sum": 10.0,
    }
    return json.dumps({"num_examples": 10, "metrics": metrics}).encode()


def evaluate(url: str, device_numbers: range) -> None:
    """Each device checks in for the open evaluation round and reports its own sums."""
    for number in device_numbers:
        token = httpx.post(f"{url}/v1/devices", timeout=30).json()["token"]
        device_headers = {"Authorization": f"Bearer {token}"}
        answer = httpx.post(
            f"{url}/v1/populations/p/checkin",
            json={"example_count": 40, "task": "evaluation"},
            headers=device_headers,
            timeout=30,
        ).json()
        assert answer["accepted"], answer
        sent = httpx.post(
            f"{url}{answer['report_url']}",
            content=evaluation_report(number),
            headers={**device_headers, "Content-Type": "application/json"},
            timeout=30,
        )
        assert sent.status_code == 200, sent.text


def operator_views(server: Server) -> dict[str, str]:
    """Everything an operator with the admin token reads, as text."""
    http = httpx.Client(base_url=server.url, headers=ADMIN, timeout=30)
    dashboard = signed_in(server.url)
    console = subprocess.run(
        [sys.executable, "-m", "orchestrator", "show", "p", "--rounds", "20"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "ORCHESTRATOR_URL": server.url, "ORCHESTRATOR_ADMIN_TOKEN": ADMIN_TOKEN},
        timeout=120,
    )
    assert console.returncode == 0, console.stderr
    return {
        "status": http.get("/v1/admin/populations/p").text,
        "populations": http.get("/v1/admin/populations").text,
        "rounds": http.get("/v1/admin/populations/p/rounds").text,
        "metrics": http.get("/metrics").text,
        "dashboard": dashboard.get("/dashboard/populations/p").text,
        "dashboard home": dashboard.get("/dashboard").text,
        "console": console.stdout,
    }


def evaluation_rounds(server: Server) -> list[dict[str, Any]]:
    answer = httpx.get(
        f"{server.url}/v1/admin/populations/p/rounds?kind=evaluation", headers=ADMIN, timeout=30
    )
    return list(answer.json())


def wait_closed(server: Server, round_id: int) -> dict[str, Any]:
    for _ in range(600):
        found = next(r for r in evaluation_rounds(server) if r["id"] == round_id)
        if found["status"] != "open":
            return found
        time.sleep(0.1)
    raise AssertionError(f"evaluation round {round_id} did not close")


def stored_evaluation_sums(server: Server) -> str:
    """What the database keeps of evaluation rounds' and reports' metrics, as text."""
    engine = create_engine(server.database_url)
    try:
        with engine.connect() as conn:
            kept = conn.execute(
                text(
                    "SELECT rounds.metrics, reports.metrics FROM rounds LEFT JOIN reports "
                    "ON reports.round_id = rounds.id WHERE rounds.kind = 'evaluation'"
                )
            ).all()
    finally:
        engine.dispose()
    return json.dumps([[str(cell) for cell in row] for row in kept])


def test_a_curious_operator_learns_no_sums_of_an_evaluation_round_below_the_floor(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    # Prepare: a population whose evaluation rounds release their sums only with 5 devices
    created = admin_create_population(server.url, export(BIASED), "p", json.dumps(SETTINGS))
    assert created.status_code == 201, created.text
    opened = httpx.post(f"{server.url}/v1/admin/populations/p/evaluations", headers=ADMIN, timeout=30)
    assert opened.status_code == 201, opened.text
    round_id = opened.json()["id"]

    # Execute: three devices report (the first one's sums are the round's running sums, and each
    # later one's is the difference of two); the operator reads everything, during and after
    evaluate(server.url, range(1, 4))
    during = operator_views(server)
    closed = wait_closed(server, round_id)
    after = operator_views(server)

    # Assert: no view shows any device's sum, or a sum of fewer than five, during or after; the
    # round was abandoned with why, and the server kept none of them
    figures = figures_of(3)
    for when, views in (("during", during), ("after", after)):
        for view, shown in views.items():
            assert not figures.search(shown), f"{view} {when} the round shows {figures.search(shown)}"
    open_round = next(r for r in json.loads(during["status"])["open_rounds"] if r["kind"] == "evaluation")
    assert open_round["metrics"] == {} and open_round["counters"]["reported"] == 3
    assert closed["status"] == "abandoned" and closed["metrics"] == {}
    assert (closed["devices_had"], closed["devices_needed"], closed["ended_by"]) == (3, FLOOR, "deadline")
    assert "only 3 reports by the deadline; the round needed 5" in closed["close_reason"]
    assert not figures.search(stored_evaluation_sums(server))

    # ... while a round with five devices releases its sums (what the operator may read)
    opened = httpx.post(f"{server.url}/v1/admin/populations/p/evaluations", headers=ADMIN, timeout=30)
    evaluate(server.url, range(1, FLOOR + 1))
    released = wait_closed(server, opened.json()["id"])
    assert released["status"] == "committed"
    assert released["metrics"]["loss_sum"] == pytest.approx(sum(loss_sum(d) for d in range(1, FLOOR + 1)))
    # Its interval would need two groups of five: none is shown, and no group's sum is kept
    assert not any(k.endswith(("_low", "_high")) or "group" in k for k in released["metrics"])
    assert "interval_group" not in stored_evaluation_sums(server)
    assert "<h2>loss</h2>" in operator_views(server)["dashboard"]


def test_the_floor_changes_live_from_the_next_evaluation_round_and_stays_within_the_target(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, evaluation_target_reports=10)
    with db.begin() as session:
        population = lock_population(session, "p")
        assert population is not None
        before = open_round(session, population, EVALUATION, 1.0)
        change_settings(session, population, {"min_evaluation_reports": 8}, "ops", 2.0)
        with pytest.raises(
            SettingsChangeError, match=r"min_evaluation_reports \(11\) must be <= evaluation_target"
        ):
            change_settings(session, population, {"min_evaluation_reports": 11}, "ops", 2.0)
    with db.begin() as session:
        population = lock_population(session, "p")
        assert population is not None
        before.status = "abandoned"
        session.merge(before)
        after = open_round(session, population, EVALUATION, 3.0)

    assert (before.min_reports, after.min_reports) == (5, 8)


def _population(factory: sessionmaker[Session]) -> Population:
    with factory() as session:
        return session.scalars(select(Population)).one()


def test_after_the_dp_budget_is_spent_no_round_of_any_kind_releases_unnoised_figures(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    # Prepare: a DP population with a budget of exactly one training round, evaluating after every
    # commit with a floor of one (so only the budget stands between a device and the operator);
    # an evaluation round is open, and one device has reported its sums into it
    budget = epsilon(1.0, 1 / 100, 1, 1e-5)
    dp = dp_settings(10.0, 1.0, epsilon_budget=budget)
    make_population(
        db,
        biased_model,
        target_reports=1,
        evaluation_every=1,
        evaluation_target_reports=2,
        min_evaluation_reports=1,
        differential_privacy=dp,
    )
    with db.begin() as session:
        population = lock_population(session, "p")
        assert population is not None
        evaluation = open_round(session, population, EVALUATION, 0.5)
    evaluator = device(db)
    assigned = checkin(db, evaluator, kind="evaluation")
    sent = report(db, evaluator, assigned.assignment_id, evaluation_report(1), ctype="application/json")
    assert not isinstance(sent, Refused), sent

    # Execute: the training round that spends the budget commits; then the operator asks for an
    # evaluation, a device asks for one, and the round's deadline passes
    trainer = device(db)
    committed = report(db, trainer, checkin(db, trainer).assignment_id, delta_body(biased_model, 0.1))
    with pytest.raises(HTTPException) as scheduled:
        admin.schedule_evaluation("p", None, db, lambda: 3.0)  # type: ignore[arg-type]
    refused = checkin(db, device(db), kind="evaluation", now=4.0)
    with db.begin() as session:
        population = lock_population(session, "p")
        assert population is not None
        advance(session, population, 100.0)

    # Assert: the open evaluation round was abandoned with why and its sums erased; none opened
    # since, from the schedule or the admin API (409), and no training round either
    assert committed.status == "committed" and committed.result_version == 1
    assert scheduled.value.status_code == 409 and "privacy budget is spent" in scheduled.value.detail
    assert isinstance(refused, Refused)
    with db() as session:
        closed = session.get(Round, evaluation.id)
        assert closed is not None
        assert (closed.status, closed.ended_by, closed.metrics) == ("abandoned", "privacy_budget", {})
        assert "privacy budget is spent" in closed.close_reason
        assert all(
            r.metrics == {} for r in session.scalars(select(Report).where(Report.round_id == evaluation.id))
        )
        kinds = [(r.kind, r.status) for r in session.scalars(select(Round).order_by(Round.id))]
        status = population_out(session, session.scalars(select(Population)).one())
    assert kinds == [("training", "committed"), ("evaluation", "abandoned")]
    assert status.open_rounds == [] and status.privacy is not None and status.privacy.budget_spent
    assert not figures_of(1).search(json.dumps([r.metrics for r in status.recent_rounds]))


def test_an_open_dp_round_never_shows_one_devices_within_clip_bit(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    # Prepare: adaptive clipping; a round of two that one device reports into, then is abandoned
    adaptive = {"target_unclipped_quantile": 0.5, "clipped_count_stddev": 1.0}
    make_population(
        db,
        biased_model,
        target_reports=2,
        min_reports=2,
        round_duration_seconds=10,
        differential_privacy=dp_settings(10.0, 1.0, **adaptive),
    )
    dev = device(db)
    answer = checkin(db, dev)
    sent = report(
        db, dev, answer.assignment_id, delta_body(biased_model, 0.1, metrics={"dp_within_clip": 0.0})
    )
    assert not isinstance(sent, Refused), sent

    # Execute: the operator reads the open round, and the round after its deadline
    with db() as session:
        during = population_out(session, session.scalars(select(Population)).one())
    with db.begin() as session:
        population = lock_population(session, "p")
        assert population is not None
        advance(session, population, 11.0)
    with db() as session:
        after = population_out(session, session.scalars(select(Population)).one())
        abandoned = session.get(Round, answer.round_id)
        assert abandoned is not None

    # Assert: the device's bit is in no view and not kept; the clip norm the round used still is
    assert [r.counters["reported"] for r in during.open_rounds] == [1]
    assert all("dp_within_clip" not in r.metrics for r in [*during.open_rounds, *after.recent_rounds])
    assert abandoned.status == "abandoned" and "dp_within_clip" not in abandoned.metrics
    assert abandoned.metrics["dp_clip_norm"] == 10.0
