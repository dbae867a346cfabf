"""What this user may do with a path, told truly (SPEC §8a): a permission failure names the
user and the directory or file that stops it, and is never reported as a missing file.
Facts only: reads ``stat`` and the user database, changes nothing."""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

from statetool.errors import StateError


def _user() -> str:
    """This process's user, as ``name (uid N)``."""
    uid = os.geteuid()
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _blocking_part(path: Path) -> str:
    """Where the walk to ``path`` stops for this user: the first directory it may not
    enter, with its owner and mode, else ``path`` itself with its owner and mode."""
    for part in [*reversed(path.parents), path]:
        try:
            st = os.stat(part)
        except OSError:
            return str(part)
        try:
            owner = pwd.getpwuid(st.st_uid).pw_name
        except KeyError:
            owner = f"uid {st.st_uid}"
        where = f"{part} (owner {owner}, mode {stat.filemode(st.st_mode)})"
        if part != path and stat.S_ISDIR(st.st_mode) and not os.access(part, os.X_OK):
            return where
    return where


def denied(path: Path, doing: str) -> StateError:
    """``RIVET_STATE_PERMISSION_DENIED`` for ``path``, naming this user and the directory or
    file that stops it (SPEC §8a: a permission failure is never a missing state).
    ``doing`` is what was refused (``read``, ``open``, ``write``)."""
    return StateError("RIVET_STATE_PERMISSION_DENIED",
                      f"this user, {_user()}, may not {doing} {path}: access stops at {_blocking_part(path)}",
                      {"path": str(path)})


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, for a message: ``a symlink``, ``a directory``,
    ``a FIFO``, ``a socket``, ``a device`` or ``a regular file``."""
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "a regular file"
