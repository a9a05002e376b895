"""secure rounds' consistency check: each survivor's signed confirmation of the survivor set, and
whether it counts (confirmed: in the unmasked sum)

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-25 21:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("secure_participants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("consistency", sa.JSON(), nullable=True))
        batch_op.add_column(
            sa.Column("sent_consistency", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch_op.add_column(sa.Column("confirmed", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("secure_participants", schema=None) as batch_op:
        batch_op.drop_column("confirmed")
        batch_op.drop_column("sent_consistency")
        batch_op.drop_column("consistency")
