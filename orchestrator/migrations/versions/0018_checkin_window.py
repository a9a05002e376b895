"""a round's pace-steering window (rounds.checkin_window): a device turned away from a full round
comes back at a random time within it

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-28 14:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Rounds opened before it have none: their refusals come back by the deadline, as they did.
    with op.batch_alter_table("rounds", schema=None) as batch_op:
        batch_op.add_column(sa.Column("checkin_window", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("rounds", schema=None) as batch_op:
        batch_op.drop_column("checkin_window")
