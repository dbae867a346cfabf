"""Files that survive a crash or a power loss: fsync of a file and of its directory, and a
verified copy of a plain file (a CDC checkpoint a move carries along, SPEC §6, §9).

Driver-free (no SQLite, no PostgreSQL): the SQLite backend, the tombstone and the SQLite
side of a move all build on it. Every file it creates is created with ``O_EXCL |
O_NOFOLLOW`` (:data:`CREATE_FLAGS`): never through a link.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from statetool.backends.faults import fault, os_fault
from statetool.errors import StateError

#: Exclusive creation that never follows a symlink (the file must not exist at all).
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


#: The errors of ``copy_file_range`` that mean "not here" rather than a failed copy: a
#: kernel without it, a filesystem that cannot (some FUSE, NFS and 9p mounts), a file kind
#: it does not take. The bytes are then copied by reads and writes.
_NO_COPY_RANGE = frozenset({errno.ENOSYS, errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP})
#: Bytes per copy_file_range call (the kernel copies them without passing through this
#: process), and per read and write of the fallback.
_RANGE_BYTES, _BLOCK_BYTES = 64 << 20, 4 << 20


def copy_bytes(src: int, dst: int, size: int, progress: Callable[[int, int], None]) -> int:
    """Copy up to ``size`` bytes from the file descriptor ``src`` to ``dst``, each from its
    current offset, with ``copy_file_range`` where the filesystem has it and by reads and
    writes where it does not (:data:`_NO_COPY_RANGE`). ``progress(bytes done, size)`` after
    each block. Returns the bytes copied (fewer than ``size`` when ``src`` ends first).
    Raises the ``OSError`` of a failed read or write (a full disk: the caller names it)."""
    done, ranged = 0, True
    buffer = memoryview(bytearray(_BLOCK_BYTES))
    while done < size:
        if ranged:
            try:
                sent = os.copy_file_range(src, dst, min(_RANGE_BYTES, size - done))
            except OSError as err:
                if err.errno not in _NO_COPY_RANGE or done:
                    raise
                ranged = False
                continue
        else:
            sent = os.readv(src, [buffer[:min(_BLOCK_BYTES, size - done)]])
            written = 0
            while written < sent:
                written += os.write(dst, buffer[written:sent])
        if sent == 0:
            break
        done += sent
        progress(done, size)
    return done


def copy_file_exclusively(source: Path, target: Path) -> None:
    """Copy the bytes of the file ``source`` into the new file ``target`` (created with
    :data:`CREATE_FLAGS`: never through a link, never over a file), with the source's mode
    (not its owner), fsynced. Raises the ``OSError`` of the copy (the caller names its fault)."""
    with open(source, "rb") as src:
        fd = os.open(target, CREATE_FLAGS, 0o600)
        try:
            like(fd, os.fstat(src.fileno()), owner=False)
            copy_bytes(src.fileno(), fd, os.fstat(src.fileno()).st_size, lambda _done, _size: None)
            os.fsync(fd)
        finally:
            os.close(fd)


def mode_of(path: Path, default: int = 0o600) -> int:
    """The permission bits of the file ``path`` leads to (a symlinked state: its real
    file), or ``default`` when nothing is there."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return default


def directory_mode(file_mode: int) -> int:
    """The mode of a directory statetool makes beside a file of ``file_mode`` (the lease
    folder beside the state): for the owner, the group and others alike, ``rwx`` where the
    file is writable, ``r-x`` where it is only readable, nothing where it is neither. So
    the folder is no more readable than the state, and whoever may write the state may
    take a lease beside it (a group that shares a 0660 state shares a 0770 folder)."""
    mode = 0
    for shift in (6, 3, 0):
        bits = (file_mode >> shift) & 0o7
        mode |= (0o7 if bits & 0o2 else 0o5 if bits & 0o4 else 0) << shift
    return mode


def like(fd: int, model: os.stat_result, *, owner: bool = True) -> None:
    """Give the file open as ``fd`` (just created by this process) the permission bits of
    ``model`` (the state's ``stat``), never wider, and with ``owner`` its owner and group
    too where they differ. A file statetool makes in a state's place or beside it is no
    more readable than the state, and a file that replaces the state keeps its owner
    (SPEC §9: the owner's next run must open it). Raises ``PermissionError`` when the owner
    cannot be given (the callers refuse that case before they create anything:
    :func:`statetool.access.refuse_unownable`)."""
    os.fchmod(fd, stat.S_IMODE(model.st_mode))
    if owner:
        give_owner(fd, model)


def give_owner(fd: int, model: os.stat_result) -> None:
    """Give the file or directory open as ``fd`` the owner and group of ``model`` where
    they differ (``fchown``). Raises ``PermissionError`` when this process may not."""
    mine = os.fstat(fd)
    if (mine.st_uid, mine.st_gid) != (model.st_uid, model.st_gid):
        os.fchown(fd, model.st_uid, model.st_gid)


def share_owner(fd: int, model: os.stat_result) -> None:
    """Give the file open as ``fd`` the owner and group of ``model`` (the state's ``stat``)
    as far as this process may: both (root, or the owner itself), else the group alone (a
    member of the state's group), else neither. For a copy beside the state that its owner
    must be able to read, a backup: root taking one for another user's state gives it that
    user, and where the owner cannot be given the copy stays its maker's, still a good copy."""
    try:
        give_owner(fd, model)
    except PermissionError:
        if os.fstat(fd).st_gid != model.st_gid:
            with contextlib.suppress(PermissionError):
                os.fchown(fd, -1, model.st_gid)


