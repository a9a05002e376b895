"""Run the exporter in another process.

Device code (tests, benchmarks, the simulator) needs TensorFlow kept out of its own process:
tflite_runtime 2.14 cannot even load a model in a process that has imported TensorFlow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from model_export.config import ModelConfig
from model_export.model_args import format_model_args

ROOT = Path(__file__).resolve().parent.parent


def export_in_subprocess(config: ModelConfig, out: Path) -> Path:
    """`python -m model_export --config ...` into `out`; returns `out`. Raises with the exporter's stderr."""
    out.mkdir(parents=True, exist_ok=True)
    config_file = out / "config.json"
    config_file.write_text(json.dumps(config.to_json()))
    return _run(["--config", str(config_file)], out)


def export_spec_in_subprocess(
    target: str, out: Path, model_args: Mapping[str, int | float | bool | str] | None = None
) -> Path:
    """`python -m model_export --model MODULE:FUNCTION` into `out` (the function returns an
    `ExportSpec`; `model_args` are its keyword arguments, as `--model-arg`s); returns `out`.
    Raises with the exporter's stderr."""
    return _run(["--model", target, *format_model_args(model_args or {})], out)


def _python_path() -> str:
    return os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)


def _run(args: list[str], out: Path) -> Path:
    result = subprocess.run(
        [sys.executable, "-m", "model_export", *args, "--output-dir", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        # The caller's directory stays importable: `--model my_model:build` next to the user's files.
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": _python_path()},
    )
    if result.returncode != 0:
        raise RuntimeError(f"model export failed: {result.stderr.strip()[-2000:]}")
    return out
