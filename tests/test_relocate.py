"""``statetool relocate --to DIR`` (issue #4; SPEC §1, §6, §9): a SQLite state moves into a
declared directory with every row and every CDC checkpoint byte; the old place refuses
every later use (statetool, the runtime API, and an older release that knows nothing of
relocations); an interruption at any instant leaves the source complete and usable and a
re-run converges; a full target, a target that holds something, and a writer with
uncheckpointed WAL pages lose nothing.

Everything is real: SQLite files in tmp_path, the CLI in subprocesses, SIGKILL through
tests/support/crash_driver.py (a process that runs relocate with a ``Context.on_step``
that kills it at the named point) or by timing, a small tmpfs for the full disk. States are built once per module (the legacy builder, then
``statetool migrate``, then the runtime API) and copied into each test.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import stat
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from support import describe, error_object, fork_cli, process_env, run_cli, run_cli_forked, tree_digest, write_config
from statetool.backends.tombstone import read_tombstone
from statetool.errors import StateError
from statetool.example import build_legacy_state
from statetool.example import main as build_example
from statetool.operations.context import Context
from statetool.operations.preflight import run_preflight
from statetool.runtime import StateStore
from statetool.schema import IN_FLIGHT_REVISION
from support.crash_driver import run_killed_at

STATE = ".rivet_state.db"
KEPT = re.compile(r"^\.rivet_state\.db\.relocated-\d{8}T\d{6}Z$")
CHECKPOINT = Path("checkpoints") / "order_events.json"
LEASES_DIR = ".rivet_state.leases"
#: Every named crash point of relocate.py, in the order a relocation passes them.
NAMED_POINTS = ("leases", "checkpointed", "locked", "digested", "copied", "checkpoint-copied", "audited",
                "linked", "kept", "tombstoned", "swapped", "finished")
#: Pages between two progress reports of the copy (statetool/backends/sqlite_pages.py, the
#: steps the backup API was driven in before): copy-page-<n> fires at multiples of it.
PAGES_PER_STEP = 4096


# --------------------------------------------------------------------------------------
# Reading states, and what a CLI run said
# --------------------------------------------------------------------------------------

Dump = dict[str, list[tuple[Any, ...]]]


def dump(path: Path) -> Dump:
    """Every row of every table of the SQLite state at ``path`` (its ``-wal`` included),
    read from a private copy so nothing is created beside the state."""
    with tempfile.TemporaryDirectory(prefix="relocate-dump-") as tmp:
        copy = Path(tmp) / "state.db"
        shutil.copyfile(path, copy)
        if Path(f"{path}-wal").exists():
            shutil.copyfile(f"{path}-wal", f"{copy}-wal")
        db = sqlite3.connect(copy)
        try:
            tables = [r[0] for r in db.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name")]
            out = {}
            for table in tables:
                width = len(db.execute(f'PRAGMA table_info("{table}")').fetchall())
                order = ", ".join(str(i) for i in range(1, width + 1))
                out[table] = db.execute(f'SELECT * FROM "{table}" ORDER BY {order}').fetchall()
            return out
        finally:
            db.close()


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _wal_frames(path: Path) -> bool:
    wal = Path(f"{path}-wal")
    return wal.exists() and wal.stat().st_size > 0


def _sql_differences(path: Path, reference: Path, skip_relocation_rows: bool) -> list[str]:
    """Tables whose rows differ between two SQLite files, compared inside SQLite (EXCEPT
    both ways; every state table has a primary key), both opened immutable: nothing is
    created beside either. Only for files without -wal frames."""
    db = sqlite3.connect(f"file:{quote(str(path))}?immutable=1", uri=True)
    try:
        db.execute("ATTACH DATABASE ? AS ref", (f"file:{quote(str(reference))}?immutable=1",))
        names = {schema: {r[0] for r in db.execute(
            f"SELECT name FROM {schema}.sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")}
            for schema in ("main", "ref")}
        if names["main"] != names["ref"]:
            return [f"tables {sorted(names['main'] ^ names['ref'])}"]
        differ = []
        for table in sorted(names["main"]):
            where = " WHERE action != 'relocate'" if table == "rivet_audit" and skip_relocation_rows else ""
            mine, theirs = f'SELECT * FROM main."{table}"{where}', f'SELECT * FROM ref."{table}"'
            extra = db.execute(f"SELECT count(*) FROM ({mine} EXCEPT {theirs})").fetchone()[0]
            missing = db.execute(f"SELECT count(*) FROM ({theirs} EXCEPT {mine})").fetchone()[0]
            if extra or missing:
                differ.append(f"{table}: {missing} rows missing, {extra} rows extra")
        return differ
    finally:
        db.close()


def same_rows(path: Path, template: Template, *, relocated: bool = False) -> bool:
    """True when the SQLite file at ``path`` holds exactly the template's rows (with
    ``relocated``: plus relocation audit rows). Cheapest proof first: byte-identical to the
    template's file; then a comparison inside SQLite; else row for row in Python."""
    if template.reference is not None and not _wal_frames(path):
        if not relocated and sha256_of(path) == template.state_sha:
            return True
        return _sql_differences(path, template.reference, relocated) == []
    d = dump(path)
    return (without_relocation_rows(d) if relocated else d) == template.rows


def relocation_details(path: Path) -> list[dict[str, Any]]:
    """The details of the ``relocate`` audit rows of the state at ``path``, oldest first."""
    db = sqlite3.connect(f"file:{quote(str(path))}?immutable=1", uri=True)
    try:
        return [json.loads(r[0]) for r in db.execute(
            "SELECT detail FROM rivet_audit WHERE action = 'relocate' ORDER BY id")]
    finally:
        db.close()


def relocation_rows(d: Dump) -> list[dict[str, Any]]:
    """The ``relocate`` audit rows of a dump, their detail parsed (columns: id, at, actor,
    command, action, detail)."""
    return [json.loads(r[5]) for r in d.get("rivet_audit", []) if r[4] == "relocate"]


