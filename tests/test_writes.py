"""Deliberate writes: ``exports set-cursor``, ``exports reset`` and ``init`` change exactly what
they say, audit it, back a SQLite state up first, and refuse (changing nothing) otherwise.
``exports list`` / ``show`` are the JSON documents an operator reads before and after."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from support import describe, error_object, write_config
from statetool import schema
from statetool.errors import StateError
from statetool.operations.exports import reset, set_cursor
from statetool.runtime import StateStore
from test_migrate import (  # noqa: F401 - target is the two-backend fixture
    BACKUP_NAME, EXPORTS_YAML, HEAD, SOURCE_KEY, VERSION_TABLE, Target, assert_valid_backup, backups, build_state, cli,
    project, sqlite_dump, state_files, target)

PROGRESS_TABLES = ("rivet_exports", "rivet_runs", "rivet_chunks", "rivet_run_aggregates", "rivet_load_ledger")


def seed_progress(target: Target) -> None:
    """A state at head with progress, written the way a pipeline writes it (the runtime API)."""
    store = StateStore.open(target.config, env=dict(target.context().env), create=True)
    with store.transaction() as tx:
        for i in range(3):
            run = tx.start_run("orders", "incremental", started_at=f"2026-05-0{i + 1}T00:00:00.000000Z")
            tx.commit_cursor("orders", "incremental", f"2026-05-0{i + 1}T23:59:59.000000Z")
            tx.finish_run(run, "succeeded", rows=100 * (i + 1), files=1, finished_at=f"2026-05-0{i + 1}T00:01:00Z")
        for export, chunks in (("order_lines", 5), ("customers", 3)):
            run = tx.start_run(export, "chunked", started_at="2026-05-04T00:00:00.000000Z")
            for k in range(chunks):
                tx.record_chunk(export, run, k, str(k * 10), str((k + 1) * 10), "done" if k < chunks - 1 else "running",
                                rows=10)
        tx.commit_cursor("order_lines", "chunked", "40")
        tx.conn.execute(sa.insert(schema.load_ledger), [
            {"export_name": "order_lines", "table_name": "dw.order_lines", "part": f"p{k}", "rows": 10,
             "loaded_at": "2026-05-04T00:10:00Z"} for k in range(3)])


def _rows_by(dump: dict[str, Any], table: str, key: str) -> dict[Any, dict[str, Any]]:
    cols, rows = dump["data"][table]
    return {r[cols.index(key)]: dict(zip(cols, r)) for r in rows}


def _new_audit_rows(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    old = _rows_by(before, "rivet_audit", "id")
    return [row for i, row in sorted(_rows_by(after, "rivet_audit", "id").items()) if i not in old]


# --------------------------------------------------------------------------------------
# exports set-cursor
# --------------------------------------------------------------------------------------

def test_set_cursor_changes_only_that_cursor_audits_and_backs_up_first(target: Target) -> None:
    seed_progress(target)
    before = target.dump()
    old = _rows_by(before, "rivet_exports", "export_name")["orders"]

    proc = cli(target, "exports", "set-cursor", "orders", "2026-04-15T00:00:00Z", "--json")
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    assert doc["export"] == "orders" and doc["action"] == "set-cursor", describe(proc)
    assert doc["before"] == {"cursor": old["cursor_value"]} and doc["after"] == {"cursor": "2026-04-15T00:00:00Z"}
    assert "2026-04-15T00:00:00Z" in doc["next_run"] and "resume" in doc["next_run"], describe(proc)

    after = target.dump()
    for table in set(before["data"]) - {"rivet_exports", "rivet_audit", "rivet_lease_tokens", "rivet_lineage"}:
        assert after["data"][table] == before["data"][table], table
    (lineage_before,), (lineage_after,) = (_rows_by(d, "rivet_lineage", "id").values() for d in (before, after))
    assert lineage_after["lineage"] == lineage_before["lineage"], "a write keeps the state's lineage"
    assert lineage_after["serial"] == lineage_before["serial"] + 1, "and advances its serial by one (SPEC §9)"
    rows_before = _rows_by(before, "rivet_exports", "export_name")
    rows_after = _rows_by(after, "rivet_exports", "export_name")
    assert {k: v for k, v in rows_after.items() if k != "orders"} == \
        {k: v for k, v in rows_before.items() if k != "orders"}
    changed = rows_after["orders"]
    assert changed["cursor_value"] == "2026-04-15T00:00:00Z"
    assert (changed["export_name"], changed["mode"]) == ("orders", old["mode"])
    assert changed["cursor_updated_at"] > old["cursor_updated_at"]

    [row] = _new_audit_rows(before, after)
    assert row["action"] == "exports.set-cursor"
    assert json.loads(row["detail"]) == {"export": "orders", "old": old["cursor_value"], "new": "2026-04-15T00:00:00Z"}
    assert "@" in row["actor"] and row["command"].startswith("statetool")

    if target.kind == "sqlite":
        [backup] = backups(target)
        assert BACKUP_NAME.match(backup.name)["label"] == "set-cursor-orders"
        assert doc["backup"] == str(backup)
        assert_valid_backup(backup, before)
    else:
        assert doc["backup"] is None

    show = cli(target, "exports", "show", "orders", "--json")
    assert show.returncode == 0, describe(show)
    assert json.loads(show.stdout)["export"]["cursor"] == "2026-04-15T00:00:00Z", describe(show)


def test_set_cursor_on_a_config_export_without_progress_creates_its_row(target: Target) -> None:
    seed_progress(target)
    before = target.dump()
    proc = cli(target, "exports", "set-cursor", "refunds", "1000", "--json")
    assert proc.returncode == 0, describe(proc)
    after = target.dump()
    row = _rows_by(after, "rivet_exports", "export_name")["refunds"]
    assert (row["mode"], row["cursor_value"]) == ("incremental", "1000")
    assert set(_rows_by(after, "rivet_exports", "export_name")) - set(_rows_by(before, "rivet_exports",
                                                                             "export_name")) == {"refunds"}
    [audit] = _new_audit_rows(before, after)
    assert json.loads(audit["detail"]) == {"export": "refunds", "old": None, "new": "1000"}


def test_each_set_cursor_keeps_its_own_backup(tmp_path: Path) -> None:
    """Changes made within one second must not overwrite each other's backups: each backup
    holds the state as it was before ITS change."""
    target = Target("sqlite", write_config(tmp_path / "pipeline", exports=EXPORTS_YAML))
    seed_progress(target)
    values = ["a1", "a2", "a3"]
    olds = []
    for value in values:
        olds.append(_rows_by(target.dump(), "rivet_exports", "export_name")["orders"]["cursor_value"])
        change = set_cursor(target.context(), "orders", value)
        assert change.backup is not None
    found = backups(target)
    assert len(found) == 3, found
    held = sorted(_rows_by(sqlite_dump(p), "rivet_exports", "export_name")["orders"]["cursor_value"] for p in found)
    assert held == sorted(olds)


def test_set_cursor_on_an_export_name_with_a_slash_keeps_its_backup_beside_the_state(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline", exports="exports:\n  - name: sales/orders\n    mode: incremental\n")
    target = Target("sqlite", config)
    StateStore.open(config, env={}, create=True)
    before = target.dump()
    proc = cli(target, "exports", "set-cursor", "sales/orders", "7", "--json")
    assert proc.returncode == 0, describe(proc)
    [backup] = backups(target)
    assert json.loads(proc.stdout)["backup"] == str(backup)
    assert_valid_backup(backup, before)
    assert [p.name for p in target.directory.rglob("*backup*")] == [backup.name]
    assert _rows_by(target.dump(), "rivet_exports", "export_name")["sales/orders"]["cursor_value"] == "7"


# --------------------------------------------------------------------------------------
# exports reset
# --------------------------------------------------------------------------------------

def test_reset_clears_exactly_that_exports_cursor_and_chunks_and_keeps_history(target: Target) -> None:
    seed_progress(target)
    before = target.dump()

    proc = cli(target, "exports", "reset", "order_lines", "--json")
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    assert doc["before"] == {"cursor": "40", "chunks": 5} and doc["after"] == {"cursor": None, "chunks": 0}
    assert "FIRST RUN" in doc["next_run"], describe(proc)

    after = target.dump()
    for table in ("rivet_runs", "rivet_load_ledger", "rivet_run_aggregates", "rivet_identity", VERSION_TABLE):
        assert after["data"][table] == before["data"][table], table
    chunks_before = project(before, "rivet_chunks", ["export_name", "chunk_index", "status"])
    chunks_after = project(after, "rivet_chunks", ["export_name", "chunk_index", "status"])
    assert chunks_after == [c for c in chunks_before if c[0] != "order_lines"]
    assert any(c[0] == "customers" for c in chunks_after)
    rows_before = _rows_by(before, "rivet_exports", "export_name")
    rows_after = _rows_by(after, "rivet_exports", "export_name")
    assert {k: v for k, v in rows_after.items() if k != "order_lines"} == \
        {k: v for k, v in rows_before.items() if k != "order_lines"}
    assert rows_after["order_lines"]["cursor_value"] is None
    assert rows_after["order_lines"]["cursor_updated_at"] is None

    [row] = _new_audit_rows(before, after)
    assert row["action"] == "exports.reset"
    assert json.loads(row["detail"]) == {"export": "order_lines", "old_cursor": "40", "chunks_removed": 5}
    if target.kind == "sqlite":
        [backup] = backups(target)
        assert BACKUP_NAME.match(backup.name)["label"] == "reset-order_lines"
        assert_valid_backup(backup, before)

    show = cli(target, "exports", "show", "order_lines", "--json")
    assert show.returncode == 0, describe(show)
    export = json.loads(show.stdout)["export"]
    assert (export["cursor"], export["chunks_total"], export["runs_total"]) == (None, 0, 1), describe(show)


def test_unknown_export_is_refused_and_nothing_changes(target: Target) -> None:
    seed_progress(target)
    before, digest = target.dump(), state_files(target)
    proc = cli(target, "exports", "set-cursor", "no_such_export", "5", "--json-errors")
    assert proc.returncode == 1, describe(proc)
    err = error_object(proc)
    assert err["code"] == "RIVET_EXPORT_UNKNOWN" and "no_such_export" in err["message"], describe(proc)
    with pytest.raises(StateError) as reset_err:
        reset(target.context(), "no_such_export")
    assert reset_err.value.code == "RIVET_EXPORT_UNKNOWN"
    assert target.dump() == before
    assert state_files(target) == digest  # no backup, no lease file of a refused change either


def test_export_writes_on_a_state_with_pending_revisions_are_refused(target: Target) -> None:
    build_state(target, "0001", legacy=True)
    before, digest = target.dump(), state_files(target)
    proc = cli(target, "exports", "set-cursor", "orders", "5", "--json-errors")
    assert proc.returncode == 3, describe(proc)
    err = error_object(proc)
    assert err["code"] == "RIVET_STATE_MIGRATION_PENDING", describe(proc)
    assert "statetool migrate" in err["action"]
    with pytest.raises(StateError) as reset_err:
        reset(target.context(), "orders")
    assert reset_err.value.code == "RIVET_STATE_MIGRATION_PENDING"
    assert target.dump() == before
    assert state_files(target) == digest


# --------------------------------------------------------------------------------------
# exports list / show
# --------------------------------------------------------------------------------------

PROGRESS_KEYS = {"name", "mode", "cursor", "cursor_updated_at", "runs_total", "runs_succeeded", "runs_failed",
                 "last_run", "chunks_total", "chunks_done", "ledger_rows", "position_committed_at", "in_config",
                 "in_state"}


def test_exports_list_and_show_json_shapes(target: Target) -> None:
    seed_progress(target)
    proc = cli(target, "exports", "list", "--json")
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    assert set(doc) == {"exports", "warnings"}
    rows = {r["name"]: r for r in doc["exports"]}
    assert [r["name"] for r in doc["exports"]] == ["orders", "order_lines", "customers", "refunds", "order_events"]
    for row in doc["exports"]:
        assert set(row) == PROGRESS_KEYS, row
    orders = rows["orders"]
    assert (orders["cursor"], orders["runs_total"], orders["runs_succeeded"], orders["in_state"]) == \
        ("2026-05-03T23:59:59.000000Z", 3, 3, True)
    assert orders["last_run"]["status"] == "succeeded" and orders["last_run"]["rows"] == 300
    assert (rows["order_lines"]["chunks_total"], rows["order_lines"]["chunks_done"],
            rows["order_lines"]["ledger_rows"]) == (5, 4, 3)
    assert (rows["refunds"]["in_state"], rows["refunds"]["runs_total"], rows["refunds"]["cursor"]) == (False, 0, None)

    proc = cli(target, "exports", "show", "orders", "--json")
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    assert set(doc) == {"export", "recent_runs", "warnings"}
    assert doc["export"] == orders
    runs = doc["recent_runs"]
    assert [r["started_at"] for r in runs] == sorted((r["started_at"] for r in runs), reverse=True)
    assert len(runs) == 3
    assert set(runs[0]) == {"run_id", "mode", "status", "started_at", "finished_at", "rows", "files", "error"}

    proc = cli(target, "exports", "show", "nope", "--json-errors")
    assert proc.returncode == 1 and error_object(proc)["code"] == "RIVET_EXPORT_UNKNOWN", describe(proc)


# --------------------------------------------------------------------------------------
# init
# --------------------------------------------------------------------------------------

def test_init_creates_a_state_at_head_stamped_with_the_computed_key_and_audited(target: Target) -> None:
    proc = cli(target, "init", "--json")
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    assert (doc["revision"], doc["state_key"]) == (HEAD, SOURCE_KEY), describe(proc)
    assert set(doc) == {"location", "revision", "state_key"}

    dump = target.dump()
    assert target.revision() == HEAD
    assert "alembic_version" not in dump["data"]
    assert set(schema.metadata.tables) <= set(dump["data"])
    for table in PROGRESS_TABLES:
        assert dump["data"][table][1] == [], table
    [identity] = target.rows("rivet_identity")
    assert identity["state_key"] == SOURCE_KEY and "@" in identity["recorded_by"]
    audit = {r["action"]: json.loads(r["detail"]) for r in target.rows("rivet_audit")}
    assert audit["init"] == {"revision": HEAD, "state_key": SOURCE_KEY}
    assert audit["identity.stamp"]["new"] == SOURCE_KEY
    if target.kind == "sqlite":
        assert doc["location"]["path"] == str(target.path)
        # built aside and linked into place: nothing else is left in the directory
        assert set(state_files(target)) == {"rivet.yaml", ".rivet_state.db"}
    else:
        assert doc["location"]["schema"] == target.schema


def test_init_without_a_computable_key_records_no_identity(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline", source_url=None, exports="source:\n  url_env: SALES_DB_URL\n"
                          + EXPORTS_YAML)
    target = Target("sqlite", config)
    proc = cli(target, "init", "--json", env={"SALES_DB_URL": ""})
    assert proc.returncode == 0, describe(proc)
    assert json.loads(proc.stdout)["state_key"] is None
    assert target.rows("rivet_identity") == []
    assert [r["action"] for r in target.rows("rivet_audit")] == ["init"]


def test_init_over_an_existing_state_is_refused_untouched(target: Target) -> None:
    seed_progress(target)
    before, digest = target.dump(), state_files(target)
    proc = cli(target, "init", "--json-errors")
    assert proc.returncode == 5, describe(proc)
    assert error_object(proc)["code"] == "RIVET_STATE_TARGET_NOT_EMPTY", describe(proc)
    assert target.dump() == before
    assert state_files(target) == digest


def test_init_over_a_text_file_is_refused_untouched(tmp_path: Path) -> None:
    target = Target("sqlite", write_config(tmp_path / "pipeline", exports=EXPORTS_YAML))
    target.path.write_text("not a database: someone's notes\n")
    digest = state_files(target)
    proc = cli(target, "init", "--json-errors")
    assert proc.returncode == 5, describe(proc)
    assert error_object(proc)["code"] == "RIVET_STATE_TARGET_NOT_EMPTY", describe(proc)
    assert state_files(target) == digest


def test_init_in_a_postgres_schema_holding_another_applications_table_is_refused(tmp_path: Path,
                                                                               pg_url: str) -> None:
    target = Target("postgres", write_config(tmp_path / "pipeline", exports=EXPORTS_YAML), pg_url)
    with target.psycopg() as conn:
        conn.execute(f'CREATE SCHEMA "{target.schema}"')
        conn.execute(f'CREATE TABLE "{target.schema}".invoices (id int primary key, total numeric)')
        conn.execute(f'INSERT INTO "{target.schema}".invoices VALUES (1, 9.5)')
    before = target.dump()
    proc = cli(target, "init", "--json-errors")
    assert proc.returncode == 5, describe(proc)
    assert error_object(proc)["code"] == "RIVET_STATE_TARGET_NOT_EMPTY", describe(proc)
    assert target.dump() == before


def test_init_in_a_missing_declared_directory_is_refused_and_creates_nothing(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline", exports=EXPORTS_YAML)
    missing = tmp_path / "nonexistent" / "dir"
    digest = state_files(Target("sqlite", config))
    proc = cli(Target("sqlite", config), "init", "--json-errors", env={"RIVET_STATE_URL": f"sqlite:{missing}"})
    assert proc.returncode == 1, describe(proc)
    err = error_object(proc)
    assert err["code"] == "RIVET_STATE_DIR_MISSING" and str(missing) in err["message"], describe(proc)
    assert not missing.parent.exists()
    assert state_files(Target("sqlite", config)) == digest
