"""run aggregates, load ledger, lease table; wider run history

Adds the run aggregate and the load ledger, the PostgreSQL lease table (SQLite leases
are flocks on sidecar files, SPEC §5, so SQLite gets no such table), and new run-history
columns. The run counts become 64-bit: PostgreSQL rewrites ``rivet_runs``; SQLite, whose
integers are 64-bit already, only changes their declared type in the table's text
(statetool/backends/sqlite_schema.py) and adds the columns in place, and rebuilds the
table (alembic batch mode: every row copied into a new table) only where that cannot be
proved safe.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

#: Tables this upgrade rebuilds (copies every row of), for the migrate plan.
UPGRADE_REBUILDS: tuple[str, ...] = ("rivet_runs",)
#: Table -> column -> new declared type: the only reason a table above is rebuilt. A
#: backend that makes these changes in place (SQLite, same affinity) rebuilds nothing.
UPGRADE_RETYPES: dict[str, dict[str, str]] = {"rivet_runs": {"rows": "BIGINT", "files": "BIGINT"}}
#: Tables the downgrade rebuilds: narrowing the counts and dropping columns copies every row
#: (alembic batch mode on SQLite; PostgreSQL rewrites a table whose column type changes).
DOWNGRADE_REBUILDS: tuple[str, ...] = ("rivet_runs",)
#: Table -> SQL predicate of the rows whose data the downgrade drops (None: every row).
DOWNGRADE_LOSES: dict[str, str | None] = {
    "rivet_run_aggregates": None,
    "rivet_load_ledger": None,
    "rivet_leases": None,
    "rivet_runs": "bytes_read <> 0 OR error_code IS NOT NULL OR duration_ms IS NOT NULL",
}


def upgrade() -> None:
    # Imported here, not at the top: statetool imports this module to read its constants
    # (statetool/migrations.py), and `check` and `info` must not load alembic.
    from alembic import op

    from statetool.backends.sqlite_schema import STATE_NAME, require_rebuildable, retype_in_place

    bind = op.get_bind()
    added = [sa.Column("bytes_read", sa.BigInteger, nullable=False, server_default="0"),
             sa.Column("duration_ms", sa.BigInteger), sa.Column("error_code", sa.Text)]
    if bind.dialect.name == "sqlite" and retype_in_place(bind, "rivet_runs", UPGRADE_RETYPES["rivet_runs"]):
        for column in added:
            op.add_column("rivet_runs", column)
    else:
        if bind.dialect.name == "sqlite":
            require_rebuildable(lambda sql: bind.exec_driver_sql(sql).fetchall(), "rivet_runs",
                                bind.info.get(STATE_NAME, "the state"))
        with op.batch_alter_table("rivet_runs", recreate="auto") as batch:
            for name in UPGRADE_RETYPES["rivet_runs"]:
                batch.alter_column(name, type_=sa.BigInteger, existing_nullable=False, existing_server_default="0")
            for column in added:
                batch.add_column(column)
    op.create_index("ix_rivet_runs_export_started", "rivet_runs", ["export_name", "started_at"])
    op.create_table(
        "rivet_run_aggregates",
        sa.Column("run_id", sa.Text, primary_key=True),
        sa.Column("config_path", sa.Text),
        sa.Column("started_at", sa.Text, nullable=False),
        sa.Column("finished_at", sa.Text),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("details_json", sa.Text),
    )
    op.create_table(
        "rivet_load_ledger",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("export_name", sa.Text, nullable=False),
        sa.Column("table_name", sa.Text, nullable=False),
        sa.Column("part", sa.Text, nullable=False),
        sa.Column("rows", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("loaded_at", sa.Text),
    )
    if op.get_context().dialect.name == "postgresql":
        op.create_table(
            "rivet_leases",
            sa.Column("key", sa.Text, primary_key=True),
            sa.Column("holder_pid", sa.Integer, nullable=False),
            sa.Column("holder_host", sa.Text, nullable=False),
            sa.Column("holder_user", sa.Text, nullable=False),
            sa.Column("command", sa.Text, nullable=False),
            sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
            sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
            sa.Column("ttl_seconds", sa.Integer, nullable=False, server_default="30"),
        )


def downgrade() -> None:
    from alembic import op

    if op.get_context().dialect.name == "postgresql":
        op.drop_table("rivet_leases")
    op.drop_table("rivet_load_ledger")
    op.drop_table("rivet_run_aggregates")
    op.drop_index("ix_rivet_runs_export_started", "rivet_runs")
    with op.batch_alter_table("rivet_runs", recreate="auto") as batch:
        batch.drop_column("error_code")
        batch.drop_column("duration_ms")
        batch.drop_column("bytes_read")
        batch.alter_column("files", type_=sa.Integer, existing_nullable=False, existing_server_default="0")
        batch.alter_column("rows", type_=sa.Integer, existing_nullable=False, existing_server_default="0")
