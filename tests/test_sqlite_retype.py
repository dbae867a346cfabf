"""Revision 0002 widens ``rivet_runs.rows``/``files`` to BIGINT. On SQLite that changes no
stored byte (INTEGER and BIGINT share INTEGER affinity), so the migration edits the
table's declared text instead of copying every row (statetool/backends/sqlite_schema.py,
issue 13 item 2), and rebuilds the table only where the edit cannot be proved safe. These
tests hold the proof to its refusals, and the migrated state to the shape a new state has,
with no free page left behind."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from support import describe, error_object, run_cli, write_config
from statetool.backends.sqlite_schema import affinity, retyped_sql
from statetool.example import build_legacy_state, create_legacy_schema

WIDEN = {"rows": "BIGINT", "files": "BIGINT"}

#: rivet_runs as SQLAlchemy wrote it for revision 0001 (the legacy shape of old releases).
EMITTED = ("CREATE TABLE rivet_runs (\n\trun_id TEXT NOT NULL, \n\texport_name TEXT NOT NULL, \n"
           "\trows INTEGER DEFAULT '0' NOT NULL, \n\tfiles INTEGER DEFAULT '0' NOT NULL, \n"
           "\terror TEXT, \n\tPRIMARY KEY (run_id)\n)")


@pytest.mark.parametrize(("declared", "expected"), [
    ("INTEGER", "INTEGER"), ("bigint", "INTEGER"), ("UNSIGNED BIG INT", "INTEGER"), ("VARCHAR(32)", "TEXT"),
    ("CLOB", "TEXT"), ("", "BLOB"), ("BLOB", "BLOB"), ("DOUBLE PRECISION", "REAL"), ("FLOAT", "REAL"),
    ("NUMERIC", "NUMERIC"), ("DECIMAL(10,5)", "NUMERIC"), ("BOOLEAN", "NUMERIC"),
    ("POINT", "INTEGER"),  # SQLite's own example of rule 1: "POINT" contains "INT"
])
def test_affinity_follows_sqlites_rules_in_order(declared: str, expected: str) -> None:
    assert affinity(declared) == expected


@pytest.mark.parametrize(("create_sql", "expected"), [
    (EMITTED, EMITTED.replace("rows INTEGER", "rows BIGINT").replace("files INTEGER", "files BIGINT")),
    ('CREATE TABLE r (id TEXT PRIMARY KEY, "rows" int NOT NULL, [files] Integer)',
     'CREATE TABLE r (id TEXT PRIMARY KEY, "rows" BIGINT NOT NULL, [files] BIGINT)'),
    ("CREATE TABLE r (id TEXT,rows INT,files UNSIGNED BIG INT CHECK (files >= 0))",
     "CREATE TABLE r (id TEXT,rows BIGINT,files BIGINT CHECK (files >= 0))"),
    ("CREATE TABLE r (id TEXT, ROWS integer(8) DEFAULT 0, files integer)",
     "CREATE TABLE r (id TEXT, ROWS BIGINT DEFAULT 0, files BIGINT)"),
    ("CREATE TABLE r (id TEXT DEFAULT 'x, rows INT', rows INTEGER, files INTEGER)",  # a string is no column
     "CREATE TABLE r (id TEXT DEFAULT 'x, rows INT', rows BIGINT, files BIGINT)"),
])
def test_a_change_of_declared_type_within_integer_affinity_is_made_in_the_text(create_sql: str, expected: str) -> None:
    assert retyped_sql(create_sql, WIDEN) == expected


@pytest.mark.parametrize("create_sql", [
    "CREATE TABLE r (id TEXT, rows TEXT, files INTEGER)",  # TEXT affinity: values may be stored as text
    "CREATE TABLE r (id TEXT, rows NUMERIC, files INTEGER)",  # NUMERIC keeps reals as reals
    "CREATE TABLE r (id TEXT, rows, files INTEGER)",  # no declared type: BLOB affinity
    "CREATE TABLE r (id TEXT, rows REAL, files INTEGER)",
    "CREATE TABLE r (id TEXT DEFAULT 'x, rows INT, y', rows INTEGER, files INTEGER)",  # the name found twice
    "CREATE TABLE r (id TEXT, files INTEGER)",  # no such column
    "CREATE TABLE r (id TEXT, rows INTEGER, files INTEGER",  # text SQLite refuses
])
def test_what_cannot_be_proved_a_type_change_only_gives_none(create_sql: str) -> None:
    assert retyped_sql(create_sql, WIDEN) is None


def _columns(path: Path, table: str) -> list[tuple[object, ...]]:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return db.execute(f"PRAGMA table_xinfo({table})").fetchall()
    finally:
        db.close()


def _pragma(path: Path, name: str) -> object:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return db.execute(f"PRAGMA {name}").fetchone()[0]
    finally:
        db.close()


def test_migrate_widens_in_place_leaving_no_free_page_and_the_shape_of_a_new_state(tmp_path: Path) -> None:
    config = write_config(tmp_path / "legacy")
    state = config.parent / ".rivet_state.db"
    written = build_legacy_state(state, [("orders", "incremental"), ("order_lines", "chunked")], 4000)
    assert _pragma(state, "freelist_count") == 0

    plan = run_cli("-c", str(config), "--json", "migrate", "--dry-run")
    assert plan.returncode == 0, describe(plan)
    assert all(step["rebuilds"] == {} for step in json.loads(plan.stdout)["steps"]), describe(plan)

    proc = run_cli("-c", str(config), "--json", "migrate")
    assert proc.returncode == 0, describe(proc)
    assert json.loads(proc.stdout)["verified_rows"]["rivet_runs"] == written["rivet_runs"]
    # no row was copied, so no page of an old table was freed (a rebuild frees about half the file)
    assert _pragma(state, "freelist_count") == 0
    assert _pragma(state, "integrity_check") == "ok"

    fresh = write_config(tmp_path / "fresh")
    made = run_cli("-c", str(fresh), "init")
    assert made.returncode == 0, describe(made)
    assert _columns(state, "rivet_runs") == _columns(fresh.parent / ".rivet_state.db", "rivet_runs")

    db = sqlite3.connect(state)
    try:  # a count beyond 32 bits stays an integer, as in any INTEGER-affinity column
        db.execute("UPDATE rivet_runs SET rows = ? WHERE run_id = 'r000000000'", (2**62 + 1,))
        db.commit()
        assert db.execute("SELECT rows, typeof(rows), bytes_read FROM rivet_runs WHERE run_id = 'r000000000'"
                          ).fetchone() == (2**62 + 1, "integer", 0)
    finally:
        db.close()


def _hand_made_legacy(tmp_path: Path, table: str, insert: str, runs: int) -> tuple[Path, Path]:
    """``(config, state)``: a legacy state whose ``rivet_runs`` is made by ``table`` (SQL),
    filled by ``insert`` with run ids ``r0`` .. (``runs`` rows)."""
    config = write_config(tmp_path / "legacy")
    state = config.parent / ".rivet_state.db"
    create_legacy_schema(state)
    db = sqlite3.connect(state)
    try:
        db.execute("DROP TABLE rivet_runs")
        db.execute(table)
        db.executemany(insert, [(f"r{i}",) for i in range(runs)])
        db.commit()
    finally:
        db.close()
    return config, state


@pytest.mark.parametrize("declared", ["TEXT", ""])
def test_a_legacy_table_whose_counts_are_not_integer_affinity_is_rebuilt(tmp_path: Path, declared: str) -> None:
    """A hand-made legacy state (the shape is recognised by its table names) whose counts
    were stored as text: the edit would keep '12' a string, so the plan lists the rebuild
    and the rebuild stores 12 an integer."""
    config, state = _hand_made_legacy(
        tmp_path, f"CREATE TABLE rivet_runs (run_id TEXT NOT NULL PRIMARY KEY, export_name TEXT NOT NULL, "
                  f"mode TEXT NOT NULL, status TEXT NOT NULL, started_at TEXT NOT NULL, finished_at TEXT, "
                  f"rows {declared} DEFAULT '0' NOT NULL, files {declared} DEFAULT '0' NOT NULL, error TEXT)",
        "INSERT INTO rivet_runs VALUES (?, 'orders', 'incremental', 'succeeded', '2026-01-01T00:00:00Z', "
        "'2026-01-01T00:00:30Z', '12', '1', NULL)", 50)

    plan = run_cli("-c", str(config), "--json", "migrate", "--dry-run")
    assert plan.returncode == 0, describe(plan)
    assert json.loads(plan.stdout)["steps"][0]["rebuilds"] == {"rivet_runs": 50}, describe(plan)

    proc = run_cli("-c", str(config), "--json", "migrate")
    assert proc.returncode == 0, describe(proc)
    db = sqlite3.connect(f"file:{state}?mode=ro", uri=True)
    try:
        assert db.execute("SELECT DISTINCT rows, typeof(rows), typeof(files) FROM rivet_runs").fetchall() == \
            [(12, "integer", "integer")]
    finally:
        db.close()
    assert [c[2] for c in _columns(state, "rivet_runs") if c[1] in ("rows", "files")] == ["BIGINT", "BIGINT"]


@pytest.mark.parametrize("table", [
    # a hand-made legacy table that already has a column the upgrade adds
    "CREATE TABLE rivet_runs (run_id TEXT NOT NULL PRIMARY KEY, export_name TEXT NOT NULL, mode TEXT NOT NULL, "
    "status TEXT NOT NULL, started_at TEXT NOT NULL, finished_at TEXT, rows INTEGER DEFAULT '0' NOT NULL, "
    "files INTEGER DEFAULT '0' NOT NULL, error TEXT, bytes_read INTEGER)",
    # STRICT knows no BIGINT: neither the edit nor the rebuild can give it that type
    "CREATE TABLE rivet_runs (run_id TEXT NOT NULL PRIMARY KEY, export_name TEXT NOT NULL, mode TEXT NOT NULL, "
    "status TEXT NOT NULL, started_at TEXT NOT NULL, finished_at TEXT, rows INTEGER DEFAULT '0' NOT NULL, "
    "files INTEGER DEFAULT '0' NOT NULL, error TEXT) STRICT",
])
def test_a_table_sqlite_refuses_to_migrate_is_refused_registered_and_the_state_is_kept(
        tmp_path: Path, table: str) -> None:
    """SQLite refusing a step of the upgrade on the migration's copy is the state's schema
    differing from its revision (found by a fresh user: it was ``RIVET_INTERNAL``); the copy
    goes, the state's bytes stay."""
    config, state = _hand_made_legacy(tmp_path, table, "INSERT INTO rivet_runs (run_id, export_name, mode, status, "
                                      "started_at) VALUES (?, 'orders', 'incremental', 'succeeded', "
                                      "'2026-01-01T00:00:00Z')", 1)
    before = state.read_bytes()
    proc = run_cli("-c", str(config), "--json-errors", "migrate")
    assert proc.returncode == 3, describe(proc)
    error = error_object(proc)
    assert error["code"] == "RIVET_STATE_SCHEMA_UNEXPECTED" and str(state) in error["message"], describe(proc)
    assert state.read_bytes() == before
    # no copy left: at most the lease files the migration took (the STRICT table is refused by the plan, before them)
    assert {".rivet_state.db", "rivet.yaml"} <= {p.name for p in config.parent.iterdir()} <= \
        {".rivet_state.db", ".rivet_state.leases", "rivet.yaml"}