def without_relocation_rows(d: Dump) -> Dump:
    out = dict(d)
    out["rivet_audit"] = [r for r in d["rivet_audit"] if r[4] != "relocate"]
    return out


def row_total(d: Dump) -> int:
    return sum(len(rows) for rows in d.values())


def assert_refused(proc: subprocess.CompletedProcess[str], code: str, exit_code: int) -> dict[str, Any]:
    assert proc.returncode == exit_code, describe(proc)
    err = error_object(proc)
    assert err["code"] == code, describe(proc)
    assert "Traceback" not in proc.stderr, describe(proc)
    return err


def without_leases(digest: dict[str, str]) -> dict[str, str]:
    """A tree digest without the lease sidecars (``.rivet_state.leases/``: taking a run lease
    creates its sidecar file once, as every run does, and it holds no state) and without a
    ``-shm`` (the WAL index: shared memory that every reader, SQLite's own read-only
    readers included, writes its read marks into; rebuilt from the ``-wal`` by any opener)."""
    return {k: v for k, v in digest.items() if not k.startswith(LEASES_DIR + "/") and not k.endswith("-shm")}


def preflight_failures(config: Path, state_url: str | None = None) -> list[str]:
    """The failing pre-flight rows of the state the config resolves to (library, read-only)."""
    pf = run_preflight(Context(config, state_url, {}, 0.0))
    assert not pf.failures or pf.failures[0].code
    return [f"{c.id}: {c.code}: {c.message}" for c in pf.failures]


# --------------------------------------------------------------------------------------
# States, built once per module and copied into each test
# --------------------------------------------------------------------------------------

@dataclass
class Template:
    """A pipeline directory (``rivet.yaml``, ``.rivet_state.db`` at head, the CDC
    checkpoint) and what it holds."""

    directory: Path
    rows: Dump
    checkpoint: bytes
    state_sha: str = ""  # sha256 of the template's state file; "" when the rows are given otherwise

    @property
    def reference(self) -> Path | None:
        """The template's own state file (never written after the fixture built it), or
        None when ``rows`` are not that file's rows."""
        return self.directory / STATE if self.state_sha else None

    def copy_to(self, base: Path) -> Path:
        """Copy the pipeline into ``base/pipeline``; returns the config path."""
        pipeline = base / "pipeline"
        shutil.copytree(self.directory, pipeline)
        return pipeline / "rivet.yaml"


def _migrate(config: Path) -> None:
    proc = run_cli("-c", str(config), "migrate", timeout=300)
    assert proc.returncode == 0, describe(proc)
    for backup in config.parent.glob(f"{STATE}.backup-*"):
        backup.unlink()  # the template stays small; the migration test owns backups


def _runtime_writes(config: Path, runs: int) -> None:
    """What a pipeline of this release adds: runs, cursors, chunk checkpoints (runtime API)."""
    store = StateStore.open(config, env={}, create=True)
    with store.transaction() as tx:
        for i in range(runs):
            run_id = tx.start_run("orders", "incremental", started_at=f"2026-06-01T00:{i // 60 % 60:02d}:{i % 60:02d}Z")
            tx.commit_cursor("orders", "incremental", f"2026-06-01T{i // 3600:02d}:{i // 60 % 60:02d}:{i % 60:02d}Z")
            tx.finish_run(run_id, "succeeded", rows=i, files=1, bytes_read=1000 * i)
        run_id = tx.start_run("order_lines", "chunked")
        for k in range(25):
            tx.record_chunk("order_lines", run_id, k, str(k * 1000), str((k + 1) * 1000), "done", rows=1000)


def _with_checkpoint(config: Path, template_dir: Path) -> bytes:
    checkpoint = template_dir / CHECKPOINT
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    # A real binlog position plus the GTID set: distinctive bytes to compare after the move.
    checkpoint.write_text(json.dumps({"file": "mysql-bin.000042", "pos": 91_234,
                                      "gtid_set": "3E11FA47-71CA-11E1-9E33-C80AA9429562:1-5812"}) + "\n")
    return checkpoint.read_bytes()


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> Template:
    """1,000 exports (1,000 cursors and chunk sets), 20,000 runs of history: an old rivet's
    legacy state upgraded by ``statetool migrate``, then used by the runtime API.
    Rollback-journal mode, as the legacy state was."""
    directory = tmp_path_factory.mktemp("history") / "pipeline"
    exports = "".join(f"  - name: t{i:04d}\n    mode: {'chunked' if i % 10 == 3 else 'incremental'}\n"
                      for i in range(998))
    exports += ("  - name: orders\n    mode: incremental\n  - name: order_lines\n    mode: chunked\n"
                "  - name: order_events\n    mode: cdc\n    cdc:\n      engine: mysql\n"
                f"      checkpoint: {CHECKPOINT}\n")
    config = write_config(directory, exports="exports:\n" + exports)
    build_example(["--config", str(config), "--runs", "20000"])
    _migrate(config)
    _runtime_writes(config, 500)
    checkpoint = _with_checkpoint(config, directory)
    rows = dump(directory / STATE)
    cursors = [r for r in rows["rivet_exports"] if r[2] is not None]
    assert len(rows["rivet_runs"]) == 20_501 and len(cursors) == 899  # every incremental export has one
    return Template(directory, rows, checkpoint, sha256_of(directory / STATE))


