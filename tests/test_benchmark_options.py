"""Benchmarks refuse options they cannot use with one clear line, before any work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("workers", ["1,two", "", "0", "1,,2", "65"])
def test_the_load_benchmark_refuses_process_counts_it_cannot_start(workers: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.load", "--workers", workers],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )

    assert done.returncode == 2
    assert "expected process counts from 1 to 64 separated by commas" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_main_quality_benchmark_refuses_a_bad_serving_bagging_before_training() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.main_quality",
            "{}",
            '{"serve_bagging": {"members": 0}}',
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )

    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "main_quality: invalid serving bagging: members must be in [1, 64], got 0"
    )
    assert "Traceback" not in done.stderr


def test_the_report_path_tool_refuses_a_folder_that_is_not_an_exported_model(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.report_path", "--model-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )

    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"python -m benchmarks.report_path: error: --model-dir: {tmp_path} is not an exported model "
        "directory: "
        f"{tmp_path / 'model.tflite'} is missing (expected the output of `python -m model_export`)"
    )
    assert "Traceback" not in done.stderr
