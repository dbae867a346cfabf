"""What this user may do with a path, told truly (SPEC §8a): a permission failure names the
user and the directory or file that stops it, and is never reported as a missing file.
Facts only: reads ``stat`` and the user database, changes nothing."""

from __future__ import annotations

import grp
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


def _name_of(uid: int, gid: int) -> str:
    """``user (uid N), group G (gid M)`` for a message."""
    try:
        user = f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        user = f"uid {uid}"
    try:
        return f"{user}, group {grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"{user}, gid {gid}"


def may_give_owner(st: os.stat_result) -> bool:
    """True when this process may give a file it creates the owner and group of ``st``
    (``fchown``, chown(2)): it is root, or it is that owner and that group is one of its
    groups. (A process with CAP_CHOWN but not root counts as not: told so truly, it is
    refused rather than half-done.)"""
    if os.geteuid() == 0:
        return True
    return st.st_uid == os.geteuid() and (st.st_gid == os.getegid() or st.st_gid in os.getgroups())


def unownable(path: Path, st: os.stat_result, doing: str) -> StateError:
    """``RIVET_STATE_PERMISSION_DENIED``: ``doing`` (e.g. ``a migration``) puts a new file
    where ``path`` is (or at its new place), which must keep ``path``'s owner and group
    (``st``), and this user cannot give them (:func:`may_give_owner`): it is another user,
    or the owner outside the file's group (then the sentence names the group, not the
    owner, as what stands in the way). The path is shown as it is."""
    if st.st_uid == os.geteuid():  # the owner, but not a member of the file's group
        why = (f"and this user, {_user()}, is its owner but not in its group, so the new file cannot keep that "
               "group; run it as a member of that group, give the state one of its owner's groups (chgrp), "
               "or run it as root")
    else:
        why = f"which this user, {_user()}, cannot give to that owner; run it as the state's owner (or as root)"
    return StateError("RIVET_STATE_PERMISSION_DENIED",
                      f"{path} belongs to {_name_of(st.st_uid, st.st_gid)}: {doing} replaces it by a new file, "
                      f"{why}; nothing was changed", {"path": str(path), "uid": st.st_uid, "gid": st.st_gid})


def refuse_unownable(path: Path, doing: str) -> None:
    """Raise :func:`unownable` unless this user may give a new file ``path``'s owner and
    group; a ``path`` that does not exist passes (there is no owner to keep)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if not may_give_owner(st):
        raise unownable(path, st, doing)


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, for a message: ``a symlink``, ``a directory``,
    ``a FIFO``, ``a socket``, ``a device`` or ``a regular file``."""
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "a regular file"
