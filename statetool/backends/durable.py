"""Files that survive a crash or a power loss: fsync of a file and of its directory, and a
verified copy of a plain file (a CDC checkpoint a move carries along, SPEC §6, §9).

Driver-free (no SQLite, no PostgreSQL): the SQLite backend, the tombstone and the SQLite
side of a move all build on it. Every file it creates is created with ``O_EXCL |
O_NOFOLLOW`` (:data:`CREATE_FLAGS`): never through a link.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from statetool.backends.faults import fault
from statetool.errors import StateError

#: Exclusive creation that never follows a symlink (the file must not exist at all).
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def fsync_dir(directory: Path) -> None:
    """fsync a directory so a rename (or a link, an unlink) inside it survives power loss."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """fsync the bytes of the regular file at ``path``."""
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


def sha256_file(path: Path) -> str:
    """The hex sha256 of the file at ``path``, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def side_copy(target: Path) -> Path:
    """The temporary file :func:`copy_verified` writes before it renames it to ``target``:
    ``.<name>.relocating`` beside it."""
    return target.with_name(f".{target.name}.relocating")


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
        with open(source, "rb") as src, os.fdopen(os.open(tmp, CREATE_FLAGS, 0o644), "wb") as dst:
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
