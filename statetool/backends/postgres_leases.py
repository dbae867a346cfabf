"""PostgreSQL leases: one row per key in ``rivet_leases`` (revision 0002), kept fresh by a heartbeat.

SPEC §5. A row is *stale* when its heartbeat is older than its TTL by the database
clock (``now()``, never the client's), or, on this host, when neither its holder nor the
command the holder started is alive (each judged by pid AND process start time, so a
reused pid never reads as alive). A holder on this host that died while its command
lives on keeps the lease live: the work still runs. A stale row is taken over at once by
compare-and-swap on the row as observed (key, pid, host, acquired_at and heartbeat_at
unchanged), never by a blind update, so of two takers racing for one stale row exactly
one wins.

Fencing (revision 0004): every acquisition draws the next token of its key from
``rivet_lease_tokens`` in the same statement, so tokens grow per key across releases. A
holding is the row with this holder's (key, pid, host, acquired_at); a write under the
lease checks, inside its own transaction, that the row is still that holding
(``SELECT ... FOR SHARE`` right before the commit, so a takeover waits for the commit).
One heartbeat thread per store refreshes every lease it holds every TTL/3 seconds; a
lease it finds gone is marked lost, and its holder stops (``leases run`` kills its
command; fenced writes refuse with ``RIVET_STATE_LEASE_LOST``).

A lease table from before revision 0004 (a state waiting for its migration) has none of
the new columns: the store sees that once, and takes and lists leases without them.

Looking at leases (``list``, ``info``, ``require_state``) runs on a psycopg session of its
own, without SQLAlchemy (issue 13 item 1); taking, beating and releasing them run on the
pooled SQLAlchemy engine, made when the first lease is taken.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from statetool.backends.base import HeldLease, Holder, LeaseInfo, Reader
from statetool.backends.postgres_faults import driver_error, rights_problem
from statetool.backends.processes import alive, command_alive, host_name, live_lease
from statetool.backends.readers import CoreReader, pyformat
from statetool.errors import StateError, moved_away
from statetool.tables import LEASE_TABLE, RELOCATED_REVISION, VERSION_TABLE, retired_detail

if TYPE_CHECKING:
    import sqlalchemy as sa
    from sqlalchemy.engine import Connection

DEFAULT_TTL = 30
#: SQLSTATE lock_not_available: lock_timeout ran out, or NOWAIT found the row locked.
_LOCK_NOT_AVAILABLE = "55P03"
#: The holder shown for a lease row or table locked by a write under way.
_LOCKED_BY_A_WRITER = Holder(0, "?", "?", "a migration or another write holding the lease table", "now")

_OLD_COLUMNS = "key, holder_pid, holder_host, holder_user, command, acquired_at, heartbeat_at, ttl_seconds"
_NEW_COLUMNS = "fencing_token, holder_started, child_pid, child_started"
_AGE = "extract(epoch FROM now() - heartbeat_at) AS age"
_OBSERVED = ("key = :key AND holder_pid = :o_pid AND holder_host = :o_host "
             "AND acquired_at = :o_acquired AND heartbeat_at = :o_heartbeat")
_MINE = "key = :key AND holder_pid = :pid AND holder_host = :host AND acquired_at = :acquired"


def _iso(t: datetime) -> str:
    return t.isoformat()


def _info(row: Mapping[str, Any], here: str) -> LeaseInfo:
    """The lease of one row of :meth:`RowLeases._select` (column name -> value)."""
    fenced = "fencing_token" in row
    holder = Holder(row["holder_pid"], row["holder_host"], row["holder_user"], row["command"],
                    _iso(row["acquired_at"]), _iso(row["heartbeat_at"]), row["ttl_seconds"],
                    *((row["fencing_token"], row["holder_started"], row["child_pid"], row["child_started"])
                      if fenced else ()))
    age = float(row["age"])
    stale = age > row["ttl_seconds"]
    if row["holder_host"] == here and not alive(holder.pid, holder.started):
        stale = not command_alive(holder.child_pid, holder.child_started)  # the run's work goes on
    return LeaseInfo(row["key"], "stale" if stale else "live", holder, age, max(0.0, row["ttl_seconds"] - age))


def _observed(row: Mapping[str, Any]) -> dict[str, object]:
    return {"key": row["key"], "o_pid": row["holder_pid"], "o_host": row["holder_host"],
            "o_acquired": row["acquired_at"], "o_heartbeat": row["heartbeat_at"]}


def _run(conn: Connection, sql: str, params: Mapping[str, object] | None = None) -> sa.CursorResult[Any]:
    """``sql`` (``:name`` parameters) on the SQLAlchemy connection ``conn``, bound by psycopg
    itself (:func:`~statetool.backends.readers.pyformat`): a lease write needs no SQL compiler."""
    return conn.exec_driver_sql(pyformat(sql), dict(params or {}))


def _lease_error(orig: BaseException, where: str, setting: str | None = None) -> StateError:
    """A driver error of a lease statement (psycopg's, or SQLAlchemy's wrapper of it): a
    missing lease table (a state below revision 0002) is ``RIVET_STATE_MIGRATION_PENDING``,
    found by the query itself, not a probe; a lease table locked past the lock timeout (a
    migration altering it) is ``RIVET_STATE_MIGRATION_LOCKED``; every other error is
    :func:`driver_error`'s (a server that went away is ``RIVET_STATE_UNREACHABLE``, never a
    traceback)."""
    sqlstate = getattr(getattr(orig, "orig", None) or orig, "sqlstate", None)
    if sqlstate == "42P01":  # undefined_table
        return StateError("RIVET_STATE_MIGRATION_PENDING",
                          "this state has no lease table (revision 0002); run statetool migrate")
    if sqlstate == _LOCK_NOT_AVAILABLE:
        return StateError("RIVET_STATE_MIGRATION_LOCKED",
                          "the lease table is locked by a migration or another write under way")
    return driver_error(orig, where, setting)


@dataclass
class RowLease:
    """A held row lease; its heartbeat is the store's."""

    key: str
    holder: Holder
    store: RowLeases
    acquired: datetime
    lost_event: threading.Event = field(default_factory=threading.Event)
    released: bool = False
    #: When the server last confirmed this holding (``time.monotonic()``): taken, or heartbeat.
    confirmed: float = field(default_factory=time.monotonic)

    @property
    def token(self) -> int | None:
        return self.holder.token

    @property
    def lost(self) -> bool:
        return self.lost_event.is_set()

    def mine(self) -> dict[str, object]:
        """The bind parameters that name this holding (``_MINE``)."""
        return {"key": self.key, "pid": self.holder.pid, "host": self.holder.host, "acquired": self.acquired}

    def set_child(self, pid: int, started: int | None) -> None:
        self.holder = self.holder._replace(child_pid=pid, child_started=started)
        if self.store.fenced_layout():
            with self.store.connect() as conn:
                _run(conn, f"UPDATE rivet_leases SET child_pid = :c, child_started = :cs WHERE {_MINE}",
                     {**self.mine(), "c": pid, "cs": started})

    def fence(self, conn: Connection, *, final: bool = False) -> None:
        if _run(conn, "SELECT to_regclass('rivet_leases')").scalar() is None:
            return  # this very transaction dropped the lease table (a downgrade under the state lease)
        lock = " FOR SHARE" if final else ""
        held = not self.lost and _run(conn, f"SELECT 1 FROM rivet_leases WHERE {_MINE}{lock}",
                                      self.mine()).first() is not None
        if not held:
            raise StateError("RIVET_STATE_LEASE_LOST",
                             f"lease {self.key} was taken over by another holder (this holder stalled past its "
                             f"TTL of {self.holder.ttl_seconds} s, or the lease was released); nothing was written",
                             {"key": self.key})

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.store.forget(self)
        try:
            with self.store.connect() as conn:
                _run(conn, f"DELETE FROM rivet_leases WHERE {_MINE}", self.mine())
        except StateError as err:
            # a downgrade this lease guarded dropped the lease table, and the lease with it;
            # or the lease was lost already (the error that says so is the one to report)
            if err.code == "RIVET_STATE_MIGRATION_PENDING" or self.lost:
                return
            raise StateError(err.code, f"{err.message}; lease {self.key} was not given back: its record goes stale "
                             f"{self.holder.ttl_seconds} s after its last heartbeat", err.details) from None

    def inheritable_fds(self) -> tuple[int, ...]:
        return ()


