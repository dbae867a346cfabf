"""``statetool migrate``: every upgrade path keeps every value, downgrades refuse to drop data
unless told, dry runs and ``--sql`` change nothing, a failing step rolls everything back, and
two migrations of one state never both run. Each shared rule runs on both backends.

The helpers at the top (``Target``, ``build_state``, dumps) are imported by test_writes.py and
test_runtime.py as well: one way to build and read a state in every test of a state's content.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from support import CliRun, describe, error_object, run_cli, tree_digest, write_config
from statetool import migrations, schema
from statetool.operations.context import Context
from statetool.operations.migrate import migrate
from support.backends import StateBackend

HEAD = "0006"
SOURCE_KEY = "postgresql://db.internal:5432/sales"
VERSION_TABLE = "rivet_state_version"
BACKUP_NAME = re.compile(r"^\.rivet_state\.db\.backup-(?P<label>.+)-(?P<stamp>\d{8}T\d{6}Z)$")


# --------------------------------------------------------------------------------------
# A state location under test, on either backend, and how to read all of it
# --------------------------------------------------------------------------------------

def split_pg_url(url: str) -> tuple[str, str]:
    """``(connectable URL without ?schema, schema)`` of a test state URL."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    schema_name = [v for k, v in query if k == "schema"][-1]
    rest = urlencode([(k, v) for k, v in query if k != "schema"])
    return urlunsplit((parts.scheme, parts.netloc, parts.path, rest, parts.fragment)), schema_name


@dataclass
class Target:
    """Where a test's state lives: SQLite beside ``config``, or a PostgreSQL schema."""

    kind: str
    config: Path
    pg_url: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        """Environment for ``run_cli`` (RIVET_STATE_URL for PostgreSQL)."""
        env = dict(self.extra_env)
        if self.pg_url:
            env["RIVET_STATE_URL"] = self.pg_url
        return env

    @property
    def directory(self) -> Path:
        return self.config.parent

    @property
    def path(self) -> Path:
        return self.directory / ".rivet_state.db"

    @property
    def schema(self) -> str | None:
        return split_pg_url(self.pg_url)[1] if self.pg_url else None

    @property
    def base_url(self) -> str:
        assert self.pg_url
        return split_pg_url(self.pg_url)[0]

    def context(self, lock_wait: float = 30.0, env: dict[str, str] | None = None) -> Context:
        """A library context for this state (the process environment without RIVET_STATE_URL)."""
        full = {k: v for k, v in os.environ.items() if k != "RIVET_STATE_URL"}
        full.update(self.env if env is None else env)
        return Context(self.config, None, full, lock_wait)

    def engine(self) -> sa.Engine:
        """A plain read-write engine on the state (PostgreSQL: search_path = the schema)."""
        if self.kind == "sqlite":
            path = self.path
            return sa.create_engine("sqlite://", creator=lambda: sqlite3.connect(path), poolclass=NullPool)
        url = "postgresql+psycopg://" + self.base_url.split("://", 1)[1]
        return sa.create_engine(url, poolclass=NullPool, connect_args={"options": f"-c search_path={self.schema}"})

    def psycopg(self) -> Any:
        import psycopg

        return psycopg.connect(self.base_url)

    def dump(self) -> dict[str, Any]:
        """Everything the state holds: its schema (tables, columns, indexes) and every row."""
        return sqlite_dump(self.path) if self.kind == "sqlite" else pg_dump(self.base_url, self.schema)

    def tables(self) -> set[str]:
        return set(self.dump()["data"])

    def revision(self) -> str | None:
        """The version table's value, None when there is no version table."""
        data = self.dump()["data"]
        if VERSION_TABLE not in data:
            return None
        rows = data[VERSION_TABLE][1]
        assert len(rows) == 1, rows
        return rows[0][0]

    def rows(self, table: str) -> list[dict[str, Any]]:
        cols, rows = self.dump()["data"][table]
        return [dict(zip(cols, r)) for r in rows]


def _sorted(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return sorted((tuple(r) for r in rows), key=repr)


def sqlite_dump(path: Path) -> dict[str, Any]:
    """Schema and rows of a SQLite file, read without creating any file beside it."""
    if not path.exists():
        return {"schema": [], "data": {}}
    wal = Path(f"{path}-wal")
    uri = f"file:{quote(str(path))}" + ("" if wal.exists() else "?immutable=1")
    db = sqlite3.connect(uri, uri=True)
    try:
        master = _sorted(db.execute("SELECT type, name, tbl_name, sql FROM sqlite_master "
                                    "WHERE name NOT LIKE 'sqlite_%'").fetchall())
        data = {}
        for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                  "AND name NOT LIKE 'sqlite_%'").fetchall():
            cur = db.execute(f'SELECT * FROM "{name}"')
            data[name] = ([d[0] for d in cur.description], _sorted(cur.fetchall()))
        return {"schema": master, "data": data}
    finally:
        db.close()


