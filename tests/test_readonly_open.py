"""SPEC §4 and §9: a read-only open of a SQLite state creates no file and misses nothing.

The hazards are SQLite's own: a ``mode=ro`` open of a WAL database can create ``-wal`` and
``-shm``; ``immutable=1`` ignores committed frames that live only in ``-wal``; a writer
killed in rollback-journal mode leaves a hot ``-journal`` that a read-only connection
cannot roll back. Every writer here is a real process, killed with SIGKILL or kept alive.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support import describe, run_cli, tree_digest, write_config
from statetool.example import build_legacy_state
from statetool.runtime import StateStore

STATE = ".rivet_state.db"
WAL_CURSOR = "2026-11-30T23:59:59.000000Z"
JOURNAL_MAGIC = bytes.fromhex("d9d505f920a163d7")


LEASES = ".rivet_state.leases"


def listing(directory: Path) -> list[str]:
    """Every path below ``directory`` (files and folders): a new file or folder shows here."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def wal_state(config: Path) -> Path:
    """A state at head in WAL mode, with one finished run, closed cleanly (no -wal, no -shm)."""
    store = StateStore.open(config, env={}, create=True)
    with store.transaction() as tx:
        run_id = tx.start_run("orders", "incremental")
        tx.commit_cursor("orders", "incremental", "2026-11-01T00:00:00.000000Z")
        tx.finish_run(run_id, "succeeded", rows=10, files=1)
    path = config.parent / STATE
    assert path.read_bytes()[18] == 2, "the state should be in WAL mode (header byte 18 = 2)"
    # the run lease the transaction took leaves its sidecar (lease files are never deleted)
    assert listing(config.parent) == [STATE, LEASES, f"{LEASES}/chunk-run%3Aorders", "rivet.yaml"], \
        listing(config.parent)
    return path


