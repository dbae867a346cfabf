"""SQLite state: the file ``.rivet_state.db`` beside the config or in a declared directory.

The read-only open creates nothing and misses nothing (SPEC §4). SQLite's own read-only
mode is not enough: a ``mode=ro`` connection to a WAL database creates ``-wal`` and
``-shm`` when they are absent and the folder is writable, and ``immutable=1`` ignores a
``-wal`` that holds committed frames (https://www.sqlite.org/wal.html#readonly,
https://www.sqlite.org/uri.html#uriimmutable). So the open is chosen from what is on disk:

* rollback-journal database (header byte 18 = 1): ``mode=ro``, which creates no file; a
  hot journal left by a killed writer makes SQLite answer SQLITE_READONLY_ROLLBACK, which
  is reported as ``RIVET_STATE_INTERRUPTED_WRITE``;
* WAL database, no ``-wal`` (or an empty one): ``immutable=1``, as nothing lies outside
  the main file (a writer starting during the read writes to a new ``-wal``, which the
  main file does not see until a checkpoint);
* WAL database whose ``-wal`` holds frames, with a live holder of a lock on the file and
  a ``-shm`` present: ``mode=ro`` beside the live writer (both files exist, so none is
  created; SQLite's readers share the writer's wal-index);
* WAL database whose ``-wal`` holds frames and no live holder (a killed writer): the
  database and its ``-wal`` are copied into a private temporary directory and read
  there, so the committed frames are seen and nothing is written beside the state.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.pool import NullPool

from statetool.access import denied
from statetool.backends.base import Progress
from statetool.backends.faults import WRITE_MARGIN, fault, refuse_unwritable
from statetool.backends.proclocks import lock_holders
from statetool.backends.sqlite_file import read_header, refuse_unsafe_companions
from statetool.errors import StateError
from statetool.location import LEASE_DIR, Location

if TYPE_CHECKING:
    from statetool.backends.sqlite_leases import FlockLeases

def fsync_dir(directory: Path) -> None:
    """fsync a directory so a rename inside it survives power loss."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def content_digest(path: Path) -> str:
    """sha256 of a SQLite file's pages with the header fields a backup rewrites zeroed (the
    change counter, bytes 24-27, its copy at 92-95, and the schema cookie, 40-43): a
    page-for-page copy made by the backup API has the same digest as its source."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        header = bytearray(fh.read(100))
        page_size = int.from_bytes(header[16:18], "big")
        page_size = 65536 if page_size == 1 else page_size
        remaining = int.from_bytes(header[28:32], "big") * page_size - len(header)
        header[24:28] = header[40:44] = header[92:96] = b"\0\0\0\0"
        digest.update(header)
        while remaining > 0:
            chunk = fh.read(min(1 << 20, remaining))
            if not chunk:
                break
            digest.update(chunk)
            remaining -= len(chunk)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


class SqliteBackend:
    """A SQLite state file. See the module docstring for how it is opened read-only."""

    dialect_name = "sqlite"
    schema = None

    def __init__(self, location: Location, lock_wait: float) -> None:
        assert location.path is not None
        self.location = location
        self.path: Path = location.path
        self.lock_wait = lock_wait

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
            raise self._not_a_directory() from None
        if self.location.scope == "declared_dir" and not os.path.lexists(self.path.parent):
            raise StateError("RIVET_STATE_DIR_MISSING",
                             f"the declared state directory {self.path.parent} does not exist (a volume that did "
                             f"not mount?){self._spelling_hint()}", {"path": str(self.path.parent)})
        return False

    def check_writable(self, *, backup: bool) -> None:
        """Refuse a write this user or this filesystem cannot complete before any file is
        opened for writing (:func:`~statetool.backends.faults.refuse_unwritable`): the
        state's directory, its lease folder and the file must be writable, and there must
        be room for a backup as large as the state (with ``backup``) and the change."""
        refuse_unsafe_companions(self.path)
        size = self.path.stat().st_size if os.path.isfile(self.path) else 0
        refuse_unwritable(self.path, directories=(self.path.parent, self.path.parent / LEASE_DIR),
                          need=(2 * size if backup else 0) + WRITE_MARGIN)

    def _spelling_hint(self) -> str:
        directory = self.path.parent
        if directory.name == self.path.name or directory.suffix == ".db":
            return (f"; a sqlite: location names the directory that holds {self.path.name}: "
                    f"sqlite:{directory.parent}")
        return ""

    def _not_a_directory(self) -> StateError:
        directory = self.path.parent
        hint = self._spelling_hint() or f"; a sqlite: location names the directory that holds {self.path.name}"
        return StateError("RIVET_STATE_DIR_MISSING", f"{directory} is a file, not a directory{hint}",
                          {"path": str(directory)})

    def _header(self) -> bytes:
        return read_header(self.path)

    def _orphan_wal_beside(self) -> bool:
        """A -wal or -shm beside the file, and no hot -journal (which mode=ro must still see)."""
        wal, shm, journal = (Path(f"{self.path}{suffix}") for suffix in ("-wal", "-shm", "-journal"))
        return (wal.exists() or shm.exists()) and not journal.exists()

    def foreign_companions(self, header: bytes) -> list[str]:
        """The ``-wal``/``-shm`` beside the state that cannot be its own, one line each: any
        of them beside a rollback-journal state (header byte 18 = 1), which never makes one;
        a ``-wal`` beside a WAL state whose header is not a WAL header or names another page
        size (https://www.sqlite.org/fileformat2.html#walformat). A write must never open the
        state with them there: SQLite would merge that ``-wal`` into the state."""
        wal, shm = Path(f"{self.path}-wal"), Path(f"{self.path}-shm")
        if header[18] != 2:
            return [f"{p} (beside a rollback-journal state, which never makes one)" for p in (wal, shm)
                    if os.path.lexists(p)]
        if not wal.is_file() or wal.stat().st_size < 32:
            return []
        with open(wal, "rb") as fh:
            wal_header = fh.read(32)
        page_size = int.from_bytes(header[16:18], "big")
        page_size = 65536 if page_size == 1 else page_size
        if wal_header[:4] not in (b"\x37\x7f\x06\x82", b"\x37\x7f\x06\x83"):
            return [f"{wal} (not a SQLite WAL file)"]
        if int.from_bytes(wal_header[8:12], "big") != page_size:
            return [f"{wal} (written for pages of {int.from_bytes(wal_header[8:12], 'big')} bytes; this state's "
                    f"pages are {page_size} bytes)"]
        return []

    def _wal_has_frames(self) -> bool:
        wal = Path(f"{self.path}-wal")
        return wal.exists() and wal.stat().st_size > 32

    @contextlib.contextmanager
    def reading(self) -> Iterator[Connection]:
        if not self.present():
            raise StateError("RIVET_STATE_MISSING", f"no state at {self.path}", {"path": str(self.path)})
        refuse_unsafe_companions(self.path)
        header = self._header()
        wal_mode = header[18] == 2
        with contextlib.ExitStack() as stack:
            if (not wal_mode and self._orphan_wal_beside() and lock_holders(self.path) == set()) or (
                    wal_mode and self.foreign_companions(header)):
                # A -wal/-shm that is not the state's own (restored or copied apart; another page
                # size): a mode=ro open adopts that -wal and rewrites the -shm, a private copy would
                # merge it; immutable=1 reads the main file alone.
                uri = f"file:{self._quoted(self.path)}?immutable=1"
            elif not wal_mode:
                uri = f"file:{self._quoted(self.path)}?mode=ro"
            elif not self._wal_has_frames():
                uri = f"file:{self._quoted(self.path)}?immutable=1"
            elif Path(f"{self.path}-shm").exists() and lock_holders(self.path):
                uri = f"file:{self._quoted(self.path)}?mode=ro"
            else:
                snapshot = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="statetool-snapshot-")))
                copy = snapshot / self.path.name
                shutil.copyfile(self.path, copy)
                shutil.copyfile(f"{self.path}-wal", f"{copy}-wal")
                uri = f"file:{self._quoted(copy)}"
            engine = self._engine(uri, timeout=min(self.lock_wait, 30.0))
            stack.callback(engine.dispose)

            @sa.event.listens_for(engine, "begin")
            def begin_snapshot(conn: Connection) -> None:
                # One read transaction: every query of the inspection sees one snapshot.
                conn.exec_driver_sql("BEGIN")

            try:
                conn = stack.enter_context(engine.connect())
                conn.exec_driver_sql("SELECT count(*) FROM sqlite_master").all()
                yield conn
            except sa.exc.DBAPIError as err:
                raise self._translate(err) from None

    @staticmethod
    def _quoted(path: Path) -> str:
        from urllib.parse import quote

        return quote(str(path))

    def _engine(self, uri: str, timeout: float) -> sa.Engine:
        def connect() -> sqlite3.Connection:
            return sqlite3.connect(uri, uri=True, timeout=timeout, isolation_level=None, check_same_thread=False)

        return sa.create_engine("sqlite://", creator=connect, poolclass=NullPool)

    def _translate(self, err: sa.exc.DBAPIError) -> StateError:
        orig = err.orig
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

    def table_names(self, conn: Connection) -> set[str]:
        try:
            rows = conn.exec_driver_sql("SELECT name FROM sqlite_master WHERE type = 'table'").all()
        except sa.exc.DBAPIError as err:
            raise self._translate(err) from None
        return {r[0] for r in rows if not r[0].startswith("sqlite_")}

    def integrity_problems(self, conn: Connection) -> list[str]:
        try:
            rows = [r[0] for r in conn.exec_driver_sql("PRAGMA quick_check").all()]
        except sa.exc.DBAPIError as err:
            return [str(err.orig)]
        return [] if rows == ["ok"] else rows

    # -- writing ---------------------------------------------------------------------

    def _writer_engine(self, path: Path) -> sa.Engine:
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
        if not self.present():
            raise StateError("RIVET_STATE_MISSING", f"no state at {self.path}", {"path": str(self.path)})
        foreign = self.foreign_companions(self._header())
        if foreign:
            raise StateError("RIVET_STATE_FOREIGN_WAL",
                             f"{'; '.join(foreign)}: a write would merge it into {self.path}; nothing was written",
                             {"path": str(self.path), "files": foreign})
        engine = self._writer_engine(self.path)
        try:
            try:
                connection = engine.connect()
            except sa.exc.OperationalError as err:  # "unable to open database file": read-only, permission
                raise fault(self.path, err) or self._translate(err) from None
            with connection as conn:
                try:
                    trans = conn.begin()
                except sa.exc.OperationalError as err:
                    if "locked" in str(err.orig) or "busy" in str(err.orig):
                        raise StateError(lock_code, f"{self.path} stayed locked by another writer for "
                                         f"{self.lock_wait:g} s (--lock-wait)", {"path": str(self.path)}) from None
                    raise fault(self.path, err) or self._translate(err) from None
                with trans:
                    try:
                        yield conn
                    except sa.exc.IntegrityError as err:  # a constraint or a trigger's RAISE: the database refuses
                        raise StateError("RIVET_STATE_WRITE_REFUSED", f"{self.path} refused the write: {err.orig}",
                                         {"path": str(self.path)}) from None
                    except (sa.exc.OperationalError, OSError) as err:  # read-only, permission, full disk
                        known = fault(self.path, err)
                        if known is None:
                            raise
                        raise known from None
        finally:
            engine.dispose()

    def _companions(self) -> list[Path]:
        """The ``-wal``, ``-shm`` and ``-journal`` beside the state's path."""
        return [p for p in (Path(f"{self.path}{suffix}") for suffix in ("-wal", "-shm", "-journal"))
                if os.path.lexists(p)]

    def create(self, build: Callable[[Connection], None]) -> None:
        leftovers = self._companions()
        if leftovers:
            # SQLite would apply them to the new file as if they were its own: another state's
            # committed frames, or the roll-back of another state's transaction.
            raise StateError("RIVET_STATE_TARGET_NOT_EMPTY",
                             f"{', '.join(map(str, leftovers))} lie where the new state would be: files of a state "
                             "that was there before; nothing was created", {"path": str(self.path)})
        directory = self.path.parent
        tmp = directory / f"{self.path.name}.init-{os.getpid()}.tmp"
        engine = self._writer_engine(tmp)

        @sa.event.listens_for(engine, "connect")
        def wal(dbapi: sqlite3.Connection, _record: object) -> None:
            mode = dbapi.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode != "wal":
                raise sqlite3.OperationalError(f"journal_mode stayed {mode}")

        try:
            with engine.connect() as conn, conn.begin():
                build(conn)
            engine.dispose()
            _fsync_file(tmp)
            try:
                os.link(tmp, self.path)  # unlike rename, never replaces what appeared meanwhile
            except FileExistsError:
                raise StateError("RIVET_STATE_TARGET_NOT_EMPTY", f"{self.path} appeared while the new state "
                                 "was being built; nothing was replaced", {"path": str(self.path)}) from None
            fsync_dir(directory)
        finally:
            engine.dispose()
            for leftover in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
                leftover.unlink(missing_ok=True)

    def _copy(self, conn: Connection, tmp: Path, progress: Progress | None, *, self_contained: bool,
              full_verify: bool = False) -> dict[str, int]:
        """Copy the state, as ``conn``'s write lock freezes it, into ``tmp`` with the online
        backup API; verify (``quick_check``, or ``integrity_check`` with ``full_verify``) and
        compare every table's row count; fsync. Returns ``{table: rows}``.

        The copy is read through a second connection: SQLite answers SQLITE_LOCKED to a
        backup whose source connection holds a write transaction, and ``conn`` holds one
        (BEGIN IMMEDIATE) so that nobody can write between the copy and what follows.
        ``self_contained`` turns the copy into a rollback-journal file (a backup to keep).
        """
        writer: sqlite3.Connection = conn.connection.driver_connection  # type: ignore[assignment]
        tables = sorted(self.table_names(conn))
        expected = {t: writer.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in tables}
        source = sqlite3.connect(f"file:{self._quoted(self.path)}?mode=ro", uri=True, timeout=self.lock_wait)
        target = sqlite3.connect(tmp)
        try:
            def step(_status: int, remaining: int, total: int) -> None:
                if progress is not None:
                    progress(total - remaining, total)

            source.backup(target, pages=4096, progress=step)
            if self_contained:
                target.execute("PRAGMA journal_mode = DELETE")
            pragma = "integrity_check" if full_verify else "quick_check"
            check = [r[0] for r in target.execute(f"PRAGMA {pragma}").fetchall()]
            got = {t: target.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in tables}
        finally:
            source.close()
            target.close()
        if check != ["ok"] or got != expected:
            tmp.unlink(missing_ok=True)
            raise StateError("RIVET_STATE_VERIFY_FAILED",
                             f"the copy of {self.path} did not verify ({pragma} {check[:3]}, "
                             f"row counts {got} vs {expected}); nothing was changed", {"path": str(self.path)})
        _fsync_file(tmp)
        return got

    def backup(self, conn: Connection, label: str, progress: Progress | None = None) -> Path:
        from urllib.parse import quote

        # The label may carry an export name: percent-encoded (as lease file names are) so a
        # "/" in it can neither fail the backup nor place it outside the state's directory.
        label = quote(label, safe="-_.")
        while True:
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            final = self.path.with_name(f"{self.path.name}.backup-{label}-{stamp}")
            if not os.path.lexists(final):
                break
            # A backup of the same label was taken within this second (two changes in a row):
            # never replace it, it holds the state before the earlier change. Wait for a free name.
            time.sleep(0.05)
        tmp = final.with_name(final.name + ".tmp")
        # A .tmp left by a backup that was killed: no other backup can be running, since
        # every backup is taken under the write lock this connection holds.
        for stale in self.path.parent.glob(f"{self.path.name}.backup-*.tmp"):
            stale.unlink(missing_ok=True)
        self._copy(conn, tmp, progress, self_contained=True)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        return final

    def copy_to(self, conn: Connection, tmp: Path, progress: Progress | None, full_verify: bool) -> dict[str, int]:
        """A page-for-page verified copy of the state at ``tmp`` (same journal mode), for a
        relocation. Returns ``{table: rows}``; raises ``RIVET_STATE_VERIFY_FAILED``."""
        return self._copy(conn, tmp, progress, self_contained=False, full_verify=full_verify)

    def checkpoint_wal(self) -> None:
        """Move every committed WAL frame into the database file and truncate the ``-wal``
        (``PRAGMA wal_checkpoint(TRUNCATE)``), so the file alone holds the whole state.
        A no-op for a rollback-journal state. Raises ``RIVET_STATE_RUN_IN_PROGRESS`` when
        another connection keeps the WAL busy past ``--lock-wait``."""
        if self._header()[18] != 2:
            return
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

    def vanished_evidence(self) -> list[str]:
        """What beside the (missing) state file shows that a state lived here: a keep of a
        relocation, backups, lease records. Empty for a new place (SPEC §5a)."""
        directory = self.path.parent
        found = [f"{p} (a journal file of a state)" for p in self._companions()]
        found += [str(p) for p in sorted(directory.glob(f"{self.path.name}.relocated-*"))]
        found += [str(p) for p in sorted(directory.glob(f"{self.path.name}.backup-*")) if not p.name.endswith(".tmp")]
        if self.leases().list():
            found.append(f"lease records in {directory / '.rivet_state.leases'}")
        return found

    def leases(self, ttl: int = 30) -> FlockLeases:
        from statetool.backends.sqlite_leases import FlockLeases

        return FlockLeases(self.path)