@pytest.fixture(scope="module")
def paged(tmp_path_factory: pytest.TempPathFactory) -> Template:
    """A WAL state of this release with ~19,000 pages: 48,000 runs of a legacy state
    rebuilt with 512-byte pages (as SQLite allows; older SQLite releases defaulted to 1 KiB),
    upgraded, switched to WAL, then written by the runtime API. So many pages make the
    backup take five steps of 4,096 pages: five distinct copy-page-<n> crash points, the
    last one a partial step."""
    directory = tmp_path_factory.mktemp("paged") / "pipeline"
    config = write_config(directory)
    path = directory / STATE
    build_legacy_state(path, [("orders", "incremental"), ("order_lines", "chunked"), ("order_events", "cdc")],
                       48_000)
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA page_size = 512")
    db.execute("VACUUM")
    db.close()
    _migrate(config)
    db = sqlite3.connect(path, isolation_level=None)
    assert db.execute("PRAGMA journal_mode = WAL").fetchone()[0] == "wal"
    db.close()
    _runtime_writes(config, 100)
    checkpoint = _with_checkpoint(config, directory)
    assert not Path(f"{path}-wal").exists()  # the last connection checkpointed and removed it
    return Template(directory, dump(path), checkpoint, sha256_of(path))


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Template:
    """A state created by this release's runtime (WAL) with 300 runs and a chunked run."""
    directory = tmp_path_factory.mktemp("small") / "pipeline"
    config = write_config(directory)
    _runtime_writes(config, 300)
    checkpoint = _with_checkpoint(config, directory)
    return Template(directory, dump(directory / STATE), checkpoint, sha256_of(directory / STATE))


def page_count(path: Path) -> int:
    header = path.read_bytes()[:100]
    return int.from_bytes(header[28:32], "big")


def copy_points(path: Path) -> list[str]:
    """Every copy-page-<n> point of a backup of the file at ``path``: after each full step
    of 4,096 pages, and after the last (partial) step."""
    total = page_count(path)
    done = list(range(PAGES_PER_STEP, total, PAGES_PER_STEP)) + [total]
    return [f"copy-page-{n}" for n in done]


# --------------------------------------------------------------------------------------
# What a finished relocation looks like
# --------------------------------------------------------------------------------------

def assert_relocated(config: Path, target: Path, template: Template) -> None:
    """The state and its checkpoint are at ``target``, complete; the old place holds a
    tombstone naming it and exactly one kept file with the old bytes; nothing temporary
    is left on either side."""
    old_dir = config.parent
    assert same_rows(target / STATE, template, relocated=True), "a row differs between the source and the target"
    rows = relocation_details(target / STATE)
    assert len(rows) == 1, f"expected one relocation audit row, found {rows}"
    assert rows[0]["from"] == str(old_dir / STATE) and rows[0]["to"] == str(target / STATE)
    assert (target / CHECKPOINT).read_bytes() == template.checkpoint
    tomb = read_tombstone(old_dir / STATE)
    assert tomb is not None, f"no tombstone at {old_dir / STATE}"
    assert tomb["to"] == str(target / STATE) and tomb["state_url"] == f"sqlite:{target}"
    kept = sorted(p.name for p in old_dir.iterdir() if p.name.startswith(f"{STATE}.relocated-"))
    assert len(kept) == 1 and KEPT.match(kept[0]), f"kept files: {kept}"
    assert tomb["kept_as"] == str(old_dir / kept[0])
    assert same_rows(old_dir / kept[0], template), "the kept bytes are not the source's"
    leftovers = [str(p) for d in (old_dir, target) for p in d.rglob("*")
                 if ".relocating" in p.name or ".tombstone-" in p.name or p.name.endswith(".tmp")]
    assert not leftovers, f"temporary files left: {leftovers}"
    beside_tombstone = [p.name for p in old_dir.iterdir() if p.name in (f"{STATE}-wal", f"{STATE}-shm",
                                                                         f"{STATE}-journal")]
    assert not beside_tombstone, f"-wal/-shm/-journal left beside the tombstone: {beside_tombstone}"
    assert preflight_failures(config, f"sqlite:{target}") == []


def _version(path: Path) -> str:
    db = sqlite3.connect(f"file:{quote(str(path))}?immutable=1", uri=True)
    try:
        return str(db.execute("SELECT version_num FROM rivet_state_version").fetchone()[0])
    finally:
        db.close()


def same_rows_in_flight(path: Path, template: Template) -> bool:
    """:func:`same_rows` (``relocated``) for a target that may still be in flight: its
    version table holds the in-flight mark instead of head, every other row compared."""
    if _version(path) != IN_FLIGHT_REVISION:
        return same_rows(path, template, relocated=True)
    with tempfile.TemporaryDirectory(prefix="relocate-in-flight-") as tmp:
        copy = Path(tmp) / STATE
        shutil.copyfile(path, copy)
        db = sqlite3.connect(copy)
        with db:
            db.execute("UPDATE rivet_state_version SET version_num = ?", (_version(template.directory / STATE),))
        db.close()
        return same_rows(copy, template, relocated=True)


def assert_source_intact_or_relocated(config: Path, target: Path, template: Template, when: str) -> None:
    """After an interruption: either the source is still the state (at head, every row,
    pre-flight clean) and a target linked before the kill is in flight (no one opens it),
    or the source is retired (the tombstone only ever replaces the source once the target
    is linked in place, verified)."""
    source = config.parent / STATE
    tomb = read_tombstone(source)
    if tomb is not None:
        assert same_rows_in_flight(target / STATE, template), f"{when}: tombstone, but the target misses rows"
        assert (target / CHECKPOINT).read_bytes() == template.checkpoint, f"{when}: checkpoint"
        return
    assert same_rows(source, template), f"{when}: the source lost or changed rows"
    assert preflight_failures(config) == [], f"{when}: the source does not pass its pre-flight"
    assert (config.parent / CHECKPOINT).read_bytes() == template.checkpoint, f"{when}: source checkpoint"
    if (target / STATE).exists():  # linked before the kill: complete, verified, this source's, in flight
        assert _version(target / STATE) == IN_FLIGHT_REVISION, f"{when}: a linked target is live beside its source"
        assert same_rows_in_flight(target / STATE, template), f"{when}: a linked target misses rows"
        assert [f.split(": ")[1] for f in preflight_failures(config, f"sqlite:{target}")] == [
            "RIVET_STATE_MOVE_IN_FLIGHT"], f"{when}: the target in flight opens"


