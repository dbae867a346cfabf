"""schema.py (the tables at head, used by every query) must be exactly what the alembic
revisions build: the revisions are frozen history and never import schema.py, so this
test is what keeps the two from drifting apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from support import describe, run_cli
from statetool import schema


def _columns(engine: sa.Engine, schema_name: str | None) -> dict[str, set[tuple[str, bool]]]:
    inspector = sa.inspect(engine)
    return {
        table: {(c["name"], bool(c["nullable"])) for c in inspector.get_columns(table, schema=schema_name)}
        for table in inspector.get_table_names(schema=schema_name)
    }


def _expected(with_leases: bool) -> dict[str, set[tuple[str, bool]]]:
    expected = {t.name: {(c.name, bool(c.nullable)) for c in t.columns} for t in schema.metadata.sorted_tables}
    expected[schema.VERSION_TABLE] = {("version_num", False)}
    if with_leases:
        expected["rivet_leases"] = {(name, False) for name in (
            "key", "holder_pid", "holder_host", "holder_user", "command", "acquired_at", "heartbeat_at", "ttl_seconds")}
        expected["rivet_leases"] |= {(name, True) for name in (
            "fencing_token", "holder_started", "child_pid", "child_started")}
        expected["rivet_lease_tokens"] = {("key", False), ("token", False)}
    return expected


def test_sqlite_state_built_by_the_revisions_matches_schema_py(config: Path) -> None:
    proc = run_cli("-c", str(config), "init")
    assert proc.returncode == 0, describe(proc)
    engine = sa.create_engine(f"sqlite:///{config.parent / '.rivet_state.db'}")
    assert _columns(engine, None) == _expected(with_leases=False)


@pytest.mark.postgres
def test_postgres_state_built_by_the_revisions_matches_schema_py(config: Path, pg_url: str) -> None:
    proc = run_cli("-c", str(config), "init", env={"RIVET_STATE_URL": pg_url})
    assert proc.returncode == 0, describe(proc)
    base, schema_name = pg_url.split("&schema=") if "&schema=" in pg_url else pg_url.split("?schema=")
    engine = sa.create_engine("postgresql+psycopg://" + base.split("://", 1)[1])
    assert _columns(engine, schema_name) == _expected(with_leases=True)


def test_the_names_of_tables_py_are_the_core_tables_and_every_table_the_state_has_had() -> None:
    """The read paths know the state's tables by the names of ``tables.py`` (no SQLAlchemy):
    they must be the Core tables' names, and ``STATE_TABLES`` every one of them with the
    lease tables and the version table (what "a database of another application" is judged by)."""
    from statetool import tables

    core = {t.name for t in schema.metadata.sorted_tables}
    assert core == {tables.EXPORTS, tables.RUNS, tables.CHUNKS, tables.RUN_AGGREGATES, tables.LOAD_LEDGER,
                    tables.IDENTITY, tables.AUDIT, tables.LINEAGE, tables.CDC_POSITIONS}
    assert tables.STATE_TABLES == core | tables.LEASE_TABLES | {tables.VERSION_TABLE}
    assert tables.LEGACY_TABLES <= core
