"""The SQLite state file judged by its first 100 bytes, without opening a database.

Shared by the SQLite backend (before every open) and the SQLite lease store (before a
lease is taken beside a state): it loads no database driver, so ``leases run`` stays as
fast as a plain ``flock`` wrapper (SPEC §5) while still refusing a missing or relocated
state (SPEC §4, §9).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from statetool.access import file_kind
from statetool.backends.tombstone import MAGIC as TOMBSTONE_MAGIC
from statetool.backends.tombstone import read_tombstone
from statetool.errors import StateError

MAGIC = b"SQLite format 3\x00"


def relocated_error(path: Path) -> StateError:
    """``RIVET_STATE_RELOCATED`` for the tombstone at ``path``: where the state went and
    the ``RIVET_STATE_URL`` every task must now run with."""
    doc = read_tombstone(path) or {}
    url = doc.get("state_url", "?")
    return StateError(
        "RIVET_STATE_RELOCATED",
        f"the state that was at {path} was moved to {doc.get('to', '?')} on {doc.get('at', '?')} "
        f"by {doc.get('by', '?')}; every task must now run with RIVET_STATE_URL={url} "
        f"(the old bytes are kept as {doc.get('kept_as', '?')})",
        {"path": str(path), "to": doc.get("to"), "state_url": url},
    )


def read_header(path: Path) -> bytes:
    """The 100-byte SQLite header of the state file at ``path``.

    Raises ``RIVET_STATE_MISSING`` (nothing there), ``RIVET_STATE_RELOCATED`` (a
    tombstone), ``RIVET_STATE_NOT_A_STATE`` (not a regular file, empty, not SQLite) and
    ``RIVET_STATE_CORRUPT`` (shorter than its header says: truncated).
    """
    if not os.path.lexists(path):
        raise StateError("RIVET_STATE_MISSING", f"no state at {path}", {"path": str(path)})
    if not path.is_file():
        raise StateError("RIVET_STATE_NOT_A_STATE", f"{path} is not a regular file", {"path": str(path)})
    with open(path, "rb") as fh:
        header = fh.read(100)
    if header.startswith(TOMBSTONE_MAGIC):
        raise relocated_error(path)
    if len(header) < 100 or not header.startswith(MAGIC):
        what = "an empty file" if not header else "not a SQLite database"
        raise StateError("RIVET_STATE_NOT_A_STATE", f"{path} is {what}, not a rivet state", {"path": str(path)})
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    header_count_valid = header[24:28] == header[92:96]
    size = path.stat().st_size
    if header_count_valid and pages and size < pages * page_size:
        raise StateError("RIVET_STATE_CORRUPT",
                         f"{path} is truncated: {size} bytes on disk, its header says "
                         f"{pages} pages of {page_size} bytes ({pages * page_size} bytes)", {"path": str(path)})
    return header


def refuse_unsafe_companions(path: Path) -> None:
    """``RIVET_STATE_UNSAFE_FILE`` when the ``-journal``, ``-wal`` or ``-shm`` of the state at
    ``path`` is a symlink or anything but a regular file: SQLite opens them by name, so a
    symlink there would make it read, merge or truncate a file elsewhere (SPEC §8a)."""
    for companion in (Path(f"{path}{suffix}") for suffix in ("-journal", "-wal", "-shm")):
        try:
            mode = os.lstat(companion).st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(mode):
            raise StateError("RIVET_STATE_UNSAFE_FILE", f"{companion} is {file_kind(mode)}, where SQLite keeps the "
                             "state's own journal; nothing was written", {"path": str(companion)})
