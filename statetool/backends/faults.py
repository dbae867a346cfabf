"""Environment faults of a SQLite state, named truly (SPEC §8a): a read-only filesystem, a
permission the user lacks, a full disk. Each is permanent until someone acts, so none is
retryable, and none is a bug of statetool.

Given an ``OSError`` or a SQLite error text, :func:`fault` returns the registered error,
or None when the error is not one of these (the caller handles it as before).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from statetool.access import denied
from statetool.errors import StateError
from statetool.numbers import size_text

#: SQLite's own texts for these faults (https://www.sqlite.org/rescode.html).
_SQLITE_READONLY = ("attempt to write a readonly database", "unable to open database file")
_SQLITE_FULL = ("database or disk is full", "disk i/o error")


def read_only_fs(path: Path) -> bool:
    """True when the filesystem holding ``path`` (or its nearest existing parent) is
    mounted read-only (statvfs ``ST_RDONLY``)."""
    probe = path
    while not os.path.exists(probe) and probe != probe.parent:  # (Path.exists raises on EACCES)
        probe = probe.parent
    try:
        return bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def fault(path: Path, err: BaseException) -> StateError | None:
    """The registered error for an environment fault met at ``path`` (a state file, a lease
    sidecar, their directory), or None.

    ``RIVET_STATE_READ_ONLY`` (the filesystem is mounted read-only),
    ``RIVET_STATE_PERMISSION_DENIED`` (this user may not write there), ``RIVET_STATE_DISK_FULL``.
    """
    number = err.errno if isinstance(err, OSError) else None
    text = str(getattr(err, "orig", err))  # as it is: it may name a file, whose case is its own
    lowered = text.lower()  # (SQLite's texts matched whatever their case)
    where = {"path": str(path)}
    if number in (errno.ENOSPC, errno.EDQUOT) or any(t in lowered for t in _SQLITE_FULL):
        what = ("no file can be created beside it: its filesystem has no inode left (every file it can hold is "
                "there, though bytes may be free: remove files there)" if _out_of_inodes(path) else "no space left")
        return StateError("RIVET_STATE_DISK_FULL", f"{what} for {path} ({text}); nothing was written", where)
    if number in (errno.EROFS, errno.EACCES, errno.EPERM) or any(t in lowered for t in _SQLITE_READONLY):
        if number == errno.EROFS or read_only_fs(path):
            return StateError("RIVET_STATE_READ_ONLY", f"{path} is on a filesystem mounted read-only; nothing was "
                              "written", where)
        if number is not None or not os.access(path if os.path.exists(path) else path.parent, os.W_OK):
            return StateError("RIVET_STATE_PERMISSION_DENIED",
                              f"this user may not write {path} (or its directory): {text}; nothing was written", where)
    return None


def _out_of_inodes(path: Path) -> bool:
    """True when the filesystem of ``path`` (or of its nearest existing parent) counts its
    files and has none left to give (``statvfs`` ``f_favail`` 0), as a tmpfs mounted with
    ``nr_inodes`` does: ENOSPC then means no new file, not no byte."""
    for place in (path, *path.parents):
        try:
            st = os.statvfs(place)
        except OSError:
            continue
        return st.f_files > 0 and st.f_favail == 0
    return False


def os_fault(err: OSError) -> StateError | None:
    """The registered error of an environment fault that reached a command's boundary
    unnamed (an ``OSError`` with a file name), or None (then it is a bug: ``RIVET_INTERNAL``).

    ``RIVET_STATE_PERMISSION_DENIED`` (EACCES/EPERM off a read-only mount),
    ``RIVET_STATE_READ_ONLY`` (EROFS), ``RIVET_STATE_DISK_FULL`` (ENOSPC/EDQUOT),
    ``RIVET_STATE_UNSAFE_FILE`` (ELOOP: a symlink met where ``O_NOFOLLOW`` forbids one),
    ``RIVET_STATE_DIR_MISSING`` (ENOTDIR: a file where a directory is expected)."""
    if err.filename is None:
        return None
    path = Path(os.fsdecode(err.filename))
    if err.errno in (errno.EACCES, errno.EPERM) and not read_only_fs(path):
        return denied(path, "open")
    if err.errno == errno.ELOOP:
        return StateError("RIVET_STATE_UNSAFE_FILE", f"{path} is a symlink where statetool follows none; "
                          "nothing was written", {"path": str(path)})
    if err.errno == errno.ENOTDIR:
        return StateError("RIVET_STATE_DIR_MISSING", f"a part of {path} is a file where a directory is expected",
                          {"path": str(path)})
    return fault(path, err)


def refuse_no_files(path: Path, directory: Path) -> None:
    """Refuse ``path``, a file to be created in ``directory``, when that directory is on a
    kernel filesystem (:data:`statetool.mounts.KERNEL`: ``/proc``, ``/sys``, ...), which
    holds no file a program creates: ``RIVET_PLACE_HOLDS_NO_FILES``. The one rule of every
    place statetool writes a file in (a state, its leases, an archive, an export, a metrics
    textfile), so none of them calls such a place full or denied (SPEC §8a: a true message).
    The mount table is read only for a filesystem that reports no size (``statvfs``: no
    blocks), as the kernel's do: a write elsewhere pays one ``statvfs``."""
    try:
        if os.statvfs(directory).f_blocks:
            return
    except OSError:
        return  # the directory's own fault is the caller's to name
    from statetool.mounts import mount_of

    found = mount_of(directory)
    if found is not None and found.kernel:
        raise StateError("RIVET_PLACE_HOLDS_NO_FILES", f"{path}: {directory} is on {found.fstype} (mounted at "
                         f"{found.point}), a kernel filesystem, which holds no file a program creates; nothing was "
                         "written", {"path": str(path), "fstype": found.fstype})


