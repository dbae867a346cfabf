"""The fault matrix of issue 10 (SPEC §8a): every write command against a state whose
environment is broken in one of the ways operators meet, each made for real:

- ``read-only``: the state's directory bind-mounted read-only (``mount --bind -o ro``);
- ``full-disk``: the state on a small tmpfs filled to the last byte;
- ``nobody``: a state of root's (directory 0755, files 0644) run by ``nobody``;
- ``nobody-open-dir``: the same with a directory every user may create files in (1777),
  so that nobody *can* leave files behind (lease records, backups) where it may not write
  the state.

Each command must fail with the fault's registered code and class (never ``RIVET_INTERNAL``),
and leave the state and its directory as they were: the same files, the same bytes
(lease sidecars are compared by name: their content is the lease's own bookkeeping), no
temp file. Commands run as another user use ``/usr/bin/python3`` with a copy of this test
environment's packages in a directory every user may read (the default interpreter of the
session lives under ``/root``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import sqlite3
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import statetool
from support import (describe, error_object, fork_cli, process_env, run_cli, run_cli_as_needed, run_cli_process,
                     tree_digest, write_config)
from support.zygote import SOCKET_VAR, zygote
from statetool.errors import REGISTRY
from statetool.location import LEASE_DIR, STATE_FILE

SOURCE = "postgresql://reader@db.internal:5432/sales"
KEY = "postgresql://db.internal:5432/sales"
Runner = Callable[..., subprocess.CompletedProcess[str]]

EXPECTED = {"read-only": "RIVET_STATE_READ_ONLY", "full-disk": "RIVET_STATE_DISK_FULL",
            "nobody": "RIVET_STATE_PERMISSION_DENIED", "nobody-open-dir": "RIVET_STATE_PERMISSION_DENIED"}


def _require_root() -> None:
    if os.geteuid() != 0:  # said loudly: without root there is no mount and no other user
        message = "the fault matrix needs root (mounts, another user)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@contextmanager
def _cli_as(user: str) -> Iterator[Runner]:
    """``run(*args, cwd=, env=)``: the real CLI as ``user``, in a process of its own forked
    by a zygote that runs as that user (:func:`support.zygote.zygote`): the machine's
    ``/usr/bin/python3`` on a copy of the installed packages and of ``support`` that every
    user may read (the tests' interpreter lives where other users may not enter)."""
    _require_root()
    root = Path(tempfile.mkdtemp(prefix=f"statetool-{user}-"))
    site = root / "site"
    shutil.copytree(sysconfig.get_paths()["purelib"], site, symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", "pip", "pip-*"))
    package = Path(statetool.__file__).parent
    shutil.copytree(package, site / "statetool", dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    if not (site / "statetool" / "_alembic").is_dir():  # an editable install: the revisions are in the tree
        shutil.copytree(package.parent / "alembic", site / "statetool" / "_alembic")
    shutil.copytree(Path(__file__).parent / "support", root / "tests" / "support",
                    ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["chmod", "-R", "a+rX", str(root)], check=True)
    base = {"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "200", "NO_COLOR": "1",
            "HOME": "/nonexistent"}
    try:
        with zygote(user, "/usr/bin/python3", [str(site), str(root / "tests")], base) as shell:
            client = Path(shell["PATH"].split(os.pathsep)[0]) / "statetool"

            def run(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
                    timeout: float = 120) -> subprocess.CompletedProcess[str]:
                full = {**base, "PYTHONPATH": str(site), **(env or {}), SOCKET_VAR: shell[SOCKET_VAR]}
                return subprocess.run([str(client), *args], cwd=cwd or "/", env=full, text=True,
                                      capture_output=True, timeout=timeout)

            yield run
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def as_nobody() -> Iterator[Runner]:
    """The real CLI as user ``nobody`` (:func:`_cli_as`)."""
    with _cli_as("nobody") as run:
        yield run


@pytest.fixture(scope="session")
def as_daemon() -> Iterator[Runner]:
    """The real CLI as user ``daemon`` (:func:`_cli_as`): the owner of a state that
    ``nobody`` may write but does not own."""
    with _cli_as("daemon") as run:
        yield run


def _ok(*args: str, env: dict[str, str] | None = None) -> None:
    proc = run_cli(*args, env=env)
    assert proc.returncode == 0, describe(proc)


def _stale_lease(config: Path) -> None:
    """Leave ``chunk-run:orders`` stale: its holder and the holder's command SIGKILLed."""
    holder = fork_cli("-c", str(config), "leases", "run", "--export", "orders", "--", "sleep", "300",
                      env=process_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        listing = run_cli("-c", str(config), "--json", "leases", "list")
        if any(r["key"] == "chunk-run:orders" and r["state"] == "live" for r in json.loads(listing.stdout)["leases"]):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the lease holder never showed as live")
    os.killpg(holder.pid, signal.SIGKILL)
    holder.wait()


def _build(directory: Path, *, revision: str | None = None, identity: bool = True) -> Path:
    """A state beside a config in ``directory`` with progress, a stale lease (so ``leases
    release`` has something to write), the identity of :data:`SOURCE` recorded (without
    ``identity``: none, so ``identity adopt`` has) and, with ``revision``, moved down to
    that revision (so ``migrate`` has)."""
    config = write_config(directory, source_url=SOURCE if identity else None)
    _ok("-c", str(config), "init")
    _ok("-c", str(config), "exports", "set-cursor", "orders", "2026-01-01")
    if revision:
        _ok("-c", str(config), "migrate", "--to", revision, "--allow-data-loss")
    else:
        _stale_lease(config)
    write_config(directory, source_url=SOURCE)
    for backup in directory.glob(f"{STATE_FILE}.backup-*"):
        backup.unlink()
    return config


def _fill(directory: Path) -> None:
    """Fill the filesystem holding ``directory`` to the last byte."""
    with open(directory / "filler", "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError:
            pass
        try:
            while True:
                fh.write(b"\0")
        except OSError:
            pass


def _mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:  # said loudly: this fault class is untested on this machine
        pytest.fail(f"mount {' '.join(args)}: {proc.stderr.strip()}")


class Place:
    """A broken environment: the config of a state in it, a runner, and the directories
    whose content must not change."""

    def __init__(self, config: Path, run: Runner, empty: Path) -> None:
        self.config, self.run, self.empty = config, run, empty

    def snapshot(self) -> dict[str, Any]:
        directory = self.config.parent
        leases = directory / LEASE_DIR
        files = {k: v for k, v in tree_digest(directory).items() if not k.startswith(LEASE_DIR + "/")}
        return {"files": files, "leases": sorted(p.name for p in leases.iterdir()) if leases.is_dir() else None,
                "empty": sorted(p.name for p in self.empty.iterdir())}


@pytest.fixture
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., Place]]:
    """``make(revision, identity=True)``: a state (:func:`_build`) in the broken environment ``request.param``; an empty
    directory beside it in the same environment is ``Place.empty`` (for ``init``)."""
    _require_root()
    kind: str = request.param
    cleanups: list[Callable[[], None]] = []

    def make(revision: str | None, identity: bool = True) -> Place:
        if kind == "read-only":
            source = tmp_path / "rw"
            config = _build(source / "pipeline", revision=revision, identity=identity)
            (source / "empty").mkdir()
            view = tmp_path / "ro"
            view.mkdir()
            _mount("--bind", "-o", "ro", str(source), str(view))
            cleanups.append(lambda: subprocess.run(["umount", str(view)], check=True))
            return Place(view / "pipeline" / config.name, run_cli_as_needed, view / "empty")
        if kind == "full-disk":
            disk = tmp_path / "disk"
            disk.mkdir()
            _mount("-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk))
            cleanups.append(lambda: subprocess.run(["umount", "-l", str(disk)], check=True))
            config = _build(disk / "pipeline", revision=revision, identity=identity)
            (disk / "empty").mkdir()
            _fill(disk)
            return Place(config, run_cli_as_needed, disk / "empty")
        runner = request.getfixturevalue("as_nobody")
        shared = Path(tempfile.mkdtemp(prefix="statetool-matrix-"))
        cleanups.append(lambda: shutil.rmtree(shared, ignore_errors=True))
        shared.chmod(0o755)
        config = _build(shared / "pipeline", revision=revision, identity=identity)
        (shared / "empty").mkdir(mode=0o755)
        subprocess.run(["chmod", "-R", "u+rwX,go+rX,go-w", str(shared)], check=True)
        if kind == "nobody-open-dir":
            for directory in (config.parent, config.parent / LEASE_DIR, shared / "empty"):
                directory.chmod(0o1777)
        return Place(config, runner, shared / "empty")

    yield make
    for cleanup in reversed(cleanups):
        cleanup()


def _assert_fault(proc: subprocess.CompletedProcess[str], kind: str, what: str) -> None:
    assert proc.returncode != 0, f"{what} succeeded in a {kind} environment\n{describe(proc)}"
    lines = proc.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("{"), f"{what}: no error object\n{describe(proc)}"
    error = json.loads(lines[-1])
    assert error["code"] == EXPECTED[kind], f"{what} in a {kind} environment\n{describe(proc)}"
    assert error["code"] != "RIVET_INTERNAL" and "Traceback" not in proc.stderr, describe(proc)
    entry = REGISTRY[error["code"]]
    assert (proc.returncode, error["exit_code"], error["retryable"]) == (entry.exit_code, entry.exit_code,
                                                                        entry.retryable), describe(proc)


WRITES = {
    "exports set-cursor": ("exports", "set-cursor", "orders", "2026-02-02"),
    "exports reset": ("exports", "reset", "orders"),
    "identity rekey": ("identity", "rekey", "--old", KEY, "--new", "postgresql://db.moved:5432/sales"),
    "leases release": ("leases", "release", "chunk-run:orders", "--reason", "fault matrix"),
    "leases run": ("leases", "run", "--export", "orders", "--", "true"),
}
KINDS = list(EXPECTED)


@pytest.mark.parametrize("place", KINDS, indirect=True)
def test_every_write_fails_with_the_faults_code_and_changes_nothing(place: Callable[..., Place],
                                                                    request: pytest.FixtureRequest) -> None:
    kind = request.node.callspec.params["place"]
    where = place(None)
    before = where.snapshot()
    for what, args in WRITES.items():
        proc = where.run("-c", str(where.config), "--json-errors", "--lock-wait", "0", *args)
        if not (kind == "full-disk" and what == "leases run" and proc.returncode == 0):
            _assert_fault(proc, kind, what)  # (a lease record rewrites the block its sidecar has: it may succeed)
        assert where.snapshot() == before, f"{what} changed the state's directory in a {kind} environment"


def _assert_dry_run_as_real(where: Place, kind: str, what: str, args: tuple[str, ...]) -> None:
    """``args --dry-run`` refused with the fault's code, as its real run (issue 14 item 7),
    or, on a read-only mount, its plan with warning ``RIVET_STATE_READ_ONLY_DRY_RUN``."""
    proc = where.run("-c", str(where.config), "--json-errors", "--lock-wait", "0", *args, "--dry-run")
    if kind == "read-only":
        assert proc.returncode == 0 and "RIVET_STATE_READ_ONLY_DRY_RUN" in proc.stderr, describe(proc)
        assert "Dry run: nothing was changed" in proc.stdout, describe(proc)
    else:
        _assert_fault(proc, kind, f"{what} --dry-run")


@pytest.mark.parametrize("place", KINDS, indirect=True)
def test_every_dry_run_of_a_change_refuses_the_fault_as_its_real_run_and_changes_nothing(
        place: Callable[..., Place], request: pytest.FixtureRequest) -> None:
    kind = request.node.callspec.params["place"]
    where = place(None)
    before = where.snapshot()
    for what, args in WRITES.items():
        if what != "leases run":
            _assert_dry_run_as_real(where, kind, what, args)
            assert where.snapshot() == before, f"{what} --dry-run changed the state's directory in a {kind} environment"


@pytest.mark.parametrize("place", KINDS, indirect=True)
def test_an_identity_adopt_dry_run_refuses_the_fault_as_its_real_run_and_changes_nothing(
        place: Callable[..., Place], request: pytest.FixtureRequest) -> None:
    kind = request.node.callspec.params["place"]
    where = place(None, identity=False)
    before = where.snapshot()
    _assert_dry_run_as_real(where, kind, "identity adopt", ("identity", "adopt"))
    assert where.snapshot() == before


@pytest.mark.parametrize("place", KINDS, indirect=True)
def test_identity_adopt_fails_with_the_faults_code_and_changes_nothing(place: Callable[..., Place],
                                                                      request: pytest.FixtureRequest) -> None:
    kind = request.node.callspec.params["place"]
    where = place(None, identity=False)
    before = where.snapshot()
    proc = where.run("-c", str(where.config), "--json-errors", "--lock-wait", "0", "identity", "adopt")
    _assert_fault(proc, kind, "identity adopt")
    assert where.snapshot() == before


@pytest.mark.parametrize("place", KINDS, indirect=True)
def test_migrate_fails_with_the_faults_code_and_changes_nothing(place: Callable[..., Place],
                                                               request: pytest.FixtureRequest) -> None:
    kind = request.node.callspec.params["place"]
    where = place("0002")
    before = where.snapshot()
    for args in (("migrate", "--dry-run"), ("migrate",)):  # the dry run refuses what the real run refuses
        proc = where.run("-c", str(where.config), "--json-errors", "--lock-wait", "0", *args)
        if kind == "read-only" and "--dry-run" in args:  # but gives its plan on a read-only mount, warning
            assert proc.returncode == 0 and "RIVET_STATE_READ_ONLY_DRY_RUN" in proc.stderr, describe(proc)
        else:
            _assert_fault(proc, kind, " ".join(args))
        assert where.snapshot() == before


@pytest.mark.parametrize("place", ["read-only", "full-disk", "nobody"], indirect=True)
def test_init_fails_with_the_faults_code_and_creates_nothing(place: Callable[..., Place],
                                                            request: pytest.FixtureRequest) -> None:
    kind = request.node.callspec.params["place"]
    where = place(None)
    before = where.snapshot()
    proc = where.run("-c", str(where.config), "--json-errors", "init", env={"RIVET_STATE_URL": f"sqlite:{where.empty}"})
    _assert_fault(proc, kind, "init")
    assert where.snapshot() == before


@pytest.mark.parametrize("place", KINDS, indirect=True)
def test_relocate_fails_with_the_faults_code_and_leaves_no_copy(place: Callable[..., Place],
                                                               request: pytest.FixtureRequest,
                                                               tmp_path: Path) -> None:
    kind = request.node.callspec.params["place"]
    where = place(None)
    target = Path(tempfile.mkdtemp(prefix="statetool-target-"))
    try:
        if kind.startswith("nobody"):
            shutil.chown(target, "nobody")
        before = where.snapshot()
        for dry_run in (("--dry-run",), ()):  # found by a tester: the dry run passed where the real run refused
            proc = where.run("-c", str(where.config), "--json-errors", "--lock-wait", "0", "relocate", *dry_run,
                             "--to", str(target))
            if kind == "read-only" and dry_run:  # a read-only source: the plan, and the warning
                assert proc.returncode == 0 and "RIVET_STATE_READ_ONLY_DRY_RUN" in proc.stderr, describe(proc)
            else:
                _assert_fault(proc, kind, " ".join(("relocate", *dry_run)))
            assert where.snapshot() == before
            assert list(target.iterdir()) == [], f"relocate left {sorted(p.name for p in target.iterdir())} behind"
    finally:
        shutil.rmtree(target, ignore_errors=True)


@pytest.mark.postgres
@pytest.mark.parametrize("place", ["read-only", "full-disk"], indirect=True)
def test_transfer_fails_with_the_faults_code_and_leaves_the_target_empty(place: Callable[..., Place],
                                                                        request: pytest.FixtureRequest,
                                                                        pg_url: str) -> None:
    kind = request.node.callspec.params["place"]
    where = place(None)
    before = where.snapshot()
    for dry_run in (("--dry-run",), ()):
        proc = where.run("-c", str(where.config), "--json-errors", "--lock-wait", "0", "transfer", *dry_run,
                         "--to", pg_url)
        if kind == "read-only" and dry_run:  # a read-only source: the plan, and the warning
            assert proc.returncode == 0 and "RIVET_STATE_READ_ONLY_DRY_RUN" in proc.stderr, describe(proc)
        else:
            _assert_fault(proc, kind, " ".join(("transfer", *dry_run)))
        assert where.snapshot() == before
    import psycopg

    base, schema = pg_url.rsplit("schema=", 1)
    with psycopg.connect(base.rstrip("?&"), autocommit=True) as conn:
        tables = conn.execute("SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                              (schema,)).fetchall()
    assert tables == [], f"transfer left {tables} in the target"


def test_text_from_the_state_is_shown_with_its_control_characters_escaped(tmp_path: Path) -> None:
    """A cursor holding terminal escapes and invisible characters (written by a pipeline, not
    by statetool, which refuses them) reaches the terminal escaped, in tables and in doctor:
    a zero-width space or a byte-order mark would make two cursors look the same."""
    config = write_config(tmp_path / "pipeline")
    _ok("-c", str(config), "init")
    _ok("-c", str(config), "exports", "set-cursor", "orders", "2026-01-01")
    with sqlite3.connect(config.parent / STATE_FILE) as conn:
        updated = conn.execute("UPDATE rivet_exports SET cursor_value = ? WHERE export_name = 'orders'",
                               ("2026\x1b]0;owned\x07\x1b[2J\r\x9b31m\u202eevil\u200b\ufeff\u00ad",)).rowcount
    assert updated == 1
    for args in (("exports", "list"), ("info",), ("doctor",), ("exports", "show", "orders")):
        proc = run_cli("-c", str(config), *args)
        assert proc.returncode in (0, 5), describe(proc)
        for raw in ("\x1b", "\x07", "\r", "\x9b", "\u202e", "\u200b", "\ufeff", "\u00ad"):
            assert raw not in proc.stdout + proc.stderr, f"{args}: a raw {raw!r} reached the terminal"
        assert "\\x1b]0;owned\\x07" in proc.stdout and "evil\\u200b\\ufeff" in proc.stdout, \
            f"{args}: the cursor is not shown escaped\n{describe(proc)}"
    proc = run_cli("-c", str(config), "--json", "exports", "list")
    assert proc.returncode == 0 and "\x1b" not in proc.stdout and "\\u001b]0;owned" in proc.stdout, describe(proc)


def test_json_errors_objects_carry_failures_with_each_failed_export(tmp_path: Path) -> None:
    """ADR-0039 D2: ``failures[]`` lists each failed export (its error object plus
    ``export``); ``[]`` for a failure of no export."""
    config = write_config(tmp_path / "pipeline", exports="""\
exports:
  - name: a_events
    mode: cdc
    cdc: {engine: mysql, checkpoint: /nonexistent/a.json}
  - name: b_events
    mode: cdc
    cdc: {engine: mysql, checkpoint: /nonexistent/b.json}
  - name: orders
    mode: incremental
""")
    _ok("-c", str(config), "init")
    for name in ("a_events", "b_events", "orders"):
        _ok("-c", str(config), "exports", "set-cursor", name, "2026-01-01")
    for command in ("check", "doctor"):
        proc = run_cli("-c", str(config), "--json-errors", command)
        assert proc.returncode == 5, describe(proc)
        error = error_object(proc)
        failed = sorted((f["export"], f["code"]) for f in error["failures"])
        assert failed == [("a_events", "RIVET_STATE_CHECKPOINT_MISSING"), ("b_events", "RIVET_STATE_CHECKPOINT_MISSING")], \
            f"{command}\n{describe(proc)}"
        assert error["code"] == "RIVET_STATE_CHECKPOINT_MISSING" and all("failures" not in f for f in error["failures"])
    proc = run_cli("-c", str(config), "--json-errors", "exports", "set-cursor", "nosuch", "x")
    assert error_object(proc)["failures"] == [], describe(proc)
    write_config(config.parent, exports="""\
exports:
  - name: orders
    mode: incremental
  - name: renamed
    mode: incremental
""")
    proc = run_cli("-c", str(config), "--json-errors", "doctor")
    assert proc.returncode == 5, describe(proc)
    error = error_object(proc)
    assert [(f["export"], f["code"]) for f in error["failures"]] == [("renamed", "RIVET_EXPORT_NO_PROGRESS")], \
        describe(proc)


OWN_FILES = (f"{STATE_FILE}-journal", f"{STATE_FILE}-wal", f"{STATE_FILE}-shm", f"{LEASE_DIR}/chunk-run%3Aorders",
             LEASE_DIR)


@pytest.mark.parametrize("own", OWN_FILES)
def test_a_symlink_where_an_own_file_belongs_is_refused_by_every_write_and_its_target_never_touched(
        tmp_path: Path, own: str) -> None:
    """SPEC §8a: whoever may write the state's directory must not make statetool write,
    truncate or merge a file elsewhere through a symlink at the name of one of its own
    files (SQLite's journal, WAL and shared memory, a lease record, the lease folder)."""
    config = _build(tmp_path / "pipeline")
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious bytes\n")
    link = config.parent / own
    if link.is_dir():
        shutil.rmtree(link)
    elif link.exists():
        link.unlink()
    link.symlink_to(victim)
    before = tree_digest(config.parent), os.readlink(link)
    for what, args in {**WRITES, "migrate": ("migrate", "--to", "0002", "--allow-data-loss")}.items():
        proc = run_cli_as_needed("-c", str(config), "--json-errors", "--lock-wait", "0", *args)
        assert proc.returncode == 5, f"{what} with a symlink at {own}\n{describe(proc)}"
        error = error_object(proc)
        assert error["code"] == "RIVET_STATE_UNSAFE_FILE" and own.split("/")[-1] in error["message"], describe(proc)
        assert victim.read_bytes() == b"precious bytes\n", f"{what} wrote through the symlink at {own}"
        assert (tree_digest(config.parent), os.readlink(link)) == before, f"{what} changed the directory"


def _foreign_wal_beside(config: Path, tmp_path: Path) -> None:
    """Put beside the (rollback-journal) state the ``-wal`` of a copy of it, written in WAL
    mode with checkpoints off, in which another export's cursor moved."""
    state = config.parent / STATE_FILE
    with sqlite3.connect(state) as conn:
        assert conn.execute("PRAGMA journal_mode=DELETE").fetchone()[0] == "delete"
    conn.close()
    copy = tmp_path / "copy" / STATE_FILE
    copy.parent.mkdir()
    shutil.copyfile(state, copy)
    writer = sqlite3.connect(copy, isolation_level=None)
    try:
        writer.execute("PRAGMA journal_mode=WAL")
        writer.execute("PRAGMA wal_autocheckpoint=0")
        writer.execute("UPDATE rivet_exports SET cursor_value = 'FOREIGN' WHERE export_name = 'order_lines'")
        if not writer.execute("SELECT changes()").fetchone()[0]:
            writer.execute("INSERT INTO rivet_exports (export_name, mode, cursor_value, updated_at) "
                           "VALUES ('order_lines', 'chunked', 'FOREIGN', '2026-01-01T00:00:00Z')")
        shutil.copyfile(f"{copy}-wal", f"{state}-wal")
    finally:
        writer.close()


@pytest.mark.postgres
def test_another_copys_wal_beside_the_state_is_refused_by_every_write_and_never_merged(
        tmp_path: Path, pg_url: str) -> None:
    """Issue 10's first finding, for every write: the ``-wal`` of another copy beside a
    rollback-journal state is never applied. Each write refuses with
    ``RIVET_STATE_FOREIGN_WAL`` naming it; the directory, the ``-wal`` included, is
    byte-identical, and no backup holding the foreign change is taken."""
    config = _build(tmp_path / "pipeline")
    _foreign_wal_beside(config, tmp_path)
    before = tree_digest(config.parent)
    target = tmp_path / "target"
    target.mkdir()
    writes = {**WRITES,
              "migrate": ("migrate", "--to", "0002", "--allow-data-loss"),
              "relocate": ("relocate", "--to", str(target)), "transfer": ("transfer", "--to", pg_url)}
    for what, args in writes.items():
        proc = run_cli_as_needed("-c", str(config), "--json-errors", "--lock-wait", "0", *args)
        assert proc.returncode == 5, f"{what} beside a foreign -wal\n{describe(proc)}"
        error = error_object(proc)
        assert error["code"] == "RIVET_STATE_FOREIGN_WAL" and f"{STATE_FILE}-wal" in error["message"], describe(proc)
        assert tree_digest(config.parent) == before, f"{what} changed the directory"
        assert list(target.iterdir()) == [], f"{what} left {list(target.iterdir())}"
    proc = run_cli("-c", str(config), "--json", "exports", "list")
    cursors = {e["name"]: e["cursor"] for e in json.loads(proc.stdout)["exports"]}
    assert cursors.get("order_lines") != "FOREIGN", "a read applied the foreign -wal"


READS = (("info",), ("check",), ("doctor",), ("exports", "list"), ("leases", "list"), ("identity", "show"))


@pytest.mark.parametrize("blocked", ["state file mode 000", "directory mode 700"])
def test_a_state_this_user_may_not_read_is_permission_denied_never_missing_nor_a_bug(
        as_nobody: Runner, blocked: str) -> None:
    """Issue 10's wrong verdicts: a state ``nobody`` may not read, or whose directory it may
    not enter, is ``RIVET_STATE_PERMISSION_DENIED`` for every read command (``check``: on
    its ``state`` row), never ``RIVET_STATE_MISSING``, a first run, or ``RIVET_INTERNAL``."""
    shared = Path(tempfile.mkdtemp(prefix="statetool-unreadable-"))
    try:
        shared.chmod(0o755)
        config = _build(shared / "pipeline")
        subprocess.run(["chmod", "-R", "a+rX", str(shared)], check=True)
        if blocked.startswith("state"):
            (config.parent / STATE_FILE).chmod(0)
            url = ""
        else:
            config.parent.chmod(0o700)
            url = f"sqlite:{config.parent}"
            moved = shared / "config" / config.name  # the config itself stays readable
            moved.parent.mkdir(mode=0o755)
            shutil.copyfile(config, moved)
            moved.chmod(0o644)
            config = moved
        for args in READS:
            if args == ("leases", "list") and blocked.startswith("state"):
                continue  # it reads the lease folder only, which nobody may read: a true listing
            proc = as_nobody("-c", str(config), "--json-errors", *args, env={"RIVET_STATE_URL": url})
            assert proc.returncode == 1, f"{args} ({blocked})\n{describe(proc)}"
            error = error_object(proc)
            assert error["code"] == "RIVET_STATE_PERMISSION_DENIED", f"{args} ({blocked})\n{describe(proc)}"
            assert "nobody" in error["message"] and "FIRST RUN" not in proc.stdout + proc.stderr, describe(proc)
        proc = as_nobody("-c", str(config), "--json", "check", env={"RIVET_STATE_URL": url})
        checks = json.loads(proc.stdout)["checks"]
        rows = {r["id"]: r for r in checks}
        assert rows["state"]["code"] == "RIVET_STATE_PERMISSION_DENIED", describe(proc)
        # one row per check: not "found" and then "fail" (found by a fresh user)
        assert len(rows) == len(checks), describe(proc)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_config_that_is_not_a_regular_file_is_refused_at_once(tmp_path: Path) -> None:
    """A FIFO used to hang every command and ``/dev/zero`` to fill the memory: both are
    ``RIVET_CONFIG_INVALID`` before a byte is read."""
    fifo = tmp_path / "rivet.fifo"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.yaml"
    zero.symlink_to("/dev/zero")
    for config, kind in ((fifo, "a FIFO"), (zero, "a device")):
        proc = run_cli("-c", str(config), "--json-errors", "info", timeout=30)
        assert proc.returncode == 1, describe(proc)
        error = error_object(proc)
        assert error["code"] == "RIVET_CONFIG_INVALID" and kind in error["message"], describe(proc)


def test_a_config_this_user_may_not_read_is_permission_denied_not_a_usage_error(as_nobody: Runner) -> None:
    shared = Path(tempfile.mkdtemp(prefix="statetool-config-"))
    try:
        shared.chmod(0o755)
        config = write_config(shared)
        config.chmod(0)
        proc = as_nobody("-c", str(config), "--json-errors", "info")
        assert proc.returncode == 1, describe(proc)
        error = error_object(proc)
        assert error["code"] == "RIVET_STATE_PERMISSION_DENIED" and str(config) in error["message"], describe(proc)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_migration_the_disk_has_no_room_for_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """Found by an operator: with 4 MB free beside a 2.6 MB legacy state, migrate passed
    the free-space check (it asked for 1 MiB), ran out of space halfway, left a backup,
    a hot journal and a lease folder, and said "nothing was written". A migration needs
    room for three copies of the state (backup, rebuilt tables, journal); short of that it
    is refused first, the dry run too, and the directory is byte-identical."""
    _require_root()
    disk = tmp_path / "disk"
    disk.mkdir()
    _mount("-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk))
    try:
        config = write_config(disk / "pipeline")
        subprocess.run([sys.executable, "-m", "statetool.example", "--config", str(config), "--runs", "20000"],
                       check=True, capture_output=True, cwd=config.parent)
        size = (config.parent / STATE_FILE).stat().st_size
        with open(disk / "filler", "wb", buffering=0) as fh:
            fh.write(b"\0" * (os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize - 2 * size))
        before = tree_digest(config.parent), sorted(p.name for p in config.parent.iterdir())
        for args in (("migrate", "--dry-run"), ("migrate",)):
            proc = run_cli("-c", str(config), "--json-errors", *args)
            assert proc.returncode == 1, describe(proc)
            error = error_object(proc)
            assert error["code"] == "RIVET_STATE_DISK_FULL" and "copies" in error["message"], describe(proc)
            assert (tree_digest(config.parent), sorted(p.name for p in config.parent.iterdir())) == before, args
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def test_leases_run_refuses_an_export_name_with_control_characters_and_leaves_no_lease_file(tmp_path: Path) -> None:
    """Found by an operator: ``leases run --export $'z\\e[2Jz\\ny'`` ran and left that lease
    file for good. The name is input: refused like every lease key with control
    characters (C0 and C1), before any file."""
    config = write_config(tmp_path / "pipeline")
    _ok("-c", str(config), "init")
    before = sorted(p.name for p in (config.parent / LEASE_DIR).iterdir()) if (config.parent / LEASE_DIR).is_dir() \
        else []
    for name in ("z\x1b[2Jz\ny", "a\x9bb"):
        proc = run_cli_process("-c", str(config), "--json-errors", "leases", "run", "--export", name, "--", "true")
        assert proc.returncode == 1, describe(proc)
        assert error_object(proc)["code"] == "RIVET_STATE_LEASE_KEY_INVALID"
        after = sorted(p.name for p in (config.parent / LEASE_DIR).iterdir()) \
            if (config.parent / LEASE_DIR).is_dir() else []
        assert after == before, after


def _listing(directory: Path) -> list[tuple[str, str]]:
    """Every file and directory below ``directory`` (its name, and its sha256 for a file):
    a refused command creates no directory either."""
    digests = tree_digest(directory)
    return sorted((str(p.relative_to(directory)), digests.get(str(p.relative_to(directory)), "dir"))
                  for p in directory.rglob("*"))


@contextmanager
def _owned_by_daemon(revision: str | None) -> Iterator[Path]:
    """The config of a state (:func:`_build`, without lease records) that belongs to user
    ``daemon``, in a directory every user may write, the state writable by every user (mode
    0666): ``nobody`` passes every permission check of a write and still is not its owner.
    The directory's name has capitals: a message must show it as it is."""
    shared = Path(tempfile.mkdtemp(prefix="statetool-Owner-"))
    try:
        shared.chmod(0o755)
        config = _build(shared / "Pipeline", revision=revision)
        shutil.rmtree(config.parent / LEASE_DIR, ignore_errors=True)
        subprocess.run(["chown", "-R", "daemon:daemon", str(config.parent)], check=True)
        config.parent.chmod(0o777)
        (config.parent / STATE_FILE).chmod(0o666)
        yield config
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_migration_by_another_user_is_refused_before_any_lease_and_the_owner_migrates_after(
        as_nobody: Runner, as_daemon: Runner) -> None:
    """A migration replaces the state's file by a new one, which must belong to the state's
    owner: a user that may write the state but cannot give a file to its owner is refused
    ``RIVET_STATE_PERMISSION_DENIED`` before anything is created (no lease folder of its
    own, which the owner could then not write into), in the dry run too, with the path as
    it is; the owner's own migration then runs (found by a fresh user, B2)."""
    with _owned_by_daemon("0002") as config:
        state = config.parent / STATE_FILE
        before = _listing(config.parent)
        for args in (("migrate", "--dry-run"), ("migrate",)):
            proc = as_nobody("-c", str(config), "--json-errors", "--lock-wait", "0", *args)
            assert proc.returncode == REGISTRY["RIVET_STATE_PERMISSION_DENIED"].exit_code, describe(proc)
            error = error_object(proc)
            assert error["code"] == "RIVET_STATE_PERMISSION_DENIED", describe(proc)
            assert str(state) in error["message"] and "daemon" in error["message"], describe(proc)
            assert _listing(config.parent) == before, f"{args} as nobody created or changed files\n{describe(proc)}"
        proc = as_daemon("-c", str(config), "--json", "--lock-wait", "0", "migrate")
        assert proc.returncode == 0, describe(proc)
        assert json.loads(proc.stdout)["applied"] is True, describe(proc)
        assert state.stat().st_uid == 1 and stat.S_IMODE(state.stat().st_mode) == 0o666, describe(proc)


def test_the_owner_outside_the_state_s_group_is_told_the_group_is_in_the_way(as_nobody: Runner) -> None:
    """``chown -R nobody dir`` keeps root's group: nobody owns the state but cannot give a new
    file that group. The refusal names the group as the obstacle and a fix that works
    (chgrp), not "run it as the state's owner", which this user already is (found by a
    fresh user); after the chgrp the same user migrates."""
    with _owned_by_daemon("0002") as config:
        subprocess.run(["chown", "-R", "nobody:root", str(config.parent)], check=True)
        state = config.parent / STATE_FILE
        before = _listing(config.parent)
        proc = as_nobody("-c", str(config), "--json-errors", "--lock-wait", "0", "migrate")
        error = error_object(proc)
        assert error["code"] == "RIVET_STATE_PERMISSION_DENIED", describe(proc)
        assert "not in its group" in error["message"] and "chgrp" in error["message"], describe(proc)
        assert "run it as the state's owner" not in error["message"], describe(proc)
        assert _listing(config.parent) == before, describe(proc)
        subprocess.run(["chgrp", "-R", "nogroup", str(config.parent)], check=True)
        proc = as_nobody("-c", str(config), "--json", "--lock-wait", "0", "migrate")
        assert proc.returncode == 0 and json.loads(proc.stdout)["applied"] is True, describe(proc)
        assert (state.stat().st_uid, state.stat().st_gid) == (65534, 65534), describe(proc)


def test_root_migrating_another_users_state_leaves_its_lease_sidecars_to_that_user(as_daemon: Runner) -> None:
    """Root may give files away, so its migration of ``daemon``'s state succeeds; the lease
    folder and files it creates on the way must then be ``daemon``'s too, or the owner's
    next run is refused at the folder root made (found by a fresh user)."""
    with _owned_by_daemon("0002") as config:
        proc = run_cli_process("-c", str(config), "--json", "--lock-wait", "0", "migrate")
        assert proc.returncode == 0, describe(proc)
        leases = config.parent / LEASE_DIR
        made = [leases, *leases.iterdir()]
        assert len(made) > 1, describe(proc)
        assert {(p.name, p.stat().st_uid, p.stat().st_gid) for p in made} == \
            {(p.name, 1, 1) for p in made}, describe(proc)
        run = as_daemon("-c", str(config), "--json-errors", "--lock-wait", "0", "leases", "run", "--export", "orders",
                        "--", "true")
        assert run.returncode == 0, describe(run)


def test_a_relocation_by_another_user_is_refused_before_anything_is_created(as_nobody: Runner) -> None:
    """A relocation puts a new file where the state was (the tombstone) and a new file at
    its new place: a user that cannot give them the state's owner is refused before any
    lease or copy is made, at the source and at the target, in the dry run too."""
    with _owned_by_daemon(None) as config:
        target = config.parent.parent / "Target"
        target.mkdir()
        shutil.chown(target, "nobody")
        before = _listing(config.parent)
        for dry_run in (("--dry-run",), ()):
            proc = as_nobody("-c", str(config), "--json-errors", "--lock-wait", "0", "relocate", *dry_run,
                             "--to", str(target))
            assert proc.returncode == REGISTRY["RIVET_STATE_PERMISSION_DENIED"].exit_code, describe(proc)
            assert error_object(proc)["code"] == "RIVET_STATE_PERMISSION_DENIED", describe(proc)
            assert _listing(config.parent) == before and list(target.iterdir()) == [], describe(proc)


def test_a_migrate_dry_run_on_a_read_only_mount_gives_its_plan_and_says_the_real_run_is_refused(
        tmp_path: Path) -> None:
    """A dry run changes nothing, so a state on a filesystem mounted read-only (a bind mount
    remounted ``ro``) still gets its plan, for people and in JSON, with warning
    ``RIVET_STATE_READ_ONLY_DRY_RUN`` saying the real run will be refused; the real run is
    refused ``RIVET_STATE_READ_ONLY``; neither creates or changes a file."""
    _require_root()
    source = tmp_path / "rw"
    config = _build(source / "pipeline", revision="0002")
    view = tmp_path / "ro"
    view.mkdir()
    _mount("--bind", str(source), str(view))
    try:
        _mount("-o", "remount,ro,bind", str(view))
        ro_config = view / "pipeline" / config.name
        before = _listing(source)
        proc = run_cli("-c", str(ro_config), "--json", "migrate", "--dry-run")
        assert proc.returncode == 0, describe(proc)
        doc = json.loads(proc.stdout)
        assert doc["dry_run"] and [s["id"] for s in doc["steps"]] == ["0003", "0004", "0005", "0006"], describe(proc)
        assert [w["code"] for w in doc["warnings"]] == ["RIVET_STATE_READ_ONLY_DRY_RUN"], describe(proc)
        assert "read-only" in doc["warnings"][0]["message"], describe(proc)
        human = run_cli("-c", str(ro_config), "migrate", "--dry-run")
        assert human.returncode == 0 and "0003" in human.stdout, describe(human)
        assert "RIVET_STATE_READ_ONLY_DRY_RUN" in human.stdout + human.stderr, describe(human)
        real = run_cli("-c", str(ro_config), "--json-errors", "migrate")
        _assert_fault(real, "read-only", "migrate")
        assert _listing(source) == before
    finally:
        subprocess.run(["umount", str(view)], check=True)


@pytest.mark.parametrize("left", ["a lease folder", "a lease file"])
def test_lease_files_another_user_left_are_refused_with_their_names_as_they_are(as_daemon: Runner, left: str) -> None:
    """A lease folder, or a lease file in a folder every user may write, that another user
    made (as an older release let a refused migration do) and the state's owner may not
    write: the owner's writes are refused ``RIVET_STATE_PERMISSION_DENIED``, never a bug,
    and the message shows each path as it is spelled (capitals, a lease file's
    percent-encoding ``%3A``), never lowercased."""
    writes = {None: (("leases", "run", "--export", "orders", "--", "true"),
                     ("exports", "set-cursor", "orders", "2026-02-02")), "0002": (("migrate",),)}
    for revision, commands in writes.items():
        with _owned_by_daemon(revision) as config:
            folder = config.parent / LEASE_DIR
            folder.mkdir(mode=0o755)
            blocking = folder
            if left == "a lease file":
                shutil.chown(folder, "daemon", "daemon")
                folder.chmod(0o777)
                blocking = folder / "chunk-run%3Aorders"
                blocking.write_text("")
            shutil.chown(blocking, "nobody", "nogroup")
            before = _listing(config.parent)
            for args in commands:
                proc = as_daemon("-c", str(config), "--json-errors", "--lock-wait", "0", *args)
                assert proc.returncode == REGISTRY["RIVET_STATE_PERMISSION_DENIED"].exit_code, describe(proc)
                message = error_object(proc)["message"]
                assert error_object(proc)["code"] == "RIVET_STATE_PERMISSION_DENIED", describe(proc)
                assert str(folder) in message and "/pipeline/" not in message, describe(proc)
                assert "%3a" not in message and "[errno" not in message, describe(proc)
                assert _listing(config.parent) == before, describe(proc)


def test_a_relocation_by_root_gives_the_moved_state_and_the_tombstone_the_states_owner(as_daemon: Runner) -> None:
    """Root relocates a state of ``daemon``'s (mode 0600): the moved state and the tombstone
    at the old place keep its owner, group and mode, so the owner's runs open the new
    place, and at the old one read ``RIVET_STATE_RELOCATED`` (a tombstone only root may read
    would be a permission failure instead)."""
    with _owned_by_daemon(None) as config:
        state = config.parent / STATE_FILE
        state.chmod(0o600)
        target = config.parent.parent / "Target"
        target.mkdir()
        shutil.chown(target, "daemon", "daemon")
        proc = run_cli("-c", str(config), "--lock-wait", "0", "relocate", "--to", str(target))
        assert proc.returncode == 0, describe(proc)
        for path in (state, target / STATE_FILE):
            st = path.stat()
            assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1, 1, 0o600), (path, describe(proc))
        old = as_daemon("-c", str(config), "--json-errors", "info")
        assert error_object(old)["code"] == "RIVET_STATE_RELOCATED", describe(old)
        new = as_daemon("-c", str(config), "--json", "info", env={"RIVET_STATE_URL": f"sqlite:{target}"})
        assert new.returncode == 0, describe(new)


def test_a_prune_dry_run_where_it_may_not_write_says_the_true_place_reason_and_action(
        as_nobody: Runner, tmp_path: Path) -> None:
    """``RIVET_STATE_READ_ONLY_DRY_RUN`` of ``prune --dry-run``, refused for each of its
    reasons: a root-owned state run by ``nobody`` (permission), and an archive whose
    directory alone is a read-only mount. Each message names the place and the reason, and
    the action points at them, never "mount the state's filesystem read-write" where that
    is not the reason, nor "the state's owner" for the archive's directory."""
    _require_root()
    shared = Path(tempfile.mkdtemp(prefix="statetool-prune-dry-"))
    try:
        shared.chmod(0o755)
        config = _build(shared / "pipeline")
        before = _listing(shared)
        proc = as_nobody("-c", str(config), "--json", "prune", "--keep-runs", "3", "--dry-run")
        assert proc.returncode == 0, describe(proc)
        (warning,) = json.loads(proc.stdout)["warnings"]
        assert warning["code"] == "RIVET_STATE_READ_ONLY_DRY_RUN", warning
        assert "may not write" in warning["message"] and str(config.parent) in warning["message"], warning
        assert "mount the state" not in warning["action"] and "the message gives" in warning["action"], warning
        assert _listing(shared) == before
    finally:
        shutil.rmtree(shared)
    config = _build(tmp_path / "pipeline")
    view = tmp_path / "ro"
    (tmp_path / "rw").mkdir()
    view.mkdir()
    _mount("--bind", "-o", "ro", str(tmp_path / "rw"), str(view))
    try:
        proc = run_cli("-c", str(config), "--json", "prune", "--keep-runs", "3", "--archive", str(view / "x.gz"),
                       "--dry-run")
    finally:
        subprocess.run(["umount", str(view)], check=True)
    assert proc.returncode == 0, describe(proc)
    (warning,) = json.loads(proc.stdout)["warnings"]
    assert f"{view} is on a filesystem mounted read-only" in warning["message"], warning
    assert "state's" not in warning["message"] + warning["action"], warning
