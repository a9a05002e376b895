"""the evaluation floor: every population gets min_evaluation_reports (the default 5, or its
evaluation_target_reports if lower, so that its settings stay valid); evaluation report rows keep
no per-device sums, abandoned evaluation rounds none of theirs, and abandoned training rounds no
raw dp_within_clip count (round_release)

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-27 19:50:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

FLOOR = 5  # PopulationSettings.min_evaluation_reports' default
_populations = sa.table("populations", sa.column("id", sa.Integer), sa.column("settings", sa.JSON))
_rounds = sa.table(
    "rounds",
    sa.column("id", sa.Integer),
    sa.column("kind", sa.String),
    sa.column("status", sa.String),
    sa.column("metrics", sa.JSON),
)
_reports = sa.table("reports", sa.column("round_id", sa.Integer), sa.column("metrics", sa.JSON))


def upgrade() -> None:
    conn = op.get_bind()
    for population_id, settings in conn.execute(sa.select(_populations.c.id, _populations.c.settings)).all():
        floor = min(FLOOR, int(settings.get("evaluation_target_reports", 10)))
        conn.execute(
            _populations.update()
            .where(_populations.c.id == population_id)
            .values(settings={**settings, "min_evaluation_reports": floor})
        )
    evaluations = sa.select(_rounds.c.id).where(_rounds.c.kind == "evaluation")
    conn.execute(_reports.update().where(_reports.c.round_id.in_(evaluations)).values(metrics={}))
    conn.execute(
        _rounds.update()
        .where(_rounds.c.kind == "evaluation", _rounds.c.status == "abandoned")
        .values(metrics={})
    )
    abandoned = sa.select(_rounds.c.id, _rounds.c.metrics).where(
        _rounds.c.kind == "training", _rounds.c.status == "abandoned"
    )
    for round_id, metrics in conn.execute(abandoned).all():
        if metrics and "dp_within_clip" in metrics:
            kept = {k: v for k, v in metrics.items() if k != "dp_within_clip"}
            conn.execute(_rounds.update().where(_rounds.c.id == round_id).values(metrics=kept))


def downgrade() -> None:
    # The settings lose the floor (the older server refuses unknown settings); erased sums stay erased.
    conn = op.get_bind()
    for population_id, settings in conn.execute(sa.select(_populations.c.id, _populations.c.settings)).all():
        kept = {k: v for k, v in settings.items() if k != "min_evaluation_reports"}
        conn.execute(_populations.update().where(_populations.c.id == population_id).values(settings=kept))