#: Room a write needs beyond its backup: the rollback journal or WAL frames of a change,
#: the lease records, SQLite's shared-memory file (bytes).
WRITE_MARGIN = 1 << 20


def refuse_unwritable(path: Path, *, directories: tuple[Path, ...], need: int,
                      room_for: str = "a backup as large as the state, and room for the change") -> None:
    """Refuse, before any file is opened for writing, a write at ``path`` (an existing file
    or one to be created in ``directories[0]``) that this filesystem or this user cannot
    complete (SPEC §8a): otherwise SQLite leaves a ``-wal``/``-shm`` pair behind, or a
    lease record is written that the write then cannot use.

    ``directories`` are the places the write creates files in (the state's directory,
    its lease folder when it exists); ``need`` the free bytes it needs there, ``room_for``
    what they are for (the message's words).
    Raises ``RIVET_PLACE_HOLDS_NO_FILES`` (:func:`refuse_no_files`),
    ``RIVET_STATE_READ_ONLY``, ``RIVET_STATE_PERMISSION_DENIED``, ``RIVET_STATE_DISK_FULL``
    (only where the filesystem reports its size: one that reports no blocks, as a tmpfs
    mounted ``size=0``, has no free count to hold a write against)."""
    refuse_no_files(path, directories[0])
    exists = os.path.lexists(path)
    if read_only_fs(path if exists else directories[0]):
        raise StateError("RIVET_STATE_READ_ONLY", f"{path if exists else directories[0]} is on a filesystem mounted "
                         "read-only; nothing was written", {"path": str(path)})
    wanted = [(d, os.W_OK | os.X_OK) for d in directories if os.path.isdir(d)] + ([(path, os.W_OK)] if exists else [])
    for target, mode in wanted:
        if not os.access(target, mode, effective_ids=os.access in os.supports_effective_ids):
            raise denied(target, "write")
    st = os.statvfs(directories[0])
    free = st.f_bavail * st.f_frsize
    if st.f_blocks and free < need:
        raise StateError("RIVET_STATE_DISK_FULL", f"{size_text(free)} free on the filesystem of {directories[0]}; "
                         f"this write needs at least {size_text(need)} there ({room_for}): free "
                         f"{size_text(need - free)} more; nothing was written", {"path": str(directories[0]), "free_bytes": free, "need_bytes": need})

