"""The operator's console (`python -m orchestrator populations|show|evaluate|download`) against a
real server on loopback, with the admin token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from model_export.config import ModelConfig
from orchestrator.console import render
from tests.conftest import BIASED, ROOT
from tests.orchestrator.conftest import ADMIN_TOKEN, Server, admin_create_population


@pytest.fixture
def console(server: Server) -> Callable[..., subprocess.CompletedProcess[str]]:
    env = {**os.environ, "ORCHESTRATOR_URL": server.url, "ORCHESTRATOR_ADMIN_TOKEN": ADMIN_TOKEN}

    def run(*args: str, token: str | None = ADMIN_TOKEN) -> subprocess.CompletedProcess[str]:
        used = dict(env)
        if token is None:
            del used["ORCHESTRATOR_ADMIN_TOKEN"]
        else:
            used["ORCHESTRATOR_ADMIN_TOKEN"] = token
        return subprocess.run(
            [sys.executable, "-m", "orchestrator", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=used,
            timeout=120,
        )

    return run


def test_an_operator_lists_shows_evaluates_and_downloads_a_population(
    server: Server,
    console: Callable[..., subprocess.CompletedProcess[str]],
    export: Callable[[ModelConfig], Path],
    tmp_path: Path,
) -> None:
    settings = {"target_reports": 2, "min_reports": 2, "round_duration_seconds": 1}
    created = admin_create_population(server.url, export(BIASED), "movies", json.dumps(settings))
    assert created.status_code == 201, created.text
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # an idle round closes at its deadline, 1 s
        listed = httpx.get(f"{server.url}/v1/admin/populations/movies/rounds", headers=admin, timeout=10)
        if any(r["status"] != "open" for r in listed.json()):
            break
        time.sleep(0.2)

    listing = console("populations")
    listing_json = console("populations", "--json")
    shown = console("show", "movies")
    shown_json = console("show", "movies", "--json", "--rounds", "3")
    evaluated = console("evaluate", "movies")
    again = console("evaluate", "movies")
    downloaded = console("download", "movies", "--out", str(tmp_path / "model"))
    paused = console("pause", "movies")
    listed_paused = console("populations")
    evaluate_paused = console("evaluate", "movies")
    resumed = console("resume", "movies", "--json")
    changed = console("change-settings", "movies", "target_reports=3", "--operator", "alice")
    unsafe = console("change-settings", "movies", 'aggregation="secure"')
    history = console("settings-history", "movies")
    archived = console("archive", "movies")
    hidden = console("populations")
    shown_all = console("populations", "--all")
    resume_archived = console("resume", "movies")

    assert listing.returncode == 0, listing.stderr
    assert listing.stdout.splitlines()[1].startswith("movies") and "abandoned in reporting" in listing.stdout
    assert [p["name"] for p in json.loads(listing_json.stdout)] == ["movies"]
    assert shown.returncode == 0, shown.stderr
    assert "version 0, 0 training rounds committed" in shown.stdout
    assert "abandoned in reporting by deadline, 0 of 2 devices" in shown.stdout
    assert "why: only 0 reports by the deadline; the round needed 2 (no device checked in)" in shown.stdout
    assert " UTC" in shown.stdout and "privacy: no differential privacy" in shown.stdout
    as_json = json.loads(shown_json.stdout)
    assert as_json["settings"]["target_reports"] == 2 and 1 <= len(as_json["rounds"]) <= 3
    assert evaluated.returncode == 0 and "opened evaluation round #" in evaluated.stdout
    assert again.returncode == 2 and again.stderr.count("\n") == 1
    assert "an evaluation round is already open" in again.stderr
    assert downloaded.returncode == 0, downloaded.stderr
    assert paused.returncode == 0 and "movies paused since" in paused.stdout, paused.stderr
    assert "(paused)" in listed_paused.stdout
    assert evaluate_paused.returncode == 2 and "the population is paused" in evaluate_paused.stderr
    assert resumed.returncode == 0 and json.loads(resumed.stdout)["paused_at"] is None
    assert any(r["kind"] == "training" for r in json.loads(resumed.stdout)["open_rounds"])
    assert changed.returncode == 0, changed.stderr
    assert "settings version 1: target_reports=3" in changed.stdout
    assert unsafe.returncode == 2 and "cannot change aggregation" in unsafe.stderr
    assert unsafe.stderr.count("\n") == 1
    assert archived.returncode == 0 and "movies archived since" in archived.stdout, archived.stderr
    assert hidden.stdout.strip() == "no populations" and "(archived)" in shown_all.stdout
    assert resume_archived.returncode == 2 and "is archived: it cannot be resumed" in resume_archived.stderr
    assert "version 1 " in history.stdout and "by alice (127.0.0.1): target_reports 2 -> 3" in history.stdout
    for name in ("model.tflite", "manifest.json", "global_params.safetensors"):
        assert (tmp_path / "model" / name).read_bytes() == (export(BIASED) / name).read_bytes() or (
            name == "manifest.json"
            and json.loads((tmp_path / "model" / name).read_text())
            == json.loads((export(BIASED) / name).read_text())
        )


def test_bad_input_is_one_line_and_exit_2(
    server: Server, console: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    unknown = console("show", "nope")
    wrong_token = console("populations", token="not-the-admin-token")
    no_token = console("populations", token=None)
    bad_count = console("show", "nope", "--rounds", "0")
    no_version = console("download", "nope", "--out", "x", "--version", "-1")

    for answer in (unknown, wrong_token, no_token):
        assert answer.returncode == 2 and answer.stderr.count("\n") == 1, answer.stderr
        assert "Traceback" not in answer.stderr
    assert "404 no population 'nope'" in unknown.stderr
    assert "403" in wrong_token.stderr and "ORCHESTRATOR_ADMIN_TOKEN" in no_token.stderr
    assert bad_count.returncode == 2 and "expected a positive whole number" in bad_count.stderr
    assert no_version.returncode == 2 and "expected a whole number >= 0" in no_version.stderr


def test_an_unreachable_server_is_one_line_and_exit_1(
    console: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    down = console("populations", "--url", "http://127.0.0.1:9")

    assert down.returncode == 1 and down.stderr.startswith("error: cannot reach http://127.0.0.1:9")
    assert down.stderr.count("\n") == 1


def test_the_globals_and_manifest_take_the_admin_token_and_refuse_other_strangers(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    created = admin_create_population(server.url, export(BIASED), "p", "{}")
    assert created.status_code == 201, created.text
    url = f"{server.url}/v1/populations/p"

    admin = httpx.get(f"{url}/models/0/global", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    stranger = httpx.get(f"{url}/models/0/global", headers={"Authorization": "Bearer x.y"})
    manifest = httpx.get(f"{url}/manifest", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})

    assert admin.status_code == 200
    assert admin.content == (export(BIASED) / "global_params.safetensors").read_bytes()
    assert stranger.status_code == 401 and manifest.status_code == 200


def test_show_counts_the_devices_seen_and_lists_the_model_versions_kept(
    server: Server,
    console: Callable[..., subprocess.CompletedProcess[str]],
    export: Callable[[ModelConfig], Path],
) -> None:
    settings = {"target_reports": 3, "min_reports": 3, "round_duration_seconds": 30, "min_examples": 1}
    created = admin_create_population(server.url, export(BIASED), "movies", json.dumps(settings))
    assert created.status_code == 201, created.text
    before = console("show", "movies")
    accepted = 0
    for _ in range(2):  # two devices check in and are assigned; a third enrolls and never does
        device = httpx.post(f"{server.url}/v1/devices", timeout=10).json()
        answer = httpx.post(
            f"{server.url}/v1/populations/movies/checkin",
            json={"example_count": 40, "task": "training"},
            headers={"Authorization": f"Bearer {device['token']}"},
            timeout=10,
        )
        accepted += answer.json()["accepted"]
    httpx.post(f"{server.url}/v1/devices", timeout=10)

    after = console("show", "movies")
    as_json = json.loads(console("show", "movies", "--json").stdout)

    assert "devices seen: none yet" in before.stdout
    assert "model versions: current 0; kept: 0 (export, " in before.stdout
    assert accepted == 2
    assert "devices seen: 2 in all, 2 in the last 24 h, last " in after.stdout
    assert as_json["devices_seen"]["total"] == 2 and as_json["devices_seen"]["last_day"] == 2
    assert [v["version"] for v in as_json["model_versions"]] == [0]
    assert as_json["model_versions"][0]["round_id"] is None


def test_a_committed_evaluation_round_shows_its_figures_with_their_intervals() -> None:
    # Prepare: a committed evaluation round as the admin API lists it, with and without intervals
    base = {"id": 7, "kind": "evaluation", "status": "committed", "opened_at": 0.0, "closed_at": 5.0}
    base = {**base, "target": 40, "counters": {"reported": 40}}
    with_intervals = {
        "weight_sum": 400.0,
        "loss": 0.3914,
        "loss_low": 0.35,
        "loss_high": 0.43,
        "accuracy": 0.8661,
        "accuracy_low": 0.84,
        "accuracy_high": 0.89,
        "interval_groups": 8.0,
    }
    without = {"weight_sum": 40.0, "loss": 0.5, "accuracy": 0.8}

    # Execute
    shown = render.round_line({**base, "metrics": with_intervals}, 10.0)
    bare = render.round_line({**base, "metrics": without}, 10.0)
    training = render.round_line({**base, "kind": "training", "metrics": with_intervals}, 10.0)

    # Assert
    assert (
        "figures: loss 0.391 [0.35, 0.43], accuracy 0.866 [0.84, 0.89] (95% intervals from 8 groups" in shown
    )
    assert "figures: loss 0.5, accuracy 0.8 (too few devices for an interval)" in bare
    assert "figures:" not in training


def test_the_admin_commands_find_the_server_at_orchestrator_port(server: Server) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ORCHESTRATOR_URL"}
    env.update(ORCHESTRATOR_ADMIN_TOKEN=ADMIN_TOKEN, ORCHESTRATOR_PORT=str(server.port))

    def run(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "orchestrator", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**env, **extra},
            timeout=120,
        )

    found = run("populations", "--json")
    bad_port = run("populations", ORCHESTRATOR_PORT="eighty")

    assert found.returncode == 0 and json.loads(found.stdout) == [], found.stderr
    assert bad_port.returncode == 2 and bad_port.stderr.count("\n") == 1, bad_port.stderr
    assert "ORCHESTRATOR_PORT must be a port number (1-65535), got 'eighty'" in bad_port.stderr
