"""PostgreSQL state: the tables of schema ``rivet_state`` (or ``?schema=``) in a shared database.

Every connection sets ``search_path`` to the state's schema, so the Core tables of
:mod:`statetool.schema` and the alembic revisions need no schema name. A read-only
session runs with ``default_transaction_read_only = on``: the server itself refuses any
write. Writers serialise on a transaction-scoped advisory lock named after the schema,
polled until ``--lock-wait`` runs out.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.pool import NullPool

from statetool.backends.base import Progress
from statetool.errors import StateError
from statetool.location import Location

if TYPE_CHECKING:
    from statetool.backends.postgres_leases import RowLeases

#: SQLSTATEs of a refused login (invalid_password, invalid_authorization_specification).
_AUTH_STATES = {"28P01", "28000"}
_POLL_SECONDS = 0.2
#: SQLSTATE classes and codes a re-run may get past (https://www.postgresql.org/docs/15/errcodes-appendix.html):
#: connection exceptions, insufficient resources, operator intervention; serialization failure, deadlock.
_TRANSIENT_CLASSES = {"08", "53", "57"}
_TRANSIENT_STATES = {"40001", "40P01", "55P03"}
#: The database refuses on purpose, the same way every time: integrity constraints, a trigger's
#: RAISE, a missing privilege, a read-only transaction or server.
_REFUSING_CLASSES = {"23", "P0"}
_REFUSING_STATES = {"42501", "25006"}
#: Milliseconds a lease statement waits for a row lock before it counts as busy.
LEASE_LOCK_TIMEOUT_MS = 200


class PostgresBackend:
    """A PostgreSQL state schema. See the module docstring."""

    dialect_name = "postgresql"

    def __init__(self, location: Location, lock_wait: float) -> None:
        assert location.url is not None and location.schema is not None
        self.location = location
        self.schema: str = location.schema
        self.lock_wait = lock_wait

    def _engine(self, read_only: bool, autocommit: bool = False) -> sa.Engine:
        options = f'-c search_path="{self.schema}"'  # quoted: an unquoted MixedCase would fold to mixedcase
        if read_only:
            options += " -c default_transaction_read_only=on"
        if autocommit:
            # A lease statement never queues behind a row lock (a writer between its last
            # fence and its commit): it gives up after this and the wait loop tries again,
            # so --lock-wait bounds every wait (docs/decisions.md, "Locks and leases").
            options += f" -c lock_timeout={LEASE_LOCK_TIMEOUT_MS}"
        url = "postgresql+psycopg://" + self.location.url.split("://", 1)[1]
        # Autocommit engines serve leases: polling, heartbeats and the release reuse one
        # pooled connection instead of opening a server connection per statement.
        extra: dict[str, Any] = {"isolation_level": "AUTOCOMMIT", "pool_size": 1, "max_overflow": 2} \
            if autocommit else {"poolclass": NullPool}
        return sa.create_engine(url, connect_args={"options": options, "connect_timeout": 10}, **extra)

    def _translate(self, err: sa.exc.DBAPIError) -> StateError:
        orig: Any = err.orig
        sqlstate = getattr(orig, "sqlstate", None)
        text = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
        where = self.location.display
        if sqlstate in _AUTH_STATES or "password authentication failed" in text or "no password supplied" in text:
            return StateError("RIVET_STATE_AUTH_FAILED", f"the state database at {where} refused the login: {text}")
        if sqlstate == "3D000" or "does not exist" in text and "database" in text:
            return StateError("RIVET_STATE_URL_INVALID", f"the state database named in {where} does not exist "
                              f"on that server: {text}")
        if sqlstate is None or sqlstate[:2] in _TRANSIENT_CLASSES or sqlstate in _TRANSIENT_STATES:
            return StateError("RIVET_STATE_UNREACHABLE", f"the state database at {where} is unreachable or busy: "
                              f"{text}")
        if sqlstate[:2] in _REFUSING_CLASSES or sqlstate in _REFUSING_STATES:
            return StateError("RIVET_STATE_WRITE_REFUSED", f"the state database at {where} refused the write "
                              f"(SQLSTATE {sqlstate}): {text}", {"sqlstate": sqlstate})
        return StateError("RIVET_INTERNAL", f"{type(orig).__name__} (SQLSTATE {sqlstate}) from the state database "
                          f"at {where}: {text}")

    @contextlib.contextmanager
    def _connect(self, read_only: bool) -> Iterator[Connection]:
        engine = self._engine(read_only)
        try:
            with engine.connect() as conn:
                yield conn
        except sa.exc.DBAPIError as err:
            raise self._translate(err) from None
        finally:
            engine.dispose()

    def table_names(self, conn: Connection) -> set[str]:
        rows = conn.execute(sa.text("SELECT table_name FROM information_schema.tables WHERE table_schema = :s"),
                            {"s": self.schema}).all()
        return {r[0] for r in rows}

    def present(self) -> bool:
        with self._connect(read_only=True) as conn:
            return bool(self.table_names(conn))

    @contextlib.contextmanager
    def reading(self) -> Iterator[Connection]:
        with self._connect(read_only=True) as conn:
            if not self.table_names(conn):
                raise StateError("RIVET_STATE_MISSING", f"no state at {self.location.display}: schema "
                                 f"{self.schema} holds no table")
            yield conn

    def integrity_problems(self, conn: Connection) -> list[str]:
        return []

    def _lock(self, conn: Connection, lock_code: str) -> None:
        deadline = time.monotonic() + self.lock_wait
        key = f"rivet_state:{self.schema}"
        while not conn.execute(sa.text("SELECT pg_try_advisory_xact_lock(hashtext(:k))"), {"k": key}).scalar():
            if time.monotonic() >= deadline:
                raise StateError(lock_code, f"another statetool writer held the state at {self.location.display} "
                                 f"for {self.lock_wait:g} s (--lock-wait)")
            time.sleep(_POLL_SECONDS)

    @contextlib.contextmanager
    def writing(self, lock_code: str) -> Iterator[Connection]:
        with self._connect(read_only=False) as conn:
            with conn.begin():
                self._lock(conn, lock_code)
                if not self.table_names(conn):
                    raise StateError("RIVET_STATE_MISSING", f"no state at {self.location.display}")
                yield conn

    def create(self, build: Callable[[Connection], None]) -> None:
        with self._connect(read_only=False) as conn:
            with conn.begin():
                self._lock(conn, "RIVET_STATE_MIGRATION_LOCKED")
                conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
                if self.table_names(conn):
                    raise StateError("RIVET_STATE_TARGET_NOT_EMPTY",
                                     f"schema {self.schema} at {self.location.display} already holds tables")
                build(conn)

    @contextlib.contextmanager
    def receiving(self) -> Iterator[Connection]:
        """One writing transaction on the schema, created if absent, under the writers'
        advisory lock; it may hold no table yet (a transfer builds and fills it). Committed
        on a clean exit; nothing of it is visible before."""
        with self._connect(read_only=False) as conn:
            with conn.begin():
                self._lock(conn, "RIVET_STATE_MIGRATION_LOCKED")
                conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
                yield conn

    def backup(self, conn: Connection, label: str, progress: Progress | None = None) -> None:
        return None

    def vanished_evidence(self) -> list[str]:
        """Always empty: an empty schema keeps no trace of a state that was dropped."""
        return []

    def leases(self, ttl: int = 30) -> RowLeases:
        from statetool.backends.postgres_leases import RowLeases

        return RowLeases(self._engine(read_only=False, autocommit=True), ttl)
