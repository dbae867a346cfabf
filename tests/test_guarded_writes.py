"""The rewritten write guard (SPEC §4, §5, §5a, §9), end to end.

* Writes of the whole state (migrate, relocate, transfer, identity adopt/rekey) hold the
  state lease ``state:exclusive`` and every run lease for their whole duration; a run that
  finds the state lease live gives its lease back and waits (``--lock-wait 0``: refused
  ``RIVET_STATE_RUN_IN_PROGRESS``).
* Whole-state and per-export writes beside a live run lease are refused and change nothing;
  ``check`` reports a live lease as warning ``RIVET_STATE_LEASE_LIVE``.
* No silent first run: ``StateStore.open`` refuses a missing state, refuses to create one
  where a state lived before (``RIVET_STATE_VANISHED``, ``RIVET_STATE_RELOCATED``), and
  warns ``RIVET_STATE_CREATED`` when it does create one.
* Refused commands create no file.
* Fencing on SQLite: a holder whose sidecar was replaced under it writes nothing.

Real SQLite files, real ``statetool`` processes, a real PostgreSQL server; no mocks, no
timed assertions (waits poll with a deadline and fail loudly).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from support import Forked, declare_export, describe, error_object, fork_code, process_env, run_cli_forked, tree_digest, write_config
from statetool import migrations
from statetool.errors import StateError
from statetool.example import build_legacy_state
from statetool.operations.create import init
from statetool.operations.exports import set_cursor
from statetool.runtime import StateStore
from support.backends import StateBackend
from test_leases import (RUN_KEY, TOUCH, LeaseRun, State,  # noqa: F401
                         pg_state, spawn, sqlite_state, state, wait_for)
from test_migrate import pg_dump, split_pg_url

STATE_FILE = ".rivet_state.db"
LEASES_DIR = ".rivet_state.leases"
STATE_LEASE = "state:exclusive"
SOURCE_KEY = "postgresql://db.internal:5432/sales"
NEW_KEY = "postgresql://newhost:5432/sales"
ONLY_ORDERS = "exports:\n  - name: orders\n    mode: incremental\n"
TWO_EXPORTS = textwrap.dedent("""\
    exports:
      - name: orders
        mode: incremental
      - name: order_lines
        mode: chunked
    """)


# -- helpers ------------------------------------------------------------------------------


def make_state(backend: StateBackend, *, exports: str | None = None, initialise: bool = True) -> State:
    """A state beside a config in ``tmp_path/pipeline`` (SQLite) or in a fresh PostgreSQL schema."""
    st = State(backend.kind, write_config(backend.pipeline, exports=exports), backend.env, backend.url)
    if initialise:
        init(st.context())
    return st


def pg_tables(pg_url: str) -> set[str]:
    """The tables of the test URL's schema (the schema need not exist)."""
    import psycopg

    base, schema_name = split_pg_url(pg_url)
    with psycopg.connect(base) as conn:
        rows = conn.execute("SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                            (schema_name,)).fetchall()
    return {r[0] for r in rows}


def content(st: State) -> Any:
    """Everything a refused write must leave as it was: every file below the config's
    directory (SQLite: the state, its backups, the lease folder) and, on PostgreSQL, every
    table's schema and rows except ``rivet_leases`` (a live holder's heartbeat moves) and
    ``rivet_lease_tokens`` (a refused acquire draws a token: a bug of its own, shown by
    :func:`test_a_refused_postgres_acquire_writes_no_row`)."""
    files = tree_digest(st.directory)
    if st.backend == "sqlite":
        return files
    assert st.pg_url is not None
    base, schema_name = split_pg_url(st.pg_url)
    dump = pg_dump(base, schema_name)
    dump["data"].pop("rivet_leases", None)
    dump["data"].pop("rivet_lease_tokens", None)
    return files, dump


def query(st: State, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Rows of ``sql`` (with ``?`` placeholders) on the state; nothing is created beside a SQLite state."""
    if st.backend == "sqlite":  # from a private copy: a mode=ro open of a WAL state creates -wal/-shm
        with tempfile.TemporaryDirectory(prefix="guard-query-") as tmp:
            copy = Path(tmp) / STATE_FILE
            shutil.copyfile(st.directory / STATE_FILE, copy)
            if Path(f"{st.directory / STATE_FILE}-wal").exists():
                shutil.copyfile(f"{st.directory / STATE_FILE}-wal", f"{copy}-wal")
            db = sqlite3.connect(copy)
            try:
                return db.execute(sql, params).fetchall()
            finally:
                db.close()
    with st.pg() as conn:
        return [tuple(r) for r in conn.execute(sql.replace("?", "%s"), params).fetchall()]


def execute(st: State, sql: str) -> None:
    """Run one statement on the state, committed (test setup only)."""
    if st.backend == "sqlite":
        db = sqlite3.connect(st.directory / STATE_FILE)
        try:
            with db:
                db.execute(sql)
        finally:
            db.close()
    else:
        with st.pg() as conn:
            conn.execute(sql)


def recorded_keys(st: State) -> list[str]:
    return [r[0] for r in query(st, "SELECT state_key FROM rivet_identity")]


def cursor_of(st: State, export: str) -> str | None:
    rows = query(st, "SELECT cursor_value FROM rivet_exports WHERE export_name = ?", (export,))
    return rows[0][0] if rows else None


def hold(st: State, spawn: Callable[..., LeaseRun], export: str = "orders") -> LeaseRun:
    """A live ``leases run`` holder of ``export``'s run lease whose record is complete
    (its command's pid written), so the lease folder no longer changes while it holds."""
    holder = spawn(st, export=export)
    command_pid = holder.wait_ready()
    key = f"chunk-run:{export}"
    wait_for(lambda: st.leases().get(key, {}).get("child_pid") == command_pid,
             f"the holder of {key} to record its command")
    assert st.leases()[key]["state"] == "live"
    return holder


def refused_busy(proc: subprocess.CompletedProcess[str], holder_pid: int,
                 code: str = "RIVET_STATE_RUN_IN_PROGRESS") -> dict[str, Any]:
    """Assert ``proc`` was refused busy (exit 2, retryable) naming the holder's pid."""
    assert proc.returncode == 2, describe(proc)
    err = error_object(proc)
    assert (err["code"], err["exit_code"], err["retryable"]) == (code, 2, True), err
    assert f"pid {holder_pid}" in err["message"], err
    return err


def refused(proc: subprocess.CompletedProcess[str], code: str, exit_code: int) -> dict[str, Any]:
    assert proc.returncode == exit_code, describe(proc)
    err = error_object(proc)
    assert (err["code"], err["exit_code"]) == (code, exit_code), err
    return err


def open_store(config: Path, **kwargs: Any) -> StateStore:
    return StateStore.open(config, env=process_env(), lock_wait=kwargs.pop("lock_wait", 0), **kwargs)


# -- 1a. a run during a long migration --------------------------------------------------------

#: The command a waiting run wraps: records, the moment it runs, the state lease's and its
#: own run lease's sidecar records and the state's revision.
RECORD = textwrap.dedent("""\
    import json, pathlib, sqlite3, sys, time
    out, leases, db = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
    now = time.time_ns()
    state_lease = json.loads((leases / "state%3Aexclusive").read_text().splitlines()[0])
    run_lease = json.loads((leases / "chunk-run%3Aorders").read_text().splitlines()[0])
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    revision = con.execute("SELECT version_num FROM rivet_state_version").fetchone()[0]
    con.close()
    out.write_text(json.dumps({"now_ns": now, "state_lease": state_lease, "run_lease": run_lease,
                               "revision": revision}))
    """)


def big_legacy_state(path: Path) -> None:
    """A legacy state big enough that ``migrate`` holds the state lease for seconds: the
    legacy builder's 50,000 runs, multiplied inside SQLite to 600,000 with padded rows
    (much faster than building 400,000 runs in Python)."""
    build_legacy_state(path, [("orders", "incremental"), ("order_lines", "chunked")], runs=50_000)
    db = sqlite3.connect(path)
    try:
        with db:
            db.execute("""
                WITH RECURSIVE k(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM k WHERE n < 11)
                INSERT INTO rivet_runs
                SELECT 'h' || n || '-' || run_id, export_name, mode, status,
                       strftime('%Y-%m-%dT%H:%M:%fZ', started_at, printf('-%d days', n * 400)),
                       finished_at, rows, files, printf('%.*c', 200, 'x')
                FROM rivet_runs, k""")
    finally:
        db.close()


def test_a_run_during_a_migration_is_refused_at_once_or_waits_until_the_migration_ended(tmp_path: Path) -> None:
    st = make_state(StateBackend.sqlite(tmp_path), exports=TWO_EXPORTS, initialise=False)
    db_path = st.directory / STATE_FILE
    big_legacy_state(db_path)
    assert query(st, "SELECT count(*) FROM rivet_runs") == [(600_000,)]

    logs = tmp_path / "logs"
    logs.mkdir()
    with open(logs / "migrate.out", "w") as out, open(logs / "migrate.err", "w") as err:
        migration = st.popen("migrate", stdout=out, stderr=err)
    waiter: Forked | None = None
    try:
        # 1. The migration holds the state lease (and the run leases): seen by `statetool leases`.
        seen: dict[str, dict[str, Any]] = {}

        def migration_holds_every_lease() -> bool:
            if migration.poll() is not None:
                pytest.fail("the migration ended before its state lease was seen live: make the state bigger\n"
                            + (logs / "migrate.err").read_text())
            proc = st.cli("--json", "leases")
            assert proc.returncode == 0, describe(proc)
            rows = {r["key"]: r for r in json.loads(proc.stdout)["leases"]}
            seen.clear()
            seen.update(rows)
            return all(rows.get(key, {}).get("state") == "live" and rows[key]["holder_pid"] == migration.pid
                       for key in (STATE_LEASE, RUN_KEY, "chunk-run:order_lines"))

        wait_for(migration_holds_every_lease, "the migration to hold state:exclusive and every run lease")
        state_token = seen[STATE_LEASE]["fencing_token"]
        orders_token = seen[RUN_KEY]["fencing_token"]
        assert isinstance(state_token, int) and isinstance(orders_token, int), seen

        # 2. A waiting run, started while the migration runs: it must wait for it.
        marker = tmp_path / "waiter-record.json"
        waiter_err = logs / "waiter.err"
        with open(waiter_err, "w") as werr:
            waiter = st.popen("--lock-wait", "120", "leases", "run", "--export", "orders", "--",
                              sys.executable, "-c", RECORD, str(marker), str(st.leases_dir), str(db_path),
                              stderr=werr)

        # 3. A run with --lock-wait 0: refused at once, naming the migration.
        refused_marker = tmp_path / "refused-ran"
        proc = st.cli_process("--lock-wait", "0", "--json-errors", "leases", "run", "--export", "orders", "--",
                              sys.executable, "-c", TOUCH, str(refused_marker))
        assert proc.returncode == 2, ("a run started during the migration was not refused (did the migration end "
                                      "first? then the state is too small)\n" + describe(proc))
        refused_busy(proc, migration.pid)
        assert "waiting" not in proc.stderr, "--lock-wait 0 waited: " + describe(proc)
        assert not refused_marker.exists()

        wait_for(lambda: "waiting up to" in waiter_err.read_text() or waiter.poll() is not None,
                 "the waiting run to log its wait")
        assert "waiting up to" in waiter_err.read_text(), (
            "the waiting run never waited: it started after the migration ended (state too small?) or it ran "
            "beside the migration\n" + waiter_err.read_text())
        assert not marker.exists(), "the waiting run's command ran while the migration held the state"

        # 4. The migration ends; only then does the waiting run run.
        assert migration.wait(timeout=120) == 0, (logs / "migrate.err").read_text()
        assert waiter.wait(timeout=120) == 0, waiter_err.read_text()
    finally:
        for proc_ in (migration, waiter):
            if proc_ is not None and proc_.poll() is None:
                os.killpg(proc_.pid, signal.SIGKILL)
                proc_.wait()
    said = " ".join((logs / "migrate.out").read_text().split())
    assert said.startswith("Migrated the state at") and " from legacy to " in said, said

    record = json.loads(marker.read_text())
    # When the command ran, the migration's state lease was released (the record of a clean
    # release: no holder, the migration's token kept), before the command started, and the
    # state was at head already.
    released = record["state_lease"]
    assert "pid" not in released and released.get("fencing_token") == state_token, released
    released_at = datetime.strptime(released["released_at"], "%Y-%m-%dT%H:%M:%S.%f%z")
    assert released_at.timestamp() * 1e9 <= record["now_ns"] + 1e6, (released, record["now_ns"])
    assert record["revision"] == migrations.head(), record
    # The run lease the command runs under was taken after the migration's.
    assert record["run_lease"]["pid"] == waiter.pid, record
    assert record["run_lease"]["fencing_token"] > orders_token, (record, orders_token)
    assert query(st, "SELECT count(*) FROM rivet_runs") == [(600_000,)]


# -- 1b. identity adopt / rekey beside a live run -------------------------------------------------


def test_identity_rekey_beside_a_live_run_is_refused_and_changes_nothing(
        state: State, spawn: Callable[..., LeaseRun]) -> None:
    assert recorded_keys(state) == [SOURCE_KEY]
    holder = hold(state, spawn)
    before = content(state)
    proc = state.cli("--lock-wait", "0", "--json-errors", "identity", "rekey", "--old", SOURCE_KEY,
                     "--new", NEW_KEY, "--reason", "db moved")
    refused_busy(proc, holder.pid)
    assert content(state) == before
    assert recorded_keys(state) == [SOURCE_KEY]
    assert state.audit_rows("identity.rekey") == []

    assert holder.finish().returncode == 0
    proc = state.cli("--lock-wait", "0", "identity", "rekey", "--old", SOURCE_KEY, "--new", NEW_KEY,
                     "--reason", "db moved")
    assert proc.returncode == 0, describe(proc)  # the refusal was the lease's, nothing else
    assert recorded_keys(state) == [NEW_KEY]


def test_identity_adopt_beside_a_live_run_is_refused_and_changes_nothing(
        state: State, spawn: Callable[..., LeaseRun]) -> None:
    execute(state, "DELETE FROM rivet_identity")  # a state with no identity: adopt would record one
    holder = hold(state, spawn)
    before = content(state)
    proc = state.cli("--lock-wait", "0", "--json-errors", "identity", "adopt")
    refused_busy(proc, holder.pid)
    assert content(state) == before
    assert recorded_keys(state) == []

    assert holder.finish().returncode == 0
    proc = state.cli("--lock-wait", "0", "identity", "adopt")
    assert proc.returncode == 0, describe(proc)
    assert recorded_keys(state) == [SOURCE_KEY]


# -- 1c. a per-export write beside a run ----------------------------------------------------------


def test_set_cursor_is_refused_beside_its_exports_run_and_allowed_beside_another_exports_run(
        state: State, spawn: Callable[..., LeaseRun]) -> None:
    holder = hold(state, spawn, "orders")
    before = content(state)
    proc = state.cli("--lock-wait", "0", "--json-errors", "exports", "set-cursor", "orders", "2026-06-01")
    refused_busy(proc, holder.pid)
    assert content(state) == before
    assert cursor_of(state, "orders") is None
    assert holder.finish().returncode == 0

    other = hold(state, spawn, "order_lines")
    proc = state.cli("--lock-wait", "0", "--json", "exports", "set-cursor", "orders", "2026-06-01")
    assert proc.returncode == 0, describe(proc)
    assert json.loads(proc.stdout)["after"] == {"cursor": "2026-06-01"}
    assert cursor_of(state, "orders") == "2026-06-01"
    assert state.leases()["chunk-run:order_lines"]["state"] == "live"  # the other run was not disturbed
    assert other.finish().returncode == 0


def test_a_refused_postgres_acquire_writes_no_row(pg_state: State, spawn: Callable[..., LeaseRun]) -> None:
    """SPEC §9 "a refused command changes no byte": a run refused (exit 2) beside a live
    holder leaves every row of the state as it was, the fencing token counter included."""
    holder = hold(pg_state, spawn, "orders")
    tokens = query(pg_state, "SELECT key, token FROM rivet_lease_tokens ORDER BY key")
    proc = pg_state.cli_process("--lock-wait", "0", "--json-errors", "leases", "run", "--export", "orders", "--",
                                "true")
    refused_busy(proc, holder.pid)
    proc = pg_state.cli("--lock-wait", "0", "--json-errors", "exports", "set-cursor", "orders", "2026-06-01")
    refused_busy(proc, holder.pid)
    assert query(pg_state, "SELECT key, token FROM rivet_lease_tokens ORDER BY key") == tokens
    assert pg_state.leases()[RUN_KEY]["fencing_token"] == dict(tokens)[RUN_KEY]
    assert holder.finish().returncode == 0


# -- 1d. check beside a live lease ----------------------------------------------------------------


def test_check_reports_a_live_lease_as_a_warning_that_strict_fails(
        state_backend: StateBackend, spawn: Callable[..., LeaseRun]) -> None:
    st = make_state(state_backend, exports=ONLY_ORDERS)
    set_cursor(st.context(), "orders", "2026-01-31")  # progress: no "no progress" warning
    proc = st.cli("check", "--strict")
    assert proc.returncode == 0, "the baseline must pass --strict, or the test proves nothing\n" + describe(proc)

    holder = hold(st, spawn)
    before = content(st)
    proc = st.cli("check", "--json")
    assert proc.returncode == 0, describe(proc)
    (row,) = [c for c in json.loads(proc.stdout)["checks"] if c["id"] == "leases"]
    assert (row["status"], row["code"]) == ("warn", "RIVET_STATE_LEASE_LIVE"), row
    assert f"pid {holder.pid}" in row["message"] and RUN_KEY in row["message"], row

    proc = st.cli("check", "--strict", "--json-errors")
    assert proc.returncode == 5, describe(proc)
    assert error_object(proc)["code"] == "RIVET_STATE_LEASE_LIVE", describe(proc)
    assert content(st) == before  # check is read-only
    assert holder.finish().returncode == 0
    proc = st.cli("check", "--strict")
    assert proc.returncode == 0, describe(proc)


# -- 2. no silent first run (StateStore.open) ---------------------------------------------------


def test_open_refuses_a_missing_state_in_an_empty_declared_directory_and_creates_nothing(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    empty = tmp_path / "state"
    empty.mkdir()
    config_files = tree_digest(config.parent)
    with pytest.raises(StateError) as caught:
        open_store(config, state_url=f"sqlite:{empty}")
    err = caught.value
    assert (err.code, err.exit_code) == ("RIVET_STATE_MISSING", 5), err
    assert "statetool init" in err.message, err.message
    assert str(empty / STATE_FILE) in err.message, err.message
    assert list(empty.iterdir()) == []
    assert tree_digest(config.parent) == config_files


def _lived_before(kind: str, tmp_path: Path, spawn: Callable[..., LeaseRun]) -> tuple[Path, str]:
    """A pipeline directory where a state lived and is now missing, with only ``kind`` of
    evidence left, made by the real commands. Returns ``(config, what the error names)``."""
    st = make_state(StateBackend.sqlite(tmp_path), exports=TWO_EXPORTS)
    directory = st.directory
    if kind == "backup":
        set_cursor(st.context(), "orders", "2026-01-31")  # a verified backup first
        (backup,) = directory.glob(f"{STATE_FILE}.backup-*")
        evidence = str(backup)
        shutil.rmtree(directory / LEASES_DIR)
    elif kind == "relocation keep":
        proc = st.cli("relocate", "--to", str(tmp_path / "moved"), "--create-dir")
        assert proc.returncode == 0, describe(proc)
        (keep,) = directory.glob(f"{STATE_FILE}.relocated-*")
        evidence = str(keep)
        shutil.rmtree(directory / LEASES_DIR)
    elif kind == "stale lease record":
        holder = hold(st, spawn)
        holder.kill_group()  # its record (pid, host, command) stays behind
        assert st.leases()[RUN_KEY]["state"] == "stale"
        evidence = str(directory / LEASES_DIR)
    elif kind == "released lease record":
        proc = st.cli_process("leases", "run", "--export", "orders", "--", "true")
        assert proc.returncode == 0, describe(proc)
        evidence = str(directory / LEASES_DIR)
    else:
        raise AssertionError(kind)
    (directory / STATE_FILE).unlink()  # the state file is gone (lost volume, wrong cleanup)
    for suffix in ("-wal", "-shm", "-journal"):
        Path(f"{directory / STATE_FILE}{suffix}").unlink(missing_ok=True)
    return st.config, evidence


@pytest.mark.parametrize("kind", ["backup", "relocation keep", "stale lease record", "released lease record"])
def test_open_with_create_refuses_a_place_where_a_state_lived_before(
        kind: str, tmp_path: Path, spawn: Callable[..., LeaseRun]) -> None:
    config, evidence = _lived_before(kind, tmp_path, spawn)
    before = tree_digest(config.parent)
    with pytest.raises(StateError) as caught:
        open_store(config, create=True)
    err = caught.value
    assert (err.code, err.exit_code, err.entry.exit_class) == ("RIVET_STATE_VANISHED", 5, "refusal"), err
    assert evidence in err.message, err.message
    assert tree_digest(config.parent) == before
    assert not (config.parent / STATE_FILE).exists()


def test_open_with_create_at_a_relocated_place_is_refused_relocated(tmp_path: Path) -> None:
    st = make_state(StateBackend.sqlite(tmp_path), exports=TWO_EXPORTS)
    moved = tmp_path / "moved"
    proc = st.cli("relocate", "--to", str(moved), "--create-dir")
    assert proc.returncode == 0, describe(proc)
    before = tree_digest(st.directory)
    with pytest.raises(StateError) as caught:
        open_store(st.config, create=True)
    assert (caught.value.code, caught.value.exit_code) == ("RIVET_STATE_RELOCATED", 5), caught.value
    assert str(moved) in caught.value.message, caught.value.message
    assert tree_digest(st.directory) == before


def test_open_with_create_in_a_new_empty_directory_creates_it_and_warns_created(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    fresh = tmp_path / "state"
    fresh.mkdir()
    store = open_store(config, state_url=f"sqlite:{fresh}", create=True)
    created = [w for w in store.warnings if w.code == "RIVET_STATE_CREATED"]
    assert len(created) == 1, store.warnings
    message = created[0].message
    assert str(fresh / STATE_FILE) in message, message
    assert "declared_dir" in message or "declared directory" in message, message
    assert (fresh / STATE_FILE).is_file()
    again = open_store(config, state_url=f"sqlite:{fresh}")
    assert [w for w in again.warnings if w.code == "RIVET_STATE_CREATED"] == []


def test_open_postgres_empty_schema_is_missing_without_create_and_created_with_a_warning(
        tmp_path: Path, pg_url: str) -> None:
    import psycopg

    config = write_config(tmp_path / "pipeline")
    base, schema_name = split_pg_url(pg_url)
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema_name}"')
    with pytest.raises(StateError) as caught:
        open_store(config, state_url=pg_url)
    assert (caught.value.code, caught.value.exit_code) == ("RIVET_STATE_MISSING", 5), caught.value
    assert "statetool init" in caught.value.message, caught.value.message
    assert pg_tables(pg_url) == set()

    store = open_store(config, state_url=pg_url, create=True)
    created = [w for w in store.warnings if w.code == "RIVET_STATE_CREATED"]
    assert len(created) == 1, store.warnings
    assert schema_name in created[0].message and "shared" in created[0].message, created[0].message
    assert {"rivet_state_version", "rivet_exports", "rivet_identity"} <= pg_tables(pg_url)
    assert not (config.parent / STATE_FILE).exists()


# -- 3. refused commands create no files ------------------------------------------------------------


def test_leases_run_in_an_empty_declared_directory_is_missing_and_creates_nothing(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    empty = tmp_path / "state"
    empty.mkdir()
    marker = tmp_path / "ran"
    proc = run_cli_forked("-c", str(config), "--state-url", f"sqlite:{empty}", "--json-errors", "leases", "run",
                          "--export", "orders", "--", sys.executable, "-c", TOUCH, str(marker))
    refused(proc, "RIVET_STATE_MISSING", 5)
    assert list(empty.iterdir()) == []
    assert not marker.exists()


def test_leases_run_at_a_relocated_old_place_is_relocated_and_creates_nothing(
        sqlite_state: State, tmp_path: Path) -> None:
    moved = tmp_path / "moved"
    proc = sqlite_state.cli("relocate", "--to", str(moved), "--create-dir")
    assert proc.returncode == 0, describe(proc)
    before = tree_digest(sqlite_state.directory)
    marker = tmp_path / "ran"
    proc = sqlite_state.cli_process("--json-errors", "leases", "run", "--export", "orders", "--",
                                    sys.executable, "-c", TOUCH, str(marker))
    err = refused(proc, "RIVET_STATE_RELOCATED", 5)
    assert str(moved) in err["message"], err
    assert tree_digest(sqlite_state.directory) == before
    assert not marker.exists()


def test_relocate_refused_by_a_live_lease_leaves_source_and_target_as_they_were(
        sqlite_state: State, spawn: Callable[..., LeaseRun], tmp_path: Path) -> None:
    holder = hold(sqlite_state, spawn)
    target_dir = tmp_path / "moved"
    target_dir.mkdir()
    before = tree_digest(sqlite_state.directory)
    proc = sqlite_state.cli("--lock-wait", "0", "--json-errors", "relocate", "--to", str(target_dir))
    refused_busy(proc, holder.pid)
    assert tree_digest(sqlite_state.directory) == before
    assert list(target_dir.iterdir()) == []
    assert holder.finish().returncode == 0


def test_transfer_refused_by_a_live_lease_leaves_the_source_as_it_was_and_creates_no_table(
        sqlite_state: State, spawn: Callable[..., LeaseRun], pg_url: str) -> None:
    holder = hold(sqlite_state, spawn)
    before = tree_digest(sqlite_state.directory)
    proc = sqlite_state.cli("--lock-wait", "0", "--json-errors", "transfer", "--to", pg_url)
    refused_busy(proc, holder.pid)
    assert tree_digest(sqlite_state.directory) == before
    assert pg_tables(pg_url) == set()
    assert holder.finish().returncode == 0


# -- 4. fencing on SQLite ---------------------------------------------------------------------------


def _replace_sidecar_under(st: State, spawn: Callable[..., LeaseRun], export: str = "orders") -> LeaseRun:
    """Delete export ``export``'s run lease sidecar and let another process take the lease
    on a new inode."""
    from statetool.location import lease_file_name

    sidecar = st.leases_dir / lease_file_name(f"chunk-run:{export}")
    old = os.stat(sidecar)
    sidecar.unlink()
    taker = hold(st, spawn, export)
    new = os.stat(sidecar)
    assert (new.st_dev, new.st_ino) != (old.st_dev, old.st_ino), "the sidecar was not replaced by a new inode"
    assert st.leases()[f"chunk-run:{export}"]["holder_pid"] == taker.pid
    return taker


def test_a_run_whose_sidecar_was_replaced_gets_lease_lost_and_writes_nothing(
        sqlite_state: State, spawn: Callable[..., LeaseRun]) -> None:
    store = open_store(sqlite_state.config, lock_wait=10)
    with store.run("orders", "incremental") as run:
        run_id = run.start_run()
        run.commit_cursor("2026-01-01")
        taker = _replace_sidecar_under(sqlite_state, spawn)
        before = tree_digest(sqlite_state.directory)
        with pytest.raises(StateError) as caught:
            run.commit_cursor("2026-02-01")
        assert (caught.value.code, caught.value.exit_code) == ("RIVET_STATE_LEASE_LOST", 2), caught.value
        with pytest.raises(StateError) as caught:
            run.finish_run(run_id, "succeeded", rows=10)
        assert caught.value.code == "RIVET_STATE_LEASE_LOST", caught.value
        assert tree_digest(sqlite_state.directory) == before
    assert cursor_of(sqlite_state, "orders") == "2026-01-01"
    assert query(sqlite_state, "SELECT status FROM rivet_runs WHERE run_id = ?", (run_id,)) == [("running",)]
    # The old holder's release did not touch the new holder's lease.
    row = sqlite_state.leases()[RUN_KEY]
    assert (row["state"], row["holder_pid"]) == ("live", taker.pid), row
    assert taker.finish().returncode == 0


def test_a_transaction_whose_sidecar_was_replaced_midway_commits_nothing(
        sqlite_state: State, spawn: Callable[..., LeaseRun]) -> None:
    store = open_store(sqlite_state.config, lock_wait=10)
    with store.run("orders", "incremental") as run:
        with pytest.raises(StateError) as caught:
            with run.transaction() as tx:
                tx.start_run("orders", "incremental", run_id="doomed-run")
                tx.commit_cursor("orders", "incremental", "2026-03-01")
                taker = _replace_sidecar_under(sqlite_state, spawn)
        assert caught.value.code == "RIVET_STATE_LEASE_LOST", caught.value
    assert cursor_of(sqlite_state, "orders") is None
    assert query(sqlite_state, "SELECT count(*) FROM rivet_runs WHERE run_id = 'doomed-run'") == [(0,)]
    assert taker.finish().returncode == 0


# -- 1. a run beside a whole-state write it does not know of ------------------------------------

#: A whole-state writer in a process of its own: holds what a migration holds (the state
#: lease, then the run lease of each export named) until GO exists; writes the keys it
#: holds to READY.
WHOLE_STATE_HOLDER = textwrap.dedent("""\
    import json, os, pathlib, sys, time
    from contextlib import ExitStack
    from statetool.operations.context import Context
    from statetool.operations.leasing import hold_whole_state
    config, ready, go = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
    ctx = Context(config_path=config, env=dict(os.environ), lock_wait=60, command="whole-state test writer")
    with ExitStack() as stack:
        held = hold_whole_state(ctx, stack, sys.argv[4:], "RIVET_STATE_RUN_IN_PROGRESS")
        tmp = pathlib.Path(str(ready) + ".tmp")
        tmp.write_text(json.dumps(sorted(lease.key for lease in held)))
        tmp.rename(ready)
        deadline = time.monotonic() + 120
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    """)


def test_a_run_of_an_export_the_whole_state_write_does_not_know_gives_its_lease_back_and_waits(
        state: State, tmp_path: Path) -> None:
    ready, go = tmp_path / "whole-ready", tmp_path / "whole-go"
    declare_export(state.config, "late_export")  # new in the config, never run: the writer does not hold it
    writer = fork_code(WHOLE_STATE_HOLDER, str(state.config), str(ready), str(go), "orders", "order_lines",
                       env=process_env(state.env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, new_session=True)
    waiter: Forked | None = None
    try:
        wait_for(lambda: ready.exists() or writer.poll() is not None, "the whole-state writer to hold")
        assert ready.exists(), writer.communicate()
        assert json.loads(ready.read_text()) == ["chunk-run:order_lines", RUN_KEY, STATE_LEASE]
        late_key = "chunk-run:late_export"  # an export the state does not know yet
        before = content(state)

        # leases run, --lock-wait 0: refused at once, naming the whole-state writer
        marker = tmp_path / "late-ran"
        proc = state.cli_process("--lock-wait", "0", "--json-errors", "leases", "run", "--export", "late_export", "--",
                                 sys.executable, "-c", TOUCH, str(marker))
        refused_busy(proc, writer.pid)
        assert not marker.exists()
        assert state.leases().get(late_key, {"state": "free"})["state"] != "live"  # given back

        # the runtime API: the same
        store = open_store(state.config, state_url=state.pg_url)
        with pytest.raises(StateError) as caught:
            with store.run("late_export", "incremental"):
                pytest.fail("StateStore.run ran beside a write of the whole state")
        assert caught.value.code == "RIVET_STATE_RUN_IN_PROGRESS", caught.value
        assert f"pid {writer.pid}" in caught.value.message, caught.value.message
        assert state.leases().get(late_key, {"state": "free"})["state"] != "live"
        with pytest.raises(StateError) as caught:  # a runtime write outside a run takes the run lease too
            with store.transaction() as tx:
                tx.commit_cursor("late_export", "incremental", "2026-06-01")
        assert caught.value.code == "RIVET_STATE_RUN_IN_PROGRESS", caught.value
        assert cursor_of(state, "late_export") is None

        # per-export writes of exports it holds: refused, nothing changed
        for args in (("set-cursor", "orders", "2026-06-01"), ("reset", "order_lines")):
            proc = state.cli("--lock-wait", "0", "--json-errors", "exports", *args)
            refused_busy(proc, writer.pid)
        assert cursor_of(state, "orders") is None
        after = content(state)
        if state.backend == "sqlite":  # the refused takers may have left a released record for late_export
            after = {k: v for k, v in after.items() if k != f"{LEASES_DIR}/chunk-run%3Alate_export"}
        assert after == before

        # a patient run waits, and runs only once the writer let go
        waiter_err = tmp_path / "waiter.err"
        with open(waiter_err, "w") as werr:
            waiter = state.popen("--lock-wait", "120", "leases", "run", "--export", "late_export", "--",
                                 sys.executable, "-c", TOUCH, str(marker), stderr=werr)
        wait_for(lambda: "waiting up to" in waiter_err.read_text() or waiter.poll() is not None,
                 "the patient run to wait")
        assert "waiting up to" in waiter_err.read_text() and "whole state" in waiter_err.read_text(), \
            waiter_err.read_text()
        assert not marker.exists()
        assert state.leases()[STATE_LEASE]["state"] == "live"
        go.touch()
        assert writer.wait(timeout=60) == 0, writer.communicate()
        assert waiter.wait(timeout=120) == 0, waiter_err.read_text()
        assert marker.read_text() == "ran"
    finally:
        go.touch()
        for proc_ in (writer, waiter):
            if proc_ is not None and proc_.poll() is None:
                os.killpg(proc_.pid, signal.SIGKILL)
                proc_.wait()


def test_a_run_refused_beside_a_whole_state_write_creates_no_lease_file(
        sqlite_state: State, tmp_path: Path) -> None:
    """SPEC §9 "a refused command creates no file": the refused run of an export nobody
    ran before leaves no sidecar of its own behind."""
    ready, go = tmp_path / "whole-ready", tmp_path / "whole-go"
    declare_export(sqlite_state.config, "late_export")
    writer = fork_code(WHOLE_STATE_HOLDER, str(sqlite_state.config), str(ready), str(go), "orders", env=process_env(),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, new_session=True)
    try:
        wait_for(lambda: ready.exists() or writer.poll() is not None, "the whole-state writer to hold")
        assert ready.exists(), writer.communicate()
        before = sorted(p.name for p in sqlite_state.leases_dir.iterdir())
        proc = sqlite_state.cli_process("--lock-wait", "0", "--json-errors", "leases", "run", "--export", "late_export",
                                        "--", "true")
        refused_busy(proc, writer.pid)
        assert sorted(p.name for p in sqlite_state.leases_dir.iterdir()) == before
    finally:
        go.touch()
        if writer.poll() is None:
            os.killpg(writer.pid, signal.SIGKILL)
        writer.communicate(timeout=60)


# -- 1. whole-state writes and runs never overlap --------------------------------------------------

#: A process that takes, ROUNDS times, either the whole state (hold_whole_state over the
#: config's exports) or one export's run lease, and appends "enter/exit KIND PID NS"
#: (CLOCK_MONOTONIC, one clock for every process of this machine) around each holding.
OVERLAP_WORKER = textwrap.dedent("""\
    import os, pathlib, random, sys, time
    from contextlib import ExitStack
    from statetool.operations.context import Context
    from statetool.operations.leasing import hold_whole_state, holding
    config, log, go, kind, rounds = sys.argv[1:6]
    ctx = Context(config_path=pathlib.Path(config), env=dict(os.environ), lock_wait=120, command=f"worker {kind}")
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    def mark(what):
        os.write(fd, f"{what} {kind} {os.getpid()} {time.monotonic_ns()}\\n".encode())
    while not pathlib.Path(go).exists():
        time.sleep(0.005)
    for _ in range(int(rounds)):
        if kind == "whole":
            with ExitStack() as stack:
                hold_whole_state(ctx, stack, ["orders", "order_lines"], "RIVET_STATE_RUN_IN_PROGRESS")
                mark("enter"); time.sleep(0.01); mark("exit")
            time.sleep(random.uniform(0, 0.03))
        else:
            with holding(ctx, "chunk-run:" + kind):
                mark("enter"); time.sleep(0.01); mark("exit")
            time.sleep(random.uniform(0.02, 0.06))
    """)


def test_whole_state_writes_and_runs_never_hold_at_once(state: State, tmp_path: Path) -> None:
    log, go = tmp_path / "holdings.log", tmp_path / "go"
    plan = [("whole", 8), ("whole", 8), ("orders", 15), ("order_lines", 15), ("late_export", 15)]
    workers = [fork_code(OVERLAP_WORKER, str(state.config), str(log), str(go), kind, str(rounds),
                         env=process_env(state.env), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for kind, rounds in plan]
    go.touch()
    for worker in workers:
        out, err = worker.communicate(timeout=150)
        assert worker.returncode == 0, f"worker failed: exit {worker.returncode}\n{out}\n{err}"
    open_at: dict[tuple[str, str], int] = {}
    intervals: list[tuple[int, int, str, str]] = []
    for line in log.read_text().splitlines():
        what, kind, pid, ns = line.split()
        if what == "enter":
            open_at[(kind, pid)] = int(ns)
        else:
            intervals.append((open_at.pop((kind, pid)), int(ns), kind, pid))
    assert not open_at and len(intervals) == sum(r for _, r in plan)
    intervals.sort()
    for i, (start, end, kind, pid) in enumerate(intervals):
        for other_start, other_end, other_kind, other_pid in intervals[i + 1:]:
            if other_start > end:
                break
            # overlapping holdings: allowed only for runs of two different exports
            assert "whole" not in (kind, other_kind) and kind != other_kind, \
                f"{kind} (pid {pid}) and {other_kind} (pid {other_pid}) held at once"


def test_a_run_whose_sidecar_was_replaced_cannot_commit_a_cdc_position(
        sqlite_state: State, spawn: Callable[..., LeaseRun]) -> None:
    """Issue 15: a position is committed under the run lease, like a cursor: once another
    holder took the lease over, the old run's commit is RIVET_STATE_LEASE_LOST and the
    state keeps the position the lease's holder last committed."""
    store = open_store(sqlite_state.config, lock_wait=10)
    with store.run("order_events", "cdc") as run:
        run.commit_position({"file": "mysql-bin.000042", "pos": 4})
        taker = _replace_sidecar_under(sqlite_state, spawn, "order_events")
        before = tree_digest(sqlite_state.directory)
        with pytest.raises(StateError) as caught:
            run.commit_position({"file": "mysql-bin.000043", "pos": 9})
        assert caught.value.code == "RIVET_STATE_LEASE_LOST", caught.value
        assert tree_digest(sqlite_state.directory) == before
    rows = query(sqlite_state, "SELECT position FROM rivet_cdc_positions WHERE export_name = 'order_events'")
    assert [json.loads(r[0]) for r in rows] == [{"file": "mysql-bin.000042", "pos": 4}]
    assert taker.finish().returncode == 0
