"""The Python API page's classification example runs as written: the model exports, and the
device's Predictor files a message as the user filed its like."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

PAGE = ROOT / "docs" / "reference" / "python-api.md"
_EXAMPLE = re.compile(
    r"^<!-- python-api-example: (?P<name>\S+) -->\n```python\n(?P<code>.*?)^```", re.M | re.S
)


def test_the_classification_example_exports_and_predicts_as_written(tmp_path: Path) -> None:
    files = {m["name"]: m["code"] for m in _EXAMPLE.finditer(PAGE.read_text())}
    assert set(files) == {"folders.py", "predict.py"}, set(files)
    for name, code in files.items():
        (tmp_path / name).write_text(code)
    # The page's commands, with this clone's packages importable from the example's folder.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([".", str(ROOT)]), "TF_CPP_MIN_LOG_LEVEL": "3"}

    exported = subprocess.run(
        [sys.executable, "-m", "model_export", "--model", "folders:build", "--output-dir", "out"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert exported.returncode == 0, exported.stderr
    predicted = subprocess.run(
        [sys.executable, "predict.py"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300
    )

    assert predicted.returncode == 0, predicted.stderr
    assert re.fullmatch(r"\[\[2 [0-4]\]\]", predicted.stdout.strip()), predicted.stdout
