"""The SQLite state file judged by its first 100 bytes, without opening a database.

Shared by the SQLite backend (before every open) and the SQLite lease store (before a
lease is taken beside a state): it loads no database driver, so ``leases run`` stays as
fast as a plain ``flock`` wrapper (SPEC §5) while still refusing a missing or relocated
state (SPEC §4, §9).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import NamedTuple

from statetool.access import file_kind
from statetool.backends.tombstone import MAGIC as TOMBSTONE_MAGIC
from statetool.backends.tombstone import read_tombstone
from statetool.errors import StateError, moved_away

MAGIC = b"SQLite format 3\x00"


def relocated_error(path: Path) -> StateError:
    """``RIVET_STATE_RELOCATED`` for the tombstone at ``path``: where the state went and
    the ``RIVET_STATE_URL`` every task must now run with (:func:`~statetool.errors.moved_away`)."""
    return moved_away(str(path), read_tombstone(path) or {}, {"path": str(path)})


def unsafe_state_file(path: Path, what: str) -> StateError:
    """``RIVET_STATE_UNSAFE_FILE`` for a state path that is not a regular file (SPEC §4):
    it is refused before anything reads from it (a FIFO would block every command)."""
    return StateError("RIVET_STATE_UNSAFE_FILE", f"{path} is {what}, not a regular file, where the state file "
                      "belongs; nothing was read or written", {"path": str(path)})


def read_header(path: Path) -> bytes:
    """The 100-byte SQLite header of the state file at ``path``.

    Raises ``RIVET_STATE_MISSING`` (nothing there), ``RIVET_STATE_UNSAFE_FILE`` (a FIFO,
    a device, a directory: never opened for reading), ``RIVET_STATE_RELOCATED`` (a
    tombstone), ``RIVET_STATE_NOT_A_STATE`` (empty, not SQLite) and
    ``RIVET_STATE_CORRUPT`` (shorter than its header says: truncated, unless a journal is
    beside it, whose roll-back restores the size the file had).
    """
    try:
        # lstat, not os.path.lexists: a directory this user may not search is a permission
        # fault (raised as it is, for the caller's fault()), never a missing state (SPEC §8a)
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise StateError("RIVET_STATE_MISSING", f"no state at {path}", {"path": str(path)}) from None
    try:
        # O_NONBLOCK: a FIFO is never waited on; it is refused by what fstat says below.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:  # a symlink to nothing: the file it names is not there (an unmounted volume?)
        raise StateError("RIVET_STATE_MISSING", f"{path} is a symlink to {os.readlink(path)}, which does not exist "
                         "(a volume that is not mounted?)", {"path": str(path), "target": os.readlink(path)}) from None
    except OSError as err:
        raise unsafe_state_file(path, os.strerror(err.errno or 0)) if err.errno == errno.ENXIO else err from None
    try:
        st = os.fstat(fd)
        kind, size = st.st_mode, st.st_size
        if not stat.S_ISREG(kind):
            raise unsafe_state_file(path, file_kind(kind))
        header = os.pread(fd, 100, 0)
    finally:
        os.close(fd)
    if header.startswith(TOMBSTONE_MAGIC):
        raise relocated_error(path)
    if len(header) < 100 or not header.startswith(MAGIC):
        what = "an empty file" if not header else "not a SQLite database"
        raise StateError("RIVET_STATE_NOT_A_STATE", f"{path} is {what}, not a rivet state", {"path": str(path)})
    page_size = page_size_of(header)
    pages = int.from_bytes(header[28:32], "big")
    header_count_valid = header[24:28] == header[92:96]
    # With a journal beside it, a short file is what a write that failed while growing the
    # file leaves (a full disk): the journal's first page, rolled back, says the true size.
    journal = Path(f"{path}-journal")
    hot = os.path.isfile(journal) and not os.path.islink(journal) and os.path.getsize(journal) > 0
    if header_count_valid and pages and size < pages * page_size and not hot:
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


#: The two WAL magic numbers: checksums in little-endian (…82) or big-endian (…83) words.
_WAL_MAGIC = {b"\x37\x7f\x06\x82": "<", b"\x37\x7f\x06\x83": ">"}
_WAL_VERSION = 3007000
_WAL_HEADER, _FRAME_HEADER = 32, 24


def _wal_checksum(data: bytes, order: str, s0: int, s1: int) -> tuple[int, int]:
    """SQLite's WAL checksum of ``data`` (a multiple of 8 bytes), continued from ``(s0, s1)``
    (https://www.sqlite.org/fileformat2.html#walformat, "Checksum Algorithm")."""
    import struct

    for x0, x1 in struct.iter_unpack(f"{order}II", data):
        s0 = (s0 + x0 + s1) & 0xFFFFFFFF
        s1 = (s1 + x1 + s0) & 0xFFFFFFFF
    return s0, s1


def page_size_of(header: bytes) -> int:
    """The page size in bytes that a database header (bytes 16-17) gives."""
    size = int.from_bytes(header[16:18], "big")
    return 65536 if size == 1 else size


def wal_mismatch(db_header: bytes, wal: Path) -> str | None:
    """Why the ``-wal`` at ``wal`` cannot be the log of the database whose 100-byte header
    is ``db_header``, or None when it fits (or holds no header: SQLite ignores a log shorter
    than 32 bytes). Checked: the magic, the format version, the page size, the header's
    checksum, and the first frame's salts and checksum, which SQLite writes together with
    the header. Reads the file by its open descriptor, never following a symlink
    (a symlink is itself a reason)."""
    try:
        fd = os.open(wal, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as err:
        return "a symlink" if err.errno == errno.ELOOP else os.strerror(err.errno or 0)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "not a regular file"
        page_size = page_size_of(db_header)
        head = os.pread(fd, _WAL_HEADER, 0)
        if len(head) < _WAL_HEADER:
            return None
        order = _WAL_MAGIC.get(head[:4])
        if order is None:
            return "not a SQLite WAL file (bad magic number)"
        if int.from_bytes(head[4:8], "big") != _WAL_VERSION:
            return f"WAL format version {int.from_bytes(head[4:8], 'big')}, not {_WAL_VERSION}"
        if int.from_bytes(head[8:12], "big") != page_size:
            return f"written for pages of {int.from_bytes(head[8:12], 'big')} bytes; this state's pages are {page_size}"
        s0, s1 = _wal_checksum(head[:24], order, 0, 0)
        if (s0, s1) != (int.from_bytes(head[24:28], "big"), int.from_bytes(head[28:32], "big")):
            return "its header checksum is wrong (a damaged or hand-edited file)"
        frame = os.pread(fd, _FRAME_HEADER + page_size, _WAL_HEADER)
        if len(frame) < _FRAME_HEADER + page_size:
            return None  # no whole frame: SQLite applies nothing from it
        if frame[8:16] != head[16:24]:
            return "its first frame carries other salts than its header (frames of another log)"
        f0, f1 = _wal_checksum(frame[:8] + frame[_FRAME_HEADER:], order, s0, s1)
        if (f0, f1) != (int.from_bytes(frame[16:20], "big"), int.from_bytes(frame[20:24], "big")):
            return "its first frame's checksum is wrong (a damaged or spliced file)"
        return None
    finally:
        os.close(fd)


def foreign_companions(path: Path, header: bytes) -> list[str]:
    """The ``-wal``/``-shm`` beside the state at ``path`` (whose 100-byte header is
    ``header``) that cannot be its own, one line each: any of them beside a rollback-journal
    state (header byte 18 = 1), which never makes one; a ``-wal`` beside a WAL state whose
    header or first frame does not fit the database (:func:`wal_mismatch`: magic, version,
    page size, checksums, salts). Nothing may open the state for writing with them there:
    SQLite would merge that ``-wal`` into the state (docs/decisions.md, "Interrupted writes
    and companion files")."""
    wal, shm = Path(f"{path}-wal"), Path(f"{path}-shm")
    if header[18] != 2:
        return [f"{p} (beside a rollback-journal state, which never makes one)" for p in (wal, shm)
                if os.path.lexists(p)]
    why = wal_mismatch(header, wal)
    return [] if why is None else [f"{wal} ({why})"]


class Orphans(NamedTuple):
    """``-wal``/``-shm`` files beside a state that it did not leave (``RIVET_STATE_ORPHAN_WAL``,
    a warning): the sentence that says which and why, and the files as evidence."""

    message: str
    evidence: dict[str, str | None]


def orphan_companions(path: Path) -> Orphans | None:
    """The ``-wal``/``-shm`` beside the state file at ``path`` that are left from another copy
    of it, judged by its header (:func:`read_header`, the one header read; None when that
    refuses the file, which is reported by the open itself): either of them beside a
    rollback-journal state (header byte 18 = 1), or a ``-shm`` without its ``-wal``. None
    when there is none."""
    try:
        header = read_header(path)
    except StateError:
        return None
    wal, shm = Path(f"{path}-wal"), Path(f"{path}-shm")
    if header[18] == 1 and (wal.exists() or shm.exists()):
        return Orphans(f"{wal.name}/{shm.name} lie beside a state in rollback-journal mode: left from another copy "
                       "of the file (a restore or a copy without them)",
                       {"wal": str(wal) if wal.exists() else None, "shm": str(shm) if shm.exists() else None})
    if shm.exists() and not wal.exists():
        return Orphans(f"{shm.name} lies beside the state without its -wal", {"shm": str(shm)})
    return None


def applied_journal(path: Path) -> Path | None:
    """The journal beside the SQLite file at ``path`` that SQLite applies to it on opening it
    there, and that a read of it applies too (``SqliteBackend.reading``): the ``-wal`` of a
    WAL file when it fits (:func:`wal_mismatch`: its committed frames are part of the file's
    content), the ``-journal`` of a rollback-journal file (a hot one is rolled back); None
    when there is none, or it is empty or no regular file. A byte copy of ``path`` alone
    lacks what it holds: a restore copies it beside its copy (docs/decisions.md, "Restore
    starts from what it verified")."""
    header = read_header(path)
    journal = Path(f"{path}-wal" if header[18] == 2 else f"{path}-journal")
    try:
        st = os.lstat(journal)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
        return None
    return journal if header[18] != 2 or wal_mismatch(header, journal) is None else None
