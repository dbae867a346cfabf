"""Who holds a lock on a file, read from Linux ``/proc/locks`` without taking any lock.

An inspection must never make a real run see a busy lock (SPEC §5), so liveness is read
from the kernel's lock table instead of by trying the lock.
"""

from __future__ import annotations

import os
from pathlib import Path

from statetool.backends.readlock import own_locks

PROC_LOCKS = Path("/proc/locks")


def lock_holders(path: Path, *, sqlite_only: bool = False) -> set[int] | None:
    """Pids holding any lock (POSIX, flock or OFD) on the file at ``path``; with
    ``sqlite_only``, the processes with a SQLite connection open on it: the holders of
    POSIX locks, which SQLite's unix VFS takes (a WAL connection holds a read lock on the
    file for as long as it is open), statetool's own OFD read locks left out.

    Returns an empty set when nobody holds one, and None when the kernel's lock table
    cannot be read (not Linux): the caller must then assume a holder may exist. OFD locks
    report pid -1, but this process's own (:func:`~statetool.backends.readlock.own_locks`)
    report its pid.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None if not PROC_LOCKS.exists() else set()
    except OSError:
        return None
    if not sqlite_only:
        return lock_holders_of(st)
    entries = _entries(st)
    return None if entries is None else {pid for kind, pid in entries if kind == "POSIX"}


def lock_holders_of(st: os.stat_result) -> set[int] | None:
    """Pids holding any lock on the file whose ``os.stat``/``os.fstat`` result is ``st``
    (an open file judged by its descriptor, never by a path that may be swapped); None
    when the kernel's lock table cannot be read."""
    entries = _entries(st)
    if entries is None:
        return None
    holders = {pid for kind, pid in entries if kind != "OFDLCK"}
    ofd = sum(kind == "OFDLCK" for kind, _ in entries)
    own = own_locks(st)
    if own:  # this process's own read locks (readlock.holding_shared) are its own pid's
        holders.add(os.getpid())
    if ofd > own:
        holders.add(-1)
    return holders


def _entries(st: os.stat_result) -> list[tuple[str, int]] | None:
    """``[(kind, pid)]`` of every lock held (waiters left out) on the file of ``st``: kind
    ``POSIX``, ``FLOCK`` or ``OFDLCK`` as ``/proc/locks`` names it; None when it cannot be read."""
    try:
        table = PROC_LOCKS.read_text()
    except OSError:
        return None
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    found: list[tuple[str, int]] = []
    for line in table.splitlines():
        fields = line.split()
        if "->" in fields:  # a waiter ("1: -> POSIX ..."), not a holder
            continue
        if len(fields) >= 6 and fields[5] == wanted:
            found.append((fields[1], int(fields[4])))
    return found
