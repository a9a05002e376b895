"""a round's check-in counters on their own row (round_admissions): a check-in's admission and a
report's count no longer wait for each other's row lock

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-28 06:20:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

_COUNTERS = ["checked_in", "accepted", "rejected_capacity", "rejected_min_examples"]


def upgrade() -> None:
    op.create_table(
        "round_admissions",
        sa.Column("round_id", sa.Integer(), nullable=False),
        *(sa.Column(name, sa.Integer(), nullable=False) for name in _COUNTERS),
        sa.ForeignKeyConstraint(["round_id"], ["rounds.id"]),
        sa.PrimaryKeyConstraint("round_id"),
    )
    columns = ", ".join(_COUNTERS)
    op.execute(f"INSERT INTO round_admissions (round_id, {columns}) SELECT id, {columns} FROM rounds")
    with op.batch_alter_table("rounds", schema=None) as batch_op:
        for name in _COUNTERS:
            batch_op.drop_column(name)


def downgrade() -> None:
    with op.batch_alter_table("rounds", schema=None) as batch_op:
        for name in _COUNTERS:
            batch_op.add_column(sa.Column(name, sa.Integer(), nullable=False, server_default="0"))
    for name in _COUNTERS:
        op.execute(
            f"UPDATE rounds SET {name} = "
            f"(SELECT {name} FROM round_admissions WHERE round_admissions.round_id = rounds.id) "
            "WHERE id IN (SELECT round_id FROM round_admissions)"
        )
    op.drop_table("round_admissions")
