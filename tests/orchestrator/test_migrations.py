"""The Alembic migrations: up to head, down to nothing and up again, and the models match them."""

from __future__ import annotations

import json

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from orchestrator.populations.locks import lock_population
from orchestrator.populations.settings import PopulationSettings
from orchestrator.rounds.lifecycle import EVALUATION, TRAINING, open_round
from orchestrator.service.population_creation import ExportedModel
from sqlalchemy import create_engine, inspect, select, text
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.db import Base, Population, Report, Round
from orchestrator.migrate import alembic_config
from tests.orchestrator.conftest import make_population


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


def test_the_evaluation_floor_migration_keeps_settings_valid_and_erases_per_device_sums(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    # Prepare: a database as 0012 left it: a population whose evaluation rounds take 2 reports (no
    # floor in its settings), an evaluation report and an abandoned evaluation round with their
    # sums, an abandoned training round with its raw within-clip count
    make_population(db, biased_model, evaluation_target_reports=2, min_evaluation_reports=2)
    with db.begin() as session:
        population = lock_population(session, "p")
        assert population is not None
        committed = open_round(session, population, EVALUATION, 1.0)
        abandoned = open_round(session, population, EVALUATION, 1.0)
        training = open_round(session, population, TRAINING, 1.0)
        sums = {"loss_sum": 7.5, "weight_sum": 10.0}
        committed.status, committed.metrics = "committed", sums
        abandoned.status, abandoned.metrics = "abandoned", sums
        training.status, training.metrics = "abandoned", {"dp_within_clip": 1.0, "dp_clip_norm": 2.0}
    url = db.kw["bind"].url.render_as_string(hide_password=False)
    config = alembic_config(url)
    command.downgrade(config, "0012")
    engine = create_engine(url)
    with engine.begin() as conn:
        settings = conn.execute(text("SELECT settings FROM populations")).scalar_one()
        settings = json.loads(settings) if isinstance(settings, str) else settings
        assert "min_evaluation_reports" not in settings
        conn.execute(text("INSERT INTO devices (id, token_hash, created_at) VALUES ('d', 'h', 0)"))
        conn.execute(
            text(
                "INSERT INTO assignments (id, round_id, device_id, status, example_count, created_at, "
                "deadline) VALUES ('a', :round_id, 'd', 'reported', 10, 0, 1)"
            ),
            {"round_id": committed.id},
        )
        conn.execute(
            text("INSERT INTO reports (assignment_id, round_id, weight, metrics) VALUES ('a', :r, 10, :m)"),
            {"r": committed.id, "m": json.dumps(sums)},
        )

    # Execute
    command.upgrade(config, "head")

    # Assert: the settings are valid with a floor of 2; only the committed round's sums remain
    with db() as session:
        population = session.scalars(select(Population)).one()
        assert PopulationSettings.model_validate(population.settings).min_evaluation_reports == 2
        by_id = {r.id: r.metrics for r in session.scalars(select(Round))}
        assert by_id[committed.id] == sums and by_id[abandoned.id] == {}
        assert by_id[training.id] == {"dp_clip_norm": 2.0}
        assert [r.metrics for r in session.scalars(select(Report))] == [{}]
    engine.dispose()
