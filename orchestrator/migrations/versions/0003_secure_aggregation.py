"""secure aggregation: secure rounds and their participants' messages

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 06:40:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "secure_rounds",
        sa.Column("round_id", sa.Integer(), nullable=False),
        sa.Column("phase", sa.String(length=16), nullable=False),
        sa.Column("phase_deadline", sa.Float(), nullable=False),
        sa.Column("parameters", sa.JSON(), nullable=False),
        sa.Column("outcome", sa.String(length=500), nullable=False),
        sa.ForeignKeyConstraint(["round_id"], ["rounds.id"]),
        sa.PrimaryKeyConstraint("round_id"),
    )
    op.create_table(
        "secure_participants",
        sa.Column("assignment_id", sa.String(length=32), nullable=False),
        sa.Column("round_id", sa.Integer(), nullable=False),
        sa.Column("device_index", sa.Integer(), nullable=False),
        sa.Column("keys", sa.JSON(), nullable=False),
        sa.Column("shares", sa.JSON(), nullable=True),
        sa.Column("sent_shares", sa.Boolean(), nullable=False),
        sa.Column("masked_input", sa.LargeBinary(), nullable=True),
        sa.Column("sent_masked_input", sa.Boolean(), nullable=False),
        sa.Column("unmasking", sa.JSON(), nullable=True),
        sa.Column("sent_unmasking", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(["assignment_id"], ["assignments.id"]),
        sa.ForeignKeyConstraint(["round_id"], ["rounds.id"]),
        sa.PrimaryKeyConstraint("assignment_id"),
    )
    op.create_index(
        "secure_participants_round_index", "secure_participants", ["round_id", "device_index"], unique=True
    )


def downgrade() -> None:
    op.drop_index("secure_participants_round_index", table_name="secure_participants")
    op.drop_table("secure_participants")
    op.drop_table("secure_rounds")
