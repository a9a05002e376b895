"""The tutorials beyond the quickstart and your-model, run as a user would: each page's bash
blocks as written, from the clone's root, the command its `tutorial-test` comment names shortened
by the options it gives, and the placeholders the page explains filled in from what the run
printed."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from android_sim.__main__ import build_parser
from android_sim.builtin_data import load_data, model_config
from android_sim.run_config import RunConfig
from model_export.config import ModelConfig
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


def test_the_mixing_tutorial_runs_as_written(export: Callable[[ModelConfig], Path], tmp_path: Path) -> None:
    page = (TUTORIALS / "mixing-centralized-data.md").read_text()
    (fleet, create, mix, central_only), shortened = tutorial("mixing-centralized-data.md")
    examples, *others = _commands(fleet)
    for command in others:  # their options parse; running each would take as long again
        build_parser().parse_args(["run", *shlex.split(command.removeprefix("./dev main"))])
    (main,) = _run([examples], shortened, tmp_path, {})
    report = json.loads((tmp_path / "runs" / "mix-examples" / "report.json").read_text())
    assert report["mixing"]["mixing"]["strategy"] == "example_transfer"
    assert report["mixing"]["central_bytes_per_assignment"] == 296  # the page's table, for 16
    assert report["algorithm"]["task_config"]["central_only_items"]  # where the page says
    assert "mixing: example_transfer over" in " ".join(main.split())

    # The quickstart's model, which the page's population uses.
    quickstart = tmp_path / "runs" / "quickstart" / "model"
    shutil.copytree(export(model_config(load_data(RunConfig(work_dir=tmp_path)))), quickstart)
    env = database(tmp_path)
    (created,) = _run(_commands(create), shortened, tmp_path, env)
    (code,) = re.findall(r"^```python\n(.*?)^```", page, re.MULTILINE | re.DOTALL)
    written = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert written.returncode == 0, written.stderr
    (command,) = _commands(mix)
    (mixed,) = _run(
        [command.replace("central.safetensors", str(tmp_path / "central.safetensors"))],
        shortened,
        tmp_path,
        env,
    )
    (central,) = _run(_commands(central_only), shortened, tmp_path, env)

    assert created.startswith("created population 'expressions'")
    attached = json.loads(mixed)
    assert attached["mixing"]["strategy"] == "parallel_training"
    assert (attached["num_examples"], attached["groups"]) == (4, 3)
    assert central.startswith("created population 'new-expressions'")
