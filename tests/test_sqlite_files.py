"""Issue 10, items 1-4 and 7 on the SQLite side: companion files that do not belong are
never merged, nothing of the state's own is followed, no fault leaves a file behind, a
state path that is not a regular file is refused at once, and SQL errors of an operation
are ``RIVET_INTERNAL``, not a retryable "unreachable".

Everything is real: WAL files written by a SQLite writer that was SIGKILLed, a FIFO made
with mkfifo, a small tmpfs filled up, the CLI in subprocesses.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import CliRun, describe, error_object, run_cli, run_cli_process, tree_digest, write_config
from statetool.backends.durable import copy_bytes
from statetool.location import LEASE_DIR
from statetool.runtime import StateStore

STATE = ".rivet_state.db"
OLD_CURSOR = "2026-11-01T00:00:00.000000Z"
FOREIGN_CURSOR = "2026-11-30T23:59:59.000000Z"
EXPORTS = textwrap.dedent("""\
    exports:
      - name: orders
        mode: incremental
      - name: refunds
        mode: incremental
    """)


def listing(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


class Place:
    """A WAL state at head in a declared directory with ``orders`` at :data:`OLD_CURSOR`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.state_dir = root / "state"
        self.state_dir.mkdir()
        self.config = write_config(root / "pipeline", exports=EXPORTS)
        self.env = {"RIVET_STATE_URL": f"sqlite:{self.state_dir}"}
        self.db = self.state_dir / STATE
        store = StateStore.open(self.config, env=self.env, create=True)
        with store.transaction() as tx:
            tx.commit_cursor("orders", "incremental", OLD_CURSOR)
        assert self.db.read_bytes()[18] == 2

    def cli(self, *args: str, timeout: float = 120) -> CliRun:
        return run_cli("-c", str(self.config), *args, env=self.env, timeout=timeout)

    def cursor(self, export: str = "orders") -> object:
        proc = self.cli("info", "--json")
        assert proc.returncode == 0, describe(proc)
        return next(e for e in json.loads(proc.stdout)["exports"] if e["name"] == export)["cursor"]


@pytest.fixture
def place(tmp_path: Path) -> Place:
    return Place(tmp_path)


