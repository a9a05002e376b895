"""The tutorials beyond the quickstart and your-model, run as a user would: each page's bash
blocks as written, from the clone's root, the command its `tutorial-test` comment names shortened
by the options it gives, and the placeholders the page explains filled in from what the run
printed."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.conftest import ROOT
from tests.test_docs import _BLOCK, _commands, _run

TUTORIALS = ROOT / "docs" / "tutorials"
_SHORTENED = re.compile(r"<!-- tutorial-test: (?P<command>.+?) \+= (?P<options>.+?) -->")
_RANKED = re.compile(r"^\s+\d+\s+(\d+)\s+-?\d", re.MULTILINE)


def tutorial(name: str) -> tuple[list[str], tuple[str, str]]:
    """A tutorial's bash blocks and its (command, extra options) shortening."""
    page = (TUTORIALS / name).read_text()
    shortened = _SHORTENED.search(page)
    assert shortened, f"{name} has no tutorial-test comment"
    return _BLOCK.findall(page), (shortened["command"], shortened["options"])


def whole(block: str) -> str:
    """A block that is one command whose quoted JSON spans lines."""
    return block.replace("\\\n", " ").strip()


def database(work: Path) -> dict[str, str]:
    """The orchestrator commands' database in `work`, not the clone's root."""
    return {"ORCHESTRATOR_DATABASE_URL": f"sqlite:///{work / 'orchestrator.sqlite'}"}


def test_the_stateful_tutorial_runs_as_written(tmp_path: Path) -> None:
    (run, create, serve), shortened = tutorial("stateful-local-parameters.md")
    (main,) = _run(_commands(run), shortened, tmp_path, {})
    (created,) = _run(_commands(create), shortened, tmp_path, database(tmp_path))

    report = json.loads((tmp_path / "runs" / "furl" / "report.json").read_text())
    population = report["population"]["name"]
    assert f"population '{population}'" in main and "final StandardEval on seen devices" in main
    assert "local parameters: keep (local learning rate 0.25)" in main  # as the page says
    assert created.startswith("created population 'furl'")
    shown = report["recommendations"][0]  # the first device whose top-10 the run showed
    (command,) = _commands(serve)
    command = command.replace("POPULATION", population).replace("DEVICE", f"{shown['device']:05d}")
    (served,) = _run([command], shortened, tmp_path, {})
    assert [int(item) for item in _RANKED.findall(served)] == shown["personalized"]


def test_the_secure_aggregation_tutorial_runs_as_written(tmp_path: Path) -> None:
    (fleet, create), shortened = tutorial("secure-aggregation-with-dp.md")
    secure, private = _commands(fleet)
    # The second command is the first with DP added: running it runs both's code.
    assert private.startswith(secure.split(" --work-dir")[0] + " --clip-norm")
    (main,) = _run([private], shortened, tmp_path, {})
    command = whole(create).replace("MODEL_DIR", "runs/secure-dp/model")  # the page's: this run's export
    (created,) = _run([command], shortened, tmp_path, database(tmp_path))

    report = json.loads((tmp_path / "runs" / "secure-dp" / "report.json").read_text())
    assert report["config"]["aggregation"] == "secure"
    privacy = report["privacy"]
    assert privacy["epsilon"] > 0 and privacy["epsilon_budget"] == 8
    assert f"differential privacy: {privacy['message']}" in " ".join(main.split())
    assert created.startswith("created population 'movies'")
