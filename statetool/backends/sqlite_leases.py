"""SQLite leases: an ``flock`` on one sidecar file per key in ``<state dir>/.rivet_state.leases/``.

SPEC §5. The holder takes ``LOCK_EX`` on the file, then writes its record (JSON: pid,
host, user, command, acquired_at, key, and since this release fencing_token,
pid_started, child_pid, child_started) into it. The kernel releases the lock when the
last process holding the open file dies (a ``leases run`` command inherits it), so a dead
holder never blocks anyone; its record stays behind, which is what ``stale`` means here.
A clean release replaces the record by ``{"key", "fencing_token", "released_at"}``: no
pid, so every release reads it as free, and the token survives for the next holder.
Files are never deleted: deleting a lock file lets a waiter that opened the old inode and
a newcomer that creates a new one hold "the same" lease at once.

Fencing: the token is the previous record's plus one, written under the lock. A write
made under the lease checks, inside its transaction, that the sidecar at the path is
still the inode this holder locked and still carries its token: nobody else can have
taken the lock on that inode, so a mismatch means the file was replaced under it.

Nothing here follows a symlink or opens a non-regular file (SPEC §8a): the folder and the
sidecars are opened with ``O_NOFOLLOW`` relative to the folder's descriptor, and anything
else where they belong is ``RIVET_STATE_UNSAFE_FILE``.

Liveness is read from ``/proc/locks`` (an FLOCK entry on the file's inode), never by
trying the lock, so listing leases cannot make a real run see a busy lease. Where the
kernel's lock table cannot be read (not Linux), a non-blocking ``LOCK_SH`` probe is the
fallback, and the documentation says so.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from statetool.backends.base import HeldLease, Holder, LeaseInfo
from statetool.backends.durable import directory_mode, give_owner, mode_of
from statetool.backends.faults import fault, refuse_unwritable
from statetool.backends.processes import command_alive, host_name, live_lease
from statetool.backends.proclocks import lock_holders_of
from statetool.backends.sqlite_file import foreign_companions, read_header, refuse_unsafe_companions
from statetool.errors import StateError
from statetool.location import LEASE_DIR, MAX_LEASE_FILE_NAME, lease_file_name

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def key_to_filename(key: str) -> str:
    """Percent-encode every byte of ``key`` outside ``[A-Za-z0-9_-]`` (``.`` and ``/`` too),
    so no key can name ``..``, a path, or a hidden file. Raises ``RIVET_CLI_USAGE`` for an
    empty key or one whose encoding is longer than a file name may be (the key comes from
    user input, e.g. ``--export``: fix the input, not a bug)."""
    name = lease_file_name(key)
    if not name or len(name) > MAX_LEASE_FILE_NAME:
        raise StateError("RIVET_CLI_USAGE", f"lease key {key[:60]!r}{'…' if len(key) > 60 else ''} is empty or "
                         f"too long for a SQLite lease file ({len(name)} bytes encoded, at most {MAX_LEASE_FILE_NAME})",
                         {"key": key})
    return name


def filename_to_key(name: str) -> str:
    """The key a sidecar file name stands for (inverse of :func:`key_to_filename`)."""
    return unquote(name)


def _unsafe(path: Path, what: str) -> StateError:
    return StateError("RIVET_STATE_UNSAFE_FILE", f"{path} is {what}, where statetool keeps a lease file; "
                      "nothing was written", {"path": str(path)})


def _read_doc(fd: int) -> dict[str, Any]:
    """The record in an open sidecar: its first line as JSON, ``{}`` when empty or torn."""
    data = os.pread(fd, 65536, 0)
    try:
        doc = json.loads(data.split(b"\n", 1)[0] or b"{}")
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _work_goes_on(record: Holder | None) -> bool:
    """Whether the command a dead holder recorded still works on this host
    (:func:`~statetool.backends.processes.command_alive`): a shell's step that outlived its
    wrapper and closed its inherited descriptors, and with them the lock, does that run's
    work, and the lease stays its (SPEC §5)."""
    return (record is not None and record.child_pid is not None and record.host == host_name()
            and command_alive(record.child_pid, record.child_started))


def _holder(doc: dict[str, Any]) -> Holder | None:
    """The holder a record names, None for a released or empty record."""
    try:
        return Holder(int(doc["pid"]), doc["host"], doc["user"], doc["command"], doc["acquired_at"],
                      token=doc.get("fencing_token"), started=doc.get("pid_started"),
                      child_pid=doc.get("child_pid"), child_started=doc.get("child_started"))
    except (ValueError, KeyError, TypeError):
        return None


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _write_doc(fd: int, doc: dict[str, Any]) -> None:
    """Replace the record: the new line first, then cut what is left of the old one, so a
    record torn by a crash still starts with a whole line."""
    data = json.dumps(doc, sort_keys=True).encode() + b"\n"
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


class FlockLease:
    """A held flock lease: the open sidecar file ``fd`` (-1 once released) at ``path``
    keeps the lock."""

    def __init__(self, key: str, holder: Holder, fd: int, path: Path) -> None:
        self.key = key
        self.holder = holder
        self.fd = fd
        self.path = path

    @property
    def token(self) -> int | None:
        return self.holder.token

    @property
    def lost(self) -> bool:
        """True once the sidecar at the path is no longer the file this holder locked
        (removed or replaced): the kernel keeps the lock on the old file, which nobody
        else will ever look at, while a newcomer locks the new one."""
        if self.fd < 0:
            return False
        mine = os.fstat(self.fd)
        try:
            there = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return True
        return (there.st_dev, there.st_ino) != (mine.st_dev, mine.st_ino)

    def _record(self) -> dict[str, Any]:
        h = self.holder
        return {"pid": h.pid, "host": h.host, "user": h.user, "command": h.command, "acquired_at": h.acquired_at,
                "key": self.key, "fencing_token": h.token, "pid_started": h.started, "child_pid": h.child_pid,
                "child_started": h.child_started}

    def set_child(self, pid: int, started: int | None) -> None:
        self.holder = self.holder._replace(child_pid=pid, child_started=started)
        _write_doc(self.fd, self._record())

    def fence(self, conn: object, *, final: bool = False) -> None:
        if self.lost or _read_doc(self.fd).get("fencing_token") != self.token:
            raise StateError("RIVET_STATE_LEASE_LOST",
                             f"lease {self.key}: {self.path} is no longer the file this holder locked (it was "
                             "removed or replaced); nothing was written", {"key": self.key})

    def release(self) -> None:
        if self.fd < 0:
            return
        _write_doc(self.fd, {"key": self.key, "fencing_token": self.token, "released_at": _now()})
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = -1

    def inheritable_fds(self) -> tuple[int, ...]:
        return (self.fd,) if self.fd >= 0 else ()


class FlockStaleClaim:
    """A stale sidecar locked for its audited release: ``fd`` (-1 once let go) holds the lock."""

    def __init__(self, info: LeaseInfo, fd: int) -> None:
        self.info = info
        self.fd = fd

    def commit(self) -> None:
        doc = _read_doc(self.fd)
        _write_doc(self.fd, {"key": self.info.key, "fencing_token": doc.get("fencing_token"), "released_at": _now()})
        self.abandon()

    def abandon(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


class FlockLeases:
    """The lease store of a SQLite state: the lease folder beside ``state_path``, the real
    state file (a symlinked state's target, so that every path to one state shares its leases)."""

    def __init__(self, state_path: Path) -> None:
        self.state_path = state_path
        self.directory = state_path.parent / LEASE_DIR

    def require_state(self, *, to_hold: bool = True) -> None:
        """Raise unless a state file is at its place (``RIVET_STATE_MISSING``,
        ``RIVET_STATE_RELOCATED``, ``RIVET_STATE_NOT_A_STATE``): a lease beside no state
        guards nothing, and its folder would make an empty directory look used), or, with
        ``to_hold``, when a companion of the state is unsafe (``RIVET_STATE_UNSAFE_FILE``)
        or another copy's (``RIVET_STATE_FOREIGN_WAL``): the command run under the lease
        would open the state through it. A list (``to_hold`` False) opens only the file's
        header, read-only, and creates nothing."""
        header = read_header(self.state_path)
        if not to_hold:
            return
        refuse_unsafe_companions(self.state_path)
        foreign = foreign_companions(self.state_path, header)
        if foreign:
            raise StateError("RIVET_STATE_FOREIGN_WAL", f"{'; '.join(foreign)}: the command run under the lease would "
                             f"merge it into {self.state_path}; nothing was run", {"files": foreign})

    def _dir_fd(self, create: bool) -> int | None:
        """The lease folder, opened without following a symlink; None when it does not
        exist and ``create`` is false. A folder this call creates is made 0700, then given
        :func:`~statetool.backends.durable.directory_mode` of the state's mode (a set-group-ID
        bit it inherited kept): no more readable than the state, and open to whoever may
        write the state. Raises ``RIVET_STATE_UNSAFE_FILE``."""
        made = False
        if create:
            try:
                os.mkdir(self.directory, 0o700)
                made = True
            except FileExistsError:
                pass
        try:
            dfd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
        except FileNotFoundError:
            if create:
                raise
            return None
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.ENOTDIR):
                raise _unsafe(self.directory, "a symlink or not a directory") from None
            raise
        if made:
            inherited = os.fstat(dfd).st_mode & stat.S_ISGID
            os.fchmod(dfd, directory_mode(mode_of(self.state_path)) | inherited)
            self._give_to_state_owner(dfd)
        return dfd

    def _give_to_state_owner(self, fd: int) -> None:
        """Run as root, give the lease folder or file this process just created (``fd``) the
        state's owner and group: root's run or migration of another user's state must not
        leave sidecars that the owner's next run cannot open (the harm of a refused write
        creating files, seen from root's side; docs/decisions.md "The owner of a replaced
        state"). Anyone else keeps what they create: they could not give it away, and the
        state's mode, which the sidecar has, already opens it to the state's writers."""
        if os.geteuid() != 0:
            return
        try:
            give_owner(fd, os.stat(self.state_path))
        except FileNotFoundError:
            return

    def _open(self, dfd: int, name: str, flags: int) -> int:
        """Open the sidecar ``name`` in the folder ``dfd`` (never through a link); one that
        ``flags`` creates is given the state's mode (no more readable than the state, and
        writable by whoever may write the state, who may take its lease). Raises
        ``RIVET_STATE_UNSAFE_FILE`` for a symlink, a directory or another kind of file."""
        try:
            fd = os.open(name, flags | _NOFOLLOW, 0o600, dir_fd=dfd)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise _unsafe(self.directory / name, "a symlink") from None
            if err.errno == errno.EISDIR:
                raise _unsafe(self.directory / name, "a directory") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise _unsafe(self.directory / name, "not a regular file")
        if flags & os.O_EXCL:
            os.fchmod(fd, mode_of(self.state_path))
            self._give_to_state_owner(fd)
        return fd

    @staticmethod
    def _live(fd: int) -> bool:
        holders = lock_holders_of(os.fstat(fd))
        if holders is not None:
            return bool(holders)
        try:  # fd is this inspection's own open of the file: a shared lock on it disturbs nobody for long
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False

    def _info(self, key: str, fd: int) -> LeaseInfo:
        # A clean release rewrites the record BEFORE it unlocks. So a record read while the
        # lock is free, and read again unchanged after the lock is seen free once more, was
        # left by a holder that died holding it: stale. Reading the record once, before or
        # after one liveness check, reports a normal release (or a quick take-and-release)
        # in between as "stale". A holder that came or went in between: look again.
        for _ in range(10):
            if self._live(fd):
                return LeaseInfo(key, "live", _holder(_read_doc(fd)))
            record = _holder(_read_doc(fd))
            if record is None:
                return LeaseInfo(key, "free", None)
            if not self._live(fd) and _holder(_read_doc(fd)) == record:
                return LeaseInfo(key, "live" if _work_goes_on(record) else "stale", record)
        return LeaseInfo(key, "live", _holder(_read_doc(fd)))  # taken and released without pause: in use

    def try_acquire(self, key: str, holder: Holder) -> HeldLease | LeaseInfo:
        try:
            return self._try_acquire(key, holder)
        except OSError as err:  # a read-only mount, another user's folder, a full disk
            known = fault(self.directory, err)
            if known is None:
                raise
            raise known from None

    def _try_acquire(self, key: str, holder: Holder) -> HeldLease | LeaseInfo:
        name = key_to_filename(key)
        dfd = self._dir_fd(create=True)
        assert dfd is not None
        created = False
        try:
            try:
                fd = self._open(dfd, name, os.O_RDWR)
            except FileNotFoundError:
                try:
                    fd, created = self._open(dfd, name, os.O_RDWR | os.O_CREAT | os.O_EXCL), True
                except FileExistsError:  # another process created it meanwhile
                    fd = self._open(dfd, name, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                info = LeaseInfo(key, "live", _holder(_read_doc(fd)))
                os.close(fd)
                return info
            try:
                before = _read_doc(fd)
                if _work_goes_on(_holder(before)):  # its holder died, the work of its run did not
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    os.close(fd)
                    return LeaseInfo(key, "live", _holder(before))
                previous = before.get("fencing_token")
                # The last token plus one; a new sidecar starts at the clock in microseconds, so one
                # that was removed (and its count with it) never hands out a token used before: every
                # acquisition takes far more than a microsecond. Only a wall clock set back breaks this
                # (docs/decisions.md, "Fencing").
                token = previous + 1 if isinstance(previous, int) and previous > 0 else time.time_ns() // 1000
                lease = FlockLease(key, holder._replace(token=token), fd, self.directory / name)
                _write_doc(fd, lease._record())  # noqa: SLF001 - the record is the lease's own
            except OSError:
                # A full disk: a sidecar this call created holds no record; it is removed (still
                # locked, so nobody has taken it meanwhile) rather than left empty.
                if created:
                    os.unlink(name, dir_fd=dfd)
                os.close(fd)
                raise
            return lease
        finally:
            os.close(dfd)

    def require_takable(self, keys: Iterable[str]) -> None:
        """Raise ``RIVET_STATE_PERMISSION_DENIED`` (or ``RIVET_STATE_READ_ONLY``) when this
        user may not write the lease folder or the sidecar of one of ``keys`` (another
        user's file, say; :func:`~statetool.backends.faults.refuse_unwritable`): found by
        ``access(2)``, nothing opened or created. A symlink is left to the take, which
        refuses it (``RIVET_STATE_UNSAFE_FILE``); ``RIVET_CLI_USAGE`` for a key no file can
        be named after."""
        if os.path.islink(self.directory) or not os.path.isdir(self.directory):
            return  # a folder the first take makes, in a directory checked writable, or one it refuses
        sidecars = [self.directory / key_to_filename(key) for key in keys]
        for target in [self.directory, *(p for p in sidecars if p.is_file() and not p.is_symlink())]:
            refuse_unwritable(target, directories=(self.directory,), need=0)

    def info(self, key: str) -> LeaseInfo:
        dfd = self._dir_fd(create=False)
        if dfd is None:
            return LeaseInfo(key, "free", None)
        try:
            fd = self._open(dfd, key_to_filename(key), os.O_RDONLY)
        except FileNotFoundError:
            return LeaseInfo(key, "free", None)
        finally:
            os.close(dfd)
        try:
            return self._info(key, fd)
        finally:
            os.close(fd)

    def list(self) -> list[LeaseInfo]:
        dfd = self._dir_fd(create=False)
        if dfd is None:
            return []
        found = []
        try:
            for name in sorted(os.listdir(dfd)):
                try:
                    fd = self._open(dfd, name, os.O_RDONLY)
                except FileNotFoundError:
                    continue  # removed meanwhile; anything unsafe is refused (RIVET_STATE_UNSAFE_FILE), not skipped

                try:
                    found.append(self._info(filename_to_key(name), fd))
                finally:
                    os.close(fd)
        finally:
            os.close(dfd)
        return found

    def _sidecar(self, key: str, flags: int) -> int:
        """The sidecar of ``key`` opened with ``flags`` (never created); raises
        ``RIVET_STATE_LEASE_UNKNOWN`` when there is none."""
        dfd = self._dir_fd(create=False)
        if dfd is None:
            raise _unknown_lease(key)
        try:
            return self._open(dfd, key_to_filename(key), flags)
        except FileNotFoundError:
            raise _unknown_lease(key) from None
        finally:
            os.close(dfd)

    def releasable(self, key: str) -> LeaseInfo:
        fd = self._sidecar(key, os.O_RDONLY)
        try:
            info = self._info(key, fd)
        finally:
            os.close(fd)
        if info.state == "live":
            raise live_lease(key, info.holder)
        return info

    def claim_stale(self, key: str, conn: object) -> FlockStaleClaim:
        fd = self._sidecar(key, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(_read_doc(fd))
            os.close(fd)
            raise live_lease(key, holder) from None
        record = _holder(_read_doc(fd))
        if _work_goes_on(record):  # its holder died, the work of its run did not: live, as info() reads it
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise live_lease(key, record)
        return FlockStaleClaim(LeaseInfo(key, "stale" if record else "free", record), fd)


def _unknown_lease(key: str) -> StateError:
    """``RIVET_STATE_LEASE_UNKNOWN``: no sidecar of ``key``."""
    return StateError("RIVET_STATE_LEASE_UNKNOWN", f"this state has no lease {key}", {"key": key})
