"""one assignment per device per round

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 06:40:47.861486
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("assignments", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_assignments_round_id"))
        batch_op.create_index("assignments_round_device", ["round_id", "device_id"], unique=True)


def downgrade() -> None:
    with op.batch_alter_table("assignments", schema=None) as batch_op:
        batch_op.drop_index("assignments_round_device")
        batch_op.create_index(batch_op.f("ix_assignments_round_id"), ["round_id"], unique=False)
