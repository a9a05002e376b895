"""a covering index of secure participants' flags: the phases count them at every message, and in
SQLite a row's flags come after its shares (~9 KB at 60 neighbours, in overflow pages)

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-28 02:50:00.000000
"""

from __future__ import annotations

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

_COLUMNS = [
    "round_id",
    "assignment_id",
    "device_index",
    "sent_shares",
    "sent_masked_input",
    "sent_consistency",
    "confirmed",
    "sent_unmasking",
]


def upgrade() -> None:
    with op.batch_alter_table("secure_participants", schema=None) as batch_op:
        batch_op.create_index("secure_participants_flags", _COLUMNS, unique=False)


def downgrade() -> None:
    with op.batch_alter_table("secure_participants", schema=None) as batch_op:
        batch_op.drop_index("secure_participants_flags")
