"""Storage backends: everything that differs between SQLite and PostgreSQL state."""

from __future__ import annotations

from statetool.backends.base import Backend
from statetool.location import Location


def open_backend(location: Location, lock_wait: float = 600.0) -> Backend:
    """The backend for a resolved location (nothing is opened until a method is called).

    ``lock_wait`` (seconds) bounds every wait for a database lock.
    """
    if location.backend == "sqlite":
        from statetool.backends.sqlite import SqliteBackend

        return SqliteBackend(location, lock_wait)
    from statetool.backends.postgres import PostgresBackend

    return PostgresBackend(location, lock_wait)
