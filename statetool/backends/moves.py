"""The SQLite side of a move (``relocate``; SPEC §9, decisions.md "Moves: one live place").

What a move does to SQLite files, step by step, each safe to interrupt at any instant:
hold writers off (a WAL checkpoint; the write lock is the caller's writing transaction),
copy the frozen file's pages into ``<target>.relocating`` in one pass over them, digested as
they are copied, while ``quick_check`` (or ``integrity_check``) and the row counts read the
source in a second thread, then verify the copy (fsynced, read back: its page digest must be the source's;
statetool/backends/sqlite_pages.py), write into the copy while it is in flight (its
version reads :data:`~statetool.schema.IN_FLIGHT_REVISION`: every opener
refuses it), link it into place, and at the end make it live. The source's side (its
tombstone, the checks before the switch, the switch itself) is
statetool/backends/tombstone.py, reached through the same object: code above the backends
sees :class:`FileMove` only as :class:`~statetool.backends.base.FileMoves`.

Every state file is named by a :class:`~statetool.location.Location` the resolver made;
the names of a move's own files (``.relocating`` and its journals) are made here. A copy
or a target is opened through :class:`~statetool.backends.sqlite.SqliteBackend`, the one
read-only open and the one writer.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from statetool import schema
from statetool.backends.base import PageCopy, Progress, Step
from statetool.backends.durable import CREATE_FLAGS, fsync_dir, fsync_file, like, side_copy
from statetool.backends.faults import fault
from statetool.backends.sqlite import SqliteBackend
from statetool.backends.sqlite_pages import content_digest, copy_digested, first_difference
from statetool.backends.tombstone import (read_tombstone, refuse_unsafe, remove_companions, require_retirable, retire,
                                          stale_tombstones, unsafe_error, wait_for_openers)
from statetool.errors import StateError
from statetool.location import Location

#: The journal files SQLite may keep beside a database file.
COMPANIONS = ("-journal", "-wal", "-shm")


class FileMove:
    """The files of a move of the SQLite state of ``backend`` (its :attr:`source`: the real
    file of a symlinked state) into another directory."""

    def __init__(self, backend: SqliteBackend) -> None:
        location = backend.location
        assert location.path is not None
        self.backend = backend
        #: The file the move copies and retires (:attr:`Location.real_path`).
        self.source: Path = location.real_path or location.path

    # -- names and leftovers -----------------------------------------------------------

    @staticmethod
    def copy_path(target: Location) -> Path:
        """Where the copy is built before it is linked into place: ``<target>.relocating``."""
        assert target.path is not None
        return target.path.with_name(f"{target.path.name}.relocating")

    def own_files(self, target: Location) -> list[Path]:
        """The names a move creates beside ``target`` besides the state itself: what must
        not be a symlink or a non-regular file (checked before anything is written)."""
        copy = self.copy_path(target)
        return [copy, *(Path(f"{copy}{suffix}") for suffix in COMPANIONS)]

    def remove_leftovers(self, target: Location, side_copies: list[Path]) -> None:
        """Remove what a killed run of this move may have left on either side: the copy and
        its journals, the checkpoints' ``side_copies``, temporary tombstones (temporary files
        only, every one checked to be a regular file before)."""
        for path in self.own_files(target) + side_copies:
            path.unlink(missing_ok=True)
        for stale in self.stale_tombstones():
            stale.unlink()

    def discard_target(self, target: Location) -> None:
        """Remove an in-flight target (never live: nobody could open it) and its journals,
        to make it again; fsync its directory."""
        assert target.path is not None and target.directory is not None
        for suffix in ("", *COMPANIONS):
            Path(f"{target.path}{suffix}").unlink(missing_ok=True)
        fsync_dir(target.directory)

    # -- holding writers off ----------------------------------------------------------

    def hold_off_writers(self) -> None:
        """Before the write lock: no other opener of the source, its WAL checkpointed
        (:meth:`SqliteBackend.hold_off_writers`, which a migration uses too). Raises
        ``RIVET_STATE_RUN_IN_PROGRESS`` and ``RIVET_STATE_FOREIGN_WAL``."""
        self.backend.hold_off_writers()

    def require_frozen(self) -> None:
        """Under the write lock: ``RIVET_STATE_RUN_IN_PROGRESS`` when a writer added WAL
        frames between the checkpoint and the lock (:meth:`SqliteBackend.require_frozen`)."""
        self.backend.require_frozen()

    def digest(self) -> str:
        """The page digest of the (frozen) source (:func:`~statetool.backends.sqlite_pages.content_digest`)."""
        return content_digest(self.source)

    # -- the copy ---------------------------------------------------------------------

    def copy_pages(self, conn: Connection, target: Location, progress: Progress, full_verify: bool) -> PageCopy:
        """Copy the source, frozen by ``conn``'s write lock, into :meth:`copy_path` in one
        pass over its pages, digested as they are copied
        (:func:`~statetool.backends.sqlite_pages.copy_digested`), while ``quick_check``
        (``integrity_check`` with ``full_verify``) and the row count of every table read the
        source in a second thread; ``progress(pages done, pages)``. Not fsynced yet:
        :meth:`verify_pages` does it.

        Raises ``RIVET_STATE_CORRUPT`` (the source fails its check, or is shorter than its
        header says), ``RIVET_STATE_VERIFY_FAILED`` (the source changed while it was copied:
        a writer that bypassed the lock) and the ``OSError`` of a full disk; the copy is
        removed then."""
        copy = self.copy_path(target)
        try:
            fd = os.open(copy, CREATE_FLAGS, 0o600)  # checked absent or removed: never follows a link
        except FileExistsError:
            raise unsafe_error(copy, "appeared while the copy was being started") from None
        try:
            before = os.stat(self.source)
            like(fd, before)  # the state's own mode and owner at its new place (owner checked before any lease)
            names = self.backend.table_names(self.backend.reader(conn))
            with self.backend.checking_pages(full_verify, names) as checked:
                digest = copy_digested(self.source, fd, progress)
                problems, tables = checked()
            if problems:
                raise StateError("RIVET_STATE_CORRUPT", f"{self.source} fails "
                                 f"{'integrity_check' if full_verify else 'quick_check'}: {problems[:3]}; "
                                 "nothing was changed", {"path": str(self.source)})
            after = os.stat(self.source)
            changed = (before.st_ino, before.st_size, before.st_mtime_ns) != (after.st_ino, after.st_size,
                                                                              after.st_mtime_ns)
            if changed or not self.backend.wal_is_empty():
                raise StateError("RIVET_STATE_VERIFY_FAILED", f"{self.source} was written while it was copied, "
                                 "past the write lock; nothing was changed", {"path": str(self.source)})
        except BaseException:
            os.close(fd)
            copy.unlink(missing_ok=True)
            raise
        os.close(fd)
        return PageCopy(copy, digest, tables)

    def verify_pages(self, copy: Path, source_digest: str) -> None:
        """fsync the copy (in a second thread) while it is read back: raise
        ``RIVET_STATE_VERIFY_FAILED`` (and remove the copy), naming the first page that
        differs, unless its page digest equals the source's."""
        with ThreadPoolExecutor(1, thread_name_prefix="fsync") as syncing:
            synced = syncing.submit(fsync_file, copy)
            digest = content_digest(copy)
            synced.result()
        if digest != source_digest:
            page = first_difference(self.source, copy)
            copy.unlink()
            raise StateError("RIVET_STATE_VERIFY_FAILED", f"the copy at {copy} differs from {self.source} "
                             f"(from page {page} on, as read back); nothing was changed", {"path": str(copy)})

    @contextlib.contextmanager
    def in_flight(self, copy: Path) -> Iterator[Connection]:
        """One writing transaction on the copy (not linked into place yet: nobody opens it),
        for the caller's audit row; before the commit its version becomes
        :data:`~statetool.schema.IN_FLIGHT_REVISION`, after it the file is
        fsynced. Errors as :meth:`SqliteBackend.writing`'s."""
        place = Location("sqlite", "declared_dir", "flag", directory=copy.parent, path=copy)
        with SqliteBackend(place, self.backend.lock_wait).writing("RIVET_STATE_RUN_IN_PROGRESS") as conn:
            yield conn
            conn.execute(sa.text(f"UPDATE {schema.VERSION_TABLE} SET version_num = :v"),
                         {"v": schema.IN_FLIGHT_REVISION})
        fsync_file(copy)

    def link_into_place(self, copy: Path, target: Location, on_step: Step) -> None:
        """Link the in-flight copy to ``target``'s path (a link never replaces anything),
        fsync, tell ``on_step("linked")``, then remove the copy's name. Raises
        ``RIVET_STATE_TARGET_NOT_EMPTY`` when a file appeared there meanwhile."""
        assert target.path is not None and target.directory is not None
        try:
            os.link(copy, target.path)
        except FileExistsError:
            raise StateError("RIVET_STATE_TARGET_NOT_EMPTY",
                             f"{target.path} appeared during the copy; nothing was replaced") from None
        fsync_dir(target.directory)
        on_step("linked")
        copy.unlink()
        fsync_dir(target.directory)

    @contextlib.contextmanager
    def removed_when_full(self, target: Location, files: list[Path]) -> Iterator[None]:
        """Copy inside this block: when the target's filesystem fills up (ENOSPC, EDQUOT,
        SQLITE_FULL), everything the block created there goes again (the copy and its
        journals, the ``side_copy`` of each of ``files``, each of ``files`` and each folder
        above it that did not exist before; what was there before stays) and
        ``RIVET_STATE_DISK_FULL`` is raised naming the target directory."""
        assert target.directory is not None
        created = _absent(target.directory, files)
        try:
            yield
        except (OSError, sqlite3.Error, StateError) as err:
            full = err if isinstance(err, StateError) else fault(target.directory, err)
            if full is None or full.code != "RIVET_STATE_DISK_FULL":
                raise
            for path in self.own_files(target) + [side_copy(f) for f in files]:
                path.unlink(missing_ok=True)
            for path in sorted(set(created), key=lambda p: len(p.parts), reverse=True):  # files, then their folders
                with contextlib.suppress(OSError):
                    if path.is_dir() and not path.is_symlink():
                        path.rmdir()  # only when empty: what was there before stays
                    else:
                        path.unlink()
            raise StateError("RIVET_STATE_DISK_FULL",
                             f"the filesystem of {target.directory} is full ({err}); what this run had copied "
                             f"there was removed, and the state at {self.source} was not changed",
                             {"directory": str(target.directory)}) from None

    # -- the source: its tombstone and the switch (statetool/backends/tombstone.py) -----

    def tombstone(self) -> dict[str, Any] | None:
        """The tombstone at the source (``to``, ``state_url``, ``kept_as``, ...): where an
        earlier move of this state went; None while the source is a state."""
        return read_tombstone(self.source)

    def stale_tombstones(self) -> list[Path]:
        """The temporary tombstones a killed move left beside the source (each to be
        checked with :meth:`refuse_unsafe` before it is removed)."""
        return stale_tombstones(self.source)

    @staticmethod
    def refuse_unsafe(*paths: Path) -> None:
        """Raise ``RIVET_STATE_UNSAFE_FILE`` for the first of ``paths`` (files a move
        creates or removes) that is a symlink or not a regular file
        (:func:`~statetool.backends.tombstone.refuse_unsafe`)."""
        refuse_unsafe(*paths)

    def require_retirable(self) -> None:
        """Refuse, before anything is written, a source whose directory cannot take the
        keep-link and the tombstone: ``RIVET_STATE_READ_ONLY`` or
        ``RIVET_STATE_PERMISSION_DENIED`` (:func:`~statetool.backends.tombstone.require_retirable`)."""
        require_retirable(self.backend.location)

    def wait_for_openers(self) -> None:
        """Wait up to the backend's ``lock_wait`` seconds until no other process holds the
        source open, then raise ``RIVET_STATE_RUN_IN_PROGRESS`` naming them
        (:func:`~statetool.backends.tombstone.wait_for_openers`)."""
        wait_for_openers(self.source, self.backend.lock_wait)

    def retire(self, doc: dict[str, Any], on_step: Step) -> Path:
        """The switch: keep the source's bytes beside it and put a tombstone holding ``doc``
        at its path in one atomic rename (:func:`~statetool.backends.tombstone.retire`;
        ``on_step`` told ``kept``, ``tombstoned``, ``swapped``). Returns where the old
        bytes are kept. Raises ``RIVET_STATE_UNSAFE_FILE``."""
        return retire(self.source, doc, on_step)

    def remove_companions(self) -> None:
        """Remove the ``-wal`` and ``-shm`` the retired source's old inode left."""
        remove_companions(self.source)

    # -- the target -------------------------------------------------------------------

    def relocation_detail(self, target: Location) -> dict[str, object] | None:
        """The detail of the last ``relocate`` audit row of the state at ``target`` (read
        through the backend's one read-only open), or None: no such row, a later row of
        another action, or no readable state there."""
        last = "(SELECT max(id) FROM rivet_audit WHERE action = 'relocate')"
        try:
            with SqliteBackend(target, self.backend.lock_wait).reading() as conn:
                detail = conn.scalar(f"SELECT detail FROM rivet_audit WHERE id = {last}")
                later = conn.scalar(f"SELECT count(*) FROM rivet_audit WHERE action <> 'relocate' AND id > {last}")
        except StateError:
            return None
        if detail is None or later:
            return None
        try:
            doc = json.loads(detail)
        except ValueError:  # an audit row this release did not write
            return None
        return doc if isinstance(doc, dict) else None

    def finish_target(self, target: Location) -> None:
        """Make the relocated copy at ``target`` live (the source is retired): its version
        goes from :data:`~statetool.schema.IN_FLIGHT_REVISION` back to head;
        fsynced. Idempotent (:meth:`SqliteBackend.make_live`)."""
        SqliteBackend(target, self.backend.lock_wait).make_live()


