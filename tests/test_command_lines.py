"""Every command line ends quietly when the reader of its output has gone (`... | head`)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from contracts.command_line import CLOSED_PIPE_EXIT
from model_export.config import ModelConfig
from tests.conftest import BIASED

ROOT = Path(__file__).resolve().parent.parent


def _into_a_closed_pipe(*args: str) -> subprocess.CompletedProcess[bytes]:
    """`python ARGS` with standard output a pipe whose reading end is closed before it starts, so
    its output fails as it does into a `| head` that has read enough."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, *args], stdout=write, stderr=subprocess.PIPE, cwd=ROOT, timeout=300
        )
    finally:
        os.close(write)


def test_a_command_whose_reader_closed_the_pipe_exits_without_a_traceback(
    export: Callable[[ModelConfig], Path], tmp_path: Path
) -> None:
    # Prepare: a population to show (the operator's `status`), and a data folder to list.
    url = f"sqlite:///{tmp_path / 'cli.sqlite'}"
    model_dir = str(export(BIASED))
    created = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator",
            "--database-url",
            url,
            "create-population",
            "p",
            "--model-dir",
            model_dir,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert created.returncode == 0, created.stderr

    # Execute
    status = _into_a_closed_pipe("-m", "orchestrator", "--database-url", url, "status", "p")
    listed = _into_a_closed_pipe("-m", "android_sim.datasets", "list", "--data-dir", str(tmp_path / "data"))

    # Assert: the shell's code for a closed pipe, and nothing on stderr.
    for done in (status, listed):
        assert (done.returncode, done.stderr.decode()) == (CLOSED_PIPE_EXIT, "")
