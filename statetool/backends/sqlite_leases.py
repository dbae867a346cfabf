"""SQLite leases: an ``flock`` on one sidecar file per key in ``<state dir>/.rivet_state.leases/``.

SPEC §5. The holder takes ``LOCK_EX`` on the file, then writes its record (JSON: pid,
host, user, command, acquired_at) into it. The kernel releases the lock when the holder
dies, so a dead holder never blocks anyone; its record stays behind, which is what
``stale`` means here. Files are never deleted: deleting a lock file lets a waiter that
opened the old inode and a newcomer that creates a new one hold "the same" lease at once.

Liveness is read from ``/proc/locks`` (an FLOCK entry on the file's inode), never by
trying the lock, so listing leases cannot make a real run see a busy lease. Where the
kernel's lock table cannot be read (not Linux), a non-blocking ``LOCK_SH`` probe is the
fallback, and the documentation says so.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path

from statetool.backends.base import HeldLease, Holder, LeaseInfo
from statetool.backends.proclocks import lock_holders
from statetool.errors import StateError

_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_MAX_NAME = 240


def key_to_filename(key: str) -> str:
    """Percent-encode every byte of ``key`` outside ``[A-Za-z0-9_-]`` (``.`` and ``/`` too),
    so no key can name ``..``, a path, or a hidden file. Raises ``RIVET_CLI_USAGE`` for an
    empty key or one whose encoding is longer than a file name may be (the key comes from
    user input, e.g. ``--export``: fix the input, not a bug)."""
    name = "".join(ch if ch in _SAFE else "".join(f"%{b:02X}" for b in ch.encode()) for ch in key)
    if not name or len(name) > _MAX_NAME:
        raise StateError("RIVET_CLI_USAGE", f"lease key {key[:60]!r}{'…' if len(key) > 60 else ''} is empty or "
                         f"too long for a SQLite lease file ({len(name)} bytes encoded, at most {_MAX_NAME})",
                         {"key": key})
    return name


def filename_to_key(name: str) -> str:
    """The key a sidecar file name stands for (inverse of :func:`key_to_filename`)."""
    from urllib.parse import unquote

    return unquote(name)


def _read_record(path: Path) -> Holder | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    if not text.strip():
        return None
    try:
        doc = json.loads(text)
        return Holder(int(doc["pid"]), doc["host"], doc["user"], doc["command"], doc["acquired_at"])
    except (ValueError, KeyError, TypeError):
        return None


@dataclass
class FlockLease:
    """A held flock lease: the open sidecar file keeps the lock."""

    key: str
    holder: Holder
    fd: int
    path: Path

    def release(self) -> None:
        if self.fd < 0:
            return
        os.ftruncate(self.fd, 0)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = -1

    def inheritable_fds(self) -> tuple[int, ...]:
        return (self.fd,) if self.fd >= 0 else ()


class FlockLeases:
    """The lease store of a SQLite state directory."""

    def __init__(self, state_dir: Path) -> None:
        self.directory = state_dir / ".rivet_state.leases"

    def _live(self, path: Path) -> bool:
        holders = lock_holders(path)
        if holders is not None:
            return bool(holders)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def _info(self, key: str, path: Path) -> LeaseInfo:
        # A clean release empties the record BEFORE it unlocks. So a record read while the
        # lock is free, and read again unchanged after the lock is seen free once more, was
        # left by a holder that died holding it: stale. Reading the record once, before or
        # after one liveness check, reports a normal release (or a quick take-and-release)
        # in between as "stale". A holder that came or went in between: look again.
        for _ in range(10):
            if self._live(path):
                return LeaseInfo(key, "live", _read_record(path))
            record = _read_record(path)
            if record is None:
                return LeaseInfo(key, "free", None)
            if not self._live(path) and _read_record(path) == record:
                return LeaseInfo(key, "stale", record)
        return LeaseInfo(key, "live", _read_record(path))  # taken and released without pause: in use

    def try_acquire(self, key: str, holder: Holder) -> HeldLease | LeaseInfo:
        self.directory.mkdir(exist_ok=True)
        path = self.directory / key_to_filename(key)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return LeaseInfo(key, "live", _read_record(path))
        os.ftruncate(fd, 0)
        record = {"pid": holder.pid, "host": holder.host, "user": holder.user, "command": holder.command,
                  "acquired_at": holder.acquired_at, "key": key}
        os.pwrite(fd, json.dumps(record).encode(), 0)
        return FlockLease(key, holder, fd, path)

    def list(self) -> list[LeaseInfo]:
        if not self.directory.is_dir():
            return []
        return [self._info(filename_to_key(p.name), p) for p in sorted(self.directory.iterdir()) if p.is_file()]

    def clear_stale(self, key: str) -> LeaseInfo:
        path = self.directory / key_to_filename(key)
        if not path.is_file():
            return LeaseInfo(key, "free", None)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_record(path)
                raise StateError("RIVET_STATE_RUN_IN_PROGRESS",
                                 f"lease {key} is held by a live process: "
                                 f"{holder.describe() if holder else 'holder record not written yet'}",
                                 {"key": key}) from None
            info = LeaseInfo(key, "stale" if _read_record(path) else "free", _read_record(path))
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return info
        finally:
            os.close(fd)
