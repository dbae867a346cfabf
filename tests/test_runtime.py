"""The runtime API (``StateStore``): opening goes through the same resolver and pre-flight as
every command; what a pipeline records is what ``statetool info`` shows."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from support import describe, tree_digest, write_config
from statetool.errors import StateError
from statetool.operations.migrate import migrate
from statetool.runtime import StateStore
from test_migrate import (EXPORTS_YAML, HEAD, SOURCE_KEY, Target, build_state, cli, state_files,  # noqa: F401
                          target)

OTHER_SOURCE = "postgresql://reader@db.other:5432/sales"


def open_store(target: Target, config: Path | None = None, **kwargs: Any) -> StateStore:
    env = {k: v for k, v in os.environ.items() if k != "RIVET_STATE_URL"}
    env.update(target.env)
    env.update(kwargs.pop("env", {}))
    kwargs.setdefault("create", True)
    return StateStore.open(config or target.config, env=env, **kwargs)


IDENTITY_WARNINGS = {"RIVET_STATE_IDENTITY_ADOPTED", "RIVET_STATE_FOREIGN_BESIDE_CONFIG"}


def identity_warnings(store: StateStore) -> list[str]:
    """The identity warnings an open gave (other warnings, e.g. about checkpoints, aside)."""
    return [w.code for w in store.warnings if w.code in IDENTITY_WARNINGS]


def _actions(target: Target) -> list[str]:
    return [r["action"] for r in sorted(target.rows("rivet_audit"), key=lambda r: r["id"])]


def test_open_creates_a_missing_state_at_head_stamped_with_its_source(target: Target) -> None:
    store = open_store(target)
    assert identity_warnings(store) == []
    assert target.revision() == HEAD
    assert [r["state_key"] for r in target.rows("rivet_identity")] == [SOURCE_KEY]
    assert _actions(target) == ["identity.stamp", "init"]
    # opening again finds its own state: nothing more is recorded
    again = open_store(target)
    assert identity_warnings(again) == []
    assert _actions(target) == ["identity.stamp", "init"]


def test_open_without_create_refuses_a_missing_state_and_creates_nothing(target: Target) -> None:
    digest = state_files(target)
    with pytest.raises(StateError) as err:
        open_store(target, create=False)
    assert err.value.code == "RIVET_STATE_MISSING"
    assert state_files(target) == digest
    assert target.tables() == set()


def test_open_never_replaces_a_file_that_is_not_a_state(tmp_path: Path) -> None:
    target = Target("sqlite", write_config(tmp_path / "pipeline", exports=EXPORTS_YAML))
    target.path.write_text("notes\n")
    digest = state_files(target)
    with pytest.raises(StateError) as err:
        open_store(target)
    assert err.value.code == "RIVET_STATE_NOT_A_STATE"
    assert state_files(target) == digest


def test_open_refuses_a_foreign_state_in_a_declared_directory_and_leaves_it_byte_identical(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    url = {"RIVET_STATE_URL": f"sqlite:{state_dir}"}
    ours = Target("sqlite", write_config(tmp_path / "sales", exports=EXPORTS_YAML), extra_env=url)
    store = open_store(ours)
    with store.transaction() as tx:
        run = tx.start_run("orders", "incremental")
        tx.commit_cursor("orders", "incremental", "42")
        tx.finish_run(run, "succeeded", rows=1)
    digest = tree_digest(state_dir)
    other = Target("sqlite", write_config(tmp_path / "other", source_url=OTHER_SOURCE, exports=EXPORTS_YAML),
                   extra_env=url)

    with pytest.raises(StateError) as err:
        open_store(other)
    assert err.value.code == "RIVET_STATE_FOREIGN"
    assert str(state_dir) in err.value.message and SOURCE_KEY in err.value.message
    assert "db.other" in err.value.message
    assert tree_digest(state_dir) == digest
    assert not [p for p in state_dir.iterdir() if p.name.endswith(("-wal", "-shm", "-journal"))]


def test_open_of_a_state_of_another_source_beside_the_config_warns_and_goes_on(tmp_path: Path) -> None:
    ours = Target("sqlite", write_config(tmp_path / "pipeline", exports=EXPORTS_YAML))
    open_store(ours)
    other_config = write_config(ours.directory, source_url=OTHER_SOURCE, exports=EXPORTS_YAML, name="other.yaml")
    store = open_store(ours, other_config)
    assert identity_warnings(store) == ["RIVET_STATE_FOREIGN_BESIDE_CONFIG"]
    assert [r["state_key"] for r in ours.rows("rivet_identity")] == [SOURCE_KEY]  # not re-keyed


def test_open_of_a_shared_postgres_state_of_another_source_reports_only(tmp_path: Path, pg_url: str) -> None:
    ours = Target("postgres", write_config(tmp_path / "pipeline", exports=EXPORTS_YAML), pg_url)
    open_store(ours)
    other_config = write_config(tmp_path / "other", source_url=OTHER_SOURCE, exports=EXPORTS_YAML)
    store = open_store(ours, other_config)
    assert identity_warnings(store) == []
    assert [r["state_key"] for r in ours.rows("rivet_identity")] == [SOURCE_KEY]


def test_open_refuses_a_state_with_pending_revisions(target: Target) -> None:
    build_state(target, "0001", legacy=True)
    before, digest = target.dump(), state_files(target)
    with pytest.raises(StateError) as err:
        open_store(target)
    assert err.value.code == "RIVET_STATE_MIGRATION_PENDING"
    assert target.dump() == before
    assert state_files(target) == digest


def test_open_adopts_a_migrated_legacy_state_with_progress_and_warns(target: Target) -> None:
    """The upgrade ran where the source URL was not known (its variable unset), so it recorded
    no identity; the pipeline's first open adopts its source, with the warning, once."""
    config = write_config(target.directory, source_url=None,
                          exports="source:\n  url_env: SALES_DB_URL\n" + EXPORTS_YAML)
    assert config == target.config
    build_state(target, "0001", legacy=True)
    ctx = target.context(env={**target.env, "SALES_DB_URL": ""})
    assert migrate(ctx).applied
    assert target.revision() == HEAD and target.rows("rivet_identity") == []
    before = target.dump()

    with_source = {"SALES_DB_URL": "postgresql://etl:secret@DB.internal/sales"}
    store = open_store(target, env=with_source)
    assert identity_warnings(store) == ["RIVET_STATE_IDENTITY_ADOPTED"]
    assert any(SOURCE_KEY in w.message for w in store.warnings)
    assert [r["state_key"] for r in target.rows("rivet_identity")] == [SOURCE_KEY]
    adopt = [r for r in target.rows("rivet_audit") if r["action"] == "identity.adopt"]
    assert len(adopt) == 1 and json.loads(adopt[0]["detail"])["new"] == SOURCE_KEY
    assert "secret" not in json.dumps(target.dump(), default=str)
    after = target.dump()
    for table in ("rivet_exports", "rivet_runs", "rivet_chunks", "rivet_load_ledger"):
        assert after["data"][table] == before["data"][table], table

    assert identity_warnings(open_store(target, env=with_source)) == []


