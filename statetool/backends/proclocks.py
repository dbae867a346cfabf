"""Who holds a lock on a file, read from Linux ``/proc/locks`` without taking any lock.

An inspection must never make a real run see a busy lock (SPEC §5), so liveness is read
from the kernel's lock table instead of by trying the lock.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC_LOCKS = Path("/proc/locks")


def lock_holders(path: Path) -> set[int] | None:
    """Pids holding any lock (POSIX, flock or OFD) on the file at ``path``.

    Returns an empty set when nobody holds one, and None when the kernel's lock table
    cannot be read (not Linux): the caller must then assume a holder may exist. OFD locks
    report pid -1.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None if not PROC_LOCKS.exists() else set()
    except OSError:
        return None
    return lock_holders_of(st)


def lock_holders_of(st: os.stat_result) -> set[int] | None:
    """Pids holding any lock on the file whose ``os.stat``/``os.fstat`` result is ``st``
    (an open file judged by its descriptor, never by a path that may be swapped); None
    when the kernel's lock table cannot be read."""
    try:
        table = PROC_LOCKS.read_text()
    except OSError:
        return None
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    holders: set[int] = set()
    for line in table.splitlines():
        fields = line.split()
        if "->" in fields:  # a waiter ("1: -> POSIX ..."), not a holder
            continue
        if len(fields) >= 6 and fields[5] == wanted:
            holders.add(int(fields[4]))
    return holders
