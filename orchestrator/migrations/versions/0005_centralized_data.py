"""a population's centralized dataset and mixing strategy

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 15:45:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "centralized_data",
        sa.Column("population_id", sa.Integer(), nullable=False),
        sa.Column("mixing", sa.JSON(), nullable=False),
        sa.Column("examples", sa.LargeBinary(), nullable=False),
        sa.Column("num_examples", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("attached_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["population_id"], ["populations.id"]),
        sa.PrimaryKeyConstraint("population_id"),
    )


def downgrade() -> None:
    op.drop_table("centralized_data")