# --------------------------------------------------------------------------------------
# 1. A big relocation, and the old place afterwards
# --------------------------------------------------------------------------------------

def test_relocation_moves_every_row_and_checkpoint_byte_and_the_old_place_refuses_every_use(
        tmp_path: Path, history: Template) -> None:
    config = history.copy_to(tmp_path)
    old = config.parent / STATE
    target = tmp_path / "volume" / "rivet-state"
    target.mkdir(parents=True)

    proc = run_cli("-c", str(config), "--json", "relocate", "--to", str(target), timeout=300)
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    assert doc["done"] and doc["state_url"] == f"sqlite:{target}"
    assert doc["tables"]["rivet_runs"] == 20_501
    assert doc["tables"]["rivet_exports"] == len(history.rows["rivet_exports"])
    assert [(m["export"], m["present"]) for m in doc["checkpoints"]] == [("order_events", True)]
    assert_relocated(config, target, history)
    assert row_total(dump(target / STATE)) == row_total(history.rows) + 1  # + the relocation audit row

    tombstone = old.read_bytes()
    url = f"RIVET_STATE_URL=sqlite:{target}"
    for args in (["info"], ["check"], ["migrate"], ["exports", "reset", "orders"]):
        proc = run_cli("-c", str(config), "--json-errors", *args)
        err = assert_refused(proc, "RIVET_STATE_RELOCATED", 5)
        assert str(target / STATE) in err["message"] and url in err["message"], describe(proc)
    proc = run_cli("-c", str(config), "--json-errors", "init")  # never recreated empty there
    assert proc.returncode == 5 and error_object(proc)["code"] in ("RIVET_STATE_TARGET_NOT_EMPTY",
                                                                 "RIVET_STATE_RELOCATED"), describe(proc)
    for create in (True, False):
        with pytest.raises(StateError) as caught:
            StateStore.open(config, env={}, create=create)
        assert caught.value.code == "RIVET_STATE_RELOCATED" and url in caught.value.message
        assert caught.value.exit_code == 5

    # An older release knows nothing of tombstones: plain SQLite refuses to read or write it.
    for sql in ("SELECT count(*) FROM rivet_runs",
                "CREATE TABLE IF NOT EXISTS rivet_runs (run_id TEXT PRIMARY KEY)"):
        db = sqlite3.connect(old)
        try:
            with pytest.raises(sqlite3.DatabaseError, match="file is not a database"):
                db.execute(sql)
        finally:
            db.close()
    assert old.read_bytes() == tombstone, "a refused use changed the tombstone"
    assert not [p for p in old.parent.iterdir() if p.name in (f"{STATE}-wal", f"{STATE}-shm", f"{STATE}-journal")]

    # The new place is the state: a run there continues from the same cursors.
    proc = run_cli("-c", str(config), "--json", "info", env={"RIVET_STATE_URL": f"sqlite:{target}"})
    assert proc.returncode == 0, describe(proc)
    # Relocating again to the same place is a no-op that says where the state is.
    proc = run_cli("-c", str(config), "--json", "relocate", "--to", str(target))
    assert proc.returncode == 0 and json.loads(proc.stdout)["done"], describe(proc)
    assert old.read_bytes() == tombstone


# --------------------------------------------------------------------------------------
# 2. SIGKILL at every point, then a re-run
# --------------------------------------------------------------------------------------

def _kill_scenario(template: Template, base: Path, kills: tuple[str, ...]) -> None:
    """Kill ``relocate`` at each point of ``kills`` in turn (a point ``timed`` kills it by
    timing: as soon as the backup has written the whole copy, i.e. during verification),
    checking the source after each; then re-run it to the end and check the result."""
    config = template.copy_to(base)
    target = base / "volume" / "state"
    target.mkdir(parents=True)
    args = ("-c", str(config), "relocate", "--to", str(target))
    for point in kills:
        if point == "timed":
            _kill_during_verification(config, target)
        else:
            proc = run_killed_at(point, *args)
            assert proc.returncode == -signal.SIGKILL, f"not killed at {point}: {describe(proc)}"
        assert_source_intact_or_relocated(config, target, template, f"after a kill at {point}")
    proc = run_cli_forked(*args)
    assert proc.returncode == 0, f"re-run after kills at {kills}: {describe(proc)}"
    assert_relocated(config, target, template)
    shutil.rmtree(base)  # 15 MB per scenario


