"""Issue 10, item 6: reads tell the truth about an interrupted write, and a refused write
never rolls the journal back.

Every hot journal here is real: a writer (the runtime API's ``StateStore`` or a plain
SQLite connection) is killed with SIGKILL in the middle of a transaction that spilled pages
into the database. ``statetool migrate`` killed at two instants shows the opposite: it
never writes the state before its switch, so it leaves no hot journal at all. ``tree_digest`` of the whole temporary
tree before and after proves that nothing changed beside the state.
"""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from support import CliRun, describe, error_object, run_cli, tree_digest, write_config
from statetool.example import build_legacy_state
from statetool.runtime import StateStore

STATE = ".rivet_state.db"
JOURNAL_MAGIC = bytes.fromhex("d9d505f920a163d7")
OLD_CURSOR = "2026-11-01T00:00:00.000000Z"
NEW_CURSOR = "2026-12-31T00:00:00.000000Z"
EXPORTS = textwrap.dedent("""\
    exports:
      - name: orders
        mode: incremental
      - name: order_lines
        mode: chunked
    """)
SOURCE_A = "postgresql://reader@db.internal:5432/sales"
SOURCE_B = "postgresql://reader@other.internal:5432/billing"


def listing(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def kill_in_transaction(code: str) -> None:
    """Run ``code`` (which prints ``in transaction`` inside an open write transaction) in a
    process and SIGKILL it there."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "in transaction"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


class Interrupted:
    """A state at head in rollback-journal mode in a declared directory, recording source A,
    with ``orders`` at :data:`OLD_CURSOR` and one finished run, then left with the hot
    journal of a ``StateStore`` transaction (new cursor, thousands of runs) killed before
    its commit."""

    def __init__(self, root: Path, *, copy_of: Path | None = None) -> None:
        """The layout in ``root``: new (configs written, empty state directory), or a copy
        of the tree an earlier one left in ``copy_of``."""
        self.root = root
        self.state_dir = root / "state"
        self.config, self.other = root / "pipeline" / "rivet.yaml", root / "other" / "rivet.yaml"
        if copy_of is not None:
            shutil.copytree(copy_of, root, symlinks=True, dirs_exist_ok=True)
        else:
            self.state_dir.mkdir()
            self.config = write_config(root / "pipeline", source_url=SOURCE_A, exports=EXPORTS)
            self.other = write_config(root / "other", source_url=SOURCE_B, exports=EXPORTS)
        self.env = {"RIVET_STATE_URL": f"sqlite:{self.state_dir}"}
        self.db = self.state_dir / STATE

    def build(self, *, killed_by_runtime: bool = True) -> Interrupted:
        store = StateStore.open(self.config, env=self.env, create=True)
        with store.transaction() as tx:
            run_id = tx.start_run("orders", "incremental")
            tx.commit_cursor("orders", "incremental", OLD_CURSOR)
            tx.finish_run(run_id, "succeeded", rows=10, files=1)
        with sqlite3.connect(self.db, isolation_level=None) as conn:
            assert conn.execute("PRAGMA journal_mode = DELETE").fetchone()[0] == "delete"
        conn.close()
        if killed_by_runtime:
            self.kill_runtime_writer()
        return self

    def kill_runtime_writer(self) -> None:
        before = self.db.read_bytes()
        kill_in_transaction(textwrap.dedent(f"""
            from pathlib import Path
            from statetool.runtime import StateStore
            store = StateStore.open(Path({str(self.config)!r}), env={self.env!r})
            with store.transaction() as tx:
                tx.commit_cursor("orders", "incremental", {NEW_CURSOR!r})
                # A page cache of 16 pages, which 2,000 runs overflow many times: SQLite spills
                # pages into the file before the commit, as a long run's transaction does.
                tx.conn.exec_driver_sql("PRAGMA cache_size = 16")
                for _ in range(2000):
                    tx.start_run("order_lines", "chunked")
                print("in transaction", flush=True)
                import time
                time.sleep(300)
        """))
        self.assert_hot(before)

    def kill_raw_writer(self, sql: str) -> None:
        before = self.db.read_bytes()
        kill_in_transaction(textwrap.dedent(f"""
            import sqlite3, time
            conn = sqlite3.connect({str(self.db)!r}, isolation_level=None)
            conn.execute("PRAGMA cache_size = 1")
            conn.execute("BEGIN IMMEDIATE")
            conn.execute({sql!r})
            print("in transaction", flush=True)
            time.sleep(300)
        """))
        self.assert_hot(before)

    def assert_hot(self, before: bytes) -> None:
        journal = Path(f"{self.db}-journal")
        assert journal.is_file() and journal.read_bytes()[:8] == JOURNAL_MAGIC, listing(self.state_dir)
        assert self.db.read_bytes() != before, "the killed writer should have spilled pages into the state"

    def cli(self, *args: str, config: Path | None = None) -> CliRun:
        return run_cli("-c", str(config or self.config), *args, env=self.env)


@pytest.fixture(scope="module")
def interrupted_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tree of one :class:`Interrupted` state, built once per module (killing a
    writer mid-transaction takes seconds): tests get copies."""
    root = tmp_path_factory.mktemp("interrupted")
    Interrupted(root).build()
    return root


@pytest.fixture
def interrupted(interrupted_template: Path, tmp_path: Path) -> Interrupted:
    """A copy of the module's interrupted state of its own (hot journal included)."""
    it = Interrupted(tmp_path, copy_of=interrupted_template)
    assert Path(f"{it.db}-journal").is_file(), listing(it.state_dir)
    return it


READS = {
    "info": ("info", "--json"),
    "check": ("check", "--json"),
    "doctor": ("doctor", "--json"),
    "exports list": ("exports", "list", "--json"),
    "exports show": ("exports", "show", "orders", "--json"),
    "identity show": ("identity", "show", "--json"),
    "leases list": ("leases", "list", "--json"),
    "migrate --dry-run": ("migrate", "--dry-run", "--json"),
}


def _hot_journal_warned(name: str, doc: dict) -> bool:
    if name == "check":
        return any(c["code"] == "RIVET_STATE_HOT_JOURNAL" and c["status"] == "warn" for c in doc["checks"])
    if name == "doctor":
        return any(r["code"] == "RIVET_STATE_HOT_JOURNAL" for r in doc["state"]["reasons"])
    return any(w["code"] == "RIVET_STATE_HOT_JOURNAL" for w in doc.get("warnings", []))


@pytest.mark.parametrize("name", list(READS))
def test_every_read_command_reads_the_state_as_before_the_interrupted_write(interrupted: Interrupted,
                                                                             name: str) -> None:
    before, files = tree_digest(interrupted.root), listing(interrupted.root)
    proc = interrupted.cli(*READS[name])
    # doctor exits 5 because order_lines never finished a run: a first run, as before the killed write
    assert proc.returncode == (5 if name == "doctor" else 0), describe(proc)
    assert "Traceback" not in proc.stderr, describe(proc)
    doc = json.loads(proc.stdout)
    if name not in ("leases list", "migrate --dry-run"):  # these two read no export progress
        assert _hot_journal_warned(name, doc), describe(proc)
    if name in ("info", "exports list"):
        orders = next(e for e in doc["exports"] if e["name"] == "orders")
        lines = next(e for e in doc["exports"] if e["name"] == "order_lines")
        assert (orders["cursor"], orders["runs_total"], lines["runs_total"]) == (OLD_CURSOR, 1, 0), describe(proc)
    if name == "exports show":
        assert doc["export"]["cursor"] == OLD_CURSOR and len(doc["recent_runs"]) == 1, describe(proc)
    if name == "doctor":
        orders = next(e for e in doc["exports"] if e["name"] == "orders")
        assert (orders["verdict"], orders["resumes_from"]) == ("resumes", f"cursor '{OLD_CURSOR}'"), describe(proc)
    if name == "identity show":
        assert doc["recorded"] == "postgresql://db.internal:5432/sales", describe(proc)
    assert listing(interrupted.root) == files, describe(proc)
    assert tree_digest(interrupted.root) == before, describe(proc)


def test_human_output_names_the_interrupted_write_with_its_action(interrupted: Interrupted) -> None:
    before = tree_digest(interrupted.root)
    proc = interrupted.cli("info")
    assert proc.returncode == 0, describe(proc)
    assert "RIVET_STATE_HOT_JOURNAL" in proc.stderr and "rolls it back in place" in proc.stderr, describe(proc)
    strict = interrupted.cli("check", "--strict", "--json")
    assert strict.returncode == 5, describe(strict)
    assert tree_digest(interrupted.root) == before


def test_a_write_whose_preflight_passes_rolls_the_journal_back_in_place(interrupted: Interrupted) -> None:
    proc = interrupted.cli("exports", "set-cursor", "orders", "2026-11-15T00:00:00.000000Z", "--json")
    assert proc.returncode == 0, describe(proc)
    assert not Path(f"{interrupted.db}-journal").exists(), describe(proc)
    backups = sorted(interrupted.state_dir.glob(f"{STATE}.backup-*"))
    assert len(backups) == 1 and not list(interrupted.state_dir.glob("*.tmp*")), listing(interrupted.state_dir)
    # The backup holds the state as it was before the interrupted write, not the half-written one.
    with sqlite3.connect(f"file:{backups[0]}?mode=ro", uri=True) as conn:
        assert conn.execute("SELECT cursor_value FROM rivet_exports WHERE export_name = 'orders'").fetchone() == \
            (OLD_CURSOR,)
        assert conn.execute("SELECT count(*) FROM rivet_runs").fetchone() == (1,)
    conn.close()
    check = interrupted.cli("check", "--json")
    assert check.returncode == 0, describe(check)
    assert not any(c["code"] == "RIVET_STATE_HOT_JOURNAL" for c in json.loads(check.stdout)["checks"])


#: Every write, against a state of another source (``ELSEWHERE`` stands for a new directory).
FOREIGN_WRITES = {
    "migrate": ("migrate",),
    "exports set-cursor": ("exports", "set-cursor", "orders", "2026-11-15T00:00:00.000000Z"),
    "exports reset": ("exports", "reset", "orders"),
    "identity adopt": ("identity", "adopt"),
    "identity rekey": ("identity", "rekey", "--old", "postgresql://nobody.internal:5432/x", "--new", SOURCE_B),
    "relocate": ("relocate", "--to", "ELSEWHERE", "--create-dir"),
    "relocate --dry-run": ("relocate", "--to", "ELSEWHERE", "--create-dir", "--dry-run"),
    "transfer": ("transfer", "--to", "postgresql://u@127.0.0.1:1/db"),
    "leases release": ("leases", "release", "chunk-run:orders", "--reason", "test"),
}


def _args(root: Path, command: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(str(root / "elsewhere") if a == "ELSEWHERE" else a for a in command)


@pytest.mark.parametrize("name", list(FOREIGN_WRITES))
def test_a_foreign_hot_journal_state_is_refused_by_every_write_byte_identical(interrupted: Interrupted,
                                                                              name: str) -> None:
    before, files = tree_digest(interrupted.root), listing(interrupted.root)
    proc = interrupted.cli("--json-errors", *_args(interrupted.root, FOREIGN_WRITES[name]), config=interrupted.other)
    assert proc.returncode == 5, describe(proc)
    assert error_object(proc)["code"] in ("RIVET_STATE_FOREIGN", "RIVET_STATE_IDENTITY_MISMATCH"), describe(proc)
    assert Path(f"{interrupted.db}-journal").exists(), describe(proc)
    assert listing(interrupted.root) == files, describe(proc)
    assert tree_digest(interrupted.root) == before, describe(proc)


@pytest.mark.parametrize("command", [("migrate",), ("exports", "set-cursor", "orders", "2026-11-15T00:00:00.000000Z"),
                                     ("identity", "adopt"), ("relocate", "--to", "ELSEWHERE", "--create-dir")])
def test_an_unknown_newer_revision_with_a_hot_journal_is_refused_byte_identical(tmp_path: Path,
                                                                               command: tuple[str, ...]) -> None:
    it = Interrupted(tmp_path).build(killed_by_runtime=False)
    with sqlite3.connect(it.db, isolation_level=None) as conn:
        conn.execute("UPDATE rivet_state_version SET version_num = '9999_future'")
    conn.close()
    it.kill_raw_writer("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 3000) "
                       "INSERT INTO rivet_runs (run_id, export_name, mode, status, started_at, error) "
                       "SELECT 'killed-' || i, 'orders', 'incremental', 'failed', '2026-12-01', hex(randomblob(500)) "
                       "FROM n")
    before, files = tree_digest(tmp_path), listing(tmp_path)
    proc = it.cli("--json-errors", *_args(tmp_path, command))
    assert proc.returncode == 3, describe(proc)
    assert error_object(proc)["code"] == "RIVET_STATE_SCHEMA_NEWER", describe(proc)
    assert listing(tmp_path) == files, describe(proc)
    assert tree_digest(tmp_path) == before, describe(proc)


def _magic(journal: Path) -> bytes:
    try:
        with open(journal, "rb") as fh:
            return fh.read(8)
    except FileNotFoundError:
        return b""


def _kill_migrate_when(config: Path, seen: callable) -> None:  # type: ignore[valid-type]
    """Start ``statetool migrate`` and SIGKILL it as soon as ``seen()`` is true."""
    proc = subprocess.Popen([sys.executable, "-m", "statetool", "-c", str(config), "migrate"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not seen() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        assert proc.poll() is None, "migrate ended before the instant it was to be killed at"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


def _copy_grown(directory: Path, size: int) -> bool:
    """A migration's copy (inside its private ``….backup-….tmp`` directory) is larger than
    ``size``: the rebuild of a table is under way in it."""
    return any(p.stat().st_size > size for p in directory.glob(f"{STATE}.backup-*.tmp/*.db") if p.exists())


def test_a_killed_migrate_is_read_as_before_and_its_rerun_leaves_nothing_behind(tmp_path: Path) -> None:
    """A SQLite migration builds the new revision in a copy and never writes the state
    itself before the switch: killed while copying or while rebuilding a table in the copy,
    it leaves the state as it was (no hot journal at all) and a private directory that
    every read leaves alone and the next write removes."""
    config = write_config(tmp_path / "pipeline", exports=EXPORTS)
    db = config.parent / STATE
    build_legacy_state(db, [("orders", "incremental"), ("order_lines", "chunked")], runs=60000)
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        runs = conn.execute("SELECT count(*) FROM rivet_runs").fetchone()[0]
    conn.close()
    original = db.read_bytes()
    # First kill: while the copy is being made (its private directory exists).
    _kill_migrate_when(config, lambda: bool(list(config.parent.glob(f"{STATE}.backup-*.tmp"))))
    assert list(config.parent.glob(f"{STATE}.backup-*.tmp")), sorted(p.name for p in config.parent.iterdir())
    # Second kill: while rivet_runs is rebuilt in the copy (the copy grew past the state).
    _kill_migrate_when(config, lambda: _copy_grown(config.parent, len(original)))
    assert db.read_bytes() == original, "a killed migration wrote into the state"
    assert not Path(f"{db}-journal").exists()
    before = tree_digest(tmp_path)
    info = run_cli("-c", str(config), "info", "--json")
    assert info.returncode == 0, describe(info)
    doc = json.loads(info.stdout)
    assert doc["revision"]["status"] == "legacy", describe(info)  # as before the killed migration
    assert sum(e["runs_total"] for e in doc["exports"]) == runs, describe(info)
    assert "RIVET_STATE_HOT_JOURNAL" not in [w["code"] for w in doc["warnings"]], describe(info)
    assert tree_digest(tmp_path) == before, describe(info)

    rerun = run_cli("-c", str(config), "migrate", "--json")
    assert rerun.returncode == 0, describe(rerun)
    leftovers = [p.name for p in config.parent.iterdir() if ".tmp" in p.name or p.name.endswith("-journal")]
    assert leftovers == [], describe(rerun)
    check = run_cli("-c", str(config), "check", "--json")
    assert check.returncode == 0, describe(check)
