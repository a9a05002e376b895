"""The PostgreSQL tutorial's own database, made as the page says: its first block as a user, its
second as root (where `initdb` refuses to run), in a fresh folder, then reached with the URL the
page's next block gives and stopped with the page's stop command."""

from __future__ import annotations

import glob
import os
import pwd
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from orchestrator.local import free_port
from tests.conftest import ROOT
from tests.test_docs import _BLOCK, _commands

PAGE = ROOT / "docs" / "tutorials" / "postgresql.md"
AS_ROOT = os.geteuid() == 0


def _has_postgres_user() -> bool:
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return False
    return True


def _database_block() -> str:
    """The block for whoever runs the tests: the page's first (a user) or its root one."""
    section = PAGE.read_text().split("## A database")[1].split("\n## ")[0]
    plain, root = _BLOCK.findall(section)
    assert "initdb" in plain and "su postgres" in root
    return str(root if AS_ROOT else plain)


def _on_port(command: str, port: int) -> str:
    """A command of the block on `port` instead of 5432, which may be taken on a shared machine."""
    command = command.replace("-h 127.0.0.1 -k /tmp", f"-h 127.0.0.1 -p {port} -k /tmp")
    return re.sub(r'(createdb"?) -h 127\.0\.0\.1', rf"\1 -h 127.0.0.1 -p {port}", command)


@pytest.mark.skipif(not glob.glob("/usr/lib/postgresql/*/bin/initdb"), reason="needs PostgreSQL's programs")
@pytest.mark.skipif(AS_ROOT and not _has_postgres_user(), reason="as root, needs the postgres user")
def test_the_tutorial_s_database_starts_as_written() -> None:
    port = free_port()
    commands = [_on_port(c, port) for c in _commands(_database_block())]
    stop = next(c.split("# stop: ", 1)[1] for c in commands if "# stop: " in c)
    setup = [line for line in commands if line.startswith(("export ", "PGBIN="))]
    url_match = re.search(r"ORCHESTRATOR_DATABASE_URL=(\S+)", PAGE.read_text())
    assert url_match
    url = url_match[1].replace("@127.0.0.1/", f"@127.0.0.1:{port}/")
    # A folder the postgres user can enter (tmp_path's parent is root's alone).
    work = Path(tempfile.mkdtemp(prefix="pg-tutorial-"))
    work.chmod(0o755)
    script = "set -e\n" + "\n".join(c.split(" # ")[0] for c in commands)
    try:
        made = subprocess.run(["bash", "-c", script], cwd=work, capture_output=True, text=True, timeout=120)
        assert made.returncode == 0, made.stderr
        engine = create_engine(url)
        try:
            with engine.connect() as conn:
                assert conn.execute(text("SELECT current_user")).scalar() == "orchestrator"
        finally:
            engine.dispose()
        stop_script = "\n".join([*setup, stop])
        stopped = subprocess.run(["bash", "-c", stop_script], cwd=work, capture_output=True, text=True)
        assert stopped.returncode == 0, stopped.stderr
    finally:
        subprocess.run(
            ["bash", "-c", "\n".join([*setup, stop.replace(" stop", " -m immediate stop")])],
            cwd=work,
            capture_output=True,
        )
        subprocess.run(["rm", "-rf", str(work)], check=False)