def _kill_during_verification(config: Path, target: Path) -> None:
    size = (config.parent / STATE).stat().st_size
    copy = target / f"{STATE}.relocating"
    proc = fork_cli("-c", str(config), "relocate", "--to", str(target), "--full-verify", env=process_env(),
                    stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if copy.stat().st_size >= size:
                break
        except FileNotFoundError:
            pass
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"relocate ended before the timed kill: {proc.returncode} {stderr!r}"


def test_sigkill_at_every_point_leaves_the_source_usable_and_a_rerun_converges(
        tmp_path: Path, paged: Template) -> None:
    pages = copy_points(paged.directory / STATE)
    assert len(pages) >= 5, pages
    scenarios: list[tuple[str, ...]] = [(p,) for p in NAMED_POINTS] + [(p,) for p in pages] + [("timed",)]
    # A resumed relocation killed again: the second attempt takes the other path (resume,
    # straight to the switch) or removes the first attempt's copy and starts over.
    scenarios += [("linked", "digested"), ("audited", pages[1]), ("kept", "tombstoned")]
    distinct = {p for s in scenarios for p in s}
    assert len(distinct) >= 16, sorted(distinct)
    failures: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        futures = {pool.submit(_kill_scenario, paged, tmp_path / f"s{i:02d}", s): s for i, s in enumerate(scenarios)}
        for future in concurrent.futures.as_completed(futures):
            try:
                future.result()
            except Exception as exc:  # noqa: BLE001 - every scenario is reported, not only the first
                failures.append(f"kills {futures[future]}: {exc}")
    assert not failures, "\n\n".join(failures)


# --------------------------------------------------------------------------------------
# 3. A full target filesystem
# --------------------------------------------------------------------------------------

class TmpfsMount:
    """A small tmpfs mounted for one test (root only; unmounted in teardown)."""

    def __init__(self, mountpoint: Path) -> None:
        self.mountpoint = mountpoint
        self.mounted = False

    def mount(self, size: str) -> Path:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(self.mountpoint)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"SKIPPED LOUDLY: the full-filesystem test needs to mount a tmpfs (root, CAP_SYS_ADMIN); "
                        f"mount refused: {proc.stderr.strip()}")
        self.mounted = True
        return self.mountpoint

    def resize(self, size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.mountpoint)], check=True)

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.mountpoint)], check=False)
            self.mounted = False


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[TmpfsMount]:
    mount = TmpfsMount(tmp_path / "tmpfs")
    try:
        yield mount
    finally:
        mount.unmount()


@pytest.mark.parametrize("where", ["state-copy", "checkpoint-copy"])
def test_full_target_filesystem_fails_with_disk_full_and_leaves_the_source_untouched(
        tmp_path: Path, paged: Template, small: Template, tmpfs: TmpfsMount, where: str) -> None:
    """``state-copy``: the state (9 MB) does not fit a 2 MiB tmpfs. ``checkpoint-copy``: the
    state fits, its CDC checkpoint (256 KiB here) does not: the failure comes after the state
    was copied, and that copy must go too."""
    template = paged if where == "state-copy" else small
    config = template.copy_to(tmp_path)
    if where == "checkpoint-copy":
        checkpoint = config.parent / CHECKPOINT
        checkpoint.write_text(json.dumps({"resume_token": "82" * 128 * 1024}) + "\n")
        template = dataclasses.replace(template, checkpoint=checkpoint.read_bytes())
    mnt = tmpfs.mount("2m" if where == "state-copy" else "8m")
    target = mnt / "state"
    target.mkdir()
    if where == "checkpoint-copy":
        room = (config.parent / STATE).stat().st_size + 64 * 1024
        free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
        (mnt / "other-data").write_bytes(b"\0" * (free - room))  # beside the target, not in it
    before = tree_digest(config.parent)

    proc = run_cli("-c", str(config), "--json-errors", "relocate", "--to", str(target))
    err = assert_refused(proc, "RIVET_STATE_DISK_FULL", 1)
    assert str(target) in err["message"], describe(proc)
    assert "free" in err["action"].lower(), err
    assert without_leases(tree_digest(config.parent)) == without_leases(before), "the source changed"
    assert sorted(p.name for p in target.rglob("*")) == [], "the failed relocation left files in the target"
    assert read_tombstone(config.parent / STATE) is None
    assert preflight_failures(config) == []

    # Space freed: the same command now completes.
    if where == "state-copy":
        tmpfs.resize("64m")
    else:
        (mnt / "other-data").unlink()
    proc = run_cli("-c", str(config), "relocate", "--to", str(target))
    assert proc.returncode == 0, describe(proc)
    assert_relocated(config, target, template)


# --------------------------------------------------------------------------------------
# 3a. The one pass over the source proves what the copy holds
# --------------------------------------------------------------------------------------

def _source_and_empty_target(template: Template, base: Path) -> tuple[Path, Path]:
    """A copy of ``template`` under ``base`` (its config) and an empty target directory."""
    config = template.copy_to(base)
    (base / "volume").mkdir()
    return config, base / "volume"


def _assert_refused_before_the_switch(config: Path, target: Path, template: Template, before: dict[str, str]) -> None:
    """The source as it was (leases aside), no tombstone, nothing of the move in the target."""
    assert without_leases(tree_digest(config.parent)) == without_leases(before), "the source changed"
    assert read_tombstone(config.parent / STATE) is None
    assert same_rows(config.parent / STATE, template)
    assert preflight_failures(config) == []
    assert sorted(p.name for p in target.iterdir()) == [], "the refused relocation left files in the target"


@pytest.mark.parametrize("fault, message", [
    # the copy's bytes changed after they were written (each block is hashed as it is read,
    # so only reading the copy back can see this)
    ("scribble-copy", "differs from"),
    # the source written past the write lock while it was copied (the copy holds what was
    # read, so only the source's modification time can see this)
    ("rewrite-source", "was written while it was copied"),
])
def test_a_copy_whose_bytes_differ_or_a_source_written_meanwhile_is_refused_verify_failed(
        tmp_path: Path, paged: Template, fault: str, message: str) -> None:
    config, target = _source_and_empty_target(paged, tmp_path)
    before = tree_digest(config.parent)

    proc = run_killed_at(f"{fault}@copy-page-{PAGES_PER_STEP}", "-c", str(config), "relocate", "--to", str(target))
    assert proc.returncode == 4 and proc.stderr.startswith("RIVET_STATE_VERIFY_FAILED: "), describe(proc)
    assert message in proc.stderr and "nothing was changed" in proc.stderr, describe(proc)
    if fault == "scribble-copy":
        assert "from page 2 on" in proc.stderr, describe(proc)  # the page the fault was written into
    _assert_refused_before_the_switch(config, target, paged, before)

    proc = run_cli("-c", str(config), "relocate", "--to", str(target))  # nothing wrong any more: it completes
    assert proc.returncode == 0, describe(proc)
    assert_relocated(config, target, paged)


