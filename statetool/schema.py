"""The state schema at head, as SQLAlchemy Core tables (what the revisions build), under the
names of :mod:`statetool.tables`.

Tables carry no schema name: on PostgreSQL every connection sets ``search_path`` to the
state's schema (``rivet_state`` or ``?schema=``), so one definition serves both backends.
Times are ISO-8601 UTC text (``2026-11-30T12:00:00.000000Z``) except in the PostgreSQL
lease table, whose times come from the database clock.
"""

from __future__ import annotations

import sqlalchemy as sa

from statetool.tables import (AUDIT, CDC_POSITIONS, CHUNKS, EXPORTS, IDENTITY, IN_FLIGHT_REVISION, LEASE_TABLE,
                              LEASE_TABLES, LEASE_TOKENS_TABLE, LEGACY_TABLES, LINEAGE, LOAD_LEDGER, RUN_AGGREGATES,
                              RUNS, STATE_TABLES, VERSION_TABLE)

__all__ = ["IN_FLIGHT_REVISION", "LEASE_TABLE", "LEASE_TABLES", "LEASE_TOKENS_TABLE", "LEGACY_TABLES",
           "STATE_TABLES", "VERSION_TABLE", "audit", "cdc_positions", "chunks", "exports", "identity", "lineage",
           "load_ledger", "metadata", "run_aggregates", "runs"]

metadata = sa.MetaData()

exports = sa.Table(
    EXPORTS, metadata,
    sa.Column("export_name", sa.Text, primary_key=True),
    sa.Column("mode", sa.Text, nullable=False),
    sa.Column("cursor_value", sa.Text),
    sa.Column("cursor_updated_at", sa.Text),
    sa.Column("updated_at", sa.Text, nullable=False),
)

runs = sa.Table(
    RUNS, metadata,
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
    CHUNKS, metadata,
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
    RUN_AGGREGATES, metadata,
    sa.Column("run_id", sa.Text, primary_key=True),
    sa.Column("config_path", sa.Text),
    sa.Column("started_at", sa.Text, nullable=False),
    sa.Column("finished_at", sa.Text),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("details_json", sa.Text),
)

load_ledger = sa.Table(
    LOAD_LEDGER, metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("export_name", sa.Text, nullable=False),
    sa.Column("table_name", sa.Text, nullable=False),
    sa.Column("part", sa.Text, nullable=False),
    sa.Column("rows", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("loaded_at", sa.Text),
)

identity = sa.Table(
    IDENTITY, metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("state_key", sa.Text, nullable=False),
    sa.Column("recorded_at", sa.Text, nullable=False),
    sa.Column("recorded_by", sa.Text, nullable=False),
)

audit = sa.Table(
    AUDIT, metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("at", sa.Text, nullable=False),
    sa.Column("actor", sa.Text, nullable=False),
    sa.Column("command", sa.Text, nullable=False),
    sa.Column("action", sa.Text, nullable=False),
    sa.Column("detail", sa.Text, nullable=False),
)

lineage = sa.Table(
    LINEAGE, metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("lineage", sa.Text, nullable=False),
    sa.Column("serial", sa.BigInteger, nullable=False),
    sa.Column("write_id", sa.Text, nullable=False),
    sa.Column("updated_at", sa.Text, nullable=False),
)

cdc_positions = sa.Table(
    CDC_POSITIONS, metadata,
    sa.Column("export_name", sa.Text, primary_key=True),
    sa.Column("engine", sa.Text, nullable=False),
    sa.Column("position", sa.Text, nullable=False),
    sa.Column("committed_at", sa.Text, nullable=False),
    sa.Column("run_id", sa.Text),
    sa.Column("fencing_token", sa.BigInteger),
)