def fsync_dir(directory: Path) -> None:
    """fsync a directory so a rename (or a link, an unlink) inside it survives power loss."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def regular_or_nothing(path: Path, refused: str) -> bool:
    """Where a command is about to write its own file ``path`` (an export, a metrics
    textfile): True when a regular file stands there, False when nothing does. Raises
    ``RIVET_STATE_UNSAFE_FILE`` for a symlink or any other kind of file, which is never
    written through nor replaced (SPEC §8a; ``refused`` ends its message: what the command
    never does), and the fault of a ``stat`` that fails (``RIVET_STATE_PERMISSION_DENIED``, ...)."""
    try:
        there = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as err:
        raise fault(path, err) or os_fault(err) or err from None
    if not stat.S_ISREG(there.st_mode):
        raise StateError("RIVET_STATE_UNSAFE_FILE", f"{path} is a symlink or not a regular file; {refused}",
                         {"path": str(path)})
    return True


def replace_whole(path: Path, body: bytes, tmp: Path, mode: int) -> None:
    """Put ``body`` at ``path`` whole or not at all, so that a reader sees the old file or
    the new one, never part of one: written into the new file ``tmp`` beside it (created
    with :data:`CREATE_FLAGS`, so never through a link, and ``mode`` less the umask),
    fsynced, renamed over ``path``, the directory fsynced. ``tmp`` is removed when a step
    after its creation fails. Raises the ``OSError`` of the step that failed: a
    ``FileExistsError`` when anything stands at ``tmp`` (left in place; the caller names it)."""
    fd = os.open(tmp, CREATE_FLAGS, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(body)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def fsync_file(path: Path) -> None:
    """fsync the bytes of the regular file at ``path``."""
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


def sha256_file(path: Path) -> str:
    """The hex sha256 of the file at ``path``, read in 1 MiB blocks."""
    import hashlib  # OpenSSL's start-up is a read's cost otherwise (issue 13): only copies hash

    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


#: The longest file name (one path component, in bytes) of Linux's file systems (NAME_MAX).
NAME_MAX = 255
#: Hex digits of the sha256 of the whole text that a shortened name keeps (issue 12 fixB item 3).
_NAME_HASH = 10


def fitting_name(head: str, text: str, tail: str, *, room: int = 0) -> str:
    """``head + text + tail``, a file name that fits :data:`NAME_MAX` bytes with ``room``
    bytes to spare (for what is added to it later: ``mkdtemp``'s random part, SQLite's
    ``-journal``).

    ``text`` is the part that comes from the operator (an export name, a checkpoint's file
    name): when the whole would not fit, it is cut at a character boundary and
    ``~<10 hex of its sha256>`` added, so two long names that share their start still get
    two names, and ``head`` and ``tail`` (what globs and ``ls`` sort by) stay whole. Raises
    ``ValueError`` when ``head`` and ``tail`` alone leave no room (a bug, not an input).
    """
    whole = f"{head}{text}{tail}"
    if len(whole.encode()) + room <= NAME_MAX:
        return whole
    import hashlib  # see sha256_file

    mark = "~" + hashlib.sha256(text.encode()).hexdigest()[:_NAME_HASH]
    budget = NAME_MAX - room - len(f"{head}{mark}{tail}".encode())
    if budget < 0:
        raise ValueError(f"no room for a name between {head!r} and {tail!r}")
    cut = text.encode()[:budget].decode(errors="ignore")
    return f"{head}{cut}{mark}{tail}"


def side_copy(target: Path) -> Path:
    """The temporary file :func:`copy_verified` writes before it renames it to ``target``:
    ``.<name>.relocating`` beside it (a long name shortened by :func:`fitting_name`)."""
    return target.with_name(fitting_name(".", target.name, ".relocating"))


def holds_other_bytes(target: Path, source: Path) -> bool:
    """True when ``target`` exists and its bytes are not those of ``source`` (sha256)."""
    return target.exists() and sha256_file(target) != sha256_file(source)


def copy_verified(source: Path, target: Path) -> None:
    """Copy the file ``source`` to ``target``: a temporary file (:func:`side_copy`, created
    exclusively), fsync, sha256 compared, rename, fsync of the directory. Nothing is done
    when ``target`` holds the same bytes already. The caller has refused a symlink or a
    non-regular file at either name. Raises ``RIVET_STATE_VERIFY_FAILED`` (the copy
    differs; it is removed), ``RIVET_STATE_DISK_FULL``, ``RIVET_STATE_READ_ONLY``,
    ``RIVET_STATE_PERMISSION_DENIED``."""
    if target.exists() and sha256_file(target) == sha256_file(source):
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = side_copy(target)
    tmp.unlink(missing_ok=True)  # a regular file (checked): what a killed run left
    try:
        with open(source, "rb") as src, os.fdopen(os.open(tmp, CREATE_FLAGS, 0o600), "wb") as dst:
            like(dst.fileno(), os.fstat(src.fileno()), owner=False)  # the source's mode, not wider
            shutil.copyfileobj(src, dst)
            dst.flush()
            os.fsync(dst.fileno())
    except OSError as err:
        raise fault(tmp, err) or err from None
    if sha256_file(tmp) != sha256_file(source):
        tmp.unlink()
        raise StateError("RIVET_STATE_VERIFY_FAILED", f"the copy of {source} at {target} did not verify")
    os.replace(tmp, target)
    fsync_dir(target.parent)