def killed_wal_writer(db: Path, export: str, cursor: str) -> None:
    """A writer that commits ``cursor`` for ``export`` into ``db``'s -wal (never
    checkpointed) and is SIGKILLed, so the committed frames stay in the -wal."""
    code = textwrap.dedent(f"""
        import sqlite3, time
        conn = sqlite3.connect({str(db)!r}, isolation_level=None)
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        conn.execute("INSERT OR REPLACE INTO rivet_exports (export_name, mode, cursor_value, updated_at) "
                     "VALUES (?, 'incremental', ?, '2026-12-01T00:00:00.000000Z')", ({export!r}, {cursor!r}))
        print("committed", flush=True)
        time.sleep(300)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "committed"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert Path(f"{db}-wal").stat().st_size > 32


def foreign_wal(place: Place) -> bytes:
    """The -wal of another copy of the state, written by a real (killed) writer."""
    copy_dir = place.root / "copy"
    copy_dir.mkdir()
    shutil.copyfile(place.db, copy_dir / STATE)
    killed_wal_writer(copy_dir / STATE, "refunds", FOREIGN_CURSOR)
    return Path(f"{copy_dir / STATE}-wal").read_bytes()


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]


#: How a real -wal of another copy is made not to fit: what SQLite checks, one at a time.
BREAKS = {
    "bad magic": lambda w: b"\0\0\0\0" + w[4:],
    "other version": lambda w: w[:4] + (3007001).to_bytes(4, "big") + w[8:],
    "header checksum": lambda w: _flip(w, 27),
    "first frame salts": lambda w: _flip(w, 32 + 9),
    "first frame checksum": lambda w: _flip(w, 32 + 24 + 100),
}


@pytest.mark.parametrize("name", list(BREAKS))
def test_a_wal_that_does_not_fit_is_ignored_by_reads_and_refused_by_writes(place: Place, name: str) -> None:
    wal = Path(f"{place.db}-wal")
    wal.write_bytes(BREAKS[name](foreign_wal(place)))
    before, files = tree_digest(place.root), listing(place.root)
    info = place.cli("info", "--json")
    assert info.returncode == 0, describe(info)
    rows = {e["name"]: e["cursor"] for e in json.loads(info.stdout)["exports"]}
    assert rows == {"orders": OLD_CURSOR, "refunds": None}, describe(info)
    # (migrate at head writes nothing, so it has nothing to refuse)
    for write in (("exports", "set-cursor", "orders", "2026-11-15T00:00:00.000000Z"), ("exports", "reset", "orders"),
                  ("identity", "rekey", "--old", "postgresql://db.internal:5432/sales", "--new",
                   "postgresql://db2.internal:5432/sales")):
        proc = place.cli("--json-errors", *write)
        assert proc.returncode == 5, describe(proc)
        error = error_object(proc)
        assert error["code"] == "RIVET_STATE_FOREIGN_WAL" and str(wal) in error["message"], describe(proc)
        assert "move the -wal/-shm" in error["action"], describe(proc)
    assert not list(place.state_dir.glob(f"{STATE}.backup-*")), listing(place.state_dir)  # no backup taken
    assert listing(place.root) == files
    assert tree_digest(place.root) == before


def test_a_symlink_at_the_wal_name_is_refused_and_never_followed(place: Place) -> None:
    victim = place.root / "victim"
    victim.write_bytes(foreign_wal(place))
    Path(f"{place.db}-wal").symlink_to(victim)
    before = tree_digest(place.root)
    proc = place.cli("--json-errors", "exports", "set-cursor", "orders", "2026-11-15T00:00:00.000000Z")
    assert proc.returncode == 5 and error_object(proc)["code"] == "RIVET_STATE_UNSAFE_FILE", describe(proc)
    assert f"{place.db.name}-wal is a symlink" in error_object(proc)["message"], describe(proc)
    assert tree_digest(place.root) == before


def test_the_state_own_wal_still_fits_and_is_kept(place: Place) -> None:
    """The checks above must not refuse the state's own -wal: a writer killed after its
    commit left frames that are the state's (header and first frame checksums right)."""
    killed_wal_writer(place.db, "refunds", FOREIGN_CURSOR)
    proc = place.cli("exports", "set-cursor", "orders", "2026-11-15T00:00:00.000000Z")
    assert proc.returncode == 0, describe(proc)
    assert place.cursor("refunds") == FOREIGN_CURSOR
    assert place.cursor("orders") == "2026-11-15T00:00:00.000000Z"


# -- backups: temporary files are never followed, and what a killed one left is removed ----------


def test_a_symlink_where_a_backup_temporary_belongs_is_refused_and_not_followed(place: Place) -> None:
    victim = place.root / "victim"
    victim.write_text("precious\n")
    planted = place.state_dir / f"{STATE}.backup-set-cursor-orders-20261201T000000Z.tmp"
    planted.symlink_to(victim)
    before, files = tree_digest(place.root), listing(place.root)
    proc = place.cli("--json-errors", "exports", "set-cursor", "orders", "2026-11-15T00:00:00.000000Z")
    assert proc.returncode == 5, describe(proc)
    error = error_object(proc)
    assert error["code"] == "RIVET_STATE_UNSAFE_FILE" and planted.name in error["message"], describe(proc)
    assert victim.read_text() == "precious\n" and planted.is_symlink()
    assert listing(place.root) == files
    assert tree_digest(place.root) == before


def test_leftovers_of_a_killed_backup_are_removed_by_the_next_write(place: Place) -> None:
    # What a backup killed under an older release left: the temporary file and its journal.
    stale = place.state_dir / f"{STATE}.backup-migrate-20261130T000000Z.tmp"
    stale.write_bytes(place.db.read_bytes())
    Path(f"{stale}-journal").write_bytes(b"\0" * 512)
    proc = place.cli("exports", "set-cursor", "orders", "2026-11-15T00:00:00.000000Z")
    assert proc.returncode == 0, describe(proc)
    names = [p.name for p in place.state_dir.iterdir()]
    assert not [n for n in names if ".tmp" in n], names
    backups = [n for n in names if ".backup-" in n]
    assert len(backups) == 1 and backups[0].startswith(f"{STATE}.backup-set-cursor-orders-"), names
    with sqlite3.connect(f"file:{place.state_dir / backups[0]}?mode=ro", uri=True) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # a self-contained file
        assert conn.execute("SELECT cursor_value FROM rivet_exports WHERE export_name = 'orders'").fetchone() == \
            (OLD_CURSOR,)
    conn.close()


# -- a state path that is not a regular file ------------------------------------------------------


COMMANDS = {
    "info": ("info",),
    "check": ("check",),
    "doctor": ("doctor",),
    "migrate": ("migrate",),
    "exports set-cursor": ("exports", "set-cursor", "orders", "2026-11-15T00:00:00.000000Z"),
    "relocate --dry-run": ("relocate", "--to", "ELSEWHERE", "--create-dir", "--dry-run"),
    "relocate": ("relocate", "--to", "ELSEWHERE", "--create-dir"),
    "transfer": ("transfer", "--to", "postgresql://u@127.0.0.1:1/db"),
}


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_a_state_path_that_is_not_a_regular_file_is_refused_at_once_by_every_command(tmp_path: Path,
                                                                                    kind: str) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    config = write_config(tmp_path / "pipeline", exports=EXPORTS)
    path = state_dir / STATE
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        os.mknod(path, 0o600 | __import__("stat").S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
    before = listing(tmp_path)
    for name, command in COMMANDS.items():
        args = tuple(str(tmp_path / "elsewhere") if a == "ELSEWHERE" else a for a in command)
        proc = run_cli("-c", str(config), "--json-errors", *args, env={"RIVET_STATE_URL": f"sqlite:{state_dir}"},
                       timeout=30)
        assert proc.returncode == 5, f"{name}: {describe(proc)}"
        error = error_object(proc)
        assert error["code"] == "RIVET_STATE_UNSAFE_FILE" and str(path) in error["message"], f"{name}: {describe(proc)}"
        assert listing(tmp_path) == before, f"{name}: {describe(proc)}"


# -- a full disk while a lease is taken -----------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_during_a_lease_take_leaves_no_empty_sidecar(tmp_path: Path, small_tmpfs: Path) -> None:
    config = write_config(tmp_path / "pipeline", exports=EXPORTS)
    env = {"RIVET_STATE_URL": f"sqlite:{small_tmpfs}"}
    init = run_cli("-c", str(config), "init", env=env)
    assert init.returncode == 0, describe(init)
    filler = small_tmpfs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass  # full
    finally:
        os.close(fd)
    before = listing(small_tmpfs)
    proc = run_cli_process("-c", str(config), "--json-errors", "leases", "run", "--export", "orders", "--", "true",
                           env=env)
    assert proc.returncode != 0 and error_object(proc)["code"] == "RIVET_STATE_DISK_FULL", describe(proc)
    # the system's own words as they are (they may name a file, whose case is its own), never lowercased
    assert "[Errno 28] No space left on device" in error_object(proc)["message"], describe(proc)
    sidecars = [p for p in small_tmpfs.rglob("*") if ".rivet_state.leases/" in str(p)]
    assert sidecars == [], [(str(p), p.stat().st_size) for p in sidecars]
    assert [p for p in listing(small_tmpfs) if p not in before] in ([], [".rivet_state.leases"]), listing(small_tmpfs)


# -- one error boundary ---------------------------------------------------------------------------


def test_an_error_of_an_operation_own_sql_is_internal_not_retryable(place: Place) -> None:
    with sqlite3.connect(place.db, isolation_level=None) as conn:
        conn.execute("ALTER TABLE rivet_exports RENAME COLUMN cursor_value TO cursor_renamed_by_hand")
    conn.close()
    before = tree_digest(place.root)
    for command in (("info",), ("exports", "list")):
        proc = place.cli("--json-errors", *command)
        assert proc.returncode == 6, describe(proc)
        error = error_object(proc)
        assert error["code"] == "RIVET_INTERNAL" and error["retryable"] is False, describe(proc)
        assert "\n" not in str(error["message"]) and "cursor_value" in str(error["message"]), describe(proc)
    assert tree_digest(place.root) == before


def test_an_error_of_a_write_own_sql_is_internal_and_nothing_is_written(place: Place) -> None:
    with sqlite3.connect(place.db, isolation_level=None) as conn:
        conn.execute("ALTER TABLE rivet_audit RENAME COLUMN detail TO detail_renamed_by_hand")
    conn.close()
    proc = place.cli("--json-errors", "exports", "set-cursor", "orders", "2026-11-15T00:00:00.000000Z")
    assert proc.returncode == 6, describe(proc)
    error = error_object(proc)
    assert error["code"] == "RIVET_INTERNAL" and "\n" not in str(error["message"]), describe(proc)
    assert place.cursor() == OLD_CURSOR
    assert not [p.name for p in place.state_dir.iterdir() if ".tmp" in p.name]


@pytest.mark.parametrize("source_kind", ["file", "pipe"])
def test_a_copy_of_bytes_works_where_copy_file_range_does_not(tmp_path: Path, source_kind: str) -> None:
    """A migration copies the state with ``copy_file_range``; where the kernel refuses it
    (a pipe here, as some FUSE, NFS and 9p mounts do) the bytes are copied by reads and
    writes, every byte and in order, and progress counts them."""
    data = os.urandom(5 << 20) + b"the end"
    seen: list[tuple[int, int]] = []
    target = tmp_path / "copy"
    with open(target, "wb") as dst:
        if source_kind == "file":
            (tmp_path / "source").write_bytes(data)
            with open(tmp_path / "source", "rb") as src:
                copied = copy_bytes(src.fileno(), dst.fileno(), len(data), lambda d, t: seen.append((d, t)))
        else:
            reader, writer = os.pipe()
            echo = "import sys; sys.stdout.buffer.write(sys.stdin.buffer.read())"
            feeder = subprocess.Popen([sys.executable, "-c", echo], stdin=subprocess.PIPE, stdout=writer)
            os.close(writer)
            assert feeder.stdin is not None
            feeder.stdin.write(data)
            feeder.stdin.close()
            try:
                with open(os.devnull, "wb") as sink, pytest.raises(OSError):  # what the fallback is for
                    os.copy_file_range(reader, sink.fileno(), 1)
                copied = copy_bytes(reader, dst.fileno(), len(data) + 100, lambda d, t: seen.append((d, t)))
            finally:
                os.close(reader)
                feeder.wait(timeout=30)
    assert copied == len(data) and target.read_bytes() == data
    assert seen and seen[-1][0] == len(data) and [d for d, _ in seen] == sorted({d for d, _ in seen})


def test_what_a_killed_migration_left_counts_as_room_so_its_rerun_on_a_nearly_full_disk_converges(
        tmp_path: Path) -> None:
    """A migrate killed while it copied leaves its private ``….backup-….tmp`` directory
    beside the state. The re-run removes it before it copies; its space check must count
    it as room, or on a disk that had room for one migration the re-run refuses
    ``RIVET_STATE_DISK_FULL`` for ever (found by a fresh user, issue 13)."""
    from statetool.backends.faults import WRITE_MARGIN
    from statetool.example import build_legacy_state

    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(disk)], check=True)
    try:
        config = write_config(tmp_path / "pipeline", exports=EXPORTS)
        state = disk / ".rivet_state.db"
        build_legacy_state(state, [("orders", "incremental")], runs=15000)
        size = state.stat().st_size
        stale = disk / ".rivet_state.db.backup-legacy-20260101T000000Z.x1y2.tmp"
        stale.mkdir(mode=0o700)
        (stale / "migrated.db").write_bytes(state.read_bytes())
        needed = 2 * size + WRITE_MARGIN  # MIGRATION_COPIES files as large as the state, and the margin
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        room = needed - size // 2  # less than a migration needs, unless the leftover counts
        assert free > room, "the tmpfs is too small for this test"
        (disk / "filler").write_bytes(b"\0" * (free - room))
        proc = run_cli("-c", str(config), "migrate", env={"RIVET_STATE_URL": f"sqlite:{disk}"})
        assert proc.returncode == 0, describe(proc)
        assert not stale.exists() and len(list(disk.glob(".rivet_state.db.backup-*"))) == 1, sorted(disk.iterdir())
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_backup_is_no_more_readable_than_its_state(tmp_path: Path) -> None:
    """A state readable by its owner only gives backups readable by its owner only: the
    backup API makes its file with SQLite's default mode (0644 less the umask), which would
    hand every cursor to every user of the host (the kind of bug relocate had)."""
    config = write_config(tmp_path / "pipeline", exports=EXPORTS)
    assert run_cli("-c", str(config), "init").returncode == 0
    state = config.parent / ".rivet_state.db"
    state.chmod(0o600)
    proc = run_cli("-c", str(config), "--json", "exports", "set-cursor", "orders", "2026-01-01")
    assert proc.returncode == 0, describe(proc)
    backup = Path(json.loads(proc.stdout)["backup"])
    assert backup.is_file() and oct(backup.stat().st_mode & 0o777) == "0o600", describe(proc)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root may give a file another user")