def _break_rowid_order(path: Path) -> None:
    """Give the second row of the first leaf page of ``rivet_runs`` the rowid 127, above the
    rowids after it: a damaged page that reads fine but fails ``quick_check``."""
    db = sqlite3.connect(f"file:{quote(str(path))}?mode=ro", uri=True)
    root = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'rivet_runs'").fetchone()[0]
    page_size = db.execute("PRAGMA page_size").fetchone()[0]
    db.close()
    data = bytearray(path.read_bytes())
    page = root
    while data[(page - 1) * page_size] == 0x05:  # an interior page: down its first child
        start = (page - 1) * page_size
        cell = start + int.from_bytes(data[start + 12:start + 14], "big")
        page = int.from_bytes(data[cell:cell + 4], "big")
    start = (page - 1) * page_size
    assert data[start] == 0x0D and int.from_bytes(data[start + 3:start + 5], "big") >= 3, "not a table leaf"
    cell = start + int.from_bytes(data[start + 10:start + 12], "big")  # the second cell
    while data[cell] & 0x80:  # its payload size (a varint), then its rowid
        cell += 1
    assert data[cell + 1] < 0x80, "a rowid of one byte expected"
    data[cell + 1] = 127
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("full_verify", [False, True])
def test_a_corrupt_source_is_refused_corrupt_and_nothing_is_copied(tmp_path: Path, small: Template,
                                                                    full_verify: bool) -> None:
    config, target = _source_and_empty_target(small, tmp_path)
    state = config.parent / STATE
    _break_rowid_order(state)
    db = sqlite3.connect(f"file:{quote(str(state))}?immutable=1", uri=True)  # creates no -wal
    assert db.execute("PRAGMA quick_check").fetchall() != [("ok",)], "the damage is not one quick_check sees"
    db.close()
    before = sha256_of(state)

    proc = run_cli("-c", str(config), "--json-errors", "relocate", "--to", str(target),
                   *(("--full-verify",) if full_verify else ()))
    err = assert_refused(proc, "RIVET_STATE_CORRUPT", 4)
    assert str(state) in err["message"], describe(proc)
    assert ("integrity_check" if full_verify else "quick_check") in err["message"], describe(proc)
    assert sha256_of(state) == before, "the source changed"  # (its empty -wal goes with the writer's close)
    assert read_tombstone(state) is None
    assert sorted(p.name for p in target.iterdir()) == [], "the refused relocation left files in the target"


# --------------------------------------------------------------------------------------
# 4. Committed rows in a -wal, and processes that hold the state open
# --------------------------------------------------------------------------------------

WAL_WRITER = textwrap.dedent("""\
    import sqlite3, sys
    db = sqlite3.connect(sys.argv[1], isolation_level=None)
    db.execute("PRAGMA wal_autocheckpoint = 0")   # the frames stay in the -wal
    for i in range(int(sys.argv[2])):
        db.execute("BEGIN IMMEDIATE")
        db.execute("INSERT INTO rivet_runs (run_id, export_name, mode, status, started_at, finished_at, rows) "
                   "VALUES (?, 'orders', 'incremental', 'succeeded', '2026-07-01T00:00:00Z', "
                   "'2026-07-01T00:00:30Z', ?)", (f"wal-{i:05d}", i))
        db.execute("UPDATE rivet_exports SET cursor_value = ? WHERE export_name = 'orders'", (f"wal-{i:05d}",))
        db.execute("COMMIT")
    print("committed", flush=True)
    sys.stdin.read()                              # keep the connection open until told
""")


