"""The read lock an ``immutable=1`` read of a WAL state holds, so no writer's close folds
its ``-wal`` into the file under it (SPEC §4, §7).

``immutable=1`` takes no lock: SQLite then assumes nobody changes the file. Beside a live
run that is not so. A runtime opens the state, commits into a new ``-wal`` and closes;
the last connection to close takes SQLite's EXCLUSIVE lock on the file, copies the
``-wal`` into it (a checkpoint) and removes the ``-wal``
(https://www.sqlite.org/wal.html#walfile). A read that had begun on the main file alone
then reads some pages from before that checkpoint and some from after: a torn read,
reported as ``RIVET_STATE_CORRUPT`` (measured here: about one read in fifteen beside a
writer committing and closing in a loop) or, worse, answered with mixed rows.

:func:`holding_shared` takes a read lock on the bytes SQLite's SHARED lock uses
(``SHARED_FIRST`` = 2^30 + 2, 510 bytes; https://www.sqlite.org/lockingv3.html and
``os_unix.c``), as an open file description (OFD) lock, for the whole read. SQLite's
EXCLUSIVE lock on those bytes is then refused to the closing writer, which leaves its
``-wal`` in place without waiting and without an error (``sqlite3WalClose`` tries the lock
once); the next close folds it. A WAL-mode run never waits for this lock and never sees
it busy (SPEC §5): its commits take no lock on the main file. OFD locks, unlike POSIX
ones, belong to this descriptor alone, so no other descriptor of this process, SQLite's
own included, can drop or share them.

A checkpoint that SQLite runs on its own as the ``-wal`` grows past 1,000 pages
(``wal_autocheckpoint``) takes no lock on the main file and is not held off; the read
notices it by the file's size and times (:class:`Fingerprint`).

This process's own OFD locks are counted here (:func:`own_locks`), so that
:mod:`statetool.backends.proclocks` can tell them from another process's (both show
pid -1 in ``/proc/locks``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from statetool.errors import StateError

#: SQLite's lock bytes (``os_unix.c``): the PENDING byte is at 1 GiB, the SHARED range after
#: it and the RESERVED byte.
SHARED_FIRST = 0x40000000 + 2
SHARED_SIZE = 510

_own: dict[tuple[int, int], int] = {}


def own_locks(st: os.stat_result) -> int:
    """How many OFD read locks this process holds now on the file whose stat is ``st``."""
    return _own.get((st.st_dev, st.st_ino), 0)


def _flock(kind: int) -> bytes:
    """A ``struct flock`` (Linux: short type, short whence, off_t start, off_t len, pid_t pid)
    over the SHARED range; the pid must be 0 for an OFD lock."""
    return struct.pack("hhqqi4x", kind, os.SEEK_SET, SHARED_FIRST, SHARED_SIZE, 0)


@contextlib.contextmanager
def holding_shared(path: Path, wait: float) -> Iterator[None]:
    """Hold a read lock on SQLite's SHARED bytes of the file at ``path`` for the block
    (the module docstring). While a writer holds EXCLUSIVE (its close is checkpointing, a
    few milliseconds), the lock is tried again every 10 ms for up to ``wait`` seconds, then
    ``RIVET_STATE_RUN_IN_PROGRESS``. Where the kernel has no OFD locks (not Linux), nothing
    is held and the read relies on :class:`Fingerprint` alone. Opens the file read-only:
    creates nothing, changes no byte."""
    import fcntl

    setlk = getattr(fcntl, "F_OFD_SETLK", None)
    if setlk is None:
        yield
        return
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.fcntl(fd, setlk, _flock(fcntl.F_RDLCK))
                break
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    raise StateError("RIVET_STATE_RUN_IN_PROGRESS",
                                     f"{path} stayed locked by a writer for {wait:g} s (--lock-wait); re-run "
                                     "when its writer has finished", {"path": str(path)}) from None
                time.sleep(0.01)
        key = (st.st_dev, st.st_ino)
        _own[key] = _own.get(key, 0) + 1
        try:
            yield
        finally:
            _own[key] -= 1
            if not _own[key]:
                del _own[key]
    finally:
        os.close(fd)


class Fingerprint(NamedTuple):
    """The main file's size and times (``st_size``, ``st_mtime_ns``, ``st_ctime_ns``, inode):
    a write into it, a checkpoint included, changes them."""

    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int

    @classmethod
    def of(cls, path: Path) -> Fingerprint:
        """The fingerprint of the file at ``path`` now."""
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)

    def changed(self, path: Path) -> bool:
        """True when the file at ``path`` is no longer as it was (or is gone)."""
        try:
            return Fingerprint.of(path) != self
        except OSError:
            return True
