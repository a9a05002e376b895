"""docs/tutorials/your-model.md runs as written: its files saved, its commands run in order from
a folder of the user's own, shortened only by the options its `your-model-test` comments name."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "docs" / "tutorials" / "your-model.md"
_FILE = re.compile(r'^```python title="(?P<name>[^"]+)"\n(?P<body>.*?)^```', re.MULTILINE | re.DOTALL)
_BASH = re.compile(r"^```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)
_SHORTENED = re.compile(r"<!-- your-model-test: (?P<command>.+?) \+= (?P<options>.+?) -->")


def tutorial() -> tuple[dict[str, str], list[str], dict[str, str]]:
    """(files to save by name, the commands in order, command prefix -> its shortening options)."""
    text = TUTORIAL.read_text()
    files = {m["name"]: m["body"] for m in _FILE.finditer(text)}
    commands = [
        line.strip()
        for block in _BASH.findall(text)
        for line in block.replace("\\\n", " ").splitlines()
        if line.strip()
    ]
    return files, commands, {m["command"]: m["options"] for m in _SHORTENED.finditer(text)}


def test_the_tutorial_names_its_files_and_shortens_only_commands_it_runs() -> None:
    files, commands, shortened = tutorial()

    assert set(files) == {"my_model.py", "make_shares.py"}
    for prefix in shortened:
        assert any(c.startswith(prefix) for c in commands), f"no command starts with {prefix!r}"


def test_the_tutorial_runs_as_written(tmp_path: Path) -> None:
    files, commands, shortened = tutorial()
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    # As after `source .venv/bin/activate`: `python` is the environment's.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    outputs = {}
    for command in commands:
        extra = next((options for prefix, options in shortened.items() if command.startswith(prefix)), "")
        words = shlex.split(f"{command} {extra}")
        result = subprocess.run(words, cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
        assert result.returncode == 0, f"`{command}` failed:\n{result.stderr[-3000:]}"
        outputs[" ".join(words[:4])] = result.stdout

    simulation = json.loads((tmp_path / "runs" / "my-simulation" / "simulation.json").read_text())
    assert simulation["model"]["local_params"] and len(simulation["model"]["local_params"]) == 2
    assert [p["round"] for p in simulation["learning_curve"]] == [0, 2, 4]
    assert simulation["held_out"]["devices"] == 4
    assert len(list((tmp_path / "runs" / "my-stores").glob("phone-*.sqlite"))) == 40
    report = json.loads((tmp_path / "runs" / "my-fleet" / "report.json").read_text())
    assert report["model"]["task"]["kind"] == "ranking"
    assert report["hit_rates"] is not None and report["hit_rates"]["devices"] > 0
    recommended = outputs["python -m device_runtime recommend"]
    ranked = [line for line in recommended.splitlines() if re.match(r"^\s+\d+\s+\d+\s+-?\d", line)]
    assert len(ranked) == 5, recommended  # -k 5
