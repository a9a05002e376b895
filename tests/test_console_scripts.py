"""The installed console commands ([project.scripts]): each runs, and its --help fits one screen."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCRIPTS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
SCREEN_LINES, SCREEN_COLUMNS = 55, 80
# Subcommands whose own --help must fit one screen too.
SUBCOMMANDS = {"device-runtime": ["import", "recommend", "predict"]}


def test_every_command_line_is_a_console_script() -> None:
    assert SCRIPTS == {
        "model-export": "model_export.__main__:main",
        "device-runtime": "device_runtime.__main__:main",
        "orchestrator": "orchestrator.__main__:main",
        "android-sim": "android_sim.__main__:main",
        "android-sim-datasets": "android_sim.datasets:main",
    }


def run_help(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    path = Path(sys.executable).parent / script
    if not path.exists():
        pytest.fail(f"{path} is not installed: `./dev setup` (pip install -e .) installs the console scripts")
    return subprocess.run(
        [str(path), *args, "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": str(SCREEN_COLUMNS), "TF_CPP_MIN_LOG_LEVEL": "3"},
        timeout=120,
    )


@pytest.mark.parametrize(
    ("script", "args"),
    [(script, ()) for script in SCRIPTS] + [(s, (sub,)) for s, subs in SUBCOMMANDS.items() for sub in subs],
    ids=lambda value: value if isinstance(value, str) else " ".join(value),
)
def test_help_says_what_the_command_does_in_one_screen(script: str, args: tuple[str, ...]) -> None:
    module = SCRIPTS[script].partition(":")[0]
    if importlib.util.find_spec(module.removesuffix(".__main__")) is None:
        pytest.skip(f"{module} is not in this tree")
    result = run_help(script, *args)

    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("usage: ")
    description = result.stdout.split("\n\n")[1]
    assert len(description.split()) >= 5, f"{script} --help has no description: {result.stdout}"
    assert len(lines) <= SCREEN_LINES, f"{script} {' '.join(args)} --help is {len(lines)} lines"
