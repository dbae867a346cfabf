"""PostgreSQL leases: one row per key in ``rivet_leases`` (revision 0002), kept fresh by a heartbeat.

SPEC §5. A row is *stale* when its heartbeat is older than its TTL by the database
clock (``now()``, never the client's), or when its holder ran on this host and its pid
is gone. A stale row is taken over at once by compare-and-swap on the row as observed
(key, pid, host, acquired_at and heartbeat_at all unchanged), never by a blind update,
so of two takers racing for one stale row exactly one wins. The holder's heartbeat
thread refreshes ``heartbeat_at`` every TTL/3 seconds for as long as the holder lives.
Documented limit: a holder that stalls past its TTL is taken over and is not fenced.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from statetool.backends.base import HeldLease, Holder, LeaseInfo
from statetool.errors import StateError

DEFAULT_TTL = 30

_COLUMNS = "key, holder_pid, holder_host, holder_user, command, acquired_at, heartbeat_at, ttl_seconds"
_SELECT = (f"SELECT {_COLUMNS}, extract(epoch FROM now() - heartbeat_at) AS age FROM rivet_leases")
_OBSERVED = ("key = :key AND holder_pid = :o_pid AND holder_host = :o_host "
             "AND acquired_at = :o_acquired AND heartbeat_at = :o_heartbeat")


def _iso(t: datetime) -> str:
    return t.isoformat()


def pid_alive(pid: int) -> bool:
    """True when a process ``pid`` exists on this host (signal 0 probe)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _info(row: Any, here: str | None = None) -> LeaseInfo:
    holder = Holder(row.holder_pid, row.holder_host, row.holder_user, row.command, _iso(row.acquired_at),
                    _iso(row.heartbeat_at), row.ttl_seconds)
    age = float(row.age)
    dead_here = row.holder_host == (here or socket.gethostname()) and not pid_alive(row.holder_pid)
    stale = age > row.ttl_seconds or dead_here
    return LeaseInfo(row.key, "stale" if stale else "live", holder, age, max(0.0, row.ttl_seconds - age))


def _observed(row: Any) -> dict[str, object]:
    return {"key": row.key, "o_pid": row.holder_pid, "o_host": row.holder_host,
            "o_acquired": row.acquired_at, "o_heartbeat": row.heartbeat_at}


@dataclass
class RowLease:
    """A held row lease and its heartbeat thread."""

    key: str
    holder: Holder
    engine: sa.Engine
    acquired: datetime
    ttl: int
    lost: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._beat, name=f"lease-heartbeat {self.key}", daemon=True)
        self._thread.start()

    def _mine(self) -> dict[str, object]:
        return {"key": self.key, "pid": self.holder.pid, "host": self.holder.host, "acquired": self.acquired}

    def _beat(self) -> None:
        interval = max(self.ttl / 3, 0.2)
        while not self._stop.wait(interval):
            try:
                with self.engine.connect() as conn:
                    kept = conn.execute(sa.text(
                        "UPDATE rivet_leases SET heartbeat_at = now() WHERE key = :key AND holder_pid = :pid "
                        "AND holder_host = :host AND acquired_at = :acquired"), self._mine()).rowcount
            except sa.exc.DBAPIError as err:
                sys.stderr.write(f"statetool: lease {self.key}: heartbeat failed ({type(err.orig).__name__}); "
                                 "retrying\n")
                continue
            if not kept:
                self.lost = True
                sys.stderr.write(f"statetool: lease {self.key} was taken over by another holder "
                                 "(this holder stalled past its TTL)\n")
                return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self.engine.connect() as conn:
            conn.execute(sa.text("DELETE FROM rivet_leases WHERE key = :key AND holder_pid = :pid "
                                 "AND holder_host = :host AND acquired_at = :acquired"), self._mine())
        self.engine.dispose()

    def inheritable_fds(self) -> tuple[int, ...]:
        return ()


class RowLeases:
    """The lease store of a PostgreSQL state schema. ``engine`` runs in autocommit."""

    def __init__(self, engine: sa.Engine, ttl: int = DEFAULT_TTL) -> None:
        self.engine = engine
        self.ttl = ttl

    @contextlib.contextmanager
    def _connect(self) -> Iterator[Connection]:
        """A pooled autocommit connection; a missing lease table (a state below revision
        0002) is ``RIVET_STATE_MIGRATION_PENDING``, found by the query itself, not a probe."""
        try:
            with self.engine.connect() as conn:
                yield conn
        except sa.exc.ProgrammingError as err:
            if getattr(err.orig, "sqlstate", None) != "42P01":  # undefined_table
                raise
            raise StateError("RIVET_STATE_MIGRATION_PENDING",
                             "this state has no lease table (revision 0002); run statetool migrate") from None

    def try_acquire(self, key: str, holder: Holder) -> HeldLease | LeaseInfo:
        values = {"key": key, "pid": holder.pid, "host": holder.host, "user": holder.user, "cmd": holder.command,
                  "ttl": self.ttl}
        with self._connect() as conn:
            for _attempt in range(3):
                acquired = conn.execute(sa.text(
                    f"INSERT INTO rivet_leases ({_COLUMNS}) VALUES (:key, :pid, :host, :user, :cmd, now(), now(), :ttl) "
                    "ON CONFLICT (key) DO NOTHING RETURNING acquired_at"), values).scalar()
                if acquired is None:
                    row = conn.execute(sa.text(f"{_SELECT} WHERE key = :key"), {"key": key}).first()
                    if row is None:
                        continue  # released between the insert and the read: try again
                    info = _info(row)
                    if info.state == "live":
                        return info
                    acquired = conn.execute(sa.text(
                        "UPDATE rivet_leases SET holder_pid = :pid, holder_host = :host, holder_user = :user, "
                        "command = :cmd, acquired_at = now(), heartbeat_at = now(), ttl_seconds = :ttl "
                        f"WHERE {_OBSERVED} RETURNING acquired_at"), {**values, **_observed(row)}).scalar()
                    if acquired is None:
                        continue  # another taker won the row: look again
                lease = RowLease(key, Holder(holder.pid, holder.host, holder.user, holder.command, _iso(acquired),
                                             _iso(acquired), self.ttl), self.engine, acquired, self.ttl)
                lease.start()
                return lease
            row = conn.execute(sa.text(f"{_SELECT} WHERE key = :key"), {"key": key}).first()
            return _info(row) if row is not None else LeaseInfo(key, "free", None)

    def list(self) -> list[LeaseInfo]:
        try:
            with self._connect() as conn:
                rows = conn.execute(sa.text(f"{_SELECT} ORDER BY key")).all()
        except StateError:
            return []  # no lease table yet: no lease has ever been taken
        here = socket.gethostname()
        return [_info(row, here) for row in rows]

    def clear_stale(self, key: str) -> LeaseInfo:
        with self._connect() as conn:
            row = conn.execute(sa.text(f"{_SELECT} WHERE key = :key"), {"key": key}).first()
            if row is None:
                return LeaseInfo(key, "free", None)
            info = _info(row)
            if info.state == "live":
                assert info.holder is not None
                raise StateError("RIVET_STATE_RUN_IN_PROGRESS",
                                 f"lease {key} is held by a live process: {info.holder.describe()}", {"key": key})
            if not conn.execute(sa.text(f"DELETE FROM rivet_leases WHERE {_OBSERVED}"), _observed(row)).rowcount:
                raise StateError("RIVET_STATE_RUN_IN_PROGRESS",
                                 f"lease {key} was taken over while it was being released; look again")
            return info
