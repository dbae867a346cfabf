"""SPEC §4, §7: a read of a SQLite state beside a live run is one moment's, never torn.

A runtime opens the state, commits into a new ``-wal`` and closes, many times a second;
each last close checkpoints the ``-wal`` into the main file. A read that began on the
main file alone (``immutable=1``, no ``-wal`` there) must not see pages of two moments:
it holds a read lock that keeps a closing writer from checkpointing under it, and a
checkpoint it cannot hold off (SQLite's own, past ``wal_autocheckpoint`` pages) makes it
refuse as retryable, never report corruption. Every writer here is a real process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from support import describe, error_object, run_cli, write_config
from support.history import bulk_history, store_of
from statetool.backends.proclocks import lock_holders
from statetool.errors import StateError
from statetool.operations.context import Context

#: Rows each of the writer's transactions inserts (and later deletes, three transactions on).
BATCH = 300


def start_writer(db: Path, stop: Path, autocheckpoint: int) -> subprocess.Popen[str]:
    """A process that, until ``stop`` exists, opens the state, inserts :data:`BATCH` runs
    of its own, deletes those of three transactions before, commits and closes (each close
    checkpoints, as a runtime's does), with SQLite's ``wal_autocheckpoint`` set to
    ``autocheckpoint`` pages; it prints ``{"transactions", "slowest"}`` (seconds per
    transaction) when it stops, and fails on any SQLite error."""
    code = textwrap.dedent(f"""
        import json, os, sqlite3, time
        i, slowest = 0, 0.0
        while not os.path.exists({str(stop)!r}):
            began = time.monotonic()
            conn = sqlite3.connect({str(db)!r}, isolation_level=None, timeout=5)
            conn.execute("PRAGMA wal_autocheckpoint = {autocheckpoint}")
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(
                "INSERT INTO rivet_runs (run_id, export_name, mode, status, started_at) "
                "VALUES (?, 'orders', 'incremental', 'succeeded', '2026-01-01T00:00:00.000000Z')",
                [(f"writer-{{i:06d}}-{{j:03d}}",) for j in range({BATCH})])
            conn.execute("DELETE FROM rivet_runs WHERE run_id LIKE ?", (f"writer-{{i - 3:06d}}-%",))
            conn.execute("COMMIT")
            conn.close()
            slowest = max(slowest, time.monotonic() - began)
            i += 1
        print(json.dumps({{"transactions": i, "slowest": slowest}}))
    """)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stopped(proc: subprocess.Popen[str], stop: Path) -> dict[str, float]:
    stop.write_text("1")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, f"the writer failed: {err}"
    return json.loads(out)


def history_state(tmp_path: Path) -> tuple[Path, Path]:
    """A WAL state with 20,000 runs and ledger rows (many pages to read), closed cleanly."""
    config = write_config(tmp_path / "pipeline")
    store_of(config, {})
    bulk_history(config, {}, "order_lines", 20000, 20000, mode="chunked")
    db = config.parent / ".rivet_state.db"
    assert db.read_bytes()[18] == 2 and not Path(f"{db}-wal").exists()
    return config, db


def read_once(config: Path) -> int:
    """One read through the state's reader: the writer's rows, checked to be whole batches
    (a torn read counts rows of two moments), and every run read as a row."""
    with Context(config, None, {}).backend().reading() as conn:
        (mine,) = conn.one("SELECT count(*) FROM rivet_runs WHERE run_id LIKE 'writer-%'") or (None,)
        assert mine is not None and mine % BATCH == 0, f"{mine} rows of the writer: not whole transactions"
        rows = conn.rows("SELECT run_id, status FROM rivet_runs ORDER BY started_at DESC, run_id")
        assert len(rows) == 20000 + mine, (len(rows), mine)
        conn.rows("SELECT count(*), sum(rows) FROM rivet_load_ledger")
        return mine


def read_for(config: Path, seconds: float) -> tuple[int, dict[str, int]]:
    """Read the state in a loop for ``seconds``: ``(reads, {error code: count})``."""
    reads, failed = 0, {}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        reads += 1
        try:
            read_once(config)
        except StateError as err:
            failed[err.code] = failed.get(err.code, 0) + 1
    return reads, failed


def reads_beside_writer(tmp_path: Path, autocheckpoint: int) -> tuple[Path, int, dict[str, int], dict[str, float]]:
    """:func:`read_for` 5 s beside :func:`start_writer`: ``(state file, reads, failures, the writer's figures)``."""
    config, db = history_state(tmp_path)
    proc = start_writer(db, tmp_path / "stop", autocheckpoint)
    try:
        time.sleep(0.3)
        reads, failed = read_for(config, 5)
    finally:
        writer = stopped(proc, tmp_path / "stop")
    return db, reads, failed, writer


def test_reads_beside_a_writer_that_commits_and_closes_in_a_loop_all_succeed(tmp_path: Path) -> None:
    db, reads, failed, writer = reads_beside_writer(tmp_path, autocheckpoint=1000)
    # before the read lock: about one read in fifteen was RIVET_STATE_CORRUPT
    assert failed == {}, f"{failed} of {reads} reads failed beside {writer['transactions']} transactions"
    assert reads > 50 and writer["transactions"] > 50, (reads, writer)
    assert writer["slowest"] < 1.0, f"a transaction of the live run took {writer['slowest']:.3f} s"
    assert sorted(p.name for p in db.parent.iterdir() if p.name.startswith(db.name)) == [db.name], \
        "the writer's last close should fold its -wal: no read may hold it afterwards"


def test_a_checkpoint_the_lock_cannot_hold_off_is_a_retryable_refusal_never_corruption(tmp_path: Path) -> None:
    _, reads, failed, writer = reads_beside_writer(tmp_path, autocheckpoint=5)
    assert set(failed) <= {"RIVET_STATE_CHANGED_DURING_READ"}, f"{failed} of {reads} reads"
    assert reads - sum(failed.values()) > 10, (reads, failed)
    assert writer["transactions"] > 50 and writer["slowest"] < 1.0, writer


def test_info_beside_a_live_run_reads_a_cursor_it_committed_every_time(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    store_of(config, {})
    out, stop = tmp_path / "latencies.json", tmp_path / "stop"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "support" / "history.py"), str(config),
                             str(out), str(stop)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while not Path(f"{out}.ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        for _ in range(15):
            info = run_cli("-c", str(config), "info", "--json")
            assert info.returncode == 0, describe(info)
            cursor = next(e for e in json.loads(info.stdout)["exports"] if e["name"] == "orders")["cursor"]
            seen.append(cursor or "")
    finally:
        stop.write_text("1")
        proc.communicate(timeout=60)
    assert proc.returncode == 0
    last = json.loads(out.read_text())["last"]
    assert seen == sorted(seen) and seen[-1] <= last and seen[-1] > seen[0], (seen, last)


def test_a_read_counts_its_own_lock_as_its_own_process_and_another_s_as_a_holder(tmp_path: Path) -> None:
    config, db = history_state(tmp_path)
    with Context(config, None, {}).backend().reading():
        assert lock_holders(db) == {os.getpid()}, "the read's own lock is this process's, not a stranger's"
        other = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            from statetool.backends.proclocks import lock_holders
            from pathlib import Path
            print(sorted(lock_holders(Path({str(db)!r}))))
        """)], capture_output=True, text=True, check=True)
        assert other.stdout.strip() == "[-1]", other
    assert lock_holders(db) == set()


def hold_exclusive(db: Path, seconds: float, released: Path) -> subprocess.Popen[str]:
    """A process holding a write lock on SQLite's SHARED bytes of ``db`` (what a closing
    writer's EXCLUSIVE lock is while it checkpoints) for ``seconds``; it writes the time it
    released it (``time.time()``) to ``released``. Returns once the lock is held."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, struct, time
        fd = os.open({str(db)!r}, os.O_RDWR)
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 0x40000002, 510, 0))
        print("held", flush=True)
        time.sleep({seconds})
        os.close(fd)
        open({str(released)!r}, "w").write(repr(time.time()))
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.parametrize(("lock_wait", "held"), [("0", 0.8), ("5", 2.0)])
def test_a_read_waits_for_a_closing_writer_s_checkpoint_at_least_a_second(tmp_path: Path, lock_wait: str,
                                                                         held: float) -> None:
    config, db = history_state(tmp_path)
    released = tmp_path / "released"
    holder = hold_exclusive(db, held, released)
    info = run_cli("-c", str(config), "--lock-wait", lock_wait, "info", "--json")
    finished = time.time()
    holder.wait(timeout=30)
    assert info.returncode == 0, describe(info)
    assert finished > float(released.read_text()), "the read went on while SQLite's EXCLUSIVE lock was held"


def test_a_checkpoint_lock_held_past_the_wait_is_run_in_progress_and_nothing_is_created(tmp_path: Path) -> None:
    config, db = history_state(tmp_path)
    before = sorted(p.name for p in db.parent.iterdir())
    holder = hold_exclusive(db, 4.0, tmp_path / "released")
    info = run_cli("-c", str(config), "--json-errors", "--lock-wait", "0", "info", "--json")
    holder.wait(timeout=30)
    assert info.returncode == 2, describe(info)
    assert error_object(info)["code"] == "RIVET_STATE_RUN_IN_PROGRESS", describe(info)
    assert sorted(p.name for p in db.parent.iterdir()) == before
