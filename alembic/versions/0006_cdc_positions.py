"""CDC positions in the state

SPEC §6 and ADR-0039 D5: a CDC export's position (where its change stream resumes) lives
in the state itself, so a pod under a PostgreSQL state needs no volume and a lost worker
takes no position with it. ``rivet_cdc_positions`` holds one row per CDC export: the
engine, the position (JSON text, as the checkpoint file holds it), when it was committed,
by which run, and the fencing token of the run lease it was committed under. A state
without a row for an export reads that export's checkpoint file where the config names
one, as before.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

#: Tables this upgrade rebuilds (copies every row of), for the migrate plan.
UPGRADE_REBUILDS: tuple[str, ...] = ()
#: Table -> SQL predicate of the rows whose data the downgrade drops (None: every row).
DOWNGRADE_LOSES: dict[str, str | None] = {"rivet_cdc_positions": None}


def upgrade() -> None:
    # Imported here, not at the top: statetool imports this module to read its constants
    # (statetool/migrations.py), and `check` and `info` must not load alembic.
    from alembic import op

    op.create_table(
        "rivet_cdc_positions",
        sa.Column("export_name", sa.Text, primary_key=True),
        sa.Column("engine", sa.Text, nullable=False),
        sa.Column("position", sa.Text, nullable=False),
        sa.Column("committed_at", sa.Text, nullable=False),
        sa.Column("run_id", sa.Text),
        sa.Column("fencing_token", sa.BigInteger),
    )


def downgrade() -> None:
    from alembic import op

    op.drop_table("rivet_cdc_positions")
