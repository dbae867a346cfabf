"""PostgreSQL state: the tables of schema ``rivet_state`` (or ``?schema=``) in a shared database.

Every connection sets ``search_path`` to the state's schema, so the Core tables of
:mod:`statetool.schema`, the read queries (statetool/operations/probe.py) and the alembic
revisions need no schema name. A read-only session runs with
``default_transaction_read_only = on``: the server itself refuses any write. Read sessions
(:meth:`PostgresBackend.reading`, :meth:`PostgresBackend.inspecting`) are psycopg
connections of their own; SQLAlchemy is imported only by writes (issue 13 item 1).
Writers serialise on a transaction-scoped advisory lock named after the schema, polled
until ``--lock-wait`` runs out.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from statetool import migrations
from statetool.backends.base import Progress, Step
from statetool.backends.postgres_faults import driver_error, ident, rights_problem
from statetool.backends.readers import CoreReader, DriverReader, pyformat
from statetool.errors import StateError
from statetool.location import Location
from statetool.tables import (IN_FLIGHT_REVISION, LEASE_TABLES, RELOCATED_REVISION, RETIRED_ACTION, VERSION_TABLE,
                              retired_detail)

if TYPE_CHECKING:
    from pathlib import Path

    import sqlalchemy as sa
    from sqlalchemy.engine import Connection

    from statetool.backends.base import Reader
    from statetool.backends.copy_text import Block, Loaded
    from statetool.backends.postgres_leases import RowLeases
    from statetool.migrations import Revision

_POLL_SECONDS = 0.2
#: Milliseconds a lease statement waits for a row lock before it counts as busy.
LEASE_LOCK_TIMEOUT_MS = 200

#: Seconds a connection attempt may take when neither the URL (``connect_timeout=``) nor
#: libpq's ``PGCONNECT_TIMEOUT`` names one (libpq's own default is to wait forever).
CONNECT_TIMEOUT = 10
#: The lock code a migration waits with: a writer that changes the shape of the tables.
_MIGRATION_LOCK = "RIVET_STATE_MIGRATION_LOCKED"


def _connect_args(query: Mapping[str, str | tuple[str, ...]], options: str) -> dict[str, Any]:
    """The driver's connection arguments: statetool's session ``options`` after the ones
    the operator gave (the URL's ``options=``, else ``PGOPTIONS``: a later ``-c`` wins, so
    statetool's search_path and read-only flag hold), and :data:`CONNECT_TIMEOUT` only when
    the URL and ``PGCONNECT_TIMEOUT`` name no timeout (a PGCONNECT_TIMEOUT that is not a
    number is replaced by it, as before). An argument given here replaces the URL's and
    libpq's environment's, so none of the operator's is dropped. Raises
    ``RIVET_STATE_URL_INVALID`` for a ``connect_timeout`` that is not a whole number."""
    given = query.get("options", os.environ.get("PGOPTIONS", ""))
    given = " ".join(given) if isinstance(given, tuple) else given
    args: dict[str, Any] = {"options": f"{given} {options}" if given.strip() else options}
    timeout = query.get("connect_timeout")
    if timeout is not None and not _whole_number(str(timeout)):
        raise StateError("RIVET_STATE_URL_INVALID",
                         f"connect_timeout={timeout} in the state URL is not a whole number of seconds")
    if timeout is None and not _whole_number(os.environ.get("PGCONNECT_TIMEOUT", "")):
        args["connect_timeout"] = CONNECT_TIMEOUT  # none given, or PGCONNECT_TIMEOUT unusable: libpq's would fail
    return args


def _whole_number(text: str) -> bool:
    """True for what libpq takes as a connect timeout: an integer, possibly negative."""
    return text.strip().lstrip("-").isdigit()


class PostgresBackend:
    """A PostgreSQL state schema. See the module docstring."""

    dialect_name = "postgresql"
    #: A schema in a shared server is where a transfer leads (SPEC §9): it takes the rows
    #: with COPY in one transaction, and what it holds is already shared by every worker.
    accepts_transfer = True
    #: A schema moves out too (into a SQLite file, or another schema or server): its rows
    #: read with ``COPY … TO STDOUT`` in the write transaction, then the schema retired in
    #: place by a marker every opener refuses (:class:`SchemaRetirement`).
    sends_transfer = True

    # -- capabilities (the reasons: backends/base.py) ------------------------------------
    #: A DBA may run the DDL of a migration by hand (alembic offline mode, ``migrate --sql``).
    supports_offline_sql = True
    #: The server keeps its own pages consistent; there is no ``quick_check`` to run.
    checks_integrity = False
    #: A writer polls the writers' advisory lock every :data:`_POLL_SECONDS` (:meth:`_lock`).
    writer_retry_seconds = _POLL_SECONDS
    #: Plain ``VACUUM`` takes SHARE UPDATE EXCLUSIVE on each table: reads, inserts, updates
    #: and deletes go on beside it (https://www.postgresql.org/docs/current/explicit-locking.html).
    #: ``VACUUM FULL`` would take ACCESS EXCLUSIVE and rewrite the tables, so it is never run.
    reclaim_blocks_writers = False

    def offline_sql(self, current: str | None, target: str, direction: str, *, stamp: str | None = None) -> str:
        """The DDL from ``current`` to ``target`` in this schema (see :class:`~statetool.backends.base.Backend`)."""
        text = migrations.offline_stamp_sql(self.dialect_name, self.schema, stamp) if stamp else ""
        if direction != "none":
            text += migrations.offline_sql(self.dialect_name, self.schema, current, target, direction)
        return text

    #: No file to copy page for page: the state is a schema on a shared server; ``transfer``
    #: moves it row for row (into SQLite, or another schema).
    relocatable = False
    #: The server keeps the state's backups (pg_dump, its own): no copy is a file of ours.
    keeps_copies = False

    def copies(self) -> list[Path]:
        """None: :attr:`keeps_copies`."""
        return []

    def __init__(self, location: Location, lock_wait: float) -> None:
        assert location.url is not None and location.schema is not None
        self.location = location
        self.schema: str = location.schema
        self.lock_wait = lock_wait

    def _options(self, read_only: bool, autocommit: bool) -> str:
        """statetool's session options: the schema as ``search_path``, read-only, and the
        lease statements' lock timeout."""
        options = f'-c search_path="{self.schema}"'  # quoted: an unquoted MixedCase would fold to mixedcase
        if read_only:
            options += " -c default_transaction_read_only=on"
        if autocommit:
            # A lease statement never queues behind a row lock (a writer between its last
            # fence and its commit): it gives up after this and the wait loop tries again,
            # so --lock-wait bounds every wait (docs/decisions.md, "Locks and leases").
            options += f" -c lock_timeout={LEASE_LOCK_TIMEOUT_MS}"
        return options

    @contextlib.contextmanager
    def _session(self, *, autocommit: bool = False, read_only: bool = True,
                 translate: Callable[[BaseException], StateError] | None = None) -> Iterator[DriverReader]:
        """A psycopg connection of its own (no SQLAlchemy) with statetool's session options,
        the same connection arguments as a write's (:func:`_connect_args`), as a
        :class:`~statetool.backends.readers.DriverReader`; rolled back and closed on the way
        out. Every driver error, connecting or in the caller's SQL, is ``translate``'s
        (default :func:`driver_error`)."""
        import psycopg

        def translated(err: BaseException) -> StateError:
            return translate(err) if translate is not None else self._fault(err)

        rest = self.location.url.split("://", 1)[1]
        query = {k: v[0] if len(v) == 1 else tuple(v) for k, v in parse_qs(urlsplit("x://" + rest).query).items()}
        args = _connect_args(query, self._options(read_only, autocommit))
        try:
            raw = psycopg.connect("postgresql://" + rest, autocommit=autocommit, **args)
        except psycopg.Error as err:
            raise translated(err) from None
        try:
            yield DriverReader(raw, psycopg.Error, translated, convert=pyformat)
        finally:
            raw.close()

    def _engine(self, read_only: bool, autocommit: bool = False) -> sa.Engine:
        import sqlalchemy as sa
        from sqlalchemy.pool import NullPool

        options = self._options(read_only, autocommit)
        url = "postgresql+psycopg://" + self.location.url.split("://", 1)[1]
        connect_args = _connect_args(sa.engine.make_url(url).query, options)
        # Autocommit engines serve leases: polling, heartbeats and the release reuse one
        # pooled connection instead of opening a server connection per statement; a pooled
        # connection the server dropped (a restart) is replaced, not used (pre-ping).
        extra: dict[str, Any] = {"isolation_level": "AUTOCOMMIT", "pool_size": 1, "max_overflow": 2,
                                 "pool_pre_ping": True} if autocommit else {"poolclass": NullPool}
        return sa.create_engine(url, connect_args=connect_args, **extra)

    @contextlib.contextmanager
    def _connect(self, read_only: bool) -> Iterator[Connection]:
        """A SQLAlchemy connection (no transaction of its own), for a write. Every driver
        error leaving it, from the connect or from the caller's SQL, is translated by
        :func:`driver_error`."""
        import sqlalchemy as sa

        engine = self._engine(read_only)
        try:
            with engine.connect() as conn:
                yield conn
        except sa.exc.DBAPIError as err:
            raise self._fault(err) from None
        finally:
            engine.dispose()

    def _fault(self, err: BaseException) -> StateError:
        """``err``, a driver error met on this state, as :func:`driver_error` names it
        (a fault of the URL names the setting that gave it)."""
        return driver_error(err, self.location.display, self.location.setting)

    def reader(self, conn: Connection) -> CoreReader:
        """The reader over ``conn``, a connection of :meth:`writing` or :meth:`receiving`."""
        return CoreReader(conn, self._fault)

    def check_rights(self, purpose: str, conn: Reader) -> None:
        """Raise ``RIVET_STATE_PERMISSION_DENIED`` (see :func:`rights_problem`) unless the
        role of ``conn`` has every right ``purpose`` (a key of
        :data:`~statetool.backends.postgres_faults.NEEDS`) needs. Reads catalogs only, so it
        runs on a read-only session too: a write's pre-flight and ``transfer --dry-run``
        refuse what the real run would, before anything changes (SPEC §8a)."""
        problem = rights_problem(conn, self.schema, purpose, self.location.display)
        if problem is not None:
            raise problem

    def _refuse_read_only(self, conn: Reader) -> None:
        """``RIVET_STATE_READ_ONLY`` when this writing session may not write (a hot standby,
        or ``default_transaction_read_only`` set for the role or the database)."""
        if conn.scalar("SELECT current_setting('transaction_read_only')") == "on":
            standby = conn.scalar("SELECT pg_is_in_recovery()")
            why = "the server is a hot standby: point the URL at the primary" if standby else (
                "default_transaction_read_only is on for this role or database: ALTER ROLE "
                f"{ident(str(conn.scalar('SELECT current_user')))} SET "
                "default_transaction_read_only = off (or use a role that may write)")
            raise StateError("RIVET_STATE_READ_ONLY", f"the state database at {self.location.display} accepts only "
                             f"reads in this session ({why}); nothing was written")

    def table_names(self, conn: Reader) -> set[str]:
        """The tables of the schema, from ``pg_class``: every role sees them, with or without
        rights on them (``information_schema`` hides what the role may not touch, which made
        a role without rights read a state as missing)."""
        rows = conn.rows("SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                         "WHERE n.nspname = :s AND c.relkind IN ('r', 'p', 'v', 'f')", {"s": self.schema})
        return {r[0] for r in rows}

    def check_writable(self, *, copies: int, replaced_by: str | None = None, room_for: str | None = None) -> None:
        """Nothing to look at before the server is asked: the server checks rights and
        space in the write's own transaction, and nothing of it outlives a failed write."""

    def leftovers(self) -> list[Path]:
        """None: a PostgreSQL migration runs in one transaction, which a kill rolls back;
        it leaves no file."""
        return []

    def present(self) -> bool:
        with self.inspecting() as conn:
            return bool(self.table_names(conn))

    @contextlib.contextmanager
    def inspecting(self) -> Iterator[DriverReader]:
        """A read-only psycopg session (``default_transaction_read_only = on``) on the schema,
        which may hold no table or not exist yet: nothing is refused for that, and no right is
        checked (ask :meth:`check_rights` for the purpose at hand). Driver errors are
        :func:`driver_error`'s (``RIVET_STATE_UNREACHABLE``, ``RIVET_STATE_AUTH_FAILED``, …)."""
        with self._session() as conn:
            yield conn

    @contextlib.contextmanager
    def reading(self) -> Iterator[DriverReader]:
        """A read-only session; ``RIVET_STATE_MISSING`` when the schema holds no table,
        ``RIVET_STATE_PERMISSION_DENIED`` when the role may not read every state table."""
        with self.inspecting() as conn:
            if not self.table_names(conn):
                raise StateError("RIVET_STATE_MISSING", f"no state at {self.location.display}: schema "
                                 f"{self.schema} holds no table")
            self.check_rights("read", conn)
            yield conn

    def scanning(self) -> contextlib.AbstractContextManager[DriverReader]:
        """:meth:`reading`: a read-only session sees the committed state without any lock a
        writer waits for (MVCC)."""
        return self.reading()

    def integrity_problems(self, conn: Connection, *, full: bool = False) -> list[str]:
        return []

    def size_bytes(self, conn: Reader) -> int:
        """The schema's tables with their indexes and TOAST (``pg_total_relation_size``)."""
        return int(conn.scalar("SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c JOIN "
                               "pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = :s AND c.relkind = 'r'",
                               {"s": self.schema}))

    def contended(self, conn: Reader) -> bool:
        """True when another client session of this database is in a transaction (a writer
        polling the writers' lock is in one), or is another role's, whose transaction this
        role may not see (``pg_stat_activity`` shows it no state)."""
        return bool(conn.scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND "
            "pid <> pg_backend_pid() AND backend_type = 'client backend' AND "
            "(xact_start IS NOT NULL OR state IS NULL))"))

    _RELATIONS = ("SELECT c.oid, c.relname, pg_get_userbyid(c.relowner), pg_has_role(c.relowner, 'USAGE') "
                  "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                  "WHERE n.nspname = :s AND c.relkind = 'r' AND c.relname = ANY(:t)")

    def check_reclaimable(self, conn: Reader, tables: Iterable[str]) -> None:
        """``RIVET_STATE_PERMISSION_DENIED`` unless this role may ``VACUUM`` each of ``tables``:
        it has the rights of their owner, or owns the database, or is a superuser (the
        server would skip the others with a mere warning)."""
        names = sorted(tables)
        if conn.scalar("SELECT rolsuper OR pg_has_role((SELECT datdba FROM pg_database WHERE datname = "
                       "current_database()), 'USAGE') FROM pg_roles WHERE rolname = current_user"):
            return
        refused = [(name, owner) for _oid, name, owner, owns in conn.rows(self._RELATIONS,
                                                                          {"s": self.schema, "t": names}) if not owns]
        if refused:
            role = conn.scalar("SELECT current_user")
            listed = ", ".join(f"{name} (owned by role {owner})" for name, owner in refused)
            raise StateError("RIVET_STATE_PERMISSION_DENIED",
                             f"role {role} may not VACUUM {listed} in schema {self.schema} at {self.location.display}; "
                             "nothing was changed. Run with the owner's role or a superuser, or leave --vacuum out "
                             "(autovacuum makes the space reusable in time)",
                             {"role": role, "schema": self.schema, "tables": [name for name, _ in refused]})

    def reclaim_space(self, tables: Iterable[str]) -> tuple[int, int]:
        """``VACUUM (ANALYZE)`` of ``tables`` on a connection in autocommit (``VACUUM`` cannot
        run in a transaction), waiting up to ``lock_wait`` for each table's lock
        (``lock_timeout``; then ``RIVET_STATE_LOCK_TIMEOUT``): the space of the removed rows
        becomes free for the tables' new rows, and the empty pages at their end go back to
        the filesystem."""
        import psycopg

        names = sorted(tables)
        sizes = (f"SELECT coalesce(sum(pg_total_relation_size(oid)), 0)::bigint FROM ({self._RELATIONS}) AS r "
                 "(oid, relname, owner, owns)")

        def translated(err: BaseException) -> StateError:
            if isinstance(err, psycopg.errors.LockNotAvailable):
                return StateError("RIVET_STATE_LOCK_TIMEOUT", f"VACUUM waited {self.lock_wait:g} s (--lock-wait) "
                                  f"for a lock on {', '.join(names)} at {self.location.display}")
            return self._fault(err)

        with self._session(autocommit=True, read_only=False, translate=translated) as conn:
            before = int(conn.scalar(sizes, {"s": self.schema, "t": names}))
            # lock_timeout 0 would wait forever: --lock-wait 0 waits a millisecond
            conn.rows(f"SELECT set_config('lock_timeout', '{max(1, int(self.lock_wait * 1000))}', false)")
            try:
                conn.raw.execute(f"VACUUM (ANALYZE) {', '.join(f'{ident(self.schema)}.{ident(t)}' for t in names)}")
            except psycopg.Error as err:
                raise translated(err) from None
            return before, int(conn.scalar(sizes, {"s": self.schema, "t": names}))

    def rebuilt_tables(self, conn: Reader, revision: Revision) -> tuple[str, ...]:
        """All of ``revision.rebuilds``: the server rewrites a table whose column type changes."""
        return revision.rebuilds

    def _lock(self, conn: Reader, lock_code: str) -> None:
        deadline = time.monotonic() + self.lock_wait
        key = f"rivet_state:{self.schema}"
        while not conn.scalar("SELECT pg_try_advisory_xact_lock(hashtext(:k))", {"k": key}):
            if time.monotonic() >= deadline:
                raise StateError(lock_code, f"another statetool writer held the state at {self.location.display} "
                                 f"for {self.lock_wait:g} s (--lock-wait)")
            time.sleep(_POLL_SECONDS)

    @contextlib.contextmanager
    def _transaction(self, purpose: str, lock_code: str) -> Iterator[Connection]:
        """One writing transaction: a state must be there (unless ``purpose`` is ``create``),
        and the session's read-only setting and its rights for ``purpose`` are checked before
        any wait or change; then the writers' advisory lock is taken. Committed on a clean
        exit; every driver error is :func:`driver_error`'s."""
        with self._connect(read_only=False) as conn:
            with conn.begin():
                reader = self.reader(conn)
                if purpose != "create" and not self.table_names(reader):
                    raise StateError("RIVET_STATE_MISSING", f"no state at {self.location.display}")
                self._refuse_read_only(reader)
                self.check_rights(purpose, reader)
                self._lock(reader, lock_code)
                yield conn

    @contextlib.contextmanager
    def writing(self, lock_code: str) -> Iterator[Connection]:
        """See :class:`~statetool.backends.base.Backend`. Refused before the lock and before
        any change: ``RIVET_STATE_MISSING``, ``RIVET_STATE_READ_ONLY``, and
        ``RIVET_STATE_PERMISSION_DENIED`` for a role without the write rights (a writer
        waiting with ``RIVET_STATE_MIGRATION_LOCKED``, a migration, also needs CREATE on the
        schema and ownership of the tables it alters)."""
        with self._transaction("migrate" if lock_code == _MIGRATION_LOCK else "write", lock_code) as conn:
            yield conn

    def create(self, build: Callable[[Connection], None], start_from: Path | None = None,
               on_step: Step | None = None) -> None:
        assert start_from is None, "keeps_copies is False: no file to start from"
        with self._transaction("create", _MIGRATION_LOCK) as conn:
            conn.exec_driver_sql(f"CREATE SCHEMA IF NOT EXISTS {ident(self.schema)}")
            if self.table_names(self.reader(conn)):
                raise StateError("RIVET_STATE_TARGET_NOT_EMPTY",
                                 f"schema {self.schema} at {self.location.display} already holds tables")
            build(conn)

    @contextlib.contextmanager
    def receiving(self) -> Iterator[Connection]:
        """One writing transaction on the schema, created if absent, under the writers'
        advisory lock; it may hold no table yet (a transfer builds and fills it). Committed
        on a clean exit; nothing of it is visible before. Refuses as :meth:`check_rights`
        ``("create")`` and ``RIVET_STATE_READ_ONLY`` before any change."""
        with self._transaction("create", _MIGRATION_LOCK) as conn:
            conn.exec_driver_sql(f"CREATE SCHEMA IF NOT EXISTS {ident(self.schema)}")
            yield conn

    def copy_into(self, conn: Connection, table: str, columns: list[str], blocks: Iterable[Block], rows: int,
                  progress: Callable[[int], None]) -> Loaded:
        """:func:`~statetool.backends.postgres_copy.copy_into` on ``conn`` (a transaction of
        :meth:`receiving`): COPY, indexes deferred for a big empty table, the server's checksum."""
        from statetool.backends import postgres_copy

        return postgres_copy.copy_into(conn, table, columns, blocks, rows, progress)

    def copy_blocks(self, conn: Connection, table: str, columns: list[str]) -> Iterator[Block]:
        """:func:`~statetool.backends.postgres_copy.copy_blocks` on ``conn`` (this state's
        write transaction): ``COPY … TO STDOUT`` in primary key order, checksummed."""
        from statetool.backends import postgres_copy

        return postgres_copy.copy_blocks(conn, table, columns)

    def drop_tables(self, conn: Connection) -> None:
        """Drop every table of the schema (with what depends on them) in ``conn``'s transaction."""
        from statetool.backends import postgres_copy

        postgres_copy.drop_tables(conn, self.table_names(self.reader(conn)))

    def in_flight(self, conn: Connection) -> bool:
        """True when the version table reads :data:`~statetool.schema.IN_FLIGHT_REVISION`."""
        return self.reader(conn).scalar(f"SELECT count(*) FROM {VERSION_TABLE} WHERE version_num = :v",
                                        {"v": IN_FLIGHT_REVISION}) == 1

    def mark_in_flight(self, conn: Connection) -> None:
        """Set the version to :data:`~statetool.schema.IN_FLIGHT_REVISION` in
        ``conn``'s transaction: every open refuses (``RIVET_STATE_MOVE_IN_FLIGHT``) until
        :meth:`make_live`."""
        conn.exec_driver_sql(f"UPDATE {VERSION_TABLE} SET version_num = %(v)s", {"v": IN_FLIGHT_REVISION})

    def make_live(self) -> None:
        """In a :meth:`receiving` transaction of its own, set an in-flight version back to
        head (idempotent; nothing to do when the state is live or the schema has no version
        table). Refuses as :meth:`receiving`."""
        with self.receiving() as conn:
            if VERSION_TABLE in self.table_names(self.reader(conn)):
                conn.exec_driver_sql(f"UPDATE {VERSION_TABLE} SET version_num = %(head)s WHERE version_num = %(v)s",
                                     {"head": migrations.head(), "v": IN_FLIGHT_REVISION})

    def backup(self, conn: Connection, label: str, progress: Progress | None = None) -> None:
        return None

    def planned_backup(self, label: str) -> None:
        return None

    def hold_off_writers(self) -> None:
        """Nothing to do: PostgreSQL writers queue on the migration transaction's locks."""

    def require_frozen(self) -> None:
        """Nothing to do: the migration's transaction sees one snapshot."""

    def migration(self, conn: Connection, label: str, progress: Progress, on_step: Step) -> InTransaction:
        """The migration runs in ``conn``'s own transaction (PostgreSQL's DDL is
        transactional): :class:`InTransaction`."""
        return InTransaction(conn)

    def vanished_evidence(self) -> list[str]:
        """Always empty: an empty schema keeps no trace of a state that was dropped."""
        return []

    def leases(self, ttl: int = 30) -> RowLeases:
        from statetool.backends.postgres_leases import RowLeases

        return RowLeases(lambda: self._engine(read_only=False, autocommit=True),
                         lambda translate: self._session(autocommit=True, read_only=False, translate=translate),
                         ttl, where=self.location.display, setting=self.location.setting, schema=self.schema)


class InTransaction:
    """A migration run in the state's write transaction itself (a
    :class:`~statetool.backends.base.Migration`): nothing is copied, nothing switched, no
    backup file; a failure rolls the one transaction back."""

    backup = None

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    @contextlib.contextmanager
    def connection(self) -> Iterator[Connection]:
        """The write transaction's connection; the caller's transaction commits it."""
        yield self.conn

    def switch(self) -> None:
        """Nothing to switch: the commit made the new revision live."""

    def discard(self) -> None:
        """Nothing to drop: the transaction rolls back."""



class SchemaRetirement:
    """A PostgreSQL state as a transfer's source retires it (a
    :class:`~statetool.backends.base.Retirement`; decisions.md, "Retiring a PostgreSQL
    source"): its rows stay where they are, its version table reads
    :data:`~statetool.tables.RELOCATED_REVISION` and a ``retired`` audit row says where the
    state went, both in the transfer's write transaction on it, so they commit together.
    There is no file: nothing to hold open, fold in or clean up (every writer is held off by
    the run leases and the writers' advisory lock of that transaction)."""

    def __init__(self, backend: PostgresBackend) -> None:
        self.backend = backend
        #: The schema as every message names it (password masked).
        self.place = backend.location.display

    def moved_to(self) -> dict[str, Any] | None:
        """The ``retired`` row's detail when the version reads the marker, else None."""
        with self.backend.inspecting() as conn:
            if VERSION_TABLE not in self.backend.table_names(conn) or \
                    conn.scalar(f"SELECT min(version_num) FROM {VERSION_TABLE}") != RELOCATED_REVISION:
                return None
            return retired_detail(conn)

    def size_bytes(self) -> int:
        """The tables of the schema with their indexes and TOAST (``pg_total_relation_size``)."""
        with self.backend.inspecting() as conn:
            return self.backend.size_bytes(conn)

    def require_retirable(self) -> None:
        """Nothing beyond the write's own checks: marking the version and writing the audit
        row are the rights of any write (checked before any lease by the guarded write)."""

    def remove_stale(self) -> None:
        """Nothing: a killed transfer's transaction on the source rolled back."""

    def hold_off_writers(self) -> None:
        """Nothing: writers queue on the write transaction's advisory lock; runs on the leases."""

    def require_frozen(self) -> None:
        """Nothing: no writer passes the leases and the lock held."""

    def digest(self, conn: Connection) -> str:
        """The server's checksum of every table but the leases (whose heartbeats move),
        over every column (:func:`~statetool.backends.postgres_copy.content_digest`)."""
        from statetool.backends import postgres_copy

        reader = self.backend.reader(conn)
        columns: dict[str, list[str]] = {}
        for table, column in reader.rows(
                "SELECT c.relname, a.attname FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
                "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = :s AND c.relkind = 'r' "
                "AND a.attnum > 0 AND NOT a.attisdropped ORDER BY c.relname, a.attnum", {"s": self.backend.schema}):
            if table not in LEASE_TABLES:
                columns.setdefault(table, []).append(column)
        return postgres_copy.content_digest(conn, columns)

    def wait_for_openers(self) -> None:
        """Nothing: a session on the schema writes only under a lease this transfer holds."""

    def retire(self, conn: Connection, doc: dict[str, Any], audit: Callable[[str, dict[str, object]], None],
               on_step: Step) -> str | None:
        """The ``retired`` audit row (``doc``) and the marker in ``conn``'s transaction, the
        source's write, committed with it; ``on_step`` told ``marked``. Returns None: the
        rows stay in place."""
        audit(RETIRED_ACTION, doc)
        conn.exec_driver_sql(f"UPDATE {VERSION_TABLE} SET version_num = %(v)s", {"v": RELOCATED_REVISION})
        on_step("marked")
        return None

    def finish_retired(self) -> None:
        """Nothing: a schema leaves no companion files."""
