"""``statetool relocate --to DIR``: move a SQLite state into a declared directory (SPEC §1, §6, §9).

The order, each step safe to interrupt at any instant:

1. Pre-flight of the source (every check; it must be at head) and of the target (an
   absolute, existing directory holding no state, or the copy an earlier interrupted
   relocation of THIS source left there).
2. Hold off writers: every run lease of the config's and the state's exports, then the
   SQLite write lock (after a WAL checkpoint, so the file alone holds every committed row).
3. Copy with the online backup API into ``<target>/.rivet_state.db.relocating``; verify
   (``quick_check`` or ``--full-verify``'s ``integrity_check``, every table's row count,
   and a digest of every page compared with the source's); fsync.
4. Copy each CDC checkpoint with a relative path to where it resolves under the target
   (temporary file, fsync, rename; sha256 compared).
5. Write an audit row into the copy (from, to, source digest, the command that finishes
   the move) and mark it in flight (its version reads ``move-in-flight``: every opener
   refuses it, ``RIVET_STATE_MOVE_IN_FLIGHT``), link it into place as
   ``<target>/.rivet_state.db`` (a link never replaces anything), fsync the directory.
6. Switch: hard-link the source to ``.rivet_state.db.relocated-<UTC>`` (its bytes are
   kept), then atomically rename a tombstone over ``.rivet_state.db``
   (statetool/backends/tombstone.py): from then on every release refuses the old place.
7. Make the target live: its version goes back to head.

So at no instant are two places live: the target opens only after the source is retired
(between 6 and 7 neither opens, and a re-run finishes the move). A symlinked state file is
retired where it really is (:attr:`Location.real_path`), never as the link.

A re-run finds the leftovers: a ``.relocating`` file is removed and copied again; an
in-flight target carrying this source's relocation row goes straight to the switch if the
source's digest is unchanged, and is made again otherwise (it was never live); a
tombstone that already names the target means done (the target is made live if a kill
came between 6 and 7).

Fault injection for the crash tests: with ``STATETOOL_CRASH_AT=<point>`` in the
environment the process SIGKILLs itself at that point (the points are listed in
:data:`CRASH_POINTS`; ``copy-page-<n>`` kills during the copy after n pages).
"""

from __future__ import annotations

import contextlib
import errno
from concurrent.futures import Future, ThreadPoolExecutor
import hashlib
import json
import os
import shlex
import shutil
import signal
import sqlite3
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from statetool import migrations
from statetool.backends.faults import WRITE_MARGIN, fault, refuse_unwritable
from statetool.backends.proclocks import lock_holders
from statetool.backends.sqlite import SqliteBackend, content_digest, fsync_dir
from statetool.backends.tombstone import (CREATE_FLAGS, IN_FLIGHT_REVISION, read_tombstone, refuse_unsafe,
                                          unsafe_error, write_tombstone_tmp)
from statetool.errors import StateError
from statetool.location import STATE_FILE, Location, resolve_checkpoint
from statetool.schema import VERSION_TABLE
from statetool.operations.context import Context, now_iso
from statetool.operations.preflight import require, run_preflight
from statetool.operations.probe import export_names, row_counts
from statetool.operations.writes import WHOLE_STATE, WriteSession, guarded_write

COPY_NAME = f"{STATE_FILE}.relocating"
CRASH_POINTS = ("leases", "checkpointed", "locked", "digested", "copied", "checkpoint-copied", "audited",
                "linked", "kept", "tombstoned", "swapped", "finished")