@dataclass
class RowStaleClaim:
    """A stale row deleted in the caller's transaction: it is gone when that commits."""

    info: LeaseInfo

    def commit(self) -> None:
        """Nothing left to do: the delete committed with the audit row."""

    def abandon(self) -> None:
        """Nothing to undo: the transaction that deleted the row rolled back."""


#: Opens a read session: ``translate`` turns each driver error into the registered error.
Looking = Callable[[Callable[[BaseException], StateError]], AbstractContextManager[Reader]]


class RowLeases:
    """The lease store of a PostgreSQL state schema: ``engine`` (made by ``make_engine``
    when a lease is first taken) runs in autocommit; ``looking`` opens the psycopg session
    that lists and reads leases; ``where`` names the state in messages, ``setting`` the
    setting that gave its URL (:func:`~statetool.backends.postgres_faults.driver_error`)."""

    def __init__(self, make_engine: Callable[[], sa.Engine], looking: Looking, ttl: int = DEFAULT_TTL, *,
                 where: str = "the state database", setting: str | None = None, schema: str | None = None) -> None:
        self._make_engine = make_engine
        self._engine: sa.Engine | None = None
        self._looking = looking
        self.ttl = ttl
        self.where = where
        self.setting = setting
        self.schema = schema
        self.here = host_name()
        self._fenced: bool | None = None
        self._held: dict[str, RowLease] = {}
        self._mutex = threading.Lock()
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    @property
    def engine(self) -> sa.Engine:
        """The pooled autocommit engine the lease writes run on, made on first use."""
        if self._engine is None:
            self._engine = self._make_engine()
        return self._engine

    @contextlib.contextmanager
    def connect(self) -> Iterator[Connection]:
        """A pooled autocommit connection of :attr:`engine`, its driver errors as
        :func:`_lease_error` names them."""
        import sqlalchemy as sa

        try:
            with self.engine.connect() as conn:
                yield conn
        except sa.exc.DBAPIError as err:
            raise _lease_error(err, self.where, self.setting) from None

    @contextlib.contextmanager
    def looking(self) -> Iterator[Reader]:
        """A session for reading leases, its driver errors as :func:`_lease_error` names
        them: a psycopg session of its own (autocommit, no SQLAlchemy) while this store has
        taken no lease, else a pooled connection of :attr:`engine` (a holder looks at leases
        between its acquisitions: no connection is opened for each look)."""
        def translate(err: BaseException) -> StateError:
            return _lease_error(err, self.where, self.setting)

        if self._engine is None:
            with self._looking(translate) as conn:
                yield conn
        else:
            with self.connect() as pooled:
                yield CoreReader(pooled, translate)

    def require_state(self, *, to_hold: bool = True) -> None:
        """Raise ``RIVET_STATE_MISSING`` when the schema holds no table (or does not
        exist), ``RIVET_STATE_RELOCATED`` when a transfer retired it; with ``to_hold``, also ``RIVET_STATE_MIGRATION_PENDING`` when it has no lease
        table yet, and ``RIVET_STATE_PERMISSION_DENIED`` when the role may not write the
        lease tables (so a lease is refused before anything is written, SPEC §8a). A list
        (``to_hold`` False) of a state without a lease table lists nothing."""
        with self.looking() as conn:
            schema = self.schema or conn.scalar("SELECT current_schema()")
            tables = {r[0] for r in conn.rows(
                "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = :s AND c.relkind IN ('r', 'p')", {"s": schema})}
            if not tables:
                raise StateError("RIVET_STATE_MISSING", f"no state here: the state schema {schema} holds no table "
                                 "(or does not exist)", {"schema": str(schema)})
            if VERSION_TABLE in tables and conn.scalar(f"SELECT min(version_num) FROM {VERSION_TABLE}") == \
                    RELOCATED_REVISION:  # a transfer moved the state away: a lease here guards nothing
                raise moved_away(self.where, retired_detail(conn), {"place": self.where})
            if not to_hold:
                return
            if LEASE_TABLE not in tables:
                raise StateError("RIVET_STATE_MIGRATION_PENDING",
                                 "this state has no lease table (revision 0002); run statetool migrate")
            problem = rights_problem(conn, str(schema), "lease", self.where)
        if problem is not None:
            raise problem

    def fenced_layout(self) -> bool:
        """True when the lease table has revision 0004's columns (read once per store)."""
        if self._fenced is None:
            with self.looking() as conn:
                self._fenced = bool(conn.scalar(
                    "SELECT count(*) FROM information_schema.columns WHERE table_schema = current_schema() "
                    "AND table_name = 'rivet_leases' AND column_name = 'fencing_token'"))
        return self._fenced

    def _columns(self) -> list[str]:
        """The names of the columns :meth:`_select` returns, in order."""
        return [*_OLD_COLUMNS.split(", "), *(_NEW_COLUMNS.split(", ") if self.fenced_layout() else ()), "age"]

    def _select(self) -> str:
        extra = f", {_NEW_COLUMNS}" if self.fenced_layout() else ""
        return f"SELECT {_OLD_COLUMNS}{extra}, {_AGE} FROM rivet_leases"

    def _read(self, conn: Reader, where: str, params: Mapping[str, object] | None = None) -> list[dict[str, Any]]:
        """The rows of :meth:`_select` followed by ``where`` (a WHERE and ORDER BY clause), by column name."""
        columns = self._columns()
        return [dict(zip(columns, row, strict=True)) for row in conn.rows(f"{self._select()} {where}", params)]

    def _take(self, conn: Connection, key: str, holder: Holder, row: Any | None) -> tuple[datetime, int | None] | None:
        """Insert the row (``row`` None) or take the observed stale ``row`` over; returns
        (acquired_at, token), or None when someone else got there first.

        The token is the key's last plus one, read with the token row locked (so two
        acquirers of one key draw in turn) and written back only by the statement that
        actually took the lease: an attempt that finds the lease busy writes nothing."""
        values: dict[str, object] = {"key": key, "pid": holder.pid, "host": holder.host, "user": holder.user,
                                     "cmd": holder.command, "ttl": self.ttl, "started": holder.started}
        if not self.fenced_layout():
            if row is None:
                sql = (f"INSERT INTO rivet_leases ({_OLD_COLUMNS}) VALUES (:key, :pid, :host, :user, :cmd, now(), "
                       "now(), :ttl) ON CONFLICT (key) DO NOTHING RETURNING acquired_at, NULL")
            else:
                values.update(_observed(row))
                sql = ("UPDATE rivet_leases SET holder_pid = :pid, holder_host = :host, holder_user = :user, "
                       "command = :cmd, acquired_at = now(), heartbeat_at = now(), ttl_seconds = :ttl "
                       f"WHERE {_OBSERVED} RETURNING acquired_at, NULL")
            got = _run(conn, sql, values).first()
            return None if got is None else (got[0], None)
        if row is None:
            take = (f"INSERT INTO rivet_leases ({_OLD_COLUMNS}, fencing_token, holder_started) "
                    "SELECT :key, :pid, :host, :user, :cmd, now(), now(), :ttl, nxt.token, :started FROM nxt "
                    "ON CONFLICT (key) DO NOTHING RETURNING key, acquired_at, fencing_token")
        else:
            values.update(_observed(row))
            take = ("UPDATE rivet_leases SET holder_pid = :pid, holder_host = :host, holder_user = :user, "
                    "command = :cmd, acquired_at = now(), heartbeat_at = now(), ttl_seconds = :ttl, "
                    "fencing_token = (SELECT token FROM nxt), holder_started = :started, child_pid = NULL, "
                    f"child_started = NULL WHERE {_OBSERVED} RETURNING key, acquired_at, fencing_token")
        got = _run(
            conn,
            "WITH nxt AS (SELECT coalesce((SELECT token FROM rivet_lease_tokens WHERE key = :key FOR UPDATE), 0) + 1 "
            f"AS token), took AS ({take}), "
            "kept AS (INSERT INTO rivet_lease_tokens (key, token) SELECT key, fencing_token FROM took "
            "ON CONFLICT (key) DO UPDATE SET token = excluded.token) "
            "SELECT acquired_at, fencing_token FROM took", values).first()
        return None if got is None else (got[0], got[1])

    def try_acquire(self, key: str, holder: Holder) -> HeldLease | LeaseInfo:
        try:
            return self._try_acquire(key, holder)
        except StateError as err:
            if err.code != "RIVET_STATE_MIGRATION_LOCKED":
                raise
            # the row or the table is locked by a writer under way (a migration): busy, look again
            return LeaseInfo(key, "live", _LOCKED_BY_A_WRITER)

    def _try_acquire(self, key: str, holder: Holder) -> HeldLease | LeaseInfo:
        with self.connect() as conn:
            for _attempt in range(3):
                taken = self._take(conn, key, holder, None)
                if taken is None:
                    row = self._first(conn, key)
                    if row is None:
                        continue  # released between the insert and the read: try again
                    info = _info(row, self.here)
                    if info.state == "live":
                        return info
                    taken = self._take(conn, key, holder, row)
                    if taken is None:
                        continue  # another taker won the row: look again
                acquired, token = taken
                lease = RowLease(key, holder._replace(acquired_at=_iso(acquired), heartbeat_at=_iso(acquired),
                                                      ttl_seconds=self.ttl, token=token), self, acquired)
                self._hold(lease)
                return lease
            row = self._first(conn, key)
            return _info(row, self.here) if row is not None else LeaseInfo(key, "free", None)

    def _first(self, conn: Connection, key: str, lock: str = "") -> dict[str, Any] | None:
        """The row of lease ``key`` on the SQLAlchemy connection ``conn`` (``lock``: a row
        lock clause), by column name, or None."""
        row = _run(conn, f"{self._select()} WHERE key = :key{lock}", {"key": key}).first()
        return None if row is None else dict(row._mapping)

    # -- the heartbeat: one thread for every lease this store holds ------------------------

    def _hold(self, lease: RowLease) -> None:
        with self._mutex:
            self._held[lease.key] = lease
            if self._thread is None:
                self._stop = threading.Event()
                self._thread = threading.Thread(target=self._beat, args=(self._stop,), name="lease-heartbeat",
                                                daemon=True)
                self._thread.start()

    def forget(self, lease: RowLease) -> None:
        """Stop beating for ``lease``; the thread ends with the last lease."""
        with self._mutex:
            if self._held.get(lease.key) is lease:
                del self._held[lease.key]
            thread = self._thread if not self._held else None
            if thread is not None and self._stop is not None:
                self._thread = None
                self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _beat(self, stop: threading.Event) -> None:
        interval = max(self.ttl / 3, 0.2)
        while not stop.wait(interval):
            with self._mutex:
                held = list(self._held.values())
            if not held:
                continue
            try:
                with self.connect() as conn:
                    kept = {(r.key, r.acquired_at) for r in _run(
                        conn,
                        "UPDATE rivet_leases SET heartbeat_at = now() WHERE key = ANY(:keys) AND holder_pid = :pid "
                        "AND holder_host = :host RETURNING key, acquired_at",
                        {"keys": [lease.key for lease in held], "pid": held[0].holder.pid,
                         "host": held[0].holder.host})}
            except StateError as err:
                self._unconfirmed(held, err)
                continue
            now = time.monotonic()
            for lease in held:
                lease.confirmed = now
                if (lease.key, lease.acquired) not in kept and not lease.released:
                    lease.lost_event.set()
                    self.forget(lease)
                    sys.stderr.write(f"statetool: lease {lease.key} was taken over by another holder "
                                     "(this holder stalled past its TTL, or the lease was released)\n")

    def _unconfirmed(self, held: list[RowLease], err: StateError) -> None:
        """A heartbeat that failed: retried at the next beat, unless the server has not
        confirmed a lease for its whole TTL. Then another holder may take it over as soon as
        the server is back, so the lease counts as lost (its holder stops, as on a takeover)."""
        sys.stderr.write(f"statetool: lease heartbeat failed ({err.code}); retrying\n")
        now = time.monotonic()
        for lease in held:
            if now - lease.confirmed >= self.ttl and not lease.released:
                lease.lost_event.set()
                self.forget(lease)
                sys.stderr.write(f"statetool: lease {lease.key} is lost: the state database at {self.where} did "
                                 f"not confirm it for {self.ttl} s (its TTL), so another holder may take it over\n")

    # -- reading and releasing ----------------------------------------------------------

    def require_takable(self, keys: Iterable[str]) -> None:
        """Nothing to look at: a lease row the role may not insert is refused by the server
        in its own statement, which leaves nothing behind (rights are checked before any
        lease: ``check_rights``)."""

    def info(self, key: str) -> LeaseInfo:
        try:
            with self.looking() as conn:
                found = self._read(conn, "WHERE key = :key", {"key": key})
        except StateError as err:
            if err.code == "RIVET_STATE_MIGRATION_LOCKED":
                return LeaseInfo(key, "live", _LOCKED_BY_A_WRITER)
            if err.code != "RIVET_STATE_MIGRATION_PENDING":
                raise
            return LeaseInfo(key, "free", None)  # no lease table yet: no lease has ever been taken
        return _info(found[0], self.here) if found else LeaseInfo(key, "free", None)

    def list(self) -> list[LeaseInfo]:
        try:
            with self.looking() as conn:
                rows = self._read(conn, "ORDER BY key")
        except StateError as err:
            if err.code != "RIVET_STATE_MIGRATION_PENDING":
                raise
            return []  # no lease table yet: no lease has ever been taken
        return [_info(row, self.here) for row in rows]

    def claim_stale(self, key: str, conn: Connection) -> RowStaleClaim:
        from sqlalchemy.exc import OperationalError

        try:
            row = self._first(conn, key, " FOR UPDATE NOWAIT")
        except OperationalError as err:
            if getattr(err.orig, "sqlstate", None) != _LOCK_NOT_AVAILABLE:
                raise
            raise StateError("RIVET_STATE_RUN_IN_PROGRESS", f"lease {key} is locked by a writer that holds it "
                             "right now; look again", {"key": key}) from None
        info = self._stale(key, row)
        _run(conn, f"DELETE FROM rivet_leases WHERE {_OBSERVED}", _observed(row))
        return RowStaleClaim(info)

    def releasable(self, key: str) -> LeaseInfo:
        with self.looking() as conn:
            found = self._read(conn, "WHERE key = :key", {"key": key})
        return self._stale(key, found[0] if found else None)

    def _stale(self, key: str, row: Mapping[str, Any] | None) -> LeaseInfo:
        """The lease of ``row`` (the row of ``key``, None when it has none), which a release
        may remove: ``RIVET_STATE_LEASE_UNKNOWN`` without a row, ``RIVET_STATE_RUN_IN_PROGRESS``
        for a live holder."""
        if row is None:
            raise StateError("RIVET_STATE_LEASE_UNKNOWN", f"this state has no lease {key}", {"key": key})
        info = _info(row, self.here)
        if info.state == "live":
            raise live_lease(key, info.holder)
        return info
