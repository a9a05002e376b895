"""a secure round's phase counters on its row (secure_rounds): a phase's condition is read from
them, not counted over every participant at every message

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-28 14:10:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

# Each counter as the rows it counts: the round's participants (p) with their assignments (a).
_LEFT = "a.status <> 'assigned'"
_COUNTED = {
    "advertised": "1 = 1",
    "sharers": "p.sent_shares",
    "senders": "p.sent_masked_input",
    "signers": "p.sent_consistency",
    "responders": "p.sent_unmasking",
    "left_before_shares": f"{_LEFT} AND NOT p.sent_shares",
    "left_before_input": f"{_LEFT} AND p.sent_shares AND NOT p.sent_masked_input",
    "left_before_confirmation": f"{_LEFT} AND p.sent_masked_input AND NOT p.sent_consistency",
}
COUNTERS = [*_COUNTED, "left_before_keys"]


def upgrade() -> None:
    with op.batch_alter_table("secure_rounds", schema=None) as batch_op:
        for name in COUNTERS:
            batch_op.add_column(sa.Column(name, sa.Integer(), nullable=False, server_default="0"))
    # The rounds under way go on from what their participants have sent (a finished round's
    # counters are never read again, but they are filled the same way).
    for name, condition in _COUNTED.items():
        op.execute(
            f"UPDATE secure_rounds SET {name} = (SELECT count(*) FROM secure_participants p "
            "JOIN assignments a ON a.id = p.assignment_id "
            f"WHERE p.round_id = secure_rounds.round_id AND {condition})"
        )
    op.execute(
        "UPDATE secure_rounds SET left_before_keys = (SELECT count(*) FROM assignments a "
        f"WHERE a.round_id = secure_rounds.round_id AND {_LEFT} AND NOT EXISTS "
        "(SELECT 1 FROM secure_participants p WHERE p.assignment_id = a.id))"
    )


def downgrade() -> None:
    with op.batch_alter_table("secure_rounds", schema=None) as batch_op:
        for name in COUNTERS:
            batch_op.drop_column(name)
