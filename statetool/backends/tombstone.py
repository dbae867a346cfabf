"""The tombstone a relocated (or transferred) SQLite state leaves at its old place (SPEC §9).

After a relocation, ``<old dir>/.rivet_state.db`` is replaced, atomically, by a small
text file that starts with :data:`MAGIC` and holds JSON saying where the state went and
the ``RIVET_STATE_URL`` to set. The old bytes are kept beside it as
``.rivet_state.db.relocated-<UTC timestamp>`` (a hard link made before the swap).

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
(read from ``/proc/locks``), and refuse otherwise, before and again just before the switch.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from statetool.redact import redact_values

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


def write_tombstone_tmp(directory: Path, doc: dict[str, Any]) -> Path:
    """Write a tombstone to a temporary file in ``directory``, fsynced; the caller renames
    it over the state file (one atomic step). Every string of ``doc`` is redacted (SPEC §7)."""
    tmp = directory / f".rivet_state.db.tombstone-{os.getpid()}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(MAGIC + json.dumps(redact_values(doc), indent=2, sort_keys=True).encode() + b"\n")
        fh.flush()
        os.fsync(fh.fileno())
    return tmp
