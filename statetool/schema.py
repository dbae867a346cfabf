"""The state schema at head, as SQLAlchemy Core tables (what the revisions build).

Tables carry no schema name: on PostgreSQL every connection sets ``search_path`` to the
state's schema (``rivet_state`` or ``?schema=``), so one definition serves both backends.
Times are ISO-8601 UTC text (``2026-11-30T12:00:00.000000Z``) except in the PostgreSQL
lease table, whose times come from the database clock.
"""

from __future__ import annotations

import sqlalchemy as sa

#: The version table of every path (online, offline ``--sql``, stamping), never alembic's
#: default ``alembic_version`` (SPEC §10); alembic/env.py reads it from here.
VERSION_TABLE = "rivet_state_version"
#: The version-table value of a move's target until the source is retired (decisions.md,
#: "Moves: one live place"): every opener refuses it (``RIVET_STATE_MOVE_IN_FLIGHT``) on
#: both backends. At most 32 characters (alembic's column); never a revision id of any release.
IN_FLIGHT_REVISION = "move-in-flight"
#: The PostgreSQL lease table (revision 0002) and the last fencing token of every key
#: (revision 0004); raw SQL in backends/postgres_leases.py, so no Core table here.
LEASE_TABLE = "rivet_leases"
LEASE_TOKENS_TABLE = "rivet_lease_tokens"
LEASE_TABLES = frozenset({LEASE_TABLE, LEASE_TOKENS_TABLE})

metadata = sa.MetaData()

exports = sa.Table(
    "rivet_exports", metadata,
    sa.Column("export_name", sa.Text, primary_key=True),
    sa.Column("mode", sa.Text, nullable=False),
    sa.Column("cursor_value", sa.Text),
    sa.Column("cursor_updated_at", sa.Text),
    sa.Column("updated_at", sa.Text, nullable=False),
)

runs = sa.Table(
    "rivet_runs", metadata,
    sa.Column("run_id", sa.Text, primary_key=True),
    sa.Column("export_name", sa.Text, nullable=False),
    sa.Column("mode", sa.Text, nullable=False),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("started_at", sa.Text, nullable=False),
    sa.Column("finished_at", sa.Text),
    sa.Column("rows", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("files", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("error", sa.Text),
    sa.Column("bytes_read", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("duration_ms", sa.BigInteger),
    sa.Column("error_code", sa.Text),
)

chunks = sa.Table(
    "rivet_chunks", metadata,
    sa.Column("export_name", sa.Text, primary_key=True),
    sa.Column("run_id", sa.Text, primary_key=True),
    sa.Column("chunk_index", sa.Integer, primary_key=True),
    sa.Column("lower_bound", sa.Text),
    sa.Column("upper_bound", sa.Text),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("rows", sa.Integer, nullable=False, server_default="0"),
    sa.Column("updated_at", sa.Text, nullable=False),
)

run_aggregates = sa.Table(
    "rivet_run_aggregates", metadata,
    sa.Column("run_id", sa.Text, primary_key=True),
    sa.Column("config_path", sa.Text),
    sa.Column("started_at", sa.Text, nullable=False),
    sa.Column("finished_at", sa.Text),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("details_json", sa.Text),
)

load_ledger = sa.Table(
    "rivet_load_ledger", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("export_name", sa.Text, nullable=False),
    sa.Column("table_name", sa.Text, nullable=False),
    sa.Column("part", sa.Text, nullable=False),
    sa.Column("rows", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("loaded_at", sa.Text),
)

identity = sa.Table(
    "rivet_identity", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("state_key", sa.Text, nullable=False),
    sa.Column("recorded_at", sa.Text, nullable=False),
    sa.Column("recorded_by", sa.Text, nullable=False),
)

audit = sa.Table(
    "rivet_audit", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("at", sa.Text, nullable=False),
    sa.Column("actor", sa.Text, nullable=False),
    sa.Column("command", sa.Text, nullable=False),
    sa.Column("action", sa.Text, nullable=False),
    sa.Column("detail", sa.Text, nullable=False),
)

#: The tables of the early state (revision 0001): their presence without a version
#: table is what makes a *legacy* state (SPEC §4).
LEGACY_TABLES = frozenset({exports.name, runs.name, chunks.name})
#: Every table name the state schema has ever had, for "a database of another application".
STATE_TABLES = frozenset(t.name for t in metadata.sorted_tables) | LEASE_TABLES | {VERSION_TABLE}
