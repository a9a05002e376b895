"""buffered secure populations: each cohort's unmasked sum, held by its buffer until the buffer
closes (cohort_sums)

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-02 19:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "cohort_sums",
        sa.Column("round_id", sa.Integer(), nullable=False),
        sa.Column("buffer_id", sa.Integer(), nullable=False),
        sa.Column("members", sa.Integer(), nullable=False),
        sa.Column("staleness", sa.Integer(), nullable=False),
        sa.Column("factor", sa.Float(), nullable=False),
        sa.Column("total", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["buffer_id"], ["rounds.id"]),
        sa.ForeignKeyConstraint(["round_id"], ["rounds.id"]),
        sa.PrimaryKeyConstraint("round_id"),
    )
    with op.batch_alter_table("cohort_sums", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_cohort_sums_buffer_id"), ["buffer_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("cohort_sums", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_cohort_sums_buffer_id"))
    op.drop_table("cohort_sums")
