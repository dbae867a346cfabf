"""The one interface every backend implements (ARCHITECTURE: storage).

Code above the backends never asks which backend it has: it calls these methods and
uses SQLAlchemy Core on the connections they yield.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from dataclasses import dataclass
from typing import Protocol

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from statetool.location import Location

#: progress(done, total) in backend-defined units (pages for a SQLite backup).
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a lease: pid, host, user, command, and times (ISO-8601 UTC).

    ``heartbeat_at`` and ``ttl_seconds`` exist on PostgreSQL only.
    """

    pid: int
    host: str
    user: str
    command: str
    acquired_at: str
    heartbeat_at: str | None = None
    ttl_seconds: int | None = None

    def describe(self) -> str:
        """``pid 123 on host as user since T: command`` for messages."""
        return f"pid {self.pid} on {self.host} as {self.user} since {self.acquired_at}: {self.command}"


@dataclass(frozen=True)
class LeaseInfo:
    """One lease as seen without taking it: ``state`` is ``live``, ``stale`` or ``free``.

    ``heartbeat_age`` and ``ttl_left`` are seconds by the database clock (PostgreSQL).
    """

    key: str
    state: str
    holder: Holder | None
    heartbeat_age: float | None = None
    ttl_left: float | None = None


class HeldLease(Protocol):
    """A lease this process holds until :meth:`release`."""

    key: str
    holder: Holder

    def release(self) -> None:
        """Give the lease up (idempotent)."""

    def inheritable_fds(self) -> tuple[int, ...]:
        """File descriptors a child process must inherit to keep holding the lease
        after this process dies (SQLite flock); empty on PostgreSQL."""


class LeaseStore(Protocol):
    """The leases of one state (SPEC §5)."""

    def try_acquire(self, key: str, holder: Holder) -> HeldLease | LeaseInfo:
        """Take ``key`` now if it is free or stale (a stale holder is taken over), else
        return the live holder's :class:`LeaseInfo`. Never waits."""

    def list(self) -> list[LeaseInfo]:
        """Every lease with its state, read without taking any lock."""

    def clear_stale(self, key: str) -> LeaseInfo:
        """Remove the record of a stale lease; returns what was removed. Raises
        ``RIVET_STATE_RUN_IN_PROGRESS`` when the holder is live."""


class Backend(Protocol):
    """A state store at one :class:`~statetool.location.Location`."""

    location: Location
    #: SQLAlchemy dialect name: ``"sqlite"`` or ``"postgresql"``.
    dialect_name: str
    #: The PostgreSQL schema of the state, None for SQLite.
    schema: str | None

    def present(self) -> bool:
        """True when anything is at the location: the file exists (SQLite), or the schema
        holds any table (PostgreSQL). Creates nothing. Raises ``RIVET_STATE_UNREACHABLE``.
        """

    def reading(self) -> AbstractContextManager[Connection]:
        """A read-only connection that creates no file and changes no byte of the state.

        Raises ``RIVET_STATE_MISSING`` (nothing there), ``RIVET_STATE_NOT_A_STATE`` (not a
        SQLite file), ``RIVET_STATE_CORRUPT`` (truncated), ``RIVET_STATE_INTERRUPTED_WRITE``
        (hot journal of a killed writer), ``RIVET_STATE_UNREACHABLE`` /
        ``RIVET_STATE_AUTH_FAILED`` (server).
        """

    def table_names(self, conn: Connection) -> set[str]:
        """The tables of the state (PostgreSQL: of its schema only)."""

    def integrity_problems(self, conn: Connection) -> list[str]:
        """Problems ``quick_check`` finds (SQLite); always empty for PostgreSQL."""

    def writing(self, lock_code: str) -> AbstractContextManager[Connection]:
        """One writing transaction, exclusive among statetool writers, committed on a clean exit.

        Waits up to ``lock_wait`` seconds for the write lock, then raises ``lock_code``.
        """

    def create(self, build: Callable[[Connection], None]) -> None:
        """Create a new state atomically: ``build`` runs in one transaction; on SQLite on a
        temporary file renamed into place only when complete. Refuses nothing itself."""

    def backup(self, conn: Connection, label: str, progress: Progress | None = None) -> Path | None:
        """A verified copy of the state beside it (SQLite), named with ``label``; None on
        PostgreSQL, whose migrations run in one transaction instead."""

    def leases(self) -> LeaseStore:
        """The lease store of this state (flock sidecars, or the PostgreSQL lease table)."""
