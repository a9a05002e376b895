"""The Alembic migrations: up to head, down to nothing and up again, and the models match them."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.db import Base
from orchestrator.migrate import alembic_config


def test_migrations_round_trip_and_match_the_models(db: sessionmaker[Session]) -> None:
    url = db.kw["bind"].url.render_as_string(hide_password=False)
    config = alembic_config(url)

    command.downgrade(config, "base")
    engine = create_engine(url)
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    command.upgrade(config, "head")

    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        indexes = {i["name"]: i for i in inspect(conn).get_indexes("assignments")}
    engine.dispose()
    assert diff == [], f"models and migrations disagree: {diff}"
    assert indexes["assignments_round_device"]["unique"]