def _start_wal_writer(state: Path, rows: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", WAL_WRITER, str(state), str(rows)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "committed"
    wal = Path(f"{state}-wal")
    assert wal.stat().st_size > 32 * 1024, "the writer's rows are not (only) in the -wal"
    return proc


def test_rows_committed_only_in_the_wal_of_a_killed_writer_all_arrive_in_the_target(
        tmp_path: Path, small: Template) -> None:
    config = small.copy_to(tmp_path)
    state = config.parent / STATE
    writer = _start_wal_writer(state, 300)
    expected = dump(state)  # the file plus its -wal: what was committed
    assert len(expected["rivet_runs"]) == len(small.rows["rivet_runs"]) + 300
    writer.kill()  # SIGKILL: the committed frames stay in the -wal, never checkpointed
    writer.wait()
    assert Path(f"{state}-wal").stat().st_size > 32 * 1024
    target = tmp_path / "volume"
    target.mkdir()

    proc = run_cli("-c", str(config), "relocate", "--to", str(target))
    assert proc.returncode == 0, describe(proc)
    assert_relocated(config, target, Template(small.directory, expected, small.checkpoint))


def test_a_writer_holding_the_state_open_with_wal_pages_is_waited_for_and_loses_nothing(
        tmp_path: Path, small: Template) -> None:
    """An idle connection of another process (say an older release's daemon) keeps the
    state open with committed pages in the -wal. Relocating under it would let it go on
    writing into the old place after the move (SQLite detects a moved database only in
    rollback-journal mode), so relocate refuses, retryably, naming the process; nothing is
    changed. Once the process has closed the state, the re-run moves every row it wrote."""
    config = small.copy_to(tmp_path)
    state = config.parent / STATE
    writer = _start_wal_writer(state, 200)
    expected = dump(state)
    target = tmp_path / "volume"
    target.mkdir()
    try:
        before = tree_digest(config.parent)
        proc = run_cli("-c", str(config), "--json-errors", "--lock-wait", "0", "relocate", "--to", str(target))
        err = assert_refused(proc, "RIVET_STATE_RUN_IN_PROGRESS", 2)
        assert str(writer.pid) in err["message"], describe(proc)
        assert without_leases(tree_digest(config.parent)) == without_leases(before)
        assert list(target.iterdir()) == []
    finally:
        writer.communicate("", timeout=30)  # EOF: the writer closes its connection and exits
    assert writer.returncode == 0
    proc = run_cli("-c", str(config), "relocate", "--to", str(target))
    assert proc.returncode == 0, describe(proc)
    assert_relocated(config, target, Template(small.directory, expected, small.checkpoint))


def test_an_old_process_that_kept_a_rollback_journal_state_open_cannot_write_after_the_move(
        tmp_path: Path, small: Template) -> None:
    """In rollback-journal mode an idle connection holds no lock, so relocate does not wait
    for it; its next write after the move fails (SQLITE_READONLY_DBMOVED: the path names
    another file now) and lands nowhere."""
    config = small.copy_to(tmp_path)
    state = config.parent / STATE
    db = sqlite3.connect(state, isolation_level=None)
    assert db.execute("PRAGMA journal_mode = DELETE").fetchone()[0] == "delete"
    db.execute("INSERT INTO rivet_audit (at, actor, command, action, detail) "
               "VALUES ('2026-07-01T00:00:00Z', 'old@worker', 'old rivet', 'old-release-write', '{}')")
    expected = dump(state)
    target = tmp_path / "volume"
    target.mkdir()
    try:
        proc = run_cli("-c", str(config), "relocate", "--to", str(target))
        assert proc.returncode == 0, describe(proc)
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            db.execute("INSERT INTO rivet_audit (at, actor, command, action, detail) "
                       "VALUES ('2026-07-01T00:01:00Z', 'old@worker', 'old rivet', 'after-the-move', '{}')")
    finally:
        db.close()
    assert_relocated(config, target, Template(small.directory, expected, small.checkpoint))


def test_a_live_run_holding_its_lease_makes_relocate_wait_then_fail_retryable(
        tmp_path: Path, small: Template) -> None:
    config = small.copy_to(tmp_path)
    holder = subprocess.Popen([sys.executable, "-m", "statetool", "-c", str(config), "leases", "run", "--export",
                               "orders", "--", sys.executable, "-c", "import sys; print('held', flush=True); "
                               "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={k: v for k, v in os.environ.items() if k != "RIVET_STATE_URL"})
    target = tmp_path / "volume"
    target.mkdir()
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        before = tree_digest(config.parent)
        started = time.monotonic()
        proc = run_cli("-c", str(config), "--json-errors", "--lock-wait", "1", "relocate", "--to", str(target))
        assert time.monotonic() - started >= 1.0
        err = assert_refused(proc, "RIVET_STATE_RUN_IN_PROGRESS", 2)
        assert "chunk-run:orders" in err["message"] and str(holder.pid) in err["message"], describe(proc)
        assert without_leases(tree_digest(config.parent)) == without_leases(before)
        assert list(target.iterdir()) == []
    finally:
        holder.communicate("", timeout=30)


# --------------------------------------------------------------------------------------
# 5. A target that already holds something
# --------------------------------------------------------------------------------------

def _foreign_state(target: Path, tmp_path: Path) -> None:
    other = write_config(tmp_path / "other-pipeline", source_url="mysql://reader@crm.internal/crm")
    store = StateStore.open(other, state_url=f"sqlite:{target}", env={}, create=True)
    with store.transaction() as tx:
        tx.commit_cursor("orders", "incremental", "2026-01-01T00:00:00Z")


def _not_a_state(target: Path, tmp_path: Path) -> None:
    (target / STATE).write_text("notes: this is not a database\n")


def _same_identity_with_progress(target: Path, config: Path) -> None:
    store = StateStore.open(config, state_url=f"sqlite:{target}", env={}, create=True)
    with store.transaction() as tx:
        run_id = tx.start_run("orders", "incremental")
        tx.finish_run(run_id, "succeeded", rows=1)


def _same_identity_empty(target: Path, config: Path) -> None:
    StateStore.open(config, state_url=f"sqlite:{target}", env={}, create=True)


@pytest.mark.parametrize(("case", "code"), [
    ("foreign state", "RIVET_STATE_FOREIGN"),
    ("file that is not a state", "RIVET_STATE_TARGET_NOT_EMPTY"),
    ("same identity with progress", "RIVET_STATE_TARGET_NOT_EMPTY"),
    ("same identity, empty", "RIVET_STATE_TARGET_NOT_EMPTY"),
])
def test_target_that_holds_a_state_or_file_is_refused_and_nothing_changes_on_either_side(
        tmp_path: Path, small: Template, case: str, code: str) -> None:
    config = small.copy_to(tmp_path)
    target = tmp_path / "volume"
    target.mkdir()
    if case == "foreign state":
        _foreign_state(target, tmp_path)
    elif case == "file that is not a state":
        _not_a_state(target, tmp_path)
    elif case == "same identity with progress":
        _same_identity_with_progress(target, config)
    else:
        _same_identity_empty(target, config)
    source_before, target_before = tree_digest(config.parent), tree_digest(target)

    proc = run_cli("-c", str(config), "--json-errors", "relocate", "--to", str(target))
    err = assert_refused(proc, code, 5)
    assert str(target) in err["message"], describe(proc)
    assert tree_digest(config.parent) == source_before, "the source side changed"
    assert tree_digest(target) == target_before, "the target side changed"
    assert read_tombstone(config.parent / STATE) is None


# --------------------------------------------------------------------------------------
# 6. The plan, and the target directory argument
# --------------------------------------------------------------------------------------

def test_dry_run_changes_nothing_and_prints_the_plan_with_the_state_url(tmp_path: Path, small: Template) -> None:
    config = small.copy_to(tmp_path)
    target = tmp_path / "volume"
    target.mkdir()
    source_before, target_before = tree_digest(config.parent), tree_digest(target)

    proc = run_cli("-c", str(config), "relocate", "--to", str(target), "--dry-run")
    assert proc.returncode == 0, describe(proc)
    assert f"RIVET_STATE_URL=sqlite:{target}" in proc.stdout and "dry run" in proc.stdout, describe(proc)
    assert str(config.parent / CHECKPOINT) in proc.stdout and str(target / CHECKPOINT) in proc.stdout

    proc = run_cli("-c", str(config), "--json", "relocate", "--to", str(target), "--dry-run")
    assert proc.returncode == 0, describe(proc)
    plan = json.loads(proc.stdout)
    assert plan["dry_run"] and not plan["done"] and plan["state_url"] == f"sqlite:{target}"
    assert plan["tables"]["rivet_runs"] == len(small.rows["rivet_runs"])
    assert plan["size_bytes"] == (config.parent / STATE).stat().st_size
    assert plan["checkpoints"][0]["target"] == str(target / CHECKPOINT)

    missing = tmp_path / "not-yet"
    proc = run_cli("-c", str(config), "relocate", "--to", str(missing), "--create-dir", "--dry-run")
    assert proc.returncode == 0, describe(proc)
    assert not missing.exists(), "a dry run created the target directory"
    assert tree_digest(config.parent) == source_before and tree_digest(target) == target_before


def test_target_directory_must_be_absolute_and_exist_unless_create_dir(tmp_path: Path, small: Template) -> None:
    config = small.copy_to(tmp_path)
    before = tree_digest(config.parent)

    proc = run_cli("-c", str(config), "--json-errors", "relocate", "--to", "volume/state", cwd=tmp_path)
    assert_refused(proc, "RIVET_STATE_DIR_RELATIVE", 1)
    assert not (tmp_path / "volume").exists()

    missing = tmp_path / "mnt" / "state"
    proc = run_cli("-c", str(config), "--json-errors", "relocate", "--to", str(missing))
    err = assert_refused(proc, "RIVET_STATE_DIR_MISSING", 1)
    assert str(missing) in err["message"] and not missing.exists()
    assert tree_digest(config.parent) == before

    # --create-dir creates it only for a relocation that will happen: a refused one creates nothing.
    other = write_config(tmp_path / "no-state-here")
    proc = run_cli("-c", str(other), "--json-errors", "relocate", "--to", str(missing), "--create-dir")
    assert_refused(proc, "RIVET_STATE_MISSING", 5)
    assert not missing.exists() and not (tmp_path / "mnt").exists(), "a refused relocate created the directory"

    proc = run_cli("-c", str(config), "relocate", "--to", str(missing), "--create-dir")
    assert proc.returncode == 0, describe(proc)
    assert_relocated(config, missing, small)


def test_relocate_from_one_declared_directory_to_another(tmp_path: Path, small: Template) -> None:
    config = small.copy_to(tmp_path)
    first, second = tmp_path / "volume-a", tmp_path / "volume-b"
    first.mkdir()
    second.mkdir()
    assert run_cli("-c", str(config), "relocate", "--to", str(first)).returncode == 0
    env = {"RIVET_STATE_URL": f"sqlite:{first}"}
    proc = run_cli("-c", str(config), "relocate", "--to", str(second), env=env)
    assert proc.returncode == 0, describe(proc)
    moved = dump(second / STATE)
    assert without_relocation_rows(moved) == small.rows
    assert [r["from"] for r in relocation_rows(moved)] == [str(config.parent / STATE), str(first / STATE)]
    assert (second / CHECKPOINT).read_bytes() == small.checkpoint
    assert read_tombstone(first / STATE)["to"] == str(second / STATE)  # type: ignore[index]
    proc = run_cli("-c", str(config), "--json-errors", "info", env=env)
    err = assert_refused(proc, "RIVET_STATE_RELOCATED", 5)
    assert f"RIVET_STATE_URL=sqlite:{second}" in err["message"]


def test_the_relocation_audit_row_in_the_target_is_redacted(tmp_path: Path, small: Template) -> None:
    """The audit row written into the copy goes through the one audit writer, which
    redacts: a password in the command line a face hands over is never stored."""
    from statetool.operations.relocate import relocate

    config = small.copy_to(tmp_path)
    target = tmp_path / "volume"
    target.mkdir()
    secret = "hunter2-in-the-url"
    command = f"statetool --state-url postgresql://rivet:{secret}@db.internal/sales relocate --to {target}"
    result = relocate(Context(config, None, {}, 10.0, command), str(target))
    assert result.done
    db = sqlite3.connect(f"file:{quote(str(target / STATE))}?immutable=1", uri=True)
    try:
        rows = db.execute("SELECT at, actor, command, action, detail FROM rivet_audit WHERE action = 'relocate'"
                          ).fetchall()
    finally:
        db.close()
    assert len(rows) == 1, rows
    assert secret not in repr(rows), f"a password reached the audit trail: {rows}"
    assert "postgresql://rivet:***@db.internal/sales" in rows[0][2], rows
    assert json.loads(rows[0][4])["to"] == str(target / STATE)


def test_relocation_keeps_the_modes_of_the_state_and_of_its_checkpoints(tmp_path: Path, history: Template) -> None:
    """A state and a CDC checkpoint readable by their owner only stay so at the new place:
    a move never widens who may read a pipeline's progress (found by a fresh user)."""
    config = history.copy_to(tmp_path)
    checkpoint = next(config.parent.rglob("order_events.json"))
    (config.parent / STATE).chmod(0o600)
    checkpoint.chmod(0o640)
    target = tmp_path / "volume" / "rivet-state"
    target.mkdir(parents=True)
    proc = run_cli("-c", str(config), "--json", "relocate", "--to", str(target), timeout=300)
    assert proc.returncode == 0, describe(proc)
    moved = [Path(m["target"]) for m in json.loads(proc.stdout)["checkpoints"] if m["present"]]
    assert stat.S_IMODE((target / STATE).stat().st_mode) == 0o600, describe(proc)
    assert moved and all(stat.S_IMODE(p.stat().st_mode) == 0o640 for p in moved), (moved, describe(proc))
