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
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from android_sim.__main__ import admin_token as fleet_admin_token
from android_sim.__main__ import build_parser
from android_sim.builtin_data import load_data, model_config
from android_sim.run_config import RunConfig
from model_export.config import ModelConfig
from orchestrator.local import free_port
from tests.conftest import ROOT
from tests.orchestrator.conftest import POSTGRES_URL, fresh_postgres_database
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
    assert created.startswith("created population 'movies-private'")


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
    (mixed,) = _run(_commands(mix), shortened, tmp_path, env)  # runs/central.safetensors: the code's
    (central,) = _run(_commands(central_only), shortened, tmp_path, env)

    assert created.startswith("created population 'expressions'")
    attached = json.loads(mixed)
    assert attached["mixing"]["strategy"] == "parallel_training"
    assert (attached["num_examples"], attached["groups"]) == (4, 3)
    assert central.startswith("created population 'new-expressions'")


def quickstart_model(export: Callable[[ModelConfig], Path], work: Path) -> None:
    """`runs/quickstart/model` in `work`: the quickstart's export, which pages name."""
    model = export(model_config(load_data(RunConfig(work_dir=work))))
    shutil.copytree(model, work / "runs" / "quickstart" / "model")


def test_the_fleet_against_a_server_takes_any_admin_token_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # token_urlsafe, as the pages make it, starts with "-" one time in 64 (on the command line,
    # argparse took it for an option); and a token there shows in process lists.
    blocks, _ = tutorial("postgresql.md")
    clients = next(block for block in blocks if "create-population movies" in block)
    fleet = _commands(clients)[-1].removeprefix("./dev main")
    monkeypatch.setenv("ORCHESTRATOR_ADMIN_TOKEN", "-lWd")
    args = build_parser().parse_args(["run", *shlex.split(fleet)])
    assert "--admin-token" not in fleet and fleet_admin_token(args) == "-lWd"


@pytest.mark.skipif(not POSTGRES_URL, reason="needs TEST_POSTGRES_URL, a PostgreSQL server (CI sets it)")
def test_the_postgresql_tutorial_runs_as_written(
    export: Callable[[ModelConfig], Path], tmp_path: Path
) -> None:
    blocks, shortened = tutorial("postgresql.md")
    server = next(block for block in blocks if "serve --workers" in block)
    clients = next(block for block in blocks if "create-population movies" in block)
    *exports, serve = _commands(server)
    serve = serve.split("#")[0].strip()  # without its comment
    assert all(line.startswith("export ORCHESTRATOR_") for line in exports)
    assert serve.startswith(".venv/bin/python -m orchestrator serve --workers 4")
    quickstart_model(export, tmp_path)
    port = free_port()  # the page's 8700 may be taken on a shared machine
    with fresh_postgres_database() as url:
        # The page's exports in a shell, its database the test's; the server started as written.
        script = "\n".join(
            re.sub(r"^export ORCHESTRATOR_DATABASE_URL=.*", f"export ORCHESTRATOR_DATABASE_URL={url}", line)
            for line in exports
        )
        token_file = tmp_path / "token"
        script += f'\nprintf %s "$ORCHESTRATOR_ADMIN_TOKEN" > {token_file}\nexec {serve} --port {port}'
        with open(tmp_path / "serve.log", "wb") as log:
            process = subprocess.Popen(["bash", "-c", script], cwd=ROOT, stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 90
            while True:
                assert process.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/openapi.json", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the server did not answer"
                time.sleep(0.2)
            token = token_file.read_text()
            env = {"ORCHESTRATOR_DATABASE_URL": url, "ORCHESTRATOR_ADMIN_TOKEN": token}
            commands = [
                c.replace('"$ORCHESTRATOR_ADMIN_TOKEN"', token).replace(":8700", f":{port}")
                for c in _commands(clients)
            ]
            created, status, fleet = _run(commands, shortened, tmp_path, env)
        finally:
            process.terminate()
            process.wait(timeout=60)

    assert created.startswith("created population 'movies'")
    assert json.loads(status)["settings"]["target_reports"] == 100
    assert "population 'movies-fleet'" in fleet and "training rounds committed" in fleet
