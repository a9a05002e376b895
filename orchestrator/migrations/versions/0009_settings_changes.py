"""settings changed mid-flight: a population's settings version, and each change with who and when

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25 19:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("populations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("settings_version", sa.Integer(), nullable=False, server_default="0"))
    op.create_table(
        "settings_changes",
        sa.Column("population_id", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("changes", sa.JSON(), nullable=False),
        sa.Column("previous", sa.JSON(), nullable=False),
        sa.Column("changed_by", sa.String(length=200), nullable=False),
        sa.Column("changed_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["population_id"], ["populations.id"]),
        sa.PrimaryKeyConstraint("population_id", "version"),
    )


def downgrade() -> None:
    op.drop_table("settings_changes")
    with op.batch_alter_table("populations", schema=None) as batch_op:
        batch_op.drop_column("settings_version")
