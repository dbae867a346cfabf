"""early state: export progress, run history, chunk checkpoints

The shape the first rivet releases wrote. A *legacy* state has exactly these tables and
no version table; statetool recognises it by this shape and stamps it at this revision
before upgrading.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

#: Tables this upgrade rebuilds (copies every row of), for the migrate plan.
UPGRADE_REBUILDS: tuple[str, ...] = ()
#: Table -> SQL predicate of the rows whose data the downgrade drops (None: every row).
DOWNGRADE_LOSES: dict[str, str | None] = {
    "rivet_exports": None,
    "rivet_runs": None,
    "rivet_chunks": None,
}


def upgrade() -> None:
    # Imported here, not at the top: statetool imports this module to read its constants
    # (statetool/migrations.py), and `check` and `info` must not load alembic.
    from alembic import op

    op.create_table(
        "rivet_exports",
        sa.Column("export_name", sa.Text, primary_key=True),
        sa.Column("mode", sa.Text, nullable=False),
        sa.Column("cursor_value", sa.Text),
        sa.Column("cursor_updated_at", sa.Text),
        sa.Column("updated_at", sa.Text, nullable=False),
    )
    op.create_table(
        "rivet_runs",
        sa.Column("run_id", sa.Text, primary_key=True),
        sa.Column("export_name", sa.Text, nullable=False),
        sa.Column("mode", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("started_at", sa.Text, nullable=False),
        sa.Column("finished_at", sa.Text),
        sa.Column("rows", sa.Integer, nullable=False, server_default="0"),
        sa.Column("files", sa.Integer, nullable=False, server_default="0"),
        sa.Column("error", sa.Text),
    )
    op.create_table(
        "rivet_chunks",
        sa.Column("export_name", sa.Text, primary_key=True),
        sa.Column("run_id", sa.Text, primary_key=True),
        sa.Column("chunk_index", sa.Integer, primary_key=True),
        sa.Column("lower_bound", sa.Text),
        sa.Column("upper_bound", sa.Text),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("rows", sa.Integer, nullable=False, server_default="0"),
        sa.Column("updated_at", sa.Text, nullable=False),
    )


def downgrade() -> None:
    from alembic import op

    op.drop_table("rivet_chunks")
    op.drop_table("rivet_runs")
    op.drop_table("rivet_exports")