def _absent(directory: Path, files: list[Path]) -> list[Path]:
    """Each of ``files``, and each folder above it inside ``directory``, that does not exist
    yet: what a copy that fails half-way must remove again."""
    absent: list[Path] = []
    for path in files:
        while path != directory and directory in path.parents and not os.path.lexists(path):
            absent.append(path)
            path = path.parent
    return absent


class FileRetirement:
    """A SQLite state as a transfer's source retires it (a
    :class:`~statetool.backends.base.Retirement`): relocate's steps on its file
    (:class:`FileMove`), the switch being relocate's tombstone."""

    def __init__(self, backend: SqliteBackend) -> None:
        self.move = FileMove(backend)
        #: The real file of a symlinked state: the one retired.
        self.place = str(self.move.source)

    def moved_to(self) -> dict[str, Any] | None:
        """The tombstone at the source, or None."""
        return self.move.tombstone()

    def size_bytes(self) -> int:
        """The size of the source file."""
        return self.move.source.stat().st_size

    def require_retirable(self) -> None:
        """The source's directory takes the tombstone, and no temporary tombstone a killed
        run left is a symlink or a non-regular file (:meth:`FileMove.require_retirable`)."""
        self.move.require_retirable()
        self.move.refuse_unsafe(*self.move.stale_tombstones())

    def remove_stale(self) -> None:
        """Remove the temporary tombstones a kill before the switch left (checked regular files)."""
        for stale in self.move.stale_tombstones():
            self.move.refuse_unsafe(stale)
            stale.unlink()

    def hold_off_writers(self) -> None:
        """:meth:`FileMove.hold_off_writers`."""
        self.move.hold_off_writers()

    def require_frozen(self) -> None:
        """:meth:`FileMove.require_frozen`."""
        self.move.require_frozen()

    def digest(self, conn: Connection) -> str:
        """The page digest of the file, frozen by ``conn``'s write lock."""
        return self.move.digest()

    def wait_for_openers(self) -> None:
        """:meth:`FileMove.wait_for_openers`."""
        self.move.wait_for_openers()

    def retire(self, conn: Connection, doc: dict[str, Any], audit: Callable[[str, dict[str, object]], None],
               on_step: Step) -> str | None:
        """The tombstone renamed over the file, its bytes kept beside it (:meth:`FileMove.retire`);
        nothing is written into the old file (``audit`` is not used: its bytes are kept as they were)."""
        return str(self.move.retire(doc, on_step))

    def finish_retired(self) -> None:
        """The old inode's ``-wal``/``-shm`` and temporary tombstones removed."""
        self.move.remove_companions()
        self.remove_stale()