def test_root_s_backup_of_another_user_s_state_is_that_user_s(tmp_path: Path) -> None:
    """Root changing a cursor of nobody's state leaves a backup that nobody owns and may
    read (found by a fresh user: the backup kept the state's mode, 0600, but was root's, so
    the state's owner could not read the copy of their own state)."""
    config = write_config(tmp_path / "pipeline", exports=EXPORTS)
    assert run_cli("-c", str(config), "init").returncode == 0
    state = config.parent / ".rivet_state.db"
    state.chmod(0o600)
    for path in (config.parent, state):
        os.chown(path, 65534, 65534)
    proc = run_cli("-c", str(config), "--json", "exports", "set-cursor", "orders", "2026-01-01")
    assert proc.returncode == 0, describe(proc)
    backup = Path(json.loads(proc.stdout)["backup"]).stat()
    assert (backup.st_uid, backup.st_gid, oct(backup.st_mode & 0o777)) == (65534, 65534, "0o600"), describe(proc)


@pytest.mark.parametrize(("mode", "folder_mode"), [(0o600, 0o700), (0o660, 0o770), (0o640, 0o750)])
def test_lease_files_their_folder_and_a_tombstone_are_no_more_readable_than_the_state(
        tmp_path: Path, mode: int, folder_mode: int) -> None:
    """Every file statetool makes beside a state is no more readable than the state: the
    lease folder (rwx where the state is writable, r-x where only readable), each lease file
    and the tombstone a relocation leaves get the state's mode (the kind of bug backups and
    relocate had: they were made 0644 and 0755). A state shared by a group (0660) gives that
    group a folder it may take leases in (0770)."""
    config = write_config(tmp_path / "pipeline", exports=EXPORTS)
    assert run_cli("-c", str(config), "init").returncode == 0
    state = config.parent / ".rivet_state.db"
    state.chmod(mode)
    shutil.rmtree(config.parent / LEASE_DIR, ignore_errors=True)
    proc = run_cli("-c", str(config), "exports", "set-cursor", "orders", "2026-01-01")
    assert proc.returncode == 0, describe(proc)
    folder = config.parent / LEASE_DIR
    assert oct(stat.S_IMODE(folder.stat().st_mode)) == oct(folder_mode), describe(proc)
    files = list(folder.iterdir())
    assert files and all(oct(stat.S_IMODE(p.stat().st_mode)) == oct(mode) for p in files), \
        [(p.name, oct(p.stat().st_mode)) for p in files]
    target = tmp_path / "volume"
    target.mkdir()
    proc = run_cli("-c", str(config), "relocate", "--to", str(target))
    assert proc.returncode == 0, describe(proc)
    assert state.read_bytes().startswith(b"RIVET-STATE-RELOCATED"), describe(proc)
    assert oct(stat.S_IMODE(state.stat().st_mode)) == oct(mode), "the tombstone is more readable than the state"
    assert oct(stat.S_IMODE((target / ".rivet_state.db").stat().st_mode)) == oct(mode)