def test_runs_recorded_through_the_api_appear_in_info(target: Target) -> None:
    store = open_store(target)
    with store.transaction() as tx:
        first = tx.start_run("orders", "incremental", started_at="2026-06-01T00:00:00.000000Z")
        tx.finish_run(first, "failed", error="connection reset", error_code="E_RESET",
                      finished_at="2026-06-01T00:00:05.000000Z")
    with store.transaction() as tx:
        second = tx.start_run("orders", "incremental", started_at="2026-06-02T00:00:00.000000Z")
        tx.commit_cursor("orders", "incremental", "2026-06-01T23:59:59Z")
        tx.finish_run(second, "succeeded", rows=1234, files=2, bytes_read=99_000,
                      finished_at="2026-06-02T00:01:00.000000Z")
        chunked = tx.start_run("order_lines", "chunked", started_at="2026-06-02T01:00:00.000000Z")
        for k in range(4):
            tx.record_chunk("order_lines", chunked, k, str(k), str(k + 1), "done" if k < 3 else "running", rows=5)
        tx.record_chunk("order_lines", chunked, 3, "3", "4", "done", rows=5)  # the same chunk, finished

    proc = cli(target, "info", "--json")
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    assert doc["revision"]["status"] == "head" and doc["identity"]["recorded"] == SOURCE_KEY, describe(proc)
    rows = {r["name"]: r for r in doc["exports"]}
    orders = rows["orders"]
    assert orders["cursor"] == "2026-06-01T23:59:59Z"
    assert (orders["runs_total"], orders["runs_succeeded"], orders["runs_failed"]) == (2, 1, 1)
    last = orders["last_run"]
    assert (last["run_id"], last["status"], last["rows"], last["files"], last["error"]) == \
        (second, "succeeded", 1234, 2, None)
    assert (last["started_at"], last["finished_at"]) == ("2026-06-02T00:00:00.000000Z", "2026-06-02T00:01:00.000000Z")
    lines = rows["order_lines"]
    assert (lines["chunks_total"], lines["chunks_done"], lines["runs_total"]) == (4, 4, 1)
    assert lines["last_run"]["status"] == "running"
    assert rows["refunds"]["in_state"] is False and rows["refunds"]["runs_total"] == 0


