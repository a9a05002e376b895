"""secure rounds: each sender's signed partner statement (secure_participants.partners), sent
with its masked input; the survivor set is chosen from them

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-02 03:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Rounds open across the upgrade lack statements: their masked inputs are refused, and the
    # round ends abandoned at its deadline as one whose devices dropped would.
    with op.batch_alter_table("secure_participants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("partners", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("secure_participants", schema=None) as batch_op:
        batch_op.drop_column("partners")
