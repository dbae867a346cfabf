"""The tombstone a relocated (or transferred) SQLite state leaves at its old place (SPEC §9).

After a relocation, ``<old dir>/.rivet_state.db`` is replaced, atomically, by a small
text file that starts with :data:`MAGIC` and holds JSON saying where the state went and
the ``RIVET_STATE_URL`` to set. The old bytes are kept beside it as
``.rivet_state.db.relocated-<UTC timestamp>`` (a hard link made before the swap). That
switch is :func:`retire`, for relocate and transfer alike.

Why a file at the old path, and not a marker inside the old database or no file at all:

* no file at all would let any release create a new, empty state there on its next
  run: the silent first run this whole tool exists to prevent;
* a marker inside the old database would be read only by releases that know it; an
  older release would go on writing to it;
* a text file is not a SQLite database, so EVERY release fails to open it (SQLite
  answers "file is not a database"), statetool and the runtime API recognise it and
  refuse with ``RIVET_STATE_RELOCATED``, and ``init`` refuses to overwrite it.

A process that still has the old database open is another matter: in rollback-journal
mode SQLite notices the move on its next write (SQLITE_READONLY_DBMOVED), but in WAL mode
it does not, and an idle connection would go on committing into the old inode. So
relocate and transfer wait (``--lock-wait``) until no other process holds the file open
(read from ``/proc/locks``), and refuse otherwise, before and again just before the switch
(:func:`wait_for_openers`).

The other end of a move, while it is in flight (decisions.md, "Moves: one live place"):
the new place receives its copy with :data:`statetool.schema.IN_FLIGHT_REVISION` in its
version table, so every opener refuses it (this release with ``RIVET_STATE_MOVE_IN_FLIGHT``,
naming the command that finishes the move; an older release sees a revision it does not know) until
the source is retired; only then is the version set back to head. At no instant are two
places live.

Every file of a move that statetool creates (the tombstone's temporary file, the kept
link, the ``.relocating`` copies) is created with ``O_EXCL | O_NOFOLLOW`` (a link never
replaces anything); a symlink or a non-regular file standing where one of them belongs is
refused by :func:`refuse_unsafe` before anything is written.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from statetool.backends.durable import CREATE_FLAGS, fsync_dir, like
from statetool.backends.faults import fault
from statetool.backends.proclocks import lock_holders
from statetool.errors import StateError
from statetool.location import STATE_FILE, Location
from statetool.redact import redact_values

if TYPE_CHECKING:
    from statetool.backends.base import Step

MAGIC = b"RIVET-STATE-RELOCATED\n"


def read_tombstone(path: Path) -> dict[str, Any] | None:
    """The tombstone at ``path`` as a dict (``to``, ``state_url``, ``at``, ``by``,
    ``kept_as``, ...), or None when the file is not a tombstone."""
    try:
        # O_NONBLOCK and the fstat: a FIFO or a device at the state's path is never read from.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode) or os.pread(fd, len(MAGIC), 0) != MAGIC:
            return None
        body = os.pread(fd, 1 << 20, len(MAGIC))
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        doc = json.loads(body)
    except ValueError:
        doc = {}
    return doc if isinstance(doc, dict) else {}


def write_tombstone_tmp(directory: Path, doc: dict[str, Any], model: os.stat_result) -> Path:
    """Write a tombstone to a temporary file in ``directory``, fsynced; the caller renames
    it over the state file (one atomic step). It gets the mode, owner and group of
    ``model`` (the ``stat`` of the state it replaces: no more readable than the state, and
    still readable by its owner's runs, which must see ``RIVET_STATE_RELOCATED``). Every
    string of ``doc`` is redacted (SPEC §7). Raises ``PermissionError`` when the owner
    cannot be given (refused before any lease: ``Backend.check_writable``)."""
    tmp = directory / f"{STATE_FILE}.tombstone-{os.getpid()}.tmp"
    refuse_unsafe(tmp)
    tmp.unlink(missing_ok=True)  # a regular file an earlier process of this pid left
    try:
        fd = os.open(tmp, CREATE_FLAGS, 0o600)
    except FileExistsError:
        raise unsafe_error(tmp, "appeared while it was being created") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            like(fd, model)
            fh.write(MAGIC + json.dumps(redact_values(doc), indent=2, sort_keys=True).encode() + b"\n")
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # no fault leaves a temporary file behind (SPEC §8a)
        raise
    return tmp


def unsafe_error(path: Path, what: str) -> StateError:
    """``RIVET_STATE_UNSAFE_FILE`` naming ``path`` (one of a move's own files) and ``what`` stands there."""
    return StateError("RIVET_STATE_UNSAFE_FILE",
                      f"{path} {what}, where statetool keeps a file of its own; it is never followed and nothing "
                      "was written: move it away and re-run", {"path": str(path)})


def refuse_unsafe(*paths: Path) -> None:
    """Raise ``RIVET_STATE_UNSAFE_FILE`` (SPEC §8a) for the first of ``paths`` that is a
    symlink or not a regular file; a path that does not exist, or is a regular file, passes."""
    for path in paths:
        if path.is_symlink():
            raise unsafe_error(path, f"is a symlink (to {os.readlink(path)})")
        if os.path.lexists(path) and not path.is_file():
            raise unsafe_error(path, "is not a regular file")


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


def stale_tombstones(source: Path) -> list[Path]:
    """Temporary tombstones a killed move left beside ``source`` (removed by the next run;
    each must be a regular file: :func:`refuse_unsafe` first)."""
    return sorted(source.parent.glob(f"{STATE_FILE}.tombstone-*.tmp"))


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


def retire(source: Path, doc: dict[str, Any], on_step: Step) -> Path:
    """Keep the bytes of the state file ``source`` as ``.rivet_state.db.relocated-<UTC>``
    (a hard link) and put a tombstone holding ``doc`` (``to``, ``state_url``, ``at``,
    ``by``, ``source_digest``, ``how``; ``kept_as`` is added) at its path in one atomic
    rename; the old inode's ``-wal``/``-shm`` go. Returns the path the old bytes are kept
    at. ``on_step`` is told ``kept``, ``tombstoned`` and ``swapped``. Raises
    ``RIVET_STATE_UNSAFE_FILE`` (something stands at the keep's name)."""
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
    on_step("kept")
    tomb = write_tombstone_tmp(directory, {**doc, "kept_as": str(kept)}, os.stat(kept))
    on_step("tombstoned")
    os.replace(tomb, source)
    fsync_dir(directory)
    on_step("swapped")
    remove_companions(source)
    return kept


def remove_companions(source: Path) -> None:
    """Remove the ``-wal`` and ``-shm`` of the retired file ``source`` (its old inode's;
    the tombstone now stands there and has none). Raises ``RIVET_STATE_UNSAFE_FILE`` for
    a symlink or non-regular file there, before removing anything."""
    companions = (Path(f"{source}-wal"), Path(f"{source}-shm"))
    refuse_unsafe(*companions)
    for leftover in companions:
        leftover.unlink(missing_ok=True)