def test_a_transaction_that_raises_writes_nothing(target: Target) -> None:
    store = open_store(target)
    before = target.dump()
    with pytest.raises(ZeroDivisionError):
        with store.transaction() as tx:
            run = tx.start_run("orders", "incremental")
            tx.commit_cursor("orders", "incremental", "99")
            tx.finish_run(run, "succeeded", rows=1)
            _ = 1 / 0
    with pytest.raises(ValueError, match="status"):
        with store.transaction() as tx:
            run = tx.start_run("orders", "incremental")
            tx.finish_run(run, "done-ish")
    after = target.dump()
    # the run lease each transaction took drew a fencing token: bookkeeping, not progress
    for dump in (before, after):
        dump["data"].pop("rivet_lease_tokens", None)
    assert after == before


def test_a_transaction_waits_for_another_writer_then_times_out(target: Target) -> None:
    store = open_store(target, lock_wait=1.0)
    before = target.dump()
    if target.kind == "sqlite":
        holder: Any = sqlite3.connect(target.path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
    else:
        holder = target.psycopg()
        holder.execute("SELECT pg_advisory_xact_lock(hashtext('rivet_state:' || %s))", (target.schema,))
    try:
        with pytest.raises(StateError) as err:
            with store.transaction() as tx:
                tx.commit_cursor("orders", "incremental", "never")
        assert err.value.code == "RIVET_STATE_LOCK_TIMEOUT"
        assert err.value.entry.retryable
    finally:
        holder.execute("ROLLBACK") if target.kind == "sqlite" else holder.rollback()
        holder.close()
    assert target.dump() == before
    with store.transaction() as tx:  # the holder is gone: the next transaction goes through
        tx.commit_cursor("orders", "incremental", "now")
    assert {r["export_name"]: r["cursor_value"] for r in target.rows("rivet_exports")} == {"orders": "now"}


OPEN_SCRIPT = """
import json, os, sys
from statetool.errors import StateError
from statetool.runtime import StateStore
try:
    store = StateStore.open(sys.argv[1], create=True)
except StateError as err:
    print(json.dumps({"code": err.code, "message": err.message}))
    sys.exit(1)
print(json.dumps({"warnings": [w.code for w in store.warnings]}))
"""


def test_two_first_runs_opening_a_missing_postgres_state_at_once_both_open_it(tmp_path: Path, pg_url: str) -> None:
    """Two tasks of one pipeline start their first run together: one creates the state, the
    other opens what the first created (no TARGET_NOT_EMPTY refusal for a state it wanted)."""
    target = Target("postgres", write_config(tmp_path / "pipeline", exports=EXPORTS_YAML), pg_url)
    holder = target.psycopg()
    holder.execute("SELECT pg_advisory_xact_lock(hashtext('rivet_state:' || %s))", (target.schema,))
    watcher = target.psycopg()
    watcher.autocommit = True
    env = {k: v for k, v in os.environ.items() if k != "RIVET_STATE_URL"}
    env["RIVET_STATE_URL"] = pg_url
    procs = []
    try:
        procs = [subprocess.Popen([sys.executable, "-c", OPEN_SCRIPT, str(target.config)], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
        deadline = time.monotonic() + 60
        waiting = 0
        while time.monotonic() < deadline and waiting < 2 and all(p.poll() is None for p in procs):
            waiting = watcher.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid NOT IN (pg_backend_pid(), %s) "
                "AND query LIKE '%%pg_try_advisory_xact_lock%%'", (holder.info.backend_pid,)).fetchone()[0]
            time.sleep(0.1)
        assert waiting == 2  # both found no state and wait to create it
    finally:
        holder.rollback()
        holder.close()
        watcher.close()
    results = [p.communicate(timeout=120) for p in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
    assert target.revision() == HEAD
    assert _actions(target) == ["identity.stamp", "init"]
