"""docs/reference/examples-table.md as written: its table imported by its command, its error lines
what the import prints, and its Python examples run in order (the agent's against a real server)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.settings import Settings
from tests.conftest import ROOT
from tests.orchestrator.conftest import Server, admin_create_population

PAGE = ROOT / "docs" / "reference" / "examples-table.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", PAGE.read_text(), re.MULTILINE | re.DOTALL)


def run(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """A command of the page, with the installed console scripts on the PATH."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(shlex.split(command), capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


@pytest.fixture
def session(hour_recommender_model: Path, tmp_path: Path) -> Path:
    """The folder the page works in: the export as `hourrec/`, the page's table as `shares.csv`."""
    (tmp_path / "hourrec").symlink_to(hour_recommender_model)
    (tmp_path / "shares.csv").write_text(blocks("csv")[0])
    return tmp_path


def test_the_import_command_and_the_python_examples_run_as_written(session: Path) -> None:
    (command,) = blocks("bash")
    imported = run(command, session)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.startswith("stores: 3 examples of 3 rows in 2 example stores (2 created")

    # The page's agent talks to a server at the orchestrator's default address, as `./dev serve` starts it.
    default = f"http://127.0.0.1:{Settings.model_fields['port'].default}"
    assert any(default in code for code in blocks("python")), default

    server = Server(session / "orchestrator.sqlite").start()
    try:
        settings = {"target_reports": 1, "min_reports": 1, "min_examples": 1, "round_duration_seconds": 60}
        created = admin_create_population(server.url, session / "hourrec", "hourrec", json.dumps(settings))
        assert created.status_code == 201, created.text
        namespace: dict[str, object] = {}
        out = io.StringIO()
        cwd = Path.cwd()
        os.chdir(session)
        try:
            with contextlib.redirect_stdout(out):
                for code in blocks("python"):
                    exec(code.replace(default, server.url), namespace)
        finally:
            os.chdir(cwd)
    finally:
        server.stop()
    printed = out.getvalue()
    assert "completed" in printed and "\nreported " in printed, printed


def test_the_error_lines_are_what_the_import_prints(session: Path) -> None:
    header = "device_id,timestamp,expression,hour\n"
    good = "ana,1,3,21\n"
    tables = [
        header + good + good + "ana,1,30,21\n",
        header + good + "ana,1,3,\n",
        header + good * 6 + "ana,yesterday,3,21\n",
        "device_id,timestamp,expression,hr\n" + good,
    ]
    (text,) = blocks("text")
    expected = text.strip().splitlines()
    assert len(expected) == len(tables)
    for table, line in zip(tables, expected, strict=True):
        (session / "shares.csv").write_text(table)
        result = run("device-runtime import --model-dir hourrec --examples shares.csv --out stores", session)
        assert result.returncode == 2 and result.stderr.strip() == line
    assert not (session / "stores").exists()
