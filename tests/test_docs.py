"""The documentation as a user meets it: the README is short and self-contained, and the
quickstart's commands run as written (the README's and the docs site's, which must agree),
shortened only by the options the page's `quickstart-test` comment names."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from model_export.config import ModelConfig
from tests.conftest import ROOT, SMALL, dataset_folder

README = ROOT / "README.md"
QUICKSTART = ROOT / "docs" / "tutorials" / "quickstart.md"
_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)
_SHORTENED = re.compile(r"<!-- quickstart-test: (?P<command>.+?) \+= (?P<options>.+?) -->")


def _section(markdown: str, heading: str) -> str:
    """The text under `## heading...` up to the next heading of that level."""
    match = re.search(rf"^## {re.escape(heading)}.*?$(.*?)(?=^## |\Z)", markdown, re.MULTILINE | re.DOTALL)
    assert match, f"no '## {heading}' section"
    return match[1]


def _commands(block: str) -> list[str]:
    """A bash block's commands, continuation lines joined."""
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def quickstart() -> tuple[list[list[str]], tuple[str, str]]:
    """The quickstart's command blocks and its (command, extra options) shortening."""
    text = _section(README.read_text(), "Quickstart")
    blocks = [_commands(b) for b in _BLOCK.findall(text)]
    shortened = _SHORTENED.search(text)
    assert blocks and shortened, "the README's quickstart has no bash blocks or no quickstart-test comment"
    return blocks, (shortened["command"], shortened["options"])


def test_the_readme_fits_on_a_few_screens_and_names_nothing_outside_the_clone() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < 300
    assert "/".join(("..", "shared")) not in text
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).is_file(), f"README links to {link}, which does not exist"


def test_the_readme_and_the_docs_quickstart_are_the_same_commands() -> None:
    blocks, shortened = quickstart()
    docs = QUICKSTART.read_text()
    assert [_commands(b) for b in _BLOCK.findall(docs)] == blocks
    docs_shortened = _SHORTENED.search(docs)
    assert docs_shortened and (docs_shortened["command"], docs_shortened["options"]) == shortened


def _run(commands: list[str], shortened: tuple[str, str], work: Path, env: dict[str, str]) -> list[str]:
    """Each command from the clone's root as written, `runs/` moved under `work`, the named
    command given the shortening options; returns their outputs."""
    outputs = []
    for command in commands:
        if command.startswith(shortened[0]):
            command = f"{command} {shortened[1]}"
        words = [word.replace("runs/", f"{work}/runs/", 1) for word in shlex.split(command)]
        result = subprocess.run(
            words, cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, **env}
        )
        assert result.returncode == 0, f"`{command}` failed:\n{result.stderr[-3000:]}"
        outputs.append(result.stdout)
    return outputs


def test_the_quickstart_runs_as_written(tmp_path: Path) -> None:
    blocks, shortened = quickstart()
    main, recommend = _run(blocks[0], shortened, tmp_path, {})

    assert "training rounds committed" in main
    report = json.loads((tmp_path / "runs" / "quickstart" / "report.json").read_text())
    assert report["rounds"]
    ranked = [line for line in recommend.splitlines() if re.match(r"^\s+\d+\s+\d+\s+-?\d", line)]
    assert len(ranked) == 5  # -k 5


def test_the_quickstart_with_movielens_runs_as_written(tmp_path: Path) -> None:
    # The fetch finds the data set already in the cache (fetched, or CI's copy) and only verifies it.
    cache = dataset_folder("movielens-100k").parent
    blocks, shortened = quickstart()
    fetched, main = _run(blocks[1], shortened, tmp_path, {"FEDRECON_DATA_DIR": str(cache)})

    assert fetched.strip() == f"movielens-100k: {cache / 'movielens-100k'}"
    assert "MovieLens u.data" in main and "training rounds committed" in main


def test_nothing_but_ci_names_the_folder_beside_the_clone() -> None:
    beside = "/".join(("..", "shared"))  # spelt so that this file does not name it either
    found = subprocess.run(
        ["git", "grep", "-n", "-F", beside, "--", ".", ":!.ci/run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert found.returncode in (0, 1), found.stderr  # 1: no match
    assert found.stdout == "", found.stdout


def test_the_serving_example_runs_as_written(export: Callable[[ModelConfig], Path], tmp_path: Path) -> None:
    page = (ROOT / "docs" / "how-to" / "serve-on-a-device.md").read_text()
    (code,) = re.findall(r"^```python\n(.*?)^```", page, re.MULTILINE | re.DOTALL)
    model_dir = export(SMALL)
    assert 'Path("runs/quickstart/model")' in code and 'Path("runs/my-device.sqlite")' in code
    code = code.replace('Path("runs/quickstart/model")', f"Path({str(model_dir)!r})")
    code = code.replace('Path("runs/my-device.sqlite")', f"Path({str(tmp_path / 'store.sqlite')!r})")
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("personalized [")


# A stated range -> (values it accepts, values it refuses), for the forms the hand-written tables use.
_PROBES: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "> 0": ((1e-6, 0.5, 3.0), (0.0, -1.0)),
    ">= 0": ((0.0, 0.5), (-1e-6, -1.0)),
    "[0, 1)": ((0.0, 0.5, 0.999), (1.0, -0.1)),
    "(0, 1)": ((0.001, 0.5, 0.999), (0.0, 1.0)),
}


def _stated_ranges(table: str) -> list[tuple[str, str]]:
    """(field, range form) for each row of the settings page whose range starts with a probe form."""
    page = (ROOT / "docs" / "reference" / "settings.md").read_text()
    rows = re.findall(rf"^\| `{table}\.(\w+)` \| ([^|]+) \|", page, re.MULTILINE)
    return [(name, form) for name, cell in rows for form in _PROBES if cell.strip().startswith(form)]


def test_the_hand_written_ranges_of_the_settings_page_are_the_validators() -> None:
    from orchestrator.aggregation.differential_privacy import DPConfig
    from orchestrator.aggregation.server_optimizer import ServerOptimizerConfig

    checked: dict[str, tuple[Callable[[dict[str, Any]], object], dict[str, Any]]] = {
        "server_optimizer": (ServerOptimizerConfig.from_json, {"name": "adam"}),
        "differential_privacy": (
            DPConfig.from_json,
            {
                "clip_norm": 1.0,
                "noise_multiplier": 1.0,
                "population_size": 1000,
                "target_unclipped_quantile": 0.5,
                "clipped_count_stddev": 5.0,
            },
        ),
    }
    probed = 0
    for table, (parse, base) in checked.items():
        for name, form in _stated_ranges(table):
            accepted, refused = _PROBES[form]
            for value in accepted:
                parse({**base, name: value})
            for value in refused:
                with pytest.raises(ValueError):
                    parse({**base, name: value})
            probed += 1
    assert probed >= 9  # the rows with a probeable range: 5 of the optimizer's, 4 of DP's
