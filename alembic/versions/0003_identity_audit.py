"""state identity record and audit trail

``rivet_identity`` holds the one ``state_key`` of the source the state belongs to (SPEC
§3), inside the state database, never in a sidecar file. ``rivet_audit`` records who did
what to the state, when and from where (adopt, rekey, reset, set-cursor, migrate).

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

#: Tables this upgrade rebuilds (copies every row of), for the migrate plan.
UPGRADE_REBUILDS: tuple[str, ...] = ()
#: Table -> SQL predicate of the rows whose data the downgrade drops (None: every row).
DOWNGRADE_LOSES: dict[str, str | None] = {"rivet_identity": None, "rivet_audit": None}


def upgrade() -> None:
    # Imported here, not at the top: statetool imports this module to read its constants
    # (statetool/migrations.py), and `check` and `info` must not load alembic.
    from alembic import op

    op.create_table(
        "rivet_identity",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("state_key", sa.Text, nullable=False),
        sa.Column("recorded_at", sa.Text, nullable=False),
        sa.Column("recorded_by", sa.Text, nullable=False),
        sa.CheckConstraint("id = 1", name="ck_rivet_identity_single_row"),
    )
    op.create_table(
        "rivet_audit",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("at", sa.Text, nullable=False),
        sa.Column("actor", sa.Text, nullable=False),
        sa.Column("command", sa.Text, nullable=False),
        sa.Column("action", sa.Text, nullable=False),
        sa.Column("detail", sa.Text, nullable=False),
    )


def downgrade() -> None:
    from alembic import op

    op.drop_table("rivet_audit")
    op.drop_table("rivet_identity")