def crash_point(name: str) -> None:
    """SIGKILL this process at ``name`` when ``STATETOOL_CRASH_AT`` says so (crash tests only)."""
    if os.environ.get("STATETOOL_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class CheckpointMove:
    """One CDC checkpoint: where it is now, where it will resolve, and whether it exists."""

    export: str
    configured: str
    source: str
    target: str
    present: bool
    bytes: int | None


@dataclass
class RelocateResult:
    """The plan and, unless ``dry_run``, what was done."""

    source: str
    target: str
    state_url: str
    size_bytes: int
    tables: dict[str, int]
    checkpoints: list[CheckpointMove]
    lock: str
    dry_run: bool = False
    done: bool = False
    resumed: bool = False
    kept_as: str | None = None
    source_digest: str | None = None
    message: str = ""

    def as_dict(self) -> dict[str, object]:
        """JSON shape of the plan and outcome (a missing checkpoint has ``present: false``)."""
        return asdict(self)


def _target_dir(to: str, create: bool, dry_run: bool) -> Path:
    """The target directory, checked the same way by a dry run and a real run (which
    creates it with ``--create-dir``); a dry run or a refusal creates nothing."""
    if not os.path.isabs(to):
        raise StateError("RIVET_STATE_DIR_RELATIVE",
                         f"target directory '{to}' is relative; every task must see the same absolute path")
    target = Path(os.path.normpath(to))
    if os.path.lexists(target) and not target.is_dir():
        raise StateError("RIVET_STATE_TARGET_NOT_EMPTY", f"target {target} exists and is not a directory")
    if not target.is_dir():
        if not create:
            raise StateError("RIVET_STATE_DIR_MISSING",
                             f"target directory {target} does not exist; mount it (or pass --create-dir)")
        parent = target.parent
        while not parent.is_dir() and parent != parent.parent:
            parent = parent.parent
        refuse_unwritable(target, directories=(parent,), need=0)  # READ_ONLY / PERMISSION_DENIED, naming it
        if not dry_run:
            try:
                target.mkdir(parents=True)
            except OSError as err:
                raise StateError("RIVET_STATE_DIR_MISSING",
                                 f"target directory {target} cannot be created: {err.strerror}") from None
    else:
        refuse_unwritable(target / STATE_FILE, directories=(target,), need=0)
    return target


def require_retirable(location: Location) -> Path:
    """The file a move retires: the state file, or, when the configured path is a symlink,
    the file it resolves to (:attr:`Location.real_path`; retiring the link would leave the
    real file writable: a second live place). Its directory must be writable, as the
    keep-link and the tombstone are made there: else ``RIVET_STATE_READ_ONLY`` or
    ``RIVET_STATE_PERMISSION_DENIED`` naming it, before anything is written (SPEC §8a, §9)."""
    assert location.path is not None
    source = location.real_path or location.path
    if not os.access(source.parent, os.W_OK | os.X_OK):
        via = f" (the real file of the symlink {location.path})" if source != location.path else ""
        err = fault(source.parent, PermissionError(errno.EACCES, f"{source.parent}{via} is not writable"))
        assert err is not None
        raise StateError(err.code, f"{err.message}; the move must retire {source}{via} there and cannot", err.details)
    return source


def move_files(directory: Path) -> list[Path]:
    """The names a move creates in ``directory`` besides the state itself: what must not
    be a symlink or a non-regular file (checked before anything is written)."""
    return [Path(f"{directory / COPY_NAME}{suffix}") for suffix in ("", "-journal", "-wal", "-shm")]


def stale_tombstones(source: Path) -> list[Path]:
    """Temporary tombstones a killed move left beside ``source`` (removed by the next run;
    each must be a regular file: :func:`refuse_unsafe` first)."""
    return sorted(source.parent.glob(f"{STATE_FILE}.tombstone-*.tmp"))


def finish_command(ctx: Context, verb: str) -> str:
    """The command line that finishes (or re-runs) this move: recorded in the target, shown
    by ``RIVET_STATE_MOVE_IN_FLIGHT``."""
    location = ctx.location
    url = f" --state-url {shlex.quote(location.state_url)}" if location.state_url else ""
    return f"statetool -c {shlex.quote(os.path.abspath(ctx.config_path))}{url} {verb}"


def _checkpoints(ctx: Context, target: Location) -> list[CheckpointMove]:
    """Each relative checkpoint: where it resolves now, and where it will resolve after the move."""
    moves = []
    for export in ctx.config.exports:
        if not export.cdc or not export.cdc.checkpoint or os.path.isabs(export.cdc.checkpoint):
            continue
        now = resolve_checkpoint(export.cdc.checkpoint, export.cdc.engine, ctx.location, ctx.config.directory)
        after = resolve_checkpoint(export.cdc.checkpoint, export.cdc.engine, target, ctx.config.directory,
                                   exists=lambda _path: True)
        assert now.path is not None and after.path is not None
        present = now.path.is_file()
        moves.append(CheckpointMove(export.name, export.cdc.checkpoint, str(now.path), str(after.path), present,
                                    now.path.stat().st_size if present else None))
    return moves


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _checkpoint_tmp(move: CheckpointMove) -> Path:
    return Path(move.target).with_name(f".{Path(move.target).name}.relocating")


def check_checkpoints(moves: list[CheckpointMove], resuming: bool) -> None:
    """Refuse, before anything is written (a dry run the same), a checkpoint target that
    already holds other bytes (``RIVET_STATE_TARGET_NOT_EMPTY``; an interrupted relocation
    of this source may overwrite its own), or a symlink / non-regular file where a
    checkpoint or its temporary copy goes (``RIVET_STATE_UNSAFE_FILE``)."""
    for move in moves:
        if not move.present:
            continue
        target = Path(move.target)
        refuse_unsafe(target, _checkpoint_tmp(move))
        if target.exists() and not resuming and _sha256(target) != _sha256(Path(move.source)):
            raise StateError("RIVET_STATE_TARGET_NOT_EMPTY",
                             f"{target} already exists with other content (checkpoint of export {move.export}); "
                             "move it aside (or remove it if it is stale) and re-run", {"path": str(target)})


def _copy_checkpoint(move: CheckpointMove) -> None:
    """Copy one checkpoint into place (temporary file, fsync, sha256 compared, rename);
    :func:`check_checkpoints` has refused every conflict before."""
    source, target = Path(move.source), Path(move.target)
    if target.exists() and _sha256(target) == _sha256(source):
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _checkpoint_tmp(move)
    tmp.unlink(missing_ok=True)  # a regular file (checked): what a killed run left
    with open(source, "rb") as src, os.fdopen(os.open(tmp, CREATE_FLAGS, 0o644), "wb") as dst:
        shutil.copyfileobj(src, dst)
        dst.flush()
        os.fsync(dst.fileno())
    if _sha256(tmp) != _sha256(source):
        tmp.unlink()
        raise StateError("RIVET_STATE_VERIFY_FAILED", f"the copy of checkpoint {source} did not verify")
    os.replace(tmp, target)
    fsync_dir(target.parent)


def _relocation_row(path: Path) -> dict[str, object] | None:
    """The last ``relocate`` audit row of the state at ``path`` (read-only), or None."""
    try:
        db = sqlite3.connect(f"file:{path}?immutable=1", uri=True)
        try:
            row = db.execute("SELECT detail FROM rivet_audit WHERE action = 'relocate' ORDER BY id DESC LIMIT 1"
                             ).fetchone()
            later = db.execute("SELECT count(*) FROM rivet_audit WHERE action != 'relocate' AND id > "
                               "(SELECT max(id) FROM rivet_audit WHERE action = 'relocate')").fetchone()[0]
        finally:
            db.close()
    except sqlite3.Error:
        return None
    if row is None or later:
        return None
    detail = json.loads(row[0])
    return detail if isinstance(detail, dict) else None


def _check_target(ctx: Context, source: Path, target_dir: Path) -> dict[str, object] | None:
    """Refuse a target that holds anything but this source's own unfinished relocation
    (in flight: never live); return that relocation's audit detail to resume it."""
    target = target_dir / STATE_FILE
    if not os.path.lexists(target):
        return None
    refuse_unsafe(target)
    target_ctx = Context(ctx.config_path, f"sqlite:{target_dir}", ctx.env, ctx.lock_wait, ctx.command)
    pf = run_preflight(target_ctx)
    foreign = next((c for c in pf.checks if c.code == "RIVET_STATE_FOREIGN"), None)
    if foreign is not None:
        raise StateError("RIVET_STATE_FOREIGN", f"the target {target_dir} holds the state of another source: "
                         f"{foreign.message}", {"directory": str(target_dir)})
    in_flight = next((c for c in pf.checks if c.code == "RIVET_STATE_MOVE_IN_FLIGHT"), None)
    if in_flight is not None:
        detail = _relocation_row(target)
        if detail is not None and detail.get("from") == str(source):
            return detail
        assert in_flight.error is not None
        raise in_flight.error  # another source's move: it must be finished first
    raise StateError("RIVET_STATE_TARGET_NOT_EMPTY",
                     f"{target} already exists ({'a state' if pf.snapshot else 'not a state of this source'}); "
                     "relocate only into a directory without a state")


def finish_target(target: Path) -> None:
    """Make the relocated copy at ``target`` live (the source is retired): its version
    goes from :data:`IN_FLIGHT_REVISION` back to head. Idempotent."""
    db = sqlite3.connect(target, isolation_level=None)
    try:
        db.execute("BEGIN IMMEDIATE")
        db.execute(f"UPDATE {VERSION_TABLE} SET version_num = ? WHERE version_num = ?",
                   (migrations.head(), IN_FLIGHT_REVISION))
        db.execute("COMMIT")
    finally:
        db.close()
    _fsync(target)


def _fsync(path: Path) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


def _remove_leftovers(source: Path, target_dir: Path, moves: list[CheckpointMove]) -> None:
    """What a killed run of this move may have left on either side (temporary files only:
    every one regular, checked before)."""
    for path in move_files(target_dir) + [_checkpoint_tmp(m) for m in moves]:
        path.unlink(missing_ok=True)
    for stale in stale_tombstones(source):
        stale.unlink()


def relocate(ctx: Context, to: str, *, create_dir: bool = False, dry_run: bool = False,
             full_verify: bool = False) -> RelocateResult:
    """Move the SQLite state at the resolved location into directory ``to`` (SPEC §9).

    Raises ``RIVET_STATE_BACKEND_UNSUPPORTED`` (not a SQLite state),
    ``RIVET_STATE_DIR_RELATIVE`` / ``RIVET_STATE_DIR_MISSING`` (target),
    ``RIVET_STATE_FOREIGN`` / ``RIVET_STATE_TARGET_NOT_EMPTY`` (target holds something),
    ``RIVET_STATE_MOVE_IN_FLIGHT`` (another source's move into the target is unfinished),
    ``RIVET_STATE_UNSAFE_FILE`` (a symlink where a file of the move belongs),
    ``RIVET_STATE_READ_ONLY`` / ``RIVET_STATE_PERMISSION_DENIED`` (the source's directory,
    or a symlinked state's real directory, cannot be written),
    ``RIVET_STATE_RUN_IN_PROGRESS`` (a live run past ``--lock-wait``),
    ``RIVET_STATE_VERIFY_FAILED`` (the copy differs; the source is untouched), and every
    pre-flight code of the source. ``dry_run`` runs every one of these checks, in this
    function, then prints the plan and writes nothing. A re-run of a finished relocation
    answers "already relocated" (and finishes one killed after the switch).
    """
    location = ctx.location
    if location.backend != "sqlite":
        raise StateError("RIVET_STATE_BACKEND_UNSUPPORTED",
                         "relocate moves a SQLite state; to move a PostgreSQL state use pg_dump")
    assert location.path is not None and location.directory is not None
    source = location.real_path or location.path
    target_dir = _target_dir(to, create_dir, dry_run=True)  # created below, once the source passed
    state_url = f"sqlite:{target_dir}"
    if target_dir in (location.directory, source.parent):
        raise StateError("RIVET_STATE_TARGET_NOT_EMPTY", f"the state is already in {target_dir}")
    tomb = read_tombstone(source)
    if tomb is not None and tomb.get("to") == str(target_dir / STATE_FILE):
        refuse_unsafe(*move_files(target_dir), *stale_tombstones(source))
        if not dry_run:  # a kill after the switch: the target is made live, leftovers go
            if (target_dir / STATE_FILE).is_file() and not (target_dir / STATE_FILE).is_symlink():
                finish_target(target_dir / STATE_FILE)
            _remove_leftovers(source, target_dir, [])
            for leftover in (Path(f"{source}-wal"), Path(f"{source}-shm")):
                leftover.unlink(missing_ok=True)
        return RelocateResult(str(source), tomb["to"], state_url, 0, {}, [], "none", dry_run, True, True,
                              tomb.get("kept_as"), tomb.get("source_digest"),
                              f"already relocated to {target_dir}; every task must run with RIVET_STATE_URL={state_url}")
    # The source's own integrity is proven by the copy instead: page digests equal, and
    # the copy passes quick_check. Per-export progress is not needed, only export names.
    require_retirable(location)  # these before the pre-flight
    refuse_unsafe(*move_files(target_dir), *stale_tombstones(source))
    pf = run_preflight(ctx, for_write=True, progress=False, integrity=False)
    snap = require(pf)
    resume = _check_target(ctx, source, target_dir) if target_dir.is_dir() else None
    backend = SqliteBackend(location, ctx.lock_wait)
    with backend.reading() as conn:
        tables = row_counts(conn, snap.tables)
        exports = sorted({e.name for e in ctx.config.exports} | export_names(conn))
    result = RelocateResult(
        str(source), str(target_dir / STATE_FILE), state_url, source.stat().st_size, tables,
        _checkpoints(ctx, Location("sqlite", "declared_dir", "flag", directory=target_dir,
                                   path=target_dir / STATE_FILE)),
        f"the run lease of every export ({len(exports)}) and the SQLite write lock",
        dry_run=dry_run, resumed=resume is not None)
    check_checkpoints(result.checkpoints, resuming=resume is not None)
    room = target_dir if target_dir.is_dir() else next(p for p in target_dir.parents if p.is_dir())
    refuse_unwritable(room / STATE_FILE, directories=(room,), need=2 * result.size_bytes + WRITE_MARGIN +
                      sum(c.bytes or 0 for c in result.checkpoints),
                      room_for="the copy of the state, its journal, and the CDC checkpoints")
    if dry_run:
        result.message = f"dry run: nothing was changed; after the move every task must run with RIVET_STATE_URL={state_url}"
        return result
    _target_dir(to, create_dir, dry_run=False)
    _remove_leftovers(source, target_dir, result.checkpoints)

    def hold_off_writers() -> None:
        crash_point("leases")
        wait_for_openers(source, ctx.lock_wait)
        backend.checkpoint_wal()
        crash_point("checkpointed")

    with contextlib.ExitStack() as stack:
        session = stack.enter_context(guarded_write(ctx, WHOLE_STATE, preflight=pf, exports=exports, claim=False,
                                                    prepare=hold_off_writers, lock_code="RIVET_STATE_RUN_IN_PROGRESS"))
        conn = session.conn
        if not backend.wal_is_empty():
            raise StateError("RIVET_STATE_RUN_IN_PROGRESS", f"a writer wrote to {source} during the checkpoint; re-run")
        crash_point("locked")
        # The source's digest is read in a second thread while the backup API copies it
        # (hashlib releases the GIL): the two reads of the frozen file overlap.
        digesting = stack.enter_context(ThreadPoolExecutor(1)).submit(content_digest, source)
        if resume is not None:
            result.source_digest = digesting.result()
            crash_point("digested")
            if resume.get("source_digest") != result.source_digest:
                # The source was written after the kill. The copy in flight was never
                # live (no one could open it), so it is simply made again.
                for suffix in ("", "-journal", "-wal", "-shm"):
                    Path(f"{target_dir / STATE_FILE}{suffix}").unlink(missing_ok=True)
                fsync_dir(target_dir)
                resume = None
        created = _absent_paths(target_dir, result.checkpoints)
        try:
            if resume is None:
                _copy_state(ctx, session, backend, conn, target_dir, result, full_verify, digesting)
            else:
                for move in result.checkpoints:
                    if move.present:
                        _copy_checkpoint(move)
        except (OSError, sqlite3.Error) as err:
            if not _disk_full(err):
                raise
            _remove_partial_copy(target_dir, result.checkpoints, created)
            raise StateError("RIVET_STATE_DISK_FULL",
                             f"the filesystem of {target_dir} is full ({err}); what this run had copied there was "
                             f"removed, and the state at {source} was not changed", {"directory": str(target_dir)}
                             ) from None
        wait_for_openers(source, ctx.lock_wait)  # again, at the last instant before the switch
        result.kept_as = retire_source(ctx, source, result.target, state_url, result.source_digest,
                                       "statetool relocate")
    finish_target(target_dir / STATE_FILE)
    crash_point("finished")
    result.done = True
    result.message = f"relocated; every task must now run with RIVET_STATE_URL={state_url}"
    return result


def wait_for_openers(source: Path, lock_wait: float) -> None:
    """Wait up to ``lock_wait`` seconds until no other process holds the source file open,
    then refuse (``RIVET_STATE_RUN_IN_PROGRESS``) naming them.

    A connection to a WAL state holds a lock on the file for as long as it is open, even
    idle, and SQLite notices a moved database only in rollback-journal mode (on opening its
    journal: SQLITE_READONLY_DBMOVED). Such a process would go on committing into the old
    place after the switch, rows no one would ever read again. Read from /proc/locks, so
    nobody is disturbed; where it cannot be read this check is skipped.
    """
    deadline = time.monotonic() + lock_wait
    while True:
        others = sorted((lock_holders(source) or set()) - {os.getpid()})
        if not others:
            return
        if time.monotonic() >= deadline:
            raise StateError("RIVET_STATE_RUN_IN_PROGRESS",
                             f"process(es) {', '.join(f'pid {p}' for p in others)} hold {source} open (an open "
                             f"SQLite connection); after the move they would go on writing into the old place. "
                             f"Stop them, or wait until they close it (waited {lock_wait:g} s, --lock-wait)",
                             {"path": str(source), "pids": others})
        time.sleep(0.2)


def _disk_full(err: BaseException) -> bool:
    """True for "no space left" from the OS (ENOSPC, EDQUOT) or from SQLite (SQLITE_FULL)."""
    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    code = getattr(err, "sqlite_errorcode", None)
    return (code is not None and code & 0xFF == 13) or "database or disk is full" in str(err)


def _absent_paths(target_dir: Path, moves: list[CheckpointMove]) -> list[Path]:
    """The checkpoint files, and the directories above them inside ``target_dir``, that do
    not exist yet: what a copy that fails half-way must remove again."""
    absent: list[Path] = []
    for move in moves:
        path = Path(move.target)
        while path != target_dir and target_dir in path.parents and not os.path.lexists(path):
            absent.append(path)
            path = path.parent
    return absent


def _remove_partial_copy(target_dir: Path, moves: list[CheckpointMove], created: list[Path]) -> None:
    for suffix in ("", "-journal", "-wal", "-shm"):
        Path(f"{target_dir / COPY_NAME}{suffix}").unlink(missing_ok=True)
    for move in moves:
        Path(move.target).with_name(f".{Path(move.target).name}.relocating").unlink(missing_ok=True)
    for path in sorted(set(created), key=lambda p: len(p.parts), reverse=True):  # files, then their folders
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink():
                path.rmdir()  # only when empty: what was there before stays
            else:
                path.unlink()


def _copy_state(ctx: Context, session: WriteSession, backend: SqliteBackend, conn: object, target_dir: Path,
                result: RelocateResult, full_verify: bool, source_digest: Future[str]) -> None:
    copy = target_dir / COPY_NAME
    os.close(os.open(copy, CREATE_FLAGS, 0o644))  # checked absent or removed: never follows a link

    def progress(done: int, total: int) -> None:
        update(done, total)
        if os.environ.get("STATETOOL_CRASH_AT", "").startswith("copy-page-"):
            crash_point(f"copy-page-{done}")

    with ctx.progress("copying") as update:
        backend.copy_to(conn, copy, progress, full_verify)  # type: ignore[arg-type]
    result.source_digest = source_digest.result()
    crash_point("digested")
    if content_digest(copy) != result.source_digest:
        copy.unlink()
        raise StateError("RIVET_STATE_VERIFY_FAILED", f"the copy at {copy} differs from {result.source}; "
                         "nothing was changed")
    crash_point("copied")
    for move in result.checkpoints:
        if move.present:
            _copy_checkpoint(move)
    crash_point("checkpoint-copied")
    db = sqlite3.connect(copy)
    try:
        with db:  # the copy is in flight: no one opens it until the source is retired
            session.audit("relocate", {"from": result.source, "to": result.target,
                                       "source_digest": result.source_digest,
                                       "finish": finish_command(ctx, f"relocate --to {shlex.quote(str(target_dir))}"),
                                       "checkpoints": [m.target for m in result.checkpoints if m.present]}, into=db)
            db.execute(f"UPDATE {VERSION_TABLE} SET version_num = ?", (IN_FLIGHT_REVISION,))
    finally:
        db.close()
    _fsync(copy)
    crash_point("audited")
    try:
        os.link(copy, target_dir / STATE_FILE)
    except FileExistsError:
        raise StateError("RIVET_STATE_TARGET_NOT_EMPTY",
                         f"{target_dir / STATE_FILE} appeared during the copy; nothing was replaced") from None
    fsync_dir(target_dir)
    crash_point("linked")
    copy.unlink()
    fsync_dir(target_dir)


def retire_source(ctx: Context, source: Path, to: str, state_url: str, digest: str | None, how: str) -> str:
    """Keep the source's bytes as ``.rivet_state.db.relocated-<UTC>`` and put a tombstone
    at its path in one atomic rename (statetool/backends/tombstone.py). Shared by relocate
    and transfer. Returns the path the old bytes are kept at."""
    directory = source.parent
    for old in directory.glob(f"{STATE_FILE}.relocated-*"):
        if old.is_file() and not old.is_symlink() and os.path.samefile(old, source):
            old.unlink()  # a link an interrupted switch made: the same bytes as the source
    kept = directory / f"{STATE_FILE}.relocated-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    refuse_unsafe(kept)
    try:
        os.link(source, kept, follow_symlinks=False)  # never replaces (nor follows) what is there
    except FileExistsError:
        raise unsafe_error(kept, "already exists") from None
    fsync_dir(directory)
    crash_point("kept")
    tomb = write_tombstone_tmp(directory, {"to": to, "state_url": state_url, "at": now_iso(), "by": ctx.actor,
                                           "kept_as": str(kept), "source_digest": digest, "how": how})
    crash_point("tombstoned")
    os.replace(tomb, source)
    fsync_dir(directory)
    crash_point("swapped")
    for leftover in (Path(f"{source}-wal"), Path(f"{source}-shm")):
        leftover.unlink(missing_ok=True)
    return str(kept)
