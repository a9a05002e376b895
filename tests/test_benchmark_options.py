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
        [sys.executable, str(ROOT / "benchmarks" / "bench_load.py"), "--workers", workers],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )

    assert done.returncode == 2
    assert "expected process counts from 1 to 64 separated by commas" in done.stderr
    assert "Traceback" not in done.stderr
