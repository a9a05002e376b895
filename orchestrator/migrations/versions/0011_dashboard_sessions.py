"""the dashboard's sign-in sessions, kept server-side so that every server process knows them
and signing out ends them everywhere

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25 21:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "dashboard_sessions",
        sa.Column("id_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.Column("address", sa.String(length=100), nullable=False),
        sa.PrimaryKeyConstraint("id_hash"),
    )


def downgrade() -> None:
    op.drop_table("dashboard_sessions")
