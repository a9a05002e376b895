"""secure rounds that scale: masked inputs in a table of their own (in SQLite a participant's
flags after a 0.75 MB input were read through its overflow pages), and each round's advertised
keys in an indexed table (no key twice in a round, without comparing with every advertisement)

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-27 23:10:00.000000
"""

from __future__ import annotations

import base64

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

_participants = sa.table(
    "secure_participants",
    sa.column("assignment_id", sa.String),
    sa.column("round_id", sa.Integer),
    sa.column("masked_input", sa.LargeBinary),
    sa.column("keys", sa.JSON),
)
_secure_rounds = sa.table("secure_rounds", sa.column("round_id", sa.Integer), sa.column("phase", sa.String))
_keys = sa.table(
    "secure_round_keys",
    sa.column("round_id", sa.Integer),
    sa.column("kind", sa.String),
    sa.column("key", sa.LargeBinary),
)
_inputs = sa.table(
    "secure_masked_inputs",
    sa.column("assignment_id", sa.String),
    sa.column("round_id", sa.Integer),
    sa.column("masked_input", sa.LargeBinary),
)


def upgrade() -> None:
    op.create_table(
        "secure_masked_inputs",
        sa.Column("assignment_id", sa.String(length=32), nullable=False),
        sa.Column("round_id", sa.Integer(), nullable=False),
        sa.Column("masked_input", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["assignment_id"], ["assignments.id"]),
        sa.ForeignKeyConstraint(["round_id"], ["rounds.id"]),
        sa.PrimaryKeyConstraint("assignment_id"),
    )
    with op.batch_alter_table("secure_masked_inputs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_secure_masked_inputs_round_id"), ["round_id"], unique=False)
    op.create_table(
        "secure_round_keys",
        sa.Column("round_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("key", sa.LargeBinary(length=64), nullable=False),
        sa.ForeignKeyConstraint(["round_id"], ["rounds.id"]),
        sa.PrimaryKeyConstraint("round_id", "kind", "key"),
    )
    # The inputs of rounds under way move (closed rounds kept none); the keys of rounds still
    # taking advertisements are indexed (no other round's are looked up again).
    conn = op.get_bind()
    advertising = sa.select(_secure_rounds.c.round_id).where(_secure_rounds.c.phase == "advertise")
    rows = conn.execute(
        sa.select(_participants.c.round_id, _participants.c["keys"]).where(
            _participants.c.round_id.in_(advertising)
        )
    ).all()
    for round_id, advertised in rows:
        for kind, key in _advertised_keys(advertised):
            conn.execute(_keys.insert().values(round_id=round_id, kind=kind, key=key))
    op.execute(
        _inputs.insert().from_select(
            ["assignment_id", "round_id", "masked_input"],
            sa.select(
                _participants.c.assignment_id, _participants.c.round_id, _participants.c.masked_input
            ).where(_participants.c.masked_input.is_not(None)),
        )
    )
    with op.batch_alter_table("secure_participants", schema=None) as batch_op:
        batch_op.drop_column("masked_input")


def _advertised_keys(advertised: dict[str, object]) -> list[tuple[str, bytes]]:
    """(kind, key) of one stored advertisement: signed ({"keys", "certificate", ...}) or bare."""
    signed = "certificate" in advertised
    keys = advertised["keys"] if signed else advertised
    assert isinstance(keys, dict)
    found = [
        ("agreement", base64.b64decode(keys[k]))
        for k in ("encryption_key", "mask_key", "self_mask_commitment")
    ]
    if signed:
        certificate = advertised["certificate"]
        assert isinstance(certificate, dict)
        found.append(("device", base64.b64decode(certificate["device_key"])))
    return sorted(set(found))  # one key used twice by its own device is indexed once


def downgrade() -> None:
    with op.batch_alter_table("secure_participants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("masked_input", sa.LargeBinary(), nullable=True))
    conn = op.get_bind()
    for assignment_id, blob in conn.execute(sa.select(_inputs.c.assignment_id, _inputs.c.masked_input)).all():
        conn.execute(
            _participants.update()
            .where(_participants.c.assignment_id == assignment_id)
            .values(masked_input=blob)
        )
    op.drop_table("secure_round_keys")
    with op.batch_alter_table("secure_masked_inputs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_secure_masked_inputs_round_id"))
    op.drop_table("secure_masked_inputs")