TEXT_COUNTS = ("CREATE TABLE rivet_runs (run_id TEXT NOT NULL PRIMARY KEY, export_name TEXT NOT NULL, mode TEXT NOT NULL, "
               "status TEXT NOT NULL, started_at TEXT NOT NULL, finished_at TEXT, rows TEXT DEFAULT '0' NOT NULL, "
               "files TEXT DEFAULT '0' NOT NULL{extra}, error TEXT)")


@pytest.mark.parametrize(("extra", "more", "lost"), [
    ("", "CREATE TRIGGER t_runs BEFORE DELETE ON rivet_runs BEGIN SELECT RAISE(ABORT, 'kept'); END", "trigger t_runs"),
    ("", "CREATE INDEX ix_double ON rivet_runs (rows || files)", "index ix_double on an expression"),
    (" CHECK (files <> '')", None, "its CHECK constraints"),
])
def test_a_rebuild_that_would_lose_part_of_the_table_is_refused_in_the_dry_run_and_the_run(
        tmp_path: Path, extra: str, more: str | None, lost: str) -> None:
    """Where rivet_runs must be rebuilt (counts declared TEXT), alembic's batch mode would
    drop its triggers, expression indexes and CHECK constraints and still verify (found by
    a fresh user): both the plan and the migration refuse, naming what would be lost."""
    config, state = _hand_made_legacy(tmp_path, TEXT_COUNTS.format(extra=extra),
                                      "INSERT INTO rivet_runs (run_id, export_name, mode, status, started_at, rows, "
                                      "files) VALUES (?, 'orders', 'incremental', 'succeeded', "
                                      "'2026-01-01T00:00:00Z', '3', '1')", 3)
    if more:
        db = sqlite3.connect(state)
        db.execute(more)
        db.commit()
        db.close()
    before = state.read_bytes()
    for args in (("migrate", "--dry-run"), ("migrate",)):
        proc = run_cli("-c", str(config), "--json-errors", *args)
        assert proc.returncode == 3, describe(proc)
        error = error_object(proc)
        assert error["code"] == "RIVET_STATE_SCHEMA_UNEXPECTED" and lost in error["message"], describe(proc)
        assert state.read_bytes() == before
