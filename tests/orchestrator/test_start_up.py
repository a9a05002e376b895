"""`python -m orchestrator serve` on a database it cannot use: one line on stderr that says what is
wrong and what to do, exit code 2, no traceback, and the file left as it was."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator.local import PROJECT_ROOT, LocalOrchestrator, free_port
from tests.orchestrator.conftest import ADMIN_TOKEN

FILE_SIZE_LIMIT = 16 * 1024  # bytes: smaller than a migrated database, as a full disk would be


def serve(database: Path, limit_file_size: bool = False) -> subprocess.CompletedProcess[str]:
    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))

    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "serve", "--port", str(free_port())],
        cwd=PROJECT_ROOT,
        env={
            **os.environ,
            "ORCHESTRATOR_ADMIN_TOKEN": ADMIN_TOKEN,
            "ORCHESTRATOR_DATABASE_URL": f"sqlite:///{database}",
        },
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=small_files if limit_file_size else None,
    )


def corrupt(tmp: Path) -> Path:
    path = tmp / "orchestrator.sqlite"
    path.write_bytes(os.urandom(8192))
    return path


def in_a_missing_directory(tmp: Path) -> Path:
    return tmp / "no such directory" / "orchestrator.sqlite"


def under_a_file(tmp: Path) -> Path:
    (tmp / "a file").write_text("")
    return tmp / "a file" / "orchestrator.sqlite"


def in_a_read_only_directory(tmp: Path) -> Path:
    (tmp / "read-only").mkdir(mode=0o555)
    return tmp / "read-only" / "orchestrator.sqlite"


CASES: list[tuple[Callable[[Path], Path], str]] = [
    (corrupt, "is not an SQLite database or is corrupt"),
    (in_a_missing_directory, "does not exist: create it"),
    (under_a_file, "is a file, not a directory"),
    (in_a_read_only_directory, "is not writable by this user"),
]


@pytest.mark.parametrize(("database", "expected"), CASES, ids=[case.__name__ for case, _ in CASES])
def test_an_unusable_database_is_one_clear_line(
    tmp_path: Path, database: Callable[[Path], Path], expected: str
) -> None:
    # Prepare
    if database is in_a_read_only_directory and os.geteuid() == 0:
        pytest.skip("root writes into a read-only directory")
    path = database(tmp_path)
    before = path.read_bytes() if path.exists() else None

    # Execute
    done = serve(path)

    # Assert
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: ") and str(path) in line and expected in line, line
    assert (path.read_bytes() if path.exists() else None) == before


def test_a_full_disk_at_start_up_is_one_clear_line(tmp_path: Path) -> None:
    # Prepare: the server may write no file larger than 16 KB (a full disk, as the file sees it)
    path = tmp_path / "orchestrator.sqlite"

    # Execute
    done = serve(path, limit_file_size=True)

    # Assert
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: ") and str(path) in line and "free space" in line, line


def test_a_started_local_orchestrator_entered_as_a_context_leaves_no_server_behind(tmp_path: Path) -> None:
    # Prepare
    server = LocalOrchestrator(f"sqlite:///{tmp_path / 'server.sqlite'}")

    # Execute: the usual form, which once started a second server and orphaned the first.
    with server.start():
        assert server.process is not None
        pid = server.process.pid
    still_serving = [
        p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _serves_on(p, server.port)
    ]

    # Assert
    assert server.process.poll() is not None, f"server {pid} still runs"
    assert still_serving == [], f"orchestrators still serving port {server.port}: {still_serving}"


def _serves_on(proc: Path, port: int) -> bool:
    try:
        command = (proc / "cmdline").read_bytes().split(b"\0")
    except OSError:  # the process ended meanwhile
        return False
    return b"serve" in command and str(port).encode() in command
