"""Storage backends: everything that differs between SQLite and PostgreSQL state."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from statetool.location import Location

if TYPE_CHECKING:
    from statetool.backends.base import Backend, FileMoves, LeaseStore, Retirement, TransferSource
    from statetool.backends.sqlite_file import Orphans


def open_backend(location: Location, lock_wait: float = 600.0) -> Backend:
    """The backend for a resolved location (nothing is opened until a method is called).

    ``lock_wait`` (seconds) bounds every wait for a database lock.
    """
    if location.backend == "sqlite":
        from statetool.backends.sqlite import SqliteBackend

        return SqliteBackend(location, lock_wait)
    from statetool.backends.postgres import PostgresBackend

    return PostgresBackend(location, lock_wait)


def open_leases(location: Location, lock_wait: float = 600.0, ttl: int = 30) -> LeaseStore:
    """The lease store of a resolved location, loading only what that store needs (a SQLite
    lease is an flock: no database driver is imported for it). ``ttl`` (seconds) is the
    TTL of the PostgreSQL leases this store takes."""
    if location.backend == "sqlite":
        from statetool.backends.sqlite_leases import FlockLeases

        assert location.path is not None
        return FlockLeases(location.real_path or location.path)
    from statetool.backends.postgres import PostgresBackend

    return PostgresBackend(location, lock_wait).leases(ttl)


def orphan_companions(location: Location) -> Orphans | None:
    """The companion files beside the state at ``location`` that it did not leave
    (:func:`statetool.backends.sqlite_file.orphan_companions`); None when there are none,
    and always for PostgreSQL, whose state has no files of its own."""
    if location.backend != "sqlite":
        return None
    from statetool.backends.sqlite_file import orphan_companions as beside_file

    assert location.path is not None
    return beside_file(location.path)


def tombstone_at(location: Location) -> dict[str, Any] | None:
    """Where the state that was at ``location`` went: what the tombstone a move left
    there says (``to``, ``state_url``, ``at``, ``by``, ``kept_as``, ...), read without
    opening a database; None when no tombstone is there, and always for PostgreSQL, whose
    state is never retired in place."""
    if location.backend != "sqlite":
        return None
    from statetool.backends.tombstone import read_tombstone

    assert location.path is not None
    return read_tombstone(location.path)


def file_move(backend: Backend) -> FileMoves:
    """The steps that move the state file of ``backend`` into another directory and retire
    it with a tombstone (statetool/backends/moves.py). Only for a backend whose
    ``relocatable`` is True (so also a transfer's source, whose ``sends_transfer`` is): the
    caller refuses the others with its own message (``RIVET_STATE_BACKEND_UNSUPPORTED``)."""
    from statetool.backends.sqlite import SqliteBackend
    from statetool.backends.moves import FileMove

    assert backend.relocatable and isinstance(backend, SqliteBackend)
    return FileMove(backend)


def retirement(backend: TransferSource) -> Retirement:
    """How the state of ``backend``, a transfer's source (``sends_transfer``), is retired at
    its old place: a state file (``relocatable``) by relocate's tombstone
    (statetool/backends/moves.py), a PostgreSQL schema by the marker in its version table
    (statetool/backends/postgres.py)."""
    if backend.relocatable:
        from statetool.backends.moves import FileRetirement
        from statetool.backends.sqlite import SqliteBackend

        assert isinstance(backend, SqliteBackend)
        return FileRetirement(backend)
    from statetool.backends.postgres import PostgresBackend, SchemaRetirement

    assert isinstance(backend, PostgresBackend)
    return SchemaRetirement(backend)
