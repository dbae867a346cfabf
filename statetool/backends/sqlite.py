"""SQLite state: the file ``.rivet_state.db`` beside the config or in a declared directory.

The read-only open creates nothing and misses nothing (SPEC §4). SQLite's own read-only
mode is not enough: a ``mode=ro`` connection to a WAL database creates ``-wal`` and
``-shm`` when they are absent and the folder is writable, and ``immutable=1`` ignores a
``-wal`` that holds committed frames (https://www.sqlite.org/wal.html#readonly,
https://www.sqlite.org/uri.html#uriimmutable). So the open is chosen from what is on disk:

* rollback-journal database (header byte 18 = 1): ``mode=ro``, which creates no file; a
  hot journal left by a killed writer makes SQLite answer SQLITE_READONLY_ROLLBACK, and
  the database and its journal are then copied into a private temporary directory and
  rolled back there: the state is read as it was before the interrupted write, and the
  connection says so (warning ``RIVET_STATE_HOT_JOURNAL``);
* WAL database with a ``-wal`` and a ``-shm`` and a live SQLite connection on the file
  (a POSIX lock, :func:`~statetool.backends.proclocks.lock_holders`): ``mode=ro``
  beside the live writer (both files exist, so none is created; SQLite's readers share
  the writer's wal-index);
* WAL database, no ``-wal`` (or an empty one): ``immutable=1``, as nothing lies outside
  the main file, under a read lock on SQLite's SHARED bytes so that no writer's close
  checkpoints into the file during the read (:mod:`statetool.backends.readlock`); a
  writer starting during the read writes to a new ``-wal``, which the main file does not
  see; a checkpoint the lock cannot hold off makes the read refuse
  (``RIVET_STATE_CHANGED_DURING_READ``);
* WAL database whose ``-wal`` holds frames and no live holder (a killed writer): the
  database and its ``-wal`` are copied into a private temporary directory (the same
  mechanism) and read there, so the committed frames are seen and nothing is written
  beside the state;
* a ``-wal``/``-shm`` that is not the state's own (:meth:`SqliteBackend.foreign_companions`):
  ``immutable=1``, the main file alone; every write refuses (``RIVET_STATE_FOREIGN_WAL``).

Reads run on the standard library's ``sqlite3`` (a :class:`~statetool.backends.readers.DriverReader`);
SQLAlchemy is imported only by the writer, the creation and a move's copy (issue 13 item 1);
``tempfile`` and ``concurrent.futures`` only where a private copy or a page check needs them
(issue 13: a read of a clean state does not pay for their start-up).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from statetool import migrations
from statetool.access import denied, refuse_unownable, unownable
from statetool.backends.base import BACKUP_TIME, Progress, Step
from statetool.backends.durable import (CREATE_FLAGS, copy_bytes, copy_file_exclusively, fitting_name, fsync_dir,
                                        fsync_file, like, mode_of, share_owner)
from statetool.backends.faults import WRITE_MARGIN, fault, refuse_unwritable
from statetool.backends.proclocks import lock_holders
from statetool.backends.readers import CoreReader, DriverReader
from statetool.backends.readlock import Fingerprint, holding_shared
from statetool.backends.sqlite_rows import copy_blocks, insert_blocks
from statetool.backends.sqlite_file import applied_journal, foreign_companions, read_header, refuse_unsafe_companions
from statetool.backends.tombstone import remove_companions, wait_for_openers
from statetool.errors import StateError, internal_error
from statetool.location import LEASE_DIR, Location
from statetool.tables import IN_FLIGHT_REVISION, VERSION_TABLE

if TYPE_CHECKING:
    import sqlalchemy as sa
    from sqlalchemy.engine import Connection

    from statetool.backends.base import Reader
    from statetool.backends.copy_text import Block, Loaded
    from statetool.backends.sqlite_leases import FlockLeases
    from statetool.migrations import Revision

#: Looks a read takes at a state whose ``-wal`` a writer's close removes meanwhile.
_VANISHED_TRIES = 5


class _LookAgain(Exception):
    """A writer committed between a read's look at the files and its read lock."""

#: Bytes a backup's private directory adds to the backup's name: "." + mkdtemp's 8 random
#: characters + ".tmp".
_PRIVATE_DIR_ROOM = 13


def _bytes_under(path: Path) -> int:
    """The bytes of the regular file ``path``, or of every regular file under the directory
    ``path`` (links not followed)."""
    if not path.is_dir():
        return os.lstat(path).st_size
    return sum(os.lstat(Path(top) / name).st_size for top, _dirs, files in os.walk(path) for name in files)


