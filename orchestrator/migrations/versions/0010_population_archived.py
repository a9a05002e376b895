"""an archived population: when it was archived (paused for good), or null

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25 19:40:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("populations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("archived_at", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("populations", schema=None) as batch_op:
        batch_op.drop_column("archived_at")
