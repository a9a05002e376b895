"""why a round closed: the reason, and for a round that did not commit its phase, devices and cause

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25 19:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("rounds", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("close_reason", sa.String(length=500), nullable=False, server_default="")
        )
        batch_op.add_column(sa.Column("stopped_phase", sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column("devices_had", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("devices_needed", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("ended_by", sa.String(length=16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("rounds", schema=None) as batch_op:
        for column in ("ended_by", "devices_needed", "devices_had", "stopped_phase", "close_reason"):
            batch_op.drop_column(column)