class SqliteBackend:
    """A SQLite state file. See the module docstring for how it is opened read-only."""

    dialect_name = "sqlite"
    schema = None
    #: One file, copied page for page with the backup API and retired in place by a
    #: tombstone (statetool/backends/moves.py): ``relocate`` moves it.
    relocatable = True
    #: Its backups and a move's keep are files beside it, SQLite states themselves.
    keeps_copies = True

    # -- capabilities (the reasons: backends/base.py) ------------------------------------
    #: The state is one file, migrated in a copy that replaces it (:class:`CopyMigration`):
    #: no DDL script to hand a DBA, so ``migrate --sql`` is refused.
    supports_offline_sql = False
    #: ``PRAGMA quick_check`` reads every page of the file.
    checks_integrity = True
    #: SQLite's busy handler sleeps at most 100 ms between two tries of a lock
    #: (``sqliteDefaultBusyCallback``, https://www.sqlite.org/c3ref/busy_timeout.html).
    writer_retry_seconds = 0.1
    #: ``VACUUM`` rebuilds the whole file under the write lock
    #: (https://www.sqlite.org/lang_vacuum.html): every writer waits for it, seconds on a
    #: large state.
    reclaim_blocks_writers = True

    def offline_sql(self, current: str | None, target: str, direction: str, *, stamp: str | None = None) -> str:
        """Raises ``RIVET_STATE_SQL_UNSUPPORTED``: see :attr:`supports_offline_sql`."""
        raise StateError("RIVET_STATE_SQL_UNSUPPORTED", f"{self.path} is a SQLite state, migrated as a "
                         "file: it has no offline SQL")

    def __init__(self, location: Location, lock_wait: float) -> None:
        assert location.path is not None
        self.location = location
        self.path: Path = location.path
        self.lock_wait = lock_wait

    @property
    def real(self) -> Path:
        """The state's real file: the file a symlinked state path leads to (the resolver's
        :attr:`Location.real_path`), else the path itself. A migration replaces this file."""
        return self.location.real_path or self.path

    # -- reading ---------------------------------------------------------------------

    def present(self) -> bool:
        """True when something stands at the state's path; False when nothing does.

        Raises ``RIVET_STATE_PERMISSION_DENIED`` when this user may not look (a directory
        it may not enter is not a missing state, SPEC §8a), and ``RIVET_STATE_DIR_MISSING``
        when the declared directory does not exist or is a file (with the spelling that
        names a directory when the file named is the state itself)."""
        try:
            os.lstat(self.path)
            return True
        except FileNotFoundError:
            pass
        except PermissionError:
            raise denied(self.path, "look at") from None
        except NotADirectoryError:
            raise self.location.not_a_directory() from None
        if self.location.scope == "declared_dir" and not os.path.lexists(self.path.parent):
            raise self.location.directory_missing()
        return False

    def check_writable(self, *, copies: int, replaced_by: str | None = None, room_for: str | None = None) -> None:
        """Refuse a write this user or this filesystem cannot complete before any file is
        opened for writing (:func:`~statetool.backends.faults.refuse_unwritable`): the
        state's directory, its lease folder and the file must be writable, and there must
        be room for ``copies`` files as large as the state (a migration's copy and the tables
        it rebuilds, a backup) and the change itself. What a killed backup or migration left
        (:meth:`_stale_temps`) counts as room: the write removes it before it copies, so a
        re-run on a nearly full disk converges. With ``replaced_by`` (the write's name: ``a
        migration``, ``a relocation``), the write puts a new file in the state file's place,
        which must keep the real file's owner and group: a user that cannot give them is
        refused first (:func:`~statetool.access.refuse_unownable`), before any lease record is
        created that the owner could then not write beside."""
        if replaced_by:
            refuse_unownable(self.real, replaced_by)
        refuse_unsafe_companions(self.path)
        size = self.path.stat().st_size if os.path.isfile(self.path) else 0
        reclaimed = sum(_bytes_under(path) for path in self._stale_temps()) if copies else 0
        # the real file's directory first: a migration's copy and backup are made there
        directories = dict.fromkeys((self.real.parent, self.path.parent, self.real.parent / LEASE_DIR))
        uses = room_for or "a migration's copy, rebuilt tables, a backup"
        refuse_unwritable(self.path, directories=tuple(directories),
                          need=max(copies * size - reclaimed, 0) + WRITE_MARGIN,
                          room_for=f"{copies} copies as large as the state ({uses}) and the change" if copies
                          else "the change")


    def contended(self, conn: Reader) -> bool:
        """True when another process holds a lock on the file (a connection open, or waiting
        for the write lock, holds a read lock on it: ``/proc/locks``), or when the lock table
        cannot be read."""
        holders = lock_holders(self.path)
        return holders is None or bool(holders - {os.getpid()})

    def check_reclaimable(self, conn: Reader, tables: Iterable[str]) -> None:
        """Nothing to check beyond :meth:`check_writable` (the file's rights and room)."""

    def reclaim_space(self, tables: Iterable[str]) -> tuple[int, int]:
        """``VACUUM`` the file (every table: SQLite has no per-table form), then
        ``wal_checkpoint(TRUNCATE)`` so that the WAL, which the rebuilt pages went through,
        gives its space back too. Refuses ``RIVET_STATE_FOREIGN_WAL`` first, as every write."""
        self._refuse_foreign(self._header())
        before = self._bytes_on_disk()
        try:
            db = sqlite3.connect(f"file:{self._quoted(self.path)}?mode=rw", uri=True, isolation_level=None,
                                 timeout=self.lock_wait)
            try:
                db.execute("PRAGMA synchronous = FULL")
                db.execute("VACUUM")
                db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
            finally:
                db.close()
        except sqlite3.Error as err:
            raise self._body_error(err, "RIVET_STATE_LOCK_TIMEOUT") from None
        return before, self._bytes_on_disk()

    def _bytes_on_disk(self) -> int:
        """The bytes of the state file and of its ``-wal``."""
        return sum(os.stat(p).st_size for p in (self.path, Path(f"{self.path}-wal")) if os.path.exists(p))

    def _header(self) -> bytes:
        return read_header(self.path)

    def _orphan_wal_beside(self) -> bool:
        """A -wal or -shm beside the file, and no hot -journal (which mode=ro must still see)."""
        wal, shm, journal = (Path(f"{self.path}{suffix}") for suffix in ("-wal", "-shm", "-journal"))
        return (wal.exists() or shm.exists()) and not journal.exists()

    def foreign_companions(self, header: bytes) -> list[str]:
        """:func:`~statetool.backends.sqlite_file.foreign_companions` of this state."""
        return foreign_companions(self.path, header)

    def _refuse_foreign(self, header: bytes) -> None:
        """Raise ``RIVET_STATE_FOREIGN_WAL`` when :meth:`foreign_companions` finds any: the
        state must not be opened for writing (nor checkpointed) with them there."""
        foreign = self.foreign_companions(header)
        if foreign:
            raise StateError("RIVET_STATE_FOREIGN_WAL",
                             f"{'; '.join(foreign)}: a write would merge it into {self.path}; nothing was written",
                             {"path": str(self.path), "files": foreign})

    def _wal_has_frames(self) -> bool:
        try:
            return os.stat(f"{self.path}-wal").st_size > 32
        except FileNotFoundError:
            return False

    def _private_copy(self, stack: contextlib.ExitStack, companion: str) -> Path:
        """Copy the state and its ``companion`` (``-wal`` or ``-journal``) into a private
        temporary directory (removed when ``stack`` closes) and return the copy's path: SQLite
        may then apply the ``-wal`` or roll the journal back there, never beside the state.

        The two files are copied again when either changed meanwhile (a writer that started
        during the copy), so the pair is one moment's; after 5 tries ``RIVET_STATE_RUN_IN_PROGRESS``.
        """
        import tempfile

        snapshot = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="statetool-snapshot-")))
        copy = snapshot / self.path.name
        sources = (self.path, Path(f"{self.path}{companion}"))

        def marks() -> list[tuple[int, int, int]]:
            return [(st.st_ino, st.st_size, st.st_mtime_ns) for st in map(os.stat, sources)]

        for _attempt in range(5):
            before = marks()
            try:
                shutil.copyfile(sources[0], copy)
                shutil.copyfile(sources[1], f"{copy}{companion}")
            except OSError as err:
                raise fault(snapshot, err) or err from None
            if marks() == before:
                return copy
        raise StateError("RIVET_STATE_RUN_IN_PROGRESS", f"{self.path} kept changing while it was read; re-run "
                         "when its writer has finished", {"path": str(self.path)})

    def _interrupted_message(self) -> str:
        return (f"{self.path}-journal is the hot journal of a write that was killed before it committed: this "
                "reads the state as it was before that write (rolled back in a private copy); nothing beside "
                "the state was changed")

    @contextlib.contextmanager
    def reading(self) -> Iterator[DriverReader]:
        """A read-only session on ``sqlite3`` (see the module docstring). A rollback-journal
        state with a hot ``-journal`` is read from a private copy rolled back there, and the
        reader's ``info["interrupted_write"]`` says so (warning ``RIVET_STATE_HOT_JOURNAL``).
        Errors are translated where the database is opened; an error of the caller's own SQL
        is :meth:`_body_error`'s (busy: ``RIVET_STATE_RUN_IN_PROGRESS``)."""
        header = self._header()
        refuse_unsafe_companions(self.path)
        wal_mode = header[18] == 2
        with contextlib.ExitStack() as stack:
            for attempt in range(_VANISHED_TRIES):
                try:
                    uri, unchanged = self._read_uri(stack, header)
                    break
                except (FileNotFoundError, _LookAgain):
                    # the -wal was there and then gone (the last writer's close folded it into the
                    # file and removed it), or a writer committed between the look and the read
                    # lock (beside a live run, a few reads in a thousand): look again
                    stack.close()
                    if attempt == _VANISHED_TRIES - 1:
                        raise StateError("RIVET_STATE_RUN_IN_PROGRESS", f"{self.path} kept changing while it "
                                         "was opened; re-run when its writer has finished",
                                         {"path": str(self.path)}) from None
            try:
                conn = self._open_read(stack, uri)
            except StateError as err:
                if err.code != "RIVET_STATE_INTERRUPTED_WRITE" or wal_mode:
                    raise
                # SQLite found a hot journal, which a read-only connection cannot roll back:
                # roll it back in a private copy instead (the same mechanism as a killed WAL writer).
                stack.close()
                conn = self._open_read(stack, f"file:{self._quoted(self._private_copy(stack, '-journal'))}")
                conn.info["interrupted_write"] = self._interrupted_message()
            if unchanged is None:
                yield conn
                return
            try:
                yield conn
            except Exception as err:
                if unchanged.changed(self.path):
                    raise self._changed_under_read() from err
                raise
            if unchanged.changed(self.path):
                raise self._changed_under_read()

    def _changed_under_read(self) -> StateError:
        """``RIVET_STATE_CHANGED_DURING_READ``: the file was written while an ``immutable=1``
        read read it (:mod:`statetool.backends.readlock`): what was read may mix two moments,
        so none of it is used."""
        return StateError("RIVET_STATE_CHANGED_DURING_READ",
                          f"{self.path} was written while it was read (a live run's checkpoint): what was read "
                          "may mix two moments and was not used; run the command again", {"path": str(self.path)})

    def _read_uri(self, stack: contextlib.ExitStack, header: bytes) -> tuple[str, Fingerprint | None]:
        """The URI :meth:`reading` opens, chosen from what is on disk (the module docstring),
        with the main file's :class:`~statetool.backends.readlock.Fingerprint` when the read
        is ``immutable=1`` (None otherwise); a private copy and the read lock are made in
        ``stack``. Raises ``FileNotFoundError`` when the ``-wal`` is removed while it is looked
        at, and :class:`_LookAgain` when a writer committed between the look and the lock."""
        wal_mode = header[18] == 2
        wal, shm = Path(f"{self.path}-wal"), Path(f"{self.path}-shm")
        if (not wal_mode and self._orphan_wal_beside() and lock_holders(self.path) == set()) or (
                wal_mode and self.foreign_companions(header)):
            # A -wal/-shm that is not the state's own (restored or copied apart; another page
            # size, another log's frames): a mode=ro open adopts that -wal and rewrites the -shm,
            # a private copy would merge it; immutable=1 reads the main file alone.
            return self._immutable(stack, wal_mode, foreign=True)
        if not wal_mode:
            return f"file:{self._quoted(self.path)}?mode=ro", None
        if wal.exists() and shm.exists() and lock_holders(self.path, sqlite_only=True):
            # a live connection: read beside it as SQLite's own reader, sharing its wal-index
            return f"file:{self._quoted(self.path)}?mode=ro", None
        if self._wal_has_frames():
            return f"file:{self._quoted(self._private_copy(stack, '-wal'))}", None
        return self._immutable(stack, wal_mode, foreign=False)

    def _immutable(self, stack: contextlib.ExitStack, wal_mode: bool, *,
                   foreign: bool) -> tuple[str, Fingerprint]:
        """An ``immutable=1`` read of the main file alone, with its fingerprint. A WAL state's
        is made under :func:`~statetool.backends.readlock.holding_shared` (no writer's close
        checkpoints under it; a close already checkpointing is waited for, ``--lock-wait`` but
        at least 1 s, as it takes milliseconds); unless the companions are ``foreign`` (their frames are never
        the state's), frames that reached the ``-wal`` before the lock was held raise
        :class:`_LookAgain`."""
        uri = f"file:{self._quoted(self.path)}?immutable=1"
        if wal_mode:
            stack.enter_context(holding_shared(self.path, max(self.lock_wait, 1.0)))
        unchanged = Fingerprint.of(self.path)
        if wal_mode and not foreign and self._wal_has_frames():
            raise _LookAgain
        return uri, unchanged

    @contextlib.contextmanager
    def scanning(self) -> Iterator[DriverReader]:
        """A read transaction on the live file opened ``mode=rw`` (see
        :class:`~statetool.backends.base.Backend`): in WAL mode a reader neither waits for the
        writer nor holds it off (https://www.sqlite.org/wal.html#concurrency), and reads the
        committed state, ``-wal`` included, without the private copies :meth:`reading` makes
        to create no file."""
        self._refuse_foreign(self._header())
        with contextlib.ExitStack() as stack:
            yield self._open_read(stack, f"file:{self._quoted(self.path)}?mode=rw")

    def _open_read(self, stack: contextlib.ExitStack, uri: str) -> DriverReader:
        """Open ``uri`` in one read transaction (every query sees one snapshot), its first
        page read; SQLite's errors translated (:meth:`_translate`)."""
        try:
            raw = sqlite3.connect(uri, uri=True, timeout=min(self.lock_wait, 30.0), isolation_level=None)
            stack.callback(raw.close)
            raw.execute("BEGIN")
            raw.execute("SELECT count(*) FROM sqlite_master").fetchall()
        except sqlite3.Error as err:
            raise self._translate(err) from None
        return DriverReader(raw, sqlite3.Error, lambda err: self._body_error(err, "RIVET_STATE_RUN_IN_PROGRESS"))

    def reader(self, conn: Connection) -> CoreReader:
        """The reader over ``conn``, a connection of :meth:`writing` (or a move's copy)."""
        return CoreReader(conn, lambda err: self._body_error(err, "RIVET_STATE_RUN_IN_PROGRESS"))

    @staticmethod
    def _quoted(path: Path) -> str:
        from urllib.parse import quote

        return quote(str(path))

    def _engine(self, uri: str, timeout: float) -> sa.Engine:
        import sqlalchemy as sa
        from sqlalchemy.pool import NullPool

        def connect() -> sqlite3.Connection:
            return sqlite3.connect(uri, uri=True, timeout=timeout, isolation_level=None, check_same_thread=False)

        return sa.create_engine("sqlite://", creator=connect, poolclass=NullPool)

    def _translate(self, orig: BaseException) -> StateError:
        """The registered error for a driver error (``sqlite3``'s own, SQLAlchemy's ``orig``)
        met where the database is opened, begun, locked or committed (issue 10, "one error
        boundary")."""
        name = getattr(orig, "sqlite_errorname", "")
        text = str(orig)
        if name == "SQLITE_READONLY_ROLLBACK" or "hot journal" in text:
            return StateError("RIVET_STATE_INTERRUPTED_WRITE",
                              f"{self.path} has a hot journal ({self.path}-journal): a writer was killed "
                              "in the middle of a transaction", {"path": str(self.path)})
        if name in ("SQLITE_NOTADB",) or "not a database" in text:
            return StateError("RIVET_STATE_NOT_A_STATE", f"{self.path} is not a SQLite database",
                              {"path": str(self.path)})
        if name.startswith("SQLITE_CORRUPT") or "malformed" in text:
            return StateError("RIVET_STATE_CORRUPT", f"{self.path} is damaged: {text}", {"path": str(self.path)})
        if name.startswith("SQLITE_BUSY") or "locked" in text:
            return StateError("RIVET_STATE_RUN_IN_PROGRESS", f"{self.path} is locked by another process: {text}",
                              {"path": str(self.path)})
        return StateError("RIVET_STATE_UNREACHABLE", f"{self.path} cannot be opened: {text}",
                          {"path": str(self.path)})

    def _body_error(self, orig: BaseException, busy_code: str) -> StateError:
        """The registered error for a driver error (``sqlite3``'s own, or SQLAlchemy's wrapper
        of it) raised by an operation's own SQL: an environment fault keeps its code
        (read-only, permission, disk full; busy as ``busy_code``), damage is
        ``RIVET_STATE_CORRUPT``, a constraint is ``RIVET_STATE_WRITE_REFUSED``, and anything
        else is a bug: ``RIVET_INTERNAL``."""
        orig = getattr(orig, "orig", None) or orig
        known = fault(self.path, orig)
        if known is not None:
            return known
        if isinstance(orig, sqlite3.IntegrityError):  # a constraint or a trigger's RAISE: the database refuses
            return StateError("RIVET_STATE_WRITE_REFUSED", f"{self.path} refused the write: {orig}",
                              {"path": str(self.path)})
        translated = self._translate(orig)
        if translated.code == "RIVET_STATE_RUN_IN_PROGRESS":
            return StateError(busy_code, translated.message, translated.details)
        if translated.code in ("RIVET_STATE_CORRUPT", "RIVET_STATE_NOT_A_STATE"):
            return translated
        return internal_error(orig)

    def table_names(self, conn: Reader) -> set[str]:
        """The tables of the file, from ``sqlite_master`` (SQLite's own tables left out)."""
        return {r[0] for r in conn.rows("SELECT name FROM sqlite_master WHERE type = 'table'")
                if not r[0].startswith("sqlite_")}

    def integrity_problems(self, conn: Reader, *, full: bool = False) -> list[str]:
        """What ``PRAGMA quick_check`` (``integrity_check`` with ``full``: every index entry
        too) reports, or the driver's error when it cannot run."""
        try:
            rows = [r[0] for r in conn.rows(f"PRAGMA {'integrity_check' if full else 'quick_check'}")]
        except StateError as err:  # the reader's translation: the driver's own words are the problem
            return [str(err.__cause__ or err.message)]
        return [] if rows == ["ok"] else rows

    def size_bytes(self, conn: Reader) -> int:
        """The real file's size and its ``-wal``'s (committed pages not yet folded in), by
        ``lstat``: a ``-wal`` that is not a regular file counts nothing."""
        total = os.stat(self.real).st_size
        with contextlib.suppress(FileNotFoundError):
            wal = os.lstat(f"{self.real}-wal")
            total += wal.st_size if stat.S_ISREG(wal.st_mode) else 0
        return total

    def rebuilt_tables(self, conn: Reader, revision: Revision) -> tuple[str, ...]:
        """Those of ``revision.rebuilds`` whose only change, ``revision.retypes``, cannot be
        made in the table's declared text (:func:`~statetool.backends.sqlite_schema.retyped_sql`).
        Raises ``RIVET_STATE_SCHEMA_UNEXPECTED`` when the rebuild of one would lose part of it
        (:func:`~statetool.backends.sqlite_schema.require_rebuildable`): the dry run refuses
        as the real run does."""
        from statetool.backends.sqlite_schema import require_rebuildable, retyped_sql

        rebuilt = []
        for table in revision.rebuilds:
            create_sql = conn.scalar("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = :t", {"t": table})
            if create_sql and table in revision.retypes and retyped_sql(create_sql, revision.retypes[table]):
                continue
            if create_sql:
                require_rebuildable(conn.rows, table, str(self.path))
            rebuilt.append(table)
        return tuple(rebuilt)

    # -- writing ---------------------------------------------------------------------

    def _writer_engine(self, path: Path) -> sa.Engine:
        import sqlalchemy as sa

        engine = self._engine(f"file:{self._quoted(path)}", timeout=self.lock_wait)

        @sa.event.listens_for(engine, "begin")
        def begin_immediate(conn: Connection) -> None:
            # pysqlite would defer BEGIN to the first DML and run DDL outside any
            # transaction; BEGIN IMMEDIATE takes the write lock before the first read.
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        @sa.event.listens_for(engine, "connect")
        def pragmas(dbapi: sqlite3.Connection, _record: object) -> None:
            dbapi.execute("PRAGMA synchronous = FULL")

        return engine

    @contextlib.contextmanager
    def writing(self, lock_code: str) -> Iterator[Connection]:
        """One writing transaction (``BEGIN IMMEDIATE``) on the state itself; a hot journal is
        rolled back in place here, after the caller's pre-flight passed on a private copy.
        Raises ``RIVET_STATE_FOREIGN_WAL`` before opening anything when a companion file does
        not belong (:meth:`foreign_companions`), ``lock_code`` when the lock stays taken, and
        the registered code of an error where the state is opened, begun or committed; the
        caller's own SQL errors are :meth:`_body_error`'s."""
        import sqlalchemy as sa

        self._refuse_foreign(self._header())
        self._stale_temps()  # refused here, before any lease or lock is taken
        engine = self._writer_engine(self.path)
        try:
            try:
                connection = engine.connect()
            except sa.exc.OperationalError as err:  # "unable to open database file": read-only, permission
                raise fault(self.path, err) or self._translate(err.orig) from None
            with connection as conn:
                try:
                    trans = conn.begin()
                except sa.exc.OperationalError as err:
                    if "locked" in str(err.orig) or "busy" in str(err.orig):
                        raise StateError(lock_code, f"{self.path} stayed locked by another writer for "
                                         f"{self.lock_wait:g} s (--lock-wait)", {"path": str(self.path)}) from None
                    raise fault(self.path, err) or self._translate(err.orig) from None
                try:
                    yield conn
                except BaseException as raised:
                    with contextlib.suppress(sa.exc.DBAPIError):
                        trans.rollback()
                    if isinstance(raised, sa.exc.DBAPIError):
                        raise self._body_error(raised.orig, lock_code) from None
                    if isinstance(raised, (OSError, sqlite3.Error)):  # a backup, a sidecar: read-only, full disk
                        raise fault(self.path, raised) or raised from None
                    raise
                try:
                    trans.commit()
                except sa.exc.DBAPIError as err:
                    raise self._body_error(err.orig, lock_code) from None
        finally:
            engine.dispose()

    def _companions(self) -> list[Path]:
        """The ``-wal``, ``-shm`` and ``-journal`` beside the state's path."""
        return [p for p in (Path(f"{self.path}{suffix}") for suffix in ("-wal", "-shm", "-journal"))
                if os.path.lexists(p)]

    def create(self, build: Callable[[Connection], None], start_from: Path | None = None,
               on_step: Step | None = None) -> None:
        with self._new_file(start_from, on_step) as conn:
            build(conn)

    def copies(self) -> list[Path]:
        directory, name = self.real.parent, self.path.name
        second = set(self._second_names())
        found: list[Path] = []
        for pattern in (f"{name}.backup-*", f"{name}.relocated-*"):
            found += [path for path in sorted(directory.glob(pattern))
                      if not path.name.endswith((".tmp", "-journal", "-wal", "-shm")) and path not in second]
        return found

    @contextlib.contextmanager
    def _new_file(self, start_from: Path | None = None, on_step: Step | None = None) -> Iterator[Connection]:
        """One writing transaction on a new state file in WAL mode (a byte copy of the state
        file ``start_from`` when given, made exclusively, never through a link, with the
        journal a read of it applies: :func:`_carry_journal`), built in a private directory
        beside the state (:meth:`_building_dir`) and linked into place only once committed,
        closed and fsynced (a link never replaces what appeared meanwhile:
        ``RIVET_STATE_TARGET_NOT_EMPTY``); a failure leaves nothing at the state's path, a kill
        leaves at most the private directory, which the next create removes. ``on_step`` is
        told ``copied`` (from ``start_from`` only), ``built`` and ``linked``
        (``restore.CREATE_POINTS``). Raises ``RIVET_STATE_TARGET_NOT_EMPTY`` when journals of
        an earlier state lie there, and the directory's faults."""
        import sqlalchemy as sa

        leftovers = self._companions()
        if leftovers:
            # SQLite would apply them to the new file as if they were its own: another state's
            # committed frames, or the roll-back of another state's transaction.
            raise StateError("RIVET_STATE_TARGET_NOT_EMPTY",
                             f"{', '.join(map(str, leftovers))} lie where the new state would be: files of a state "
                             "that was there before; nothing was created", {"path": str(self.path)})
        directory = self.path.parent
        step = on_step or (lambda _name: None)
        with self._building_dir() as private:
            tmp = private / self.path.name
            if start_from is not None:
                try:
                    copy_file_exclusively(start_from, tmp)
                    _carry_journal(start_from, tmp)
                except OSError as err:
                    raise fault(directory, err) or err from None
                step("copied")
            engine = self._writer_engine(tmp)

            @sa.event.listens_for(engine, "connect")
            def wal(dbapi: sqlite3.Connection, _record: object) -> None:
                mode = dbapi.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                if mode != "wal":
                    raise sqlite3.OperationalError(f"journal_mode stayed {mode}")

            try:
                with engine.connect() as conn, conn.begin():
                    yield conn
            except sa.exc.IntegrityError as err:  # a constraint of the new state refused a row given to it
                raise self._body_error(err, "RIVET_STATE_LOCK_TIMEOUT") from None
            except (OSError, sqlite3.Error, sa.exc.OperationalError) as err:  # read-only, permission, full disk
                raise fault(directory, err) or err from None
            finally:
                engine.dispose()  # the last connection's close folds the WAL into the file
            fsync_file(tmp)
            step("built")
            try:
                os.link(tmp, self.path)  # unlike rename, never replaces what appeared meanwhile
            except FileExistsError:
                raise StateError("RIVET_STATE_TARGET_NOT_EMPTY", f"{self.path} appeared while the new state "
                                 "was being built; nothing was replaced", {"path": str(self.path)}) from None
        fsync_dir(directory)  # the link and the private directory's removal
        step("linked")

    #: The private directories new states are built in (:meth:`_building_dir`).
    _BUILDING = ".init-"

    @contextlib.contextmanager
    def _building_dir(self) -> Iterator[Path]:
        """:meth:`_private_dir` for a new state (``<state>.init-<random>.tmp``), locked
        (``flock``) for as long as the state is built in it, so that one a killed create
        left is told from one another create is building in: the abandoned ones are removed
        first (:meth:`_remove_abandoned_builds`). A directory removed as abandoned between
        its making and its lock is made again."""
        import fcntl

        self._remove_abandoned_builds()
        while True:
            with self._private_dir(f"{self.path.name}{self._BUILDING}") as made:
                try:
                    fd = os.open(made, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    if os.fstat(fd).st_nlink == 0:
                        continue
                    yield made
                    return
                finally:
                    os.close(fd)

    def _remove_abandoned_builds(self) -> None:
        """Remove every ``<state>.init-….tmp`` directory beside the state whose lock nobody
        holds: what a create (``init``, a transfer into this file, a restore where no state
        was) SIGKILLed before its end left, a copy of a state that was never in place."""
        import fcntl

        for path in self.path.parent.glob(f"{self.path.name}{self._BUILDING}*.tmp"):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue  # gone meanwhile, or no directory of ours (a symlink is never followed)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # another create is building in it
            try:
                shutil.rmtree(path, ignore_errors=True)
            finally:
                os.close(fd)

    def _make_private_dir(self, directory: Path, prefix: str) -> Path:
        """A new directory of this user's only (mode 0700, a name nobody can guess, ending
        in ``.tmp``) in ``directory``, for a file SQLite must create by path (a backup, a
        migration's copy, a new state) and its journal: a symlink planted at a predictable
        name is never followed (issue 10)."""
        import tempfile

        try:
            return Path(tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=directory))
        except OSError as err:
            raise fault(directory, err) or err from None

    @contextlib.contextmanager
    def _private_dir(self, prefix: str) -> Iterator[Path]:
        """:meth:`_make_private_dir` beside the state, removed on the way out, whatever happened."""
        made = self._make_private_dir(self.path.parent, prefix)
        try:
            yield made
        finally:
            shutil.rmtree(made, ignore_errors=True)

    def _temp_names(self) -> list[Path]:
        """What a killed backup or migration left beside the state (or beside its real file),
        found by name only: ``….backup-….tmp`` (a private directory or, from older releases, a
        file) and ``….backup-….tmp-journal``."""
        found: list[Path] = []
        for directory in dict.fromkeys((self.path.parent, self.real.parent)):
            found += sorted(directory.glob(f"{self.path.name}.backup-*.tmp")) + sorted(
                directory.glob(f"{self.path.name}.backup-*.tmp-journal"))
        return found

    def _second_names(self) -> list[Path]:
        """Every backup name that is a hard link of the state itself: what a migration killed
        between keeping the original and switching its copy in leaves. Such a name changes
        with the state; it is no backup."""
        return [path for path in sorted(self.real.parent.glob(f"{self.path.name}.backup-*"))
                if path.is_file() and not path.is_symlink() and os.path.samefile(path, self.real)]

    def leftovers(self) -> list[Path]:
        """What a killed migration or backup left beside the state (:meth:`_temp_names`,
        :meth:`_second_names`), for the reads to report (``info``, ``check``: warning
        ``RIVET_STATE_LEFTOVER_TEMP``). Read-only: nothing is followed or removed; the next
        migration, or write that takes a backup, removes them before it copies
        (:meth:`_remove_stale_temps`)."""
        if not os.path.isfile(self.real):
            return []
        return self._temp_names() + self._second_names()

    def _stale_temps(self) -> list[Path]:
        """:meth:`_temp_names`, each checked: raises ``RIVET_STATE_UNSAFE_FILE`` when one of
        them is a symlink or another kind of file: nothing is then removed or followed, and
        nothing is written."""
        found = self._temp_names()
        for path in found:
            kind = os.lstat(path).st_mode
            if not (stat.S_ISDIR(kind) or stat.S_ISREG(kind)):
                raise StateError("RIVET_STATE_UNSAFE_FILE", f"{path} is a symlink or not a regular file, where "
                                 "statetool keeps the temporary file of a backup; nothing was written",
                                 {"path": str(path)})
        return found

    def _remove_stale_temps(self) -> None:
        """Remove :meth:`_stale_temps`, :meth:`_second_names` and what a killed create left
        (:meth:`_remove_abandoned_builds`). Runs under the write lock, so no backup or
        migration copy is being made."""
        self._remove_abandoned_builds()
        for path in self._stale_temps():
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        for path in self._second_names():
            path.unlink()

    def _copy(self, conn: Connection, tmp: Path, progress: Progress | None) -> dict[str, int]:
        """Copy the state, as ``conn``'s write lock freezes it, into ``tmp`` with the online
        backup API, as a rollback-journal file (a backup to keep, one self-contained file);
        verify (``quick_check``) and compare every table's row count; fsync. Returns
        ``{table: rows}``.

        The copy is read through a second connection: SQLite answers SQLITE_LOCKED to a
        backup whose source connection holds a write transaction, and ``conn`` holds one
        (BEGIN IMMEDIATE) so that nobody can write between the copy and what follows.
        """
        writer: sqlite3.Connection = conn.connection.driver_connection  # type: ignore[assignment]
        tables = sorted(self.table_names(self.reader(conn)))
        expected = {t: writer.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in tables}
        source = sqlite3.connect(f"file:{self._quoted(self.path)}?mode=ro", uri=True, timeout=self.lock_wait)
        target = sqlite3.connect(tmp)
        try:
            def step(_status: int, remaining: int, total: int) -> None:
                if progress is not None:
                    progress(total - remaining, total)

            source.backup(target, pages=4096, progress=step)
            target.execute("PRAGMA journal_mode = DELETE")
            check = [r[0] for r in target.execute("PRAGMA quick_check").fetchall()]
            got = {t: target.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in tables}
        finally:
            source.close()
            target.close()
        if check != ["ok"] or got != expected:
            tmp.unlink(missing_ok=True)
            raise StateError("RIVET_STATE_VERIFY_FAILED",
                             f"the copy of {self.path} did not verify (quick_check {check[:3]}, "
                             f"row counts {got} vs {expected}); nothing was changed", {"path": str(self.path)})
        fsync_file(tmp)
        return got

    def _backup_file(self, label: str, directory: Path, stamp: str) -> Path:
        """``<directory>/.rivet_state.db.backup-<label>-<stamp>`` (decisions.md, "Backups
        (SQLite)"). The label may carry an export name: percent-encoded (as lease file names
        are) so a "/" in it can neither fail the backup nor place it outside the state's
        directory, and a long one shortened: the name must leave room for its private
        directory."""
        from urllib.parse import quote

        return directory / fitting_name(f"{self.path.name}.backup-", quote(label, safe="-_."), f"-{stamp}",
                                        room=_PRIVATE_DIR_ROOM)

    def planned_backup(self, label: str) -> str:
        return str(self._backup_file(label, self.path.parent, BACKUP_TIME))

    def _backup_name(self, label: str, directory: Path) -> Path:
        """:meth:`_backup_file` at this second's UTC time, a name nothing stands at."""
        while True:
            final = self._backup_file(label, directory, time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
            if not os.path.lexists(final):
                return final
            # A backup of the same label was taken within this second (two changes in a row):
            # never replace it, it holds the state before the earlier change. Wait for a free name.
            time.sleep(0.05)

    def backup(self, conn: Connection, label: str, progress: Progress | None = None) -> Path:
        final = self._backup_name(label, self.path.parent)
        self._remove_stale_temps()
        with self._private_dir(f"{final.name}.") as private:
            # a short name inside: SQLite opens no path longer than 512 bytes (unix VFS
            # MAX_PATHNAME), and the directory's name alone may take 255
            tmp = private / "backup.db"
            self._copy(conn, tmp, progress)
            os.chmod(tmp, mode_of(self.real))  # no wider than the state (in our 0700 directory)
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                share_owner(fd, os.stat(self.real))  # root's backup of a user's state is that user's
            finally:
                os.close(fd)
            try:
                os.link(tmp, final)  # never replaces, never follows what stands at that name
            except FileExistsError:
                raise StateError("RIVET_STATE_UNSAFE_FILE", f"{final} appeared while the backup was taken; "
                                 "nothing was written", {"path": str(final)}) from None
        fsync_dir(final.parent)
        return final

    @contextlib.contextmanager
    def checking_pages(self, full: bool, tables: set[str]) -> Iterator[Callable[[], tuple[list[str], dict[str, int]]]]:
        """``PRAGMA quick_check`` (``integrity_check`` when ``full``, which reads every index
        too) of the state, then the row count of each of ``tables``, in a second thread on a
        read-only connection of its own, while the caller's block runs (a move's copy of the
        same frozen file: the two reads share the page cache, and SQLite releases the GIL).
        Yields the function that waits for them and returns ``(problems, {table: rows})``:
        no problem is ``ok``, and no rows are counted after a problem. An error raised by the
        block interrupts the check (``sqlite3_interrupt``)."""
        db = sqlite3.connect(f"file:{self._quoted(self.path)}?mode=ro", uri=True, timeout=self.lock_wait,
                             check_same_thread=False)

        def check() -> tuple[list[str], dict[str, int]]:
            try:
                rows = [r[0] for r in db.execute(f"PRAGMA {'integrity_check' if full else 'quick_check'}")]
                if rows != ["ok"]:
                    return rows, {}
                return [], {t: db.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in sorted(tables)}
            except sqlite3.Error as err:  # "database disk image is malformed", "interrupted"
                return [str(err)], {}

        from concurrent.futures import ThreadPoolExecutor

        try:
            with ThreadPoolExecutor(1, thread_name_prefix="page-check") as pool:
                checking = pool.submit(check)
                try:
                    yield checking.result
                except BaseException:
                    db.interrupt()
                    raise
        finally:
            db.close()

    def checkpoint_wal(self) -> None:
        """Move every committed WAL frame into the database file and truncate the ``-wal``
        (``PRAGMA wal_checkpoint(TRUNCATE)``), so the file alone holds the whole state.
        A no-op for a rollback-journal state. Raises ``RIVET_STATE_FOREIGN_WAL`` (a ``-wal``
        that is not the state's) and ``RIVET_STATE_RUN_IN_PROGRESS`` when another connection
        keeps the WAL busy past ``--lock-wait``."""
        header = self._header()
        if header[18] != 2:
            return
        self._refuse_foreign(header)
        db = sqlite3.connect(self.path, timeout=self.lock_wait)
        try:
            busy, _log, _done = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        finally:
            db.close()
        if busy:
            raise StateError("RIVET_STATE_RUN_IN_PROGRESS",
                             f"another connection kept {self.path}-wal busy; re-run when it has finished",
                             {"path": str(self.path)})

    def wal_is_empty(self) -> bool:
        """True when no ``-wal`` frame lies outside the database file."""
        return not self._wal_has_frames()

    def hold_off_writers(self) -> None:
        """Before the write lock: wait for every other opener of the real file to close it
        (:func:`~statetool.backends.tombstone.wait_for_openers`), then checkpoint its WAL so
        the file alone holds every committed row. Raises ``RIVET_STATE_RUN_IN_PROGRESS`` and
        ``RIVET_STATE_FOREIGN_WAL``."""
        wait_for_openers(self.real, self.lock_wait)
        self.checkpoint_wal()

    def require_frozen(self) -> None:
        """Under the write lock: raise ``RIVET_STATE_RUN_IN_PROGRESS`` when a writer added
        WAL frames since the checkpoint of :meth:`hold_off_writers`."""
        if not self.wal_is_empty():
            raise StateError("RIVET_STATE_RUN_IN_PROGRESS",
                             f"a writer wrote to {self.real} during the checkpoint; re-run")

    def restoration(self, conn: Connection, source: Path, progress: Progress, on_step: Step) -> CopyMigration:
        """:class:`CopyMigration` of the state file ``source`` instead of the state itself:
        the live state, kept whole, becomes the backup labelled ``restore``."""
        return CopyMigration(self, "restore", progress, on_step, source=source)

    def migration(self, conn: Connection, label: str, progress: Progress, on_step: Step) -> CopyMigration:
        """The copy a migration is built in (:class:`CopyMigration`), made from the state as
        ``conn``'s write lock and :meth:`require_frozen` hold it; the original becomes the
        backup named with ``label``. Raises ``RIVET_STATE_PERMISSION_DENIED`` (the copy
        cannot be given the state's owner), ``RIVET_STATE_DISK_FULL`` and the other faults of
        its directory, ``RIVET_STATE_UNSAFE_FILE``."""
        return CopyMigration(self, label, progress, on_step)

    # -- a transfer's two ends (base.TransferSource, base.TransferDestination) ----------
    #: A file on one worker's disk moves into a shared PostgreSQL schema by transfer.
    sends_transfer = True
    #: A PostgreSQL state comes back into one file by transfer (row for row, into a file
    #: built aside and linked into place). Between two files a move is relocate's, page for
    #: page: transfer refuses a move between two ``relocatable`` places.
    accepts_transfer = True

    def copy_blocks(self, conn: Connection, table: str, columns: list[str]) -> Iterator[Block]:
        """:func:`~statetool.backends.sqlite_rows.copy_blocks`: ``table`` read on ``conn``
        (a session of this state) in blocks of COPY text with their checksums."""
        return copy_blocks(conn, table, columns)

    @contextlib.contextmanager
    def inspecting(self) -> Iterator[DriverReader]:
        """The read-only open of the state file when one is there (:meth:`reading`: a
        tombstone is ``RIVET_STATE_RELOCATED``, a file that is no state
        ``RIVET_STATE_NOT_A_STATE``), else a session on an empty database in memory: no
        table, nothing created. ``RIVET_STATE_DIR_MISSING`` when the directory does not exist
        (it is never created)."""
        if self.present():
            with self.reading() as conn:
                yield conn
            return
        raw = sqlite3.connect(":memory:")
        try:
            yield DriverReader(raw, sqlite3.Error, self._translate)
        finally:
            raw.close()

    def check_rights(self, purpose: str, conn: Reader) -> None:
        """The file's directory (and its lease folder) writable by this user, with room for
        the change (:meth:`check_writable`: ``RIVET_STATE_READ_ONLY``,
        ``RIVET_STATE_PERMISSION_DENIED``, ``RIVET_STATE_DISK_FULL``); ``purpose`` is the
        same for every write of a file."""
        self.check_writable(copies=1)

    @contextlib.contextmanager
    def receiving(self) -> Iterator[Connection]:
        """One writing transaction on the state file: the file that is there (an in-flight
        copy to finish, or a state initialised for this source), else a new file in WAL
        mode built aside and linked into place once committed (:meth:`_new_file`): nothing
        of it is visible before."""
        if self.present():
            with self.writing("RIVET_STATE_RUN_IN_PROGRESS") as conn:
                yield conn
            return
        with self._new_file() as conn:
            yield conn

    def copy_into(self, conn: Connection, table: str, columns: list[str], blocks: Iterable[Block], rows: int,
                  progress: Callable[[int], None]) -> Loaded:
        """:func:`~statetool.backends.sqlite_rows.insert_blocks` on ``conn`` (a transaction of
        :meth:`receiving`), counted and checksummed by this file before and after."""
        return insert_blocks(conn, table, columns, blocks, progress)

    def drop_tables(self, conn: Connection) -> None:
        """Drop every table of the file in ``conn``'s transaction (a copy never live, made again)."""
        for table in sorted(self.table_names(self.reader(conn))):
            conn.exec_driver_sql(f'DROP TABLE "{table}"')

    def in_flight(self, conn: Connection) -> bool:
        """True when the version table reads :data:`~statetool.tables.IN_FLIGHT_REVISION`."""
        return self.reader(conn).scalar(f"SELECT count(*) FROM {VERSION_TABLE} WHERE version_num = :v",
                                        {"v": IN_FLIGHT_REVISION}) == 1

    def mark_in_flight(self, conn: Connection) -> None:
        """Set the version to :data:`~statetool.tables.IN_FLIGHT_REVISION` in ``conn``'s
        transaction: every open refuses (``RIVET_STATE_MOVE_IN_FLIGHT``) until :meth:`make_live`."""
        conn.exec_driver_sql(f"UPDATE {VERSION_TABLE} SET version_num = ?", (IN_FLIGHT_REVISION,))

    def make_live(self) -> None:
        """Set an in-flight version back to head in a transaction of its own, fsynced
        (idempotent). The file is opened ``mode=rw``: a state that is gone is an error,
        never a new empty file."""
        try:
            db = sqlite3.connect(f"file:{self._quoted(self.path)}?mode=rw", uri=True, isolation_level=None,
                                 timeout=self.lock_wait)
            try:
                db.execute("BEGIN IMMEDIATE")
                db.execute(f"UPDATE {VERSION_TABLE} SET version_num = ? WHERE version_num = ?",
                           (migrations.head(), IN_FLIGHT_REVISION))
                db.execute("COMMIT")
            finally:
                db.close()
        except sqlite3.Error as err:
            raise fault(self.path, err) or err from None
        fsync_file(self.path)

    def vanished_evidence(self) -> list[str]:
        """What beside the (missing) state file shows that a state lived here: a keep of a
        relocation, backups, lease records. Empty for a new place (SPEC §5a)."""
        directory = self.path.parent
        found = [f"{p} (a journal file of a state)" for p in self._companions()]
        found += [str(p) for p in sorted(directory.glob(f"{self.path.name}.relocated-*"))]
        found += [str(p) for p in sorted(directory.glob(f"{self.path.name}.backup-*")) if not p.name.endswith(".tmp")]
        leases = self.leases()
        if leases.list():
            found.append(f"lease records in {leases.directory}")
        return found

    def leases(self, ttl: int = 30) -> FlockLeases:
        from statetool.backends.sqlite_leases import FlockLeases

        return FlockLeases(self.real)


#: Seconds between two flushes of a migration's copy while it is built (:func:`_written_behind`).
_WRITE_BEHIND_EVERY = 0.25


@contextlib.contextmanager
def _written_behind(path: Path) -> Iterator[None]:
    """While the block runs, a thread flushes the file at ``path`` to disk every
    :data:`_WRITE_BEHIND_EVERY` seconds (``fdatasync``, which releases the GIL). A copy
    built with ``synchronous = OFF`` is otherwise written to disk only by its final fsync,
    all at once (the kernel starts on its own only after 30 s or 10 % of memory dirty):
    flushed behind the rebuild, the disk works while SQLite sorts, and the final fsync
    has little left to write. Errors of a flush are left to that final fsync."""
    import threading

    stop = threading.Event()

    def flush() -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return
        try:
            while not stop.wait(_WRITE_BEHIND_EVERY):
                with contextlib.suppress(OSError):
                    os.fdatasync(fd)
        finally:
            os.close(fd)

    worker = threading.Thread(target=flush, name="statetool-write-behind", daemon=True)
    worker.start()
    try:
        yield
    finally:
        stop.set()
        worker.join()


def _carry_journal(source: Path, copy: Path) -> None:
    """Copy the journal SQLite applies to the file ``source`` (:func:`applied_journal`)
    beside ``copy``, a byte copy of it, under the same suffix: the first open of ``copy``
    then applies it as a read of ``source`` does (the committed frames of its ``-wal``, the
    roll-back of a hot ``-journal``), so the copy holds what ``source`` was verified to
    hold. Raises the ``OSError`` of the copy."""
    journal = applied_journal(source)
    if journal is not None:
        copy_file_exclusively(journal, Path(f"{copy}{journal.name[len(source.name):]}"))


class CopyMigration:
    """A migration of a SQLite state built in a copy of it, which then replaces it whole
    (a :class:`~statetool.backends.base.Migration`; decisions.md, "Revisions and
    migrations"). The original is never written: renamed aside, it IS the backup.

    Made under the state's write lock, once :meth:`SqliteBackend.require_frozen` holds:
    the real file is copied (:func:`~statetool.backends.durable.copy_bytes`) into
    ``migrated.db`` inside a private directory (``….backup-<label>-<time>.<random>.tmp``,
    mode 0700) beside it, with the original's mode and owner. :meth:`connection` opens the copy with journaling and
    syncing off (a crash loses only the copy; the original is untouched) for the
    migration's steps, commits, sets the original's journal mode back and fsyncs.
    :meth:`switch`, after the state's own transaction has closed and under every lease,
    hard-links the original to the backup name and renames the copy over the real file.
    The steps are told to ``on_step``: ``copied``, ``built``, ``closed``, ``kept``,
    ``swapped``.
    """

    def __init__(self, backend: SqliteBackend, label: str, progress: Progress, on_step: Step,
                 source: Path | None = None) -> None:
        self.backend, self.on_step, self.label = backend, on_step, label
        self.real = backend.real
        #: The file whose bytes the copy starts from: the state itself, or a restore's copy.
        self.source = source or self.real
        backend._remove_stale_temps()
        self.backup: Path = backend._backup_name(label, self.real.parent)
        self._private = backend._make_private_dir(self.real.parent, f"{self.backup.name}.")
        self.copy = self._private / "migrated.db"
        self._wal = read_header(self.real)[18] == 2
        try:
            self._marks = self._copy_file(progress)
        except BaseException:
            self.discard()
            raise
        on_step("copied")

    @staticmethod
    def _marks_of(path: Path) -> tuple[int, int, int]:
        st = os.lstat(path)
        return st.st_ino, st.st_size, st.st_mtime_ns

    def _copy_file(self, progress: Progress) -> tuple[int, int, int]:
        """Copy the frozen real file into :attr:`copy` (created exclusively, never through a
        link), with the original's mode, owner and group. Returns the original's (inode,
        size, mtime) as copied, which :meth:`switch` checks again."""
        marks = self._marks_of(self.real)
        st = os.stat(self.real)
        try:
            fd = os.open(self.copy, CREATE_FLAGS, 0o600)
        except OSError as err:
            raise fault(self.real.parent, err) or err from None
        try:
            try:
                like(fd, st)  # refused before any lease already (check_writable): here only if it changed since
            except PermissionError:
                raise unownable(self.real, st, "a migration") from None
            with open(self.source, "rb") as src:
                copy_bytes(src.fileno(), fd, os.fstat(src.fileno()).st_size, progress)
            if self.source != self.real:  # the live state's own WAL was checkpointed, and it is frozen
                _carry_journal(self.source, self.copy)
        except OSError as err:
            raise fault(self.real.parent, err) or err from None
        finally:
            os.close(fd)
        return marks

    @contextlib.contextmanager
    def connection(self) -> Iterator[Connection]:
        """A writing transaction on the copy (nobody else knows its name), journaling and
        syncing off; committed on a clean exit, then the state's journal mode set back (WAL
        for a WAL state) and the copy fsynced (``on_step("built")``). On any error the copy
        goes (:meth:`discard`); errors of the copy's own file are the state directory's
        faults (a full disk: ``RIVET_STATE_DISK_FULL``)."""
        import sqlalchemy as sa

        from statetool.backends.sqlite_schema import STATE_NAME

        backend = self.backend
        engine = backend._engine(f"file:{backend._quoted(self.copy)}", timeout=backend.lock_wait)

        @sa.event.listens_for(engine, "connect")
        def pragmas(dbapi: sqlite3.Connection, _record: object) -> None:
            mode = dbapi.execute("PRAGMA journal_mode = OFF").fetchone()[0]
            if mode != "off":
                raise sqlite3.OperationalError(f"journal_mode stayed {mode}")
            dbapi.execute("PRAGMA synchronous = OFF")

        @sa.event.listens_for(engine, "begin")
        def begin(conn: Connection) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        try:
            with engine.connect() as conn, _written_behind(self.copy):
                conn.info[STATE_NAME] = str(self.real)
                with conn.begin():
                    yield conn
                if self._wal:
                    raw: sqlite3.Connection = conn.connection.driver_connection  # type: ignore[assignment]
                    mode = raw.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                    if mode != "wal":
                        raise sqlite3.OperationalError(f"journal_mode stayed {mode}")
            engine.dispose()
            fsync_file(self.copy)
        except BaseException as raised:
            engine.dispose()
            self.discard()
            if isinstance(raised, sa.exc.DBAPIError):
                error = backend._body_error(raised, "RIVET_STATE_MIGRATION_LOCKED")
                if error.code == "RIVET_INTERNAL" and isinstance(raised.orig, sqlite3.OperationalError):
                    # SQLite refused a step's DDL on the copy: the tables are not what the
                    # revision they are stamped with has (a table made or altered by hand)
                    raise StateError("RIVET_STATE_SCHEMA_UNEXPECTED",
                                     f"{self.real} cannot be migrated from revision {self.label}: SQLite refused "
                                     f"a step on its tables ({raised.orig}), which differ from that revision's; "
                                     "nothing was changed", {"path": str(self.real)}) from None
                raise error from None
            if isinstance(raised, (OSError, sqlite3.Error)):
                raise fault(self.real.parent, raised) or raised from None
            raise
        self.on_step("built")

    def switch(self) -> None:
        """Put the built copy in place; the state's transaction has closed, every lease is
        still held. Waits for other openers (``--lock-wait``), refuses when the original
        changed since it was copied (``RIVET_STATE_RUN_IN_PROGRESS``: a writer that holds
        no lease; nothing is replaced and the copy goes), removes the closed original's
        empty ``-wal``/``-shm``, hard-links the original to :attr:`backup` (``kept``), renames
        the copy over the real file (``swapped``), fsyncing the directory after each."""
        directory = self.real.parent
        self.on_step("closed")
        try:
            wait_for_openers(self.real, self.backend.lock_wait)
            if self._marks_of(self.real) != self._marks:
                raise StateError("RIVET_STATE_RUN_IN_PROGRESS",
                                 f"{self.real} was written while it was migrated (by a writer that holds no "
                                 "lease); nothing was replaced: re-run when it has finished", {"path": str(self.real)})
            self.backend.require_frozen()
            remove_companions(self.real)
            try:
                os.link(self.real, self.backup, follow_symlinks=False)  # never replaces what stands there
            except FileExistsError:
                raise StateError("RIVET_STATE_UNSAFE_FILE", f"{self.backup} appeared while the migration ran; "
                                 "nothing was replaced", {"path": str(self.backup)}) from None
            fsync_dir(directory)
            self.on_step("kept")
            os.rename(self.copy, self.real)
            fsync_dir(directory)
        except BaseException as raised:
            self.discard()
            if isinstance(raised, OSError):
                raise fault(directory, raised) or raised from None
            raise
        with contextlib.suppress(OSError):
            self._private.rmdir()
        self.on_step("swapped")

    def discard(self) -> None:
        """Remove the copy's private directory, and the backup name when it is still a link
        of the state itself (the switch did not happen). Idempotent."""
        shutil.rmtree(self._private, ignore_errors=True)
        with contextlib.suppress(OSError):
            if os.path.samefile(self.backup, self.real):
                self.backup.unlink()
