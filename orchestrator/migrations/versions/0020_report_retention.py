"""report retention: the deltas of reports whose round has closed are deleted (population setting
report_deltas, default until_round_closes); weights, metrics and the rounds' counts stay

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-02 03:00:00.000000
"""

from __future__ import annotations

from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # No population could ask to keep them before this setting existed: the default applies to
    # every closed round. (SQLite reuses the pages; VACUUM gives them back to the file system.)
    op.execute(
        "UPDATE reports SET delta = NULL WHERE delta IS NOT NULL "
        "AND round_id IN (SELECT id FROM rounds WHERE status <> 'open')"
    )


def downgrade() -> None:
    pass  # a deleted delta is gone; the schema is unchanged
