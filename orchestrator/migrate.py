"""Bring a database to the latest schema (Alembic `upgrade head`).

This is the server's first touch of its database, so a database it cannot use (a corrupt or
foreign file, a directory that does not exist or is not writable, a full disk, a server that does
not answer) is reported here as `DatabaseUnusable`: one sentence that says what is wrong and what
to do, for the command line to print instead of a traceback.

Several processes may start together on one empty PostgreSQL database (every container
orchestrator starts a deployment's replicas at once): without a lock, two of them create the same
tables and one fails on PostgreSQL's catalog (`pg_type_typname_nsp_index`). So on PostgreSQL the
upgrade runs under a session advisory lock: the first process migrates, the others wait for it
and then find the schema current. (SQLite serializes the upgrade's writes by its file lock.)
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
# The advisory lock that serializes schema upgrades on PostgreSQL: a fixed 64-bit key of this
# project's own ("fedrecon" in ASCII), which no other lock of the database's users should share.
MIGRATION_LOCK_KEY = int.from_bytes(b"fedrecon", "big") - 2**63


class DatabaseUnusable(RuntimeError):
    """The database cannot be opened or brought to the schema; the message says why and what to do."""


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def migrate(database_url: str) -> None:
    try:
        if make_url(database_url).get_backend_name() == "postgresql":
            _upgrade_under_lock(database_url)
        else:
            command.upgrade(alembic_config(database_url), "head")
    except (DBAPIError, OSError) as e:
        raise DatabaseUnusable(_explain(database_url, e)) from e


def _upgrade_under_lock(database_url: str) -> None:
    """`upgrade head` while holding the migration advisory lock on a connection of its own. A
    session lock, not a transaction one: Alembic commits on its own connection; the lock goes
    with this connection when it closes, or with the process if it dies."""
    engine = create_engine(database_url, poolclass=NullPool)
    try:
        with engine.connect() as lock:
            lock.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
            lock.commit()
            try:
                command.upgrade(alembic_config(database_url), "head")
            finally:
                lock.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK_KEY})
                lock.commit()
    finally:
        engine.dispose()


def _explain(database_url: str, error: DBAPIError | OSError) -> str:
    url = make_url(database_url)
    cause = str(error.orig if isinstance(error, DBAPIError) else error).strip().splitlines()[0]
    lowered = cause.lower()
    sqlite = url.get_backend_name() == "sqlite"
    path = Path(url.database or "")
    shown = str(path) if sqlite else url.render_as_string(hide_password=True)
    if (isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EFBIG)) or "full" in lowered:
        return f"no room to write the database {shown} ({cause}): free space on its disk, or move it"
    if not sqlite:
        return f"cannot use the database at {shown} ({cause}): check that it runs and that the URL is right"
    if "not a database" in lowered or "malformed" in lowered:
        return (
            f"{path} is not an SQLite database or is corrupt ({cause}): restore it from a backup, "
            "or point ORCHESTRATOR_DATABASE_URL at a new file"
        )
    if "unable to open" in lowered or "readonly" in lowered or "read-only" in lowered:
        folder = path.resolve().parent
        if folder.exists() and not folder.is_dir():
            why = f"{folder} is a file, not a directory"
        elif not folder.is_dir():
            why = f"its directory {folder} does not exist: create it"
        elif not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            why = f"{folder if not path.exists() else path} is not writable by this user: fix its permissions"
        else:
            why = "check the path and its permissions"
        return f"cannot open the SQLite database {path} ({cause}); {why}, or choose another path"
    if "i/o error" in lowered:
        return (
            f"cannot write the SQLite database {path} ({cause}): the disk may be full or failing; "
            "free space or move the database"
        )
    return f"cannot use the SQLite database {path} ({cause}): check the file, or choose another path"
