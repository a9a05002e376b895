"""a population's idle back-off: training rounds in a row without a check-in, and the next one's time

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25 19:10:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("populations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("idle_rounds", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("next_round_at", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("populations", schema=None) as batch_op:
        batch_op.drop_column("next_round_at")
        batch_op.drop_column("idle_rounds")