def pg_dump(base_url: str, schema_name: str) -> dict[str, Any]:
    """Columns (with types, defaults), indexes and rows of every table of one schema."""
    import psycopg

    with psycopg.connect(base_url) as conn:
        columns = _sorted(conn.execute(
            "SELECT table_name, column_name, data_type, is_nullable, column_default FROM information_schema.columns "
            "WHERE table_schema = %s", (schema_name,)).fetchall())
        indexes = _sorted(conn.execute("SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = %s",
                                       (schema_name,)).fetchall())
        data = {}
        for (name,) in conn.execute("SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                                    (schema_name,)).fetchall():
            cur = conn.execute(f'SELECT * FROM "{schema_name}"."{name}"')
            data[name] = ([d.name for d in cur.description], _sorted(cur.fetchall()))
        return {"schema": columns + indexes, "data": data}


def project(dump: dict[str, Any], table: str, columns: list[str]) -> list[tuple[Any, ...]]:
    """The rows of ``table`` in ``dump`` restricted to ``columns`` (in that order), sorted."""
    cols, rows = dump["data"][table]
    idx = [cols.index(c) for c in columns]
    return _sorted([tuple(r[i] for i in idx) for r in rows])


# --------------------------------------------------------------------------------------
# Building a state at a revision, with data in every table that revision has
# --------------------------------------------------------------------------------------

EXPORTS_YAML = textwrap.dedent("""\
    exports:
      - name: orders
        mode: incremental
      - name: order_lines
        mode: chunked
      - name: customers
        mode: chunked
      - name: refunds
        mode: incremental
      - name: order_events
        mode: cdc
        cdc:
          engine: mysql
          checkpoint: checkpoints/order_events.json
    """)


def rows_0001() -> dict[str, list[dict[str, Any]]]:
    """Rows for the tables of revision 0001, with the awkward values real states hold:
    NULLs, quotes, non-ASCII text, counts near the 32-bit limit, an export not in the config."""
    exports = [
        {"export_name": "orders", "mode": "incremental", "cursor_value": "2026-03-01T00:00:00.000000Z",
         "cursor_updated_at": "2026-03-01T00:05:00.000000Z", "updated_at": "2026-03-01T00:05:00.000000Z"},
        {"export_name": "order_lines", "mode": "chunked", "cursor_value": None, "cursor_updated_at": None,
         "updated_at": "2026-03-01T01:00:00.000000Z"},
        {"export_name": "customers", "mode": "chunked", "cursor_value": None, "cursor_updated_at": None,
         "updated_at": "2026-03-01T02:00:00.000000Z"},
        {"export_name": "kündigungen", "mode": "incremental", "cursor_value": "id > 'O''Brien' ✓",
         "cursor_updated_at": "2026-02-01T00:00:00.000000Z", "updated_at": "2026-02-01T00:00:00.000000Z"},
    ]
    names = ["orders", "order_lines", "customers", "kündigungen"]
    runs = []
    for i in range(48):
        status = ("failed" if i % 7 == 6 else "running" if i == 47 else "succeeded")
        runs.append({
            "run_id": f"run-{i:04d}", "export_name": names[i % 4],
            "mode": "chunked" if i % 4 in (1, 2) else "incremental",
            "status": status, "started_at": f"2026-01-{1 + i % 28:02d}T{i % 24:02d}:00:00.000000Z",
            "finished_at": None if status == "running" else f"2026-01-{1 + i % 28:02d}T{i % 24:02d}:00:30.000000Z",
            "rows": 2_147_483_000 + i if i % 11 == 0 else i * 1000, "files": i % 5,
            "error": 'server said "no" to O\'Reilly\nsecond line' if status == "failed" else None,
        })
    chunks = []
    for export, run_id in (("order_lines", "run-0045"), ("customers", "run-0046")):
        for k in range(6):
            chunks.append({"export_name": export, "run_id": run_id, "chunk_index": k,
                           "lower_bound": None if k == 0 else str(k * 1000),
                           "upper_bound": None if k == 5 else str((k + 1) * 1000),
                           "status": "done" if k < 4 else "pending", "rows": 1000 * k,
                           "updated_at": f"2026-01-20T00:0{k}:00.000000Z"})
    return {"rivet_exports": exports, "rivet_runs": runs, "rivet_chunks": chunks}


def build_state(target: Target, revision: str, *, legacy: bool = False, newer_data: bool = True) -> None:
    """Create the state of ``target`` at ``revision`` (``legacy``: 0001 without a version table)
    and fill every table. ``newer_data``: also fill what revision 0002 added (its tables and
    run columns), the data a downgrade to 0001 would drop."""
    engine = target.engine()
    try:
        with engine.begin() as conn:
            if target.kind == "postgres":
                conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{target.schema}"')
            migrations.apply(conn, revision, target.schema, "up")
            if legacy:
                conn.exec_driver_sql(f"DROP TABLE {VERSION_TABLE}")
            for table, rows in rows_0001().items():
                conn.execute(sa.text(f'INSERT INTO "{table}" ({", ".join(rows[0])}) '
                                     f'VALUES ({", ".join(":" + c for c in rows[0])})'), rows)
            if migrations.index_of(revision) >= 1 and newer_data:
                conn.execute(sa.text("UPDATE rivet_runs SET bytes_read = :b, duration_ms = :d, error_code = :c "
                                     "WHERE run_id = :r"),
                             [{"b": 9_000_000_000 + i, "d": 30_000 + i, "c": "E_RESET" if i % 7 == 6 else None,
                               "r": f"run-{i:04d}"} for i in range(0, 48, 3)])
                conn.execute(sa.text("INSERT INTO rivet_run_aggregates VALUES (:r, :p, :s, :f, :st, :d)"),
                             [{"r": f"agg-{i}", "p": "/srv/pipe/rivet.yaml", "s": f"2026-01-0{i + 1}T00:00:00Z",
                               "f": None if i == 2 else f"2026-01-0{i + 1}T00:10:00Z", "st": "succeeded",
                               "d": json.dumps({"exports": i})} for i in range(3)])
                conn.execute(sa.text("INSERT INTO rivet_load_ledger (export_name, table_name, part, rows, loaded_at) "
                                     "VALUES (:e, :t, :p, :n, :at)"),
                             [{"e": "orders", "t": "dw.orders", "p": f"part-{i:05d}.parquet", "n": 5_000_000_000 + i,
                               "at": None if i == 3 else f"2026-01-10T00:00:0{i}Z"} for i in range(5)])
                if target.kind == "postgres":
                    conn.execute(sa.text("INSERT INTO rivet_leases VALUES ('load-table:dw.orders', 4242, 'worker-7', "
                                         "'etl', 'rivet run', '2026-01-01T00:00:00+00', '2026-01-01T00:00:10+00', 30)"))
            if revision == HEAD:
                conn.execute(sa.text("INSERT INTO rivet_audit (at, actor, command, action, detail) "
                                     "VALUES ('2026-01-01T00:00:00Z', 'ops@host', 'statetool init', 'init', '{}')"))
    finally:
        engine.dispose()


@pytest.fixture
def target(state_backend: StateBackend) -> Target:
    """A state location with nothing there yet: SQLite beside the config, or a fresh PG schema."""
    return Target(state_backend.kind, write_config(state_backend.pipeline, exports=EXPORTS_YAML), state_backend.url)


def cli(target: Target, *args: str, env: dict[str, str] | None = None) -> CliRun:
    """The real CLI on ``target``'s state."""
    return run_cli("-c", str(target.config), *args, env={**target.env, **(env or {})})


def backups(target: Target) -> list[Path]:
    return sorted(target.directory.glob(".rivet_state.db.backup-*"))


def without_lease_files(files: Iterable[str]) -> set[str]:
    """``files`` less the lease sidecars (``.rivet_state.leases/*``): a migration holds the
    state lease and every run lease while it runs, and lease files are never deleted."""
    return {f for f in files if not f.startswith(".rivet_state.leases/")}


def without_lease_tokens(dump: dict[str, Any]) -> dict[str, Any]:
    """``dump`` less ``rivet_lease_tokens`` (PostgreSQL): every lease a write takes draws the
    next fencing token of its key, even when the write then rolls back."""
    dump["data"].pop("rivet_lease_tokens", None)
    return dump


def state_files(target: Target) -> dict[str, str]:
    """The digest of the pipeline directory (SQLite) - what "changes nothing" means there."""
    return tree_digest(target.directory)


def assert_valid_backup(path: Path, expected_dump: dict[str, Any]) -> None:
    """``path`` is a SQLite database that passes quick_check and holds exactly ``expected_dump``."""
    assert path.read_bytes()[:16] == b"SQLite format 3\x00", path
    db = sqlite3.connect(f"file:{quote(str(path))}?mode=ro", uri=True)
    try:
        assert db.execute("PRAGMA quick_check").fetchall() == [("ok",)]
    finally:
        db.close()
    assert sqlite_dump(path) == expected_dump


# --------------------------------------------------------------------------------------
# 1. Upgrades from every earlier revision keep every value
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("start", ["legacy", "0001", "0002"])
def test_upgrade_from_every_earlier_revision_keeps_every_row_and_value(target: Target, start: str) -> None:
    build_state(target, "0001" if start == "legacy" else start, legacy=start == "legacy")
    before = target.dump()
    digest_before = state_files(target)

    proc = cli(target, "migrate", "--json")
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    assert (doc["from_revision"], doc["to_revision"], doc["direction"], doc["applied"]) == (start, HEAD, "up", True)
    assert [s["id"] for s in doc["steps"]] == [r.id for r in migrations.revisions()][migrations.index_of(
        "0001" if start == "legacy" else start) + 1:]

    after = target.dump()
    for table, (cols, rows) in before["data"].items():
        if table == VERSION_TABLE:
            continue
        assert project(after, table, cols) == rows, f"{table}: rows or values changed by the upgrade"
    assert target.revision() == HEAD
    assert after["data"][VERSION_TABLE][0] == ["version_num"]
    assert "alembic_version" not in after["data"]
    assert set(schema.metadata.tables) <= set(after["data"])
    # the state had progress and no identity: the upgrade adopted this config's source, said so, audited it
    assert [r["state_key"] for r in target.rows("rivet_identity")] == [SOURCE_KEY]
    assert "RIVET_STATE_IDENTITY_ADOPTED" in [w["code"] for w in doc["warnings"]], describe(proc)
    audit = {r["action"]: json.loads(r["detail"]) for r in target.rows("rivet_audit")}
    assert audit["migrate"] == {"from": start, "to": HEAD, "backup": doc["backup"]}
    assert audit["identity.adopt"]["new"] == SOURCE_KEY

    if target.kind == "sqlite":
        found = backups(target)
        assert len(found) == 1, found
        match = BACKUP_NAME.match(found[0].name)
        assert match and match["label"] == start, found[0].name
        assert doc["backup"] == str(found[0])
        assert_valid_backup(found[0], before)
        # nothing else appeared beside the state (no -wal, -shm, -journal, .tmp)
        assert without_lease_files(state_files(target)) == without_lease_files(digest_before) | {found[0].name}
    else:
        assert doc["backup"] is None


def test_upgrade_of_a_legacy_state_built_by_an_old_release(tmp_path: Path) -> None:
    """The legacy shape as statetool.example builds it (rollback journal, thousands of runs)."""
    from statetool.example import build_legacy_state

    config = write_config(tmp_path / "pipeline")
    target = Target("sqlite", config)
    written = build_legacy_state(target.path, [("orders", "incremental"), ("order_lines", "chunked")], 3000)
    before = target.dump()

    plan = migrate(target.context(), dry_run=True)
    assert {s.id: s.rebuilds for s in plan.steps}["0002"] == {}  # widened in place: no row copied

    proc = cli(target, "migrate", "--json")
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    assert doc["verified_rows"] == {t: written[t] for t in written}
    after = target.dump()
    for table, (cols, rows) in before["data"].items():
        assert project(after, table, cols) == rows, table
    assert_valid_backup(Path(doc["backup"]), before)


# --------------------------------------------------------------------------------------
# Downgrades: refuse to drop data unless told; round trips keep what both revisions hold
# --------------------------------------------------------------------------------------

COLUMNS_0001 = {t: [c.name for c in schema.metadata.tables[t].columns][:n]
                for t, n in (("rivet_exports", 5), ("rivet_runs", 9), ("rivet_chunks", 8))}


def test_downgrade_that_drops_data_is_refused_without_allow_data_loss(target: Target) -> None:
    build_state(target, "0002")
    before, digest = target.dump(), state_files(target)

    proc = cli(target, "migrate", "--to", "0001", "--json-errors")
    assert proc.returncode == 5, describe(proc)
    err = error_object(proc)
    assert err["code"] == "RIVET_STATE_DATA_LOSS", describe(proc)
    # the refusal names what would be dropped, with counts
    assert "rivet_load_ledger" in err["message"] and "5 rows" in err["message"], describe(proc)
    assert target.dump() == before
    assert state_files(target) == digest  # not even a backup


def test_dry_run_of_a_lossy_downgrade_refuses_as_the_real_run_and_shows_the_plan_when_allowed(
        target: Target) -> None:
    """A dry run refuses whatever the real run refuses (issue 10): without
    ``--allow-data-loss`` it is ``RIVET_STATE_DATA_LOSS`` too; with it, the plan names what
    the downgrade drops. Neither changes a byte."""
    build_state(target, "0002")
    before, digest = target.dump(), state_files(target)

    proc = cli(target, "migrate", "--to", "0001", "--dry-run", "--json-errors")
    assert proc.returncode == 5 and error_object(proc)["code"] == "RIVET_STATE_DATA_LOSS", describe(proc)
    assert "rivet_load_ledger" in error_object(proc)["message"], describe(proc)
    proc = cli(target, "migrate", "--to", "0001", "--dry-run", "--allow-data-loss", "--json")
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    assert doc["dry_run"] is True and doc["applied"] is False, describe(proc)
    assert doc["steps"][0]["loses"]["rivet_load_ledger"] == 5, describe(proc)
    # undoing 0002 narrows the counts and drops columns: every run is copied (found by a fresh user)
    assert doc["steps"][0]["rebuilds"] == {"rivet_runs": len(before["data"]["rivet_runs"][1])}, describe(proc)
    assert "drops" in doc["message"], describe(proc)
    assert target.dump() == before
    assert state_files(target) == digest


def test_downgrade_with_allow_data_loss_then_upgrade_round_trips(target: Target) -> None:
    build_state(target, "0002")
    at_0002 = target.dump()

    assert migrate(target.context()).applied
    down = cli(target, "migrate", "--to", "0001", "--allow-data-loss", "--json")
    assert down.returncode == 0, describe(down)
    doc = json.loads(down.stdout)
    assert (doc["from_revision"], doc["to_revision"], doc["direction"]) == (HEAD, "0001", "down")
    assert [s["id"] for s in doc["steps"]] == ["0006", "0005", "0004", "0003", "0002"]
    lost = {table: rows for step in doc["steps"] for table, rows in step["loses"].items()}
    assert lost["rivet_load_ledger"] == 5 and lost["rivet_run_aggregates"] == 3
    assert lost["rivet_runs"] == 16  # the runs whose bytes_read/duration/error_code go
    assert target.revision() == "0001"
    at_0001 = target.dump()
    assert set(at_0001["data"]) == {VERSION_TABLE, "rivet_exports", "rivet_runs", "rivet_chunks"}
    for table, cols in COLUMNS_0001.items():
        assert project(at_0001, table, cols) == project(at_0002, table, cols), table
    if target.kind == "sqlite":
        labels = sorted(BACKUP_NAME.match(p.name)["label"] for p in backups(target))
        assert labels == ["0002", HEAD]

    assert migrate(target.context()).applied
    assert target.revision() == HEAD
    final = target.dump()
    for table, cols in COLUMNS_0001.items():
        assert project(final, table, cols) == project(at_0002, table, cols), table
    assert {r[0] for r in project(final, "rivet_runs", ["bytes_read"])} == {0}
    assert final["data"]["rivet_load_ledger"][1] == []


def test_lossless_downgrade_needs_no_flag_and_round_trips_exactly(target: Target) -> None:
    """0002 -> 0001 on a state that holds nothing 0002 added: no data lost, no flag needed,
    and up again gives back the very same tables, columns and rows."""
    build_state(target, "0001")
    at_0001 = target.dump()
    assert migrate(target.context(), to="0002").applied
    at_0002 = target.dump()
    assert target.revision() == "0002"

    down = cli(target, "migrate", "--to", "0001", "--json")
    assert down.returncode == 0, describe(down)
    assert all(n == 0 for s in json.loads(down.stdout)["steps"] for n in s["loses"].values()), describe(down)
    back = target.dump()
    assert back["data"] == at_0001["data"]
    if target.kind == "postgres":  # column types (integer again), defaults and indexes too
        assert back["schema"] == at_0001["schema"]

    assert migrate(target.context(), to="0002").applied
    assert target.dump()["data"] == at_0002["data"]


# --------------------------------------------------------------------------------------
# 2. Plans, SQL, refusals that change nothing
# --------------------------------------------------------------------------------------

def test_dry_run_prints_the_plan_and_writes_nothing(target: Target) -> None:
    build_state(target, "0001", legacy=True)
    before, digest = target.dump(), state_files(target)
    runs = len(before["data"]["rivet_runs"][1])

    proc = cli(target, "migrate", "--dry-run")
    assert proc.returncode == 0, describe(proc)
    out = " ".join(proc.stdout.split())
    assert "from legacy to 0006" in out, describe(proc)
    for rev in migrations.revisions()[1:]:
        assert rev.id in out and rev.description.split(";")[0] in out, describe(proc)
    # PostgreSQL rewrites rivet_runs to widen its counts; SQLite changes only their declared type
    rebuilt = {"rivet_runs": runs} if target.kind == "postgres" else {}
    assert (f"rivet_runs ({runs})" in out) == bool(rebuilt), describe(proc)
    assert "nothing was changed" in out, describe(proc)

    doc = migrate(target.context(), dry_run=True).as_dict()  # the --json document
    assert (doc["from_revision"], doc["to_revision"], doc["dry_run"], doc["applied"]) == ("legacy", HEAD, True, False)
    assert [(s["id"], s["rebuilds"]) for s in doc["steps"]] == [("0002", rebuilt), ("0003", {}), ("0004", {}), ("0005", {}),
                                                                    ("0006", {})]
    assert doc["backup"] is None

    assert target.dump() == before
    assert target.revision() is None
    assert state_files(target) == digest


def test_sql_on_postgres_prints_the_ddl_with_the_version_table_and_changes_nothing(
        tmp_path: Path, pg_url: str) -> None:
    target = Target("postgres", write_config(tmp_path / "pipeline", exports=EXPORTS_YAML), pg_url)
    build_state(target, "0001")
    before = target.dump()

    proc = cli(target, "migrate", "--sql")
    assert proc.returncode == 0, describe(proc)
    assert VERSION_TABLE in proc.stdout, describe(proc)
    assert "alembic_version" not in proc.stdout, describe(proc)
    assert "ALTER TABLE" in proc.stdout and "rivet_identity" in proc.stdout, describe(proc)
    assert target.dump() == before

    # the SQL is what a DBA can really run: applied by hand, it brings the state to head
    with target.psycopg() as conn:
        conn.execute(proc.stdout)
    assert target.revision() == HEAD
    after = target.dump()
    for table, (cols, rows) in before["data"].items():
        if table != VERSION_TABLE:
            assert project(after, table, cols) == rows, table
    from statetool.operations.check import check

    assert check(target.context()).exit_code == 0


def test_sql_on_a_legacy_postgres_state_stamps_then_upgrades(tmp_path: Path, pg_url: str) -> None:
    target = Target("postgres", write_config(tmp_path / "pipeline", exports=EXPORTS_YAML), pg_url)
    build_state(target, "0001", legacy=True)
    before = target.dump()
    proc = cli(target, "migrate", "--sql")
    assert proc.returncode == 0, describe(proc)
    assert target.dump() == before
    with target.psycopg() as conn:
        conn.execute(proc.stdout)
    assert target.revision() == HEAD


@pytest.mark.parametrize("revision", ["0001", "head"])
def test_sql_on_sqlite_is_refused_and_changes_nothing(tmp_path: Path, revision: str) -> None:
    """Refused whatever the state's revision: at head too (it said "nothing to do", exit 0)."""
    target = Target("sqlite", write_config(tmp_path / "pipeline", exports=EXPORTS_YAML))
    build_state(target, HEAD if revision == "head" else revision)
    digest = state_files(target)
    proc = cli(target, "migrate", "--sql", "--json-errors")
    assert proc.returncode == 1, describe(proc)
    assert error_object(proc)["code"] == "RIVET_STATE_SQL_UNSUPPORTED", describe(proc)
    assert state_files(target) == digest


def test_the_revision_graph_is_what_alembic_reads_and_reading_it_loads_no_alembic() -> None:
    """``check`` and ``info`` need the list of revisions, not the engine: a fresh process
    that reads it has imported no alembic module, and the list (ids, parents, descriptions,
    what each step rebuilds and drops) is the one alembic's own script directory reads."""
    code = ("import json, sys; from statetool import migrations; "
            "revs = [[r.id, r.down, r.description, list(r.rebuilds), r.loses] for r in migrations.revisions()]; "
            "print(json.dumps({'revisions': revs, 'alembic': sorted(m for m in sys.modules if m.split('.')[0] == 'alembic')}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    assert doc["alembic"] == [], doc["alembic"]
    from alembic.script import ScriptDirectory

    script = ScriptDirectory(str(migrations.script_location()))
    expected = [[s.revision, s.down_revision, s.doc, list(s.module.UPGRADE_REBUILDS), s.module.DOWNGRADE_LOSES]
                for s in reversed(list(script.walk_revisions()))]
    assert doc["revisions"] == expected
    assert doc["revisions"][-1][0] == HEAD


def test_migrate_refuses_a_missing_state_points_to_init_and_creates_nothing(target: Target) -> None:
    digest = state_files(target)
    proc = cli(target, "migrate")
    assert proc.returncode == 5, describe(proc)
    assert "RIVET_STATE_MISSING" in proc.stderr, describe(proc)
    assert "statetool init" in " ".join(proc.stderr.split()), describe(proc)
    assert state_files(target) == digest
    if target.kind == "postgres":
        with target.psycopg() as conn:
            found = conn.execute("SELECT count(*) FROM information_schema.schemata WHERE schema_name = %s",
                                 (target.schema,)).fetchone()[0]
        assert found == 0


def test_migrate_to_an_unknown_revision_is_refused(target: Target) -> None:
    build_state(target, "0001")
    before, digest = target.dump(), state_files(target)
    proc = cli(target, "migrate", "--to", "0099", "--json-errors")
    assert proc.returncode == 1, describe(proc)
    err = error_object(proc)
    assert err["code"] == "RIVET_STATE_REVISION_UNKNOWN", describe(proc)
    assert "0099" in err["message"] and HEAD in err["message"], describe(proc)
    assert target.dump() == before and state_files(target) == digest


def test_migrate_at_head_does_nothing_and_takes_no_backup(target: Target) -> None:
    build_state(target, HEAD)
    before, digest = target.dump(), state_files(target)
    proc = cli(target, "migrate", "--json")
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    assert doc["applied"] is False and "nothing to do" in doc["message"], describe(proc)
    assert target.dump() == before and state_files(target) == digest


# --------------------------------------------------------------------------------------
# 3. A migration that fails half way leaves the state exactly as it was
# --------------------------------------------------------------------------------------

FAILING_0007 = '''\
"""a revision that does real work and then fails

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table("rivet_half_done", sa.Column("id", sa.Integer, primary_key=True))
    op.execute("INSERT INTO rivet_half_done (id) VALUES (1)")
    with op.batch_alter_table("rivet_runs", recreate="always") as batch:
        batch.add_column(sa.Column("half_done", sa.Text))
    op.execute("UPDATE rivet_exports SET cursor_value = 'clobbered'")
    op.execute("DELETE FROM rivet_chunks")
    op.execute("UPDATE rivet_identity SET state_key = 'clobbered'")
    raise RuntimeError("revision 0007 failed half way")


def downgrade() -> None:
    op.drop_table("rivet_half_done")
'''


@pytest.fixture
def add_failing_revision(tmp_path: Path) -> Any:
    """A function that points statetool at a copy of its alembic scripts with a 0007 that
    fails half way (undone after the test)."""
    copy = tmp_path / "alembic-with-0007"
    shutil.copytree(migrations.script_location(), copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "versions" / "0007_fails_half_way.py").write_text(FAILING_0007)
    original = migrations.script_location

    def activate() -> None:
        migrations.script_location = lambda: copy  # type: ignore[assignment]
        migrations.revisions.cache_clear()
        assert migrations.head() == "0007"

    try:
        yield activate
    finally:
        migrations.script_location = original  # type: ignore[assignment]
        migrations.revisions.cache_clear()
    assert migrations.head() == HEAD


@pytest.mark.parametrize("start", ["legacy", HEAD])
def test_migration_failing_half_way_leaves_the_state_exactly_as_before(
        target: Target, start: str, add_failing_revision: Any) -> None:
    if start == HEAD:
        # a state as a pipeline's first run makes it (init: WAL mode on SQLite), with progress
        from statetool.runtime import StateStore

        store = StateStore.open(target.config, env=dict(target.context().env), create=True)
        with store.transaction() as tx:
            run = tx.start_run("orders", "incremental")
            tx.commit_cursor("orders", "incremental", "2026-01-01")
            tx.finish_run(run, "succeeded", rows=3)
            tx.record_chunk("order_lines", run, 0, None, "10", "done", rows=10)
    else:
        build_state(target, "0001", legacy=True)
    before = without_lease_tokens(target.dump())
    files_before = {f: d for f, d in state_files(target).items() if f in without_lease_files([f])}
    if target.kind == "sqlite":
        bytes_before = target.path.read_bytes()
    add_failing_revision()

    with pytest.raises(RuntimeError, match="revision 0007 failed half way"):
        migrate(target.context())

    assert without_lease_tokens(target.dump()) == before
    assert "rivet_half_done" not in target.tables()
    assert target.revision() == (None if start == "legacy" else HEAD)
    if target.kind == "sqlite":
        assert target.path.read_bytes() == bytes_before
        files_after = state_files(target)
        new_files = without_lease_files(files_after) - set(files_before)
        # at most the verified backup taken before the change; no journal, wal or tmp left
        assert all(BACKUP_NAME.match(Path(f).name) for f in new_files), new_files
        assert all(files_before[f] == files_after.get(f) for f in files_before)


# --------------------------------------------------------------------------------------
# 4. Two migrations of one state never both run
# --------------------------------------------------------------------------------------

def _hold_pg_migration_lock(target: Target) -> Any:
    conn = target.psycopg()
    got = conn.execute("SELECT pg_try_advisory_xact_lock(hashtext('rivet_state:' || %s))", (target.schema,)).fetchone()
    assert got == (True,)
    return conn


def _popen_cli(target: Target, *args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "RIVET_STATE_URL"}
    env.update({"COLUMNS": "200", "NO_COLOR": "1", **target.env})
    return subprocess.Popen([sys.executable, "-m", "statetool", "-c", str(target.config), *args], env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_two_concurrent_migrations_on_postgres_one_upgrades_the_other_finds_it_done(
        tmp_path: Path, pg_url: str) -> None:
    target = Target("postgres", write_config(tmp_path / "pipeline", exports=EXPORTS_YAML), pg_url)
    build_state(target, "0001")
    before = target.dump()
    holder = _hold_pg_migration_lock(target)
    watcher = target.psycopg()
    watcher.autocommit = True  # pg_stat_activity is a snapshot per transaction: look afresh each time
    procs = []
    try:
        procs = [_popen_cli(target, "migrate", "--json", "--lock-wait", "60") for _ in range(2)]
        # both have passed their pre-flight and are polling for the migration lock
        deadline = time.monotonic() + 60
        waiting = 0
        while time.monotonic() < deadline:
            waiting = watcher.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid NOT IN (pg_backend_pid(), %s) "
                "AND query LIKE '%%pg_try_advisory_xact_lock%%'", (holder.info.backend_pid,)).fetchone()[0]
            if waiting == 2 or any(p.poll() is not None for p in procs):
                break
            time.sleep(0.1)
        assert waiting == 2, [describe(_finish(p)) for p in procs]
        assert target.revision() == "0001"
    finally:
        holder.rollback()
        holder.close()
        watcher.close()
    results = [_finish(p) for p in procs]
    for proc in results:
        assert proc.returncode == 0, describe(proc)
    docs = [json.loads(p.stdout) for p in results]
    applied = [d for d in docs if d["applied"]]
    assert len(applied) == 1, [describe(p) for p in results]
    other = next(d for d in docs if not d["applied"])
    assert "another migration" in other["message"], other
    assert target.revision() == HEAD
    after = target.dump()
    for table, (cols, rows) in before["data"].items():
        if table != VERSION_TABLE:
            assert project(after, table, cols) == rows, table
    assert [r["action"] for r in target.rows("rivet_audit")].count("migrate") == 1


def test_migrate_on_postgres_while_another_holds_the_lock_fails_retryable(tmp_path: Path, pg_url: str) -> None:
    target = Target("postgres", write_config(tmp_path / "pipeline", exports=EXPORTS_YAML), pg_url)
    build_state(target, "0001")
    before = target.dump()
    holder = _hold_pg_migration_lock(target)
    try:
        started = time.monotonic()
        proc = cli(target, "migrate", "--lock-wait", "0", "--json-errors")
        assert proc.returncode == 2, describe(proc)
        err = error_object(proc)
        assert (err["code"], err["retryable"], err["exit_class"]) == ("RIVET_STATE_MIGRATION_LOCKED", True, 2), \
            describe(proc)
        proc = cli(target, "migrate", "--lock-wait", "1.5", "--json-errors")
        assert proc.returncode == 2 and error_object(proc)["code"] == "RIVET_STATE_MIGRATION_LOCKED", describe(proc)
        assert time.monotonic() - started >= 1.5
    finally:
        holder.rollback()
        holder.close()
    assert target.dump() == before


def test_migrate_on_sqlite_while_another_writer_holds_it_fails_retryable(tmp_path: Path) -> None:
    target = Target("sqlite", write_config(tmp_path / "pipeline", exports=EXPORTS_YAML))
    build_state(target, "0001")
    before, digest = target.dump(), state_files(target)
    writer = sqlite3.connect(target.path, isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")
        proc = cli(target, "migrate", "--lock-wait", "1", "--json-errors")
        assert proc.returncode == 2, describe(proc)
        err = error_object(proc)
        assert (err["code"], err["retryable"]) == ("RIVET_STATE_MIGRATION_LOCKED", True), describe(proc)
        assert backups(target) == []
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert target.dump() == before
    assert state_files(target) == digest


def test_two_concurrent_migrations_on_sqlite_apply_once(tmp_path: Path) -> None:
    target = Target("sqlite", write_config(tmp_path / "pipeline", exports=EXPORTS_YAML))
    build_state(target, "0001")
    before = target.dump()
    writer = sqlite3.connect(target.path, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    try:
        procs = [_popen_cli(target, "migrate", "--json", "--lock-wait", "60") for _ in range(2)]
        time.sleep(3)  # let both reach the write lock (a late one finds the state at head: also fine)
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    results = [_finish(p) for p in procs]
    for proc in results:
        assert proc.returncode == 0, describe(proc)
    docs = [json.loads(p.stdout) for p in results]
    assert sum(d["applied"] for d in docs) == 1, [describe(p) for p in results]
    assert len(backups(target)) == 1
    assert target.revision() == HEAD
    after = target.dump()
    for table, (cols, rows) in before["data"].items():
        if table != VERSION_TABLE:
            assert project(after, table, cols) == rows, table