def start_wal_writer(db: Path) -> subprocess.Popen[str]:
    """A process that commits a new cursor into the WAL, never checkpoints, and stays alive."""
    code = textwrap.dedent(f"""
        import sqlite3, sys, time
        conn = sqlite3.connect({str(db)!r}, isolation_level=None)
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("UPDATE rivet_exports SET cursor_value = ? WHERE export_name = 'orders'", ({WAL_CURSOR!r},))
        conn.execute("COMMIT")
        print("committed", flush=True)
        time.sleep(300)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line == "committed", f"the writer did not commit (said {line!r})"
    return proc


def kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def cursor_of(doc: dict, name: str) -> object:
    return next(e for e in doc["exports"] if e["name"] == name)["cursor"]


def test_wal_state_without_wal_file_is_read_without_creating_wal_or_shm(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    wal_state(config)
    before, files_before = tree_digest(config.parent), listing(config.parent)
    info = run_cli("-c", str(config), "info", "--json")
    assert info.returncode == 0, describe(info)
    assert cursor_of(json.loads(info.stdout), "orders") == "2026-11-01T00:00:00.000000Z", describe(info)
    check = run_cli("-c", str(config), "check", "--json")
    assert check.returncode == 0, describe(check)
    assert json.loads(check.stdout)["ok"] is True, describe(check)
    assert listing(config.parent) == files_before, describe(check)
    assert tree_digest(config.parent) == before, describe(check)


def test_wal_state_in_declared_dir_is_read_without_creating_any_file(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    wal_state(config)
    declared = tmp_path / "state"
    declared.mkdir()
    (config.parent / STATE).rename(declared / STATE)
    env = {"RIVET_STATE_URL": f"sqlite:{declared}"}
    before = (tree_digest(declared), listing(declared), listing(config.parent))
    for command in ("info", "check"):
        proc = run_cli("-c", str(config), command, "--json", env=env)
        assert proc.returncode == 0, describe(proc)
        assert (tree_digest(declared), listing(declared), listing(config.parent)) == before, describe(proc)


def test_committed_frames_of_a_killed_writer_are_seen_and_nothing_changes(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    db = wal_state(config)
    writer = start_wal_writer(db)
    kill(writer)
    wal, shm = Path(f"{db}-wal"), Path(f"{db}-shm")
    assert wal.is_file() and wal.stat().st_size > 32 and shm.is_file(), listing(config.parent)
    # The committed cursor lives only in the -wal: the main file alone does not have it.
    with sqlite3.connect(f"file:{db}?immutable=1", uri=True) as main_only:
        in_main = main_only.execute("SELECT cursor_value FROM rivet_exports WHERE export_name = 'orders'").fetchone()
    main_only.close()
    assert in_main == ("2026-11-01T00:00:00.000000Z",)
    before, files_before = tree_digest(config.parent), listing(config.parent)

    info = run_cli("-c", str(config), "info", "--json")
    assert info.returncode == 0, describe(info)
    assert cursor_of(json.loads(info.stdout), "orders") == WAL_CURSOR, describe(info)
    assert listing(config.parent) == files_before, describe(info)
    assert tree_digest(config.parent) == before, describe(info)

    check = run_cli("-c", str(config), "check", "--json")
    assert check.returncode == 0, describe(check)
    assert json.loads(check.stdout)["ok"] is True, describe(check)
    assert listing(config.parent) == files_before, describe(check)
    assert tree_digest(config.parent) == before, describe(check)


def test_live_writer_with_uncheckpointed_frames_is_read_beside_it_creating_nothing(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    db = wal_state(config)
    writer = start_wal_writer(db)
    try:
        files_before = listing(config.parent)
        assert f"{STATE}-wal" in files_before and f"{STATE}-shm" in files_before, files_before
        digest = tree_digest(config.parent)
        info = run_cli("-c", str(config), "info", "--json")
        assert writer.poll() is None, "the writer should still be alive"
        assert info.returncode == 0, describe(info)
        assert cursor_of(json.loads(info.stdout), "orders") == WAL_CURSOR, describe(info)
        assert listing(config.parent) == files_before, describe(info)
        after = tree_digest(config.parent)
        # A reader may update its read mark in the -shm (SQLite's shared index); the state
        # and its log must not change.
        for name in (STATE, f"{STATE}-wal", "rivet.yaml"):
            assert after[name] == digest[name], f"{name} changed\n{describe(info)}"
    finally:
        kill(writer)


def hot_journal_state(config: Path) -> tuple[Path, list[tuple[object, ...]]]:
    """A legacy (rollback-journal) state left with a hot -journal by a writer SIGKILLed
    in the middle of a transaction that had already spilled pages into the database."""
    db = config.parent / STATE
    build_legacy_state(db, [("orders", "incremental"), ("order_lines", "chunked")], runs=3000)
    assert db.read_bytes()[18] == 1, "a legacy state uses the rollback journal"
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT run_id, status, error FROM rivet_runs ORDER BY run_id").fetchall()
    conn.close()
    main_before = db.read_bytes()
    code = textwrap.dedent(f"""
        import sqlite3, time
        conn = sqlite3.connect({str(db)!r}, isolation_level=None)
        conn.execute("PRAGMA cache_size = 1")
        conn.execute("BEGIN")
        conn.execute("UPDATE rivet_runs SET error = 'half-written by a killed writer ' || run_id, status = 'failed'")
        print("in transaction", flush=True)
        time.sleep(300)
    """)
    writer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "in transaction"
    finally:
        kill(writer)
    journal = Path(f"{db}-journal")
    assert journal.is_file() and journal.read_bytes()[:8] == JOURNAL_MAGIC, listing(config.parent)
    assert db.read_bytes() != main_before, "the killed writer should have spilled pages into the database"
    return db, rows


def test_hot_journal_is_read_as_before_the_interrupted_write_and_nothing_changes(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    _db, committed_rows = hot_journal_state(config)
    before, files_before = tree_digest(config.parent), listing(config.parent)

    check = run_cli("-c", str(config), "check", "--json")
    # A legacy state has revisions pending (schema drift, 3): the journal itself is a warning.
    assert check.returncode == 3, describe(check)
    rows = {c["id"]: c for c in json.loads(check.stdout)["checks"]}
    assert rows["integrity"]["status"] == "warn" and rows["integrity"]["code"] == "RIVET_STATE_HOT_JOURNAL", \
        describe(check)
    assert "next write" in rows["integrity"]["action"], describe(check)
    assert "Traceback" not in check.stderr, describe(check)
    assert listing(config.parent) == files_before, describe(check)
    assert tree_digest(config.parent) == before, describe(check)

    info = run_cli("-c", str(config), "info", "--json")
    assert info.returncode == 0, describe(info)
    doc = json.loads(info.stdout)
    assert "RIVET_STATE_HOT_JOURNAL" in [w["code"] for w in doc["warnings"]], describe(info)
    # the half-written update (every run 'failed') is not what is shown: the committed runs are
    succeeded = sum(e["runs_succeeded"] for e in doc["exports"])
    assert succeeded == sum(1 for r in committed_rows if r[1] == "succeeded") > 0, describe(info)
    assert tree_digest(config.parent) == before, describe(info)
    assert listing(config.parent) == files_before, describe(info)


def test_hot_journal_is_rolled_back_by_migrate_and_the_state_is_usable(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    db, committed_rows = hot_journal_state(config)

    migrate = run_cli("-c", str(config), "migrate", "--json")
    assert migrate.returncode == 0, describe(migrate)
    assert json.loads(migrate.stdout)["applied"] is True, describe(migrate)
    assert not Path(f"{db}-journal").exists(), describe(migrate)

    check = run_cli("-c", str(config), "check", "--json")
    assert check.returncode == 0, describe(check)
    # The half-written update is gone: every committed row is back as it was.
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT run_id, status, error FROM rivet_runs ORDER BY run_id").fetchall()
    conn.close()
    assert rows == committed_rows


def test_dry_run_migrate_plans_from_the_state_before_the_interrupted_write(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    hot_journal_state(config)
    before, files_before = tree_digest(config.parent), listing(config.parent)
    proc = run_cli("-c", str(config), "migrate", "--dry-run", "--json")
    assert proc.returncode == 0, describe(proc)
    assert tree_digest(config.parent) == before, describe(proc)
    assert listing(config.parent) == files_before, describe(proc)


@pytest.mark.parametrize("command", [("info",), ("check",)])
def test_rollback_mode_state_is_read_without_creating_a_journal(tmp_path: Path, command: tuple[str, ...]) -> None:
    config = write_config(tmp_path / "pipeline")
    build_legacy_state(config.parent / STATE, [("orders", "incremental")], runs=20)
    before, files_before = tree_digest(config.parent), listing(config.parent)
    proc = run_cli("-c", str(config), *command, "--json")
    # A legacy state has revisions pending: check fails with schema drift, info describes it.
    assert proc.returncode == (3 if command == ("check",) else 0), describe(proc)
    assert listing(config.parent) == files_before, describe(proc)
    assert tree_digest(config.parent) == before, describe(proc)
