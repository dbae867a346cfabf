"""``statetool init``: a new empty state at head, stamped with its identity (SPEC §8)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.engine import Connection

from statetool import migrations
from statetool.errors import StateError
from statetool.backends.base import Backend
from statetool.operations.context import Context
from statetool.operations.probe import read_snapshot
from statetool.operations.writes import create_state


@dataclass
class InitResult:
    """Where the new state is, its revision and the identity it was stamped with (or None)."""

    location: dict[str, object]
    revision: str
    state_key: str | None

    def as_dict(self) -> dict[str, object]:
        """``{"location", "revision", "state_key"}``."""
        return {"location": self.location, "revision": self.revision, "state_key": self.state_key}


def init(ctx: Context) -> InitResult:
    """Create a new state at the resolved location.

    Refuses ``RIVET_STATE_RELOCATED`` at the old place of a state a move retired (a
    tombstone, a PostgreSQL schema marked by a transfer: never a new state over it, SPEC §9),
    ``RIVET_STATE_TARGET_NOT_EMPTY`` when a state or any file is already there,
    ``RIVET_STATE_DIR_MISSING`` when a declared directory does not exist (it is never
    created: a missing mount would hide the real state). SQLite: built in a temporary
    file and linked into place only when complete.
    """
    location = ctx.location
    key = ctx.computed_key
    problem = location.directory_problem()
    if problem is not None:
        raise problem
    backend = ctx.backend()
    if backend.present():
        _refuse_moved_away(backend)
        raise StateError("RIVET_STATE_TARGET_NOT_EMPTY",
                         f"something is already at {location.display}; init never overwrites "
                         "(statetool info shows what it is)")

    def build(conn: Connection) -> None:
        migrations.apply(conn, migrations.head(), backend.schema, "up")

    create_state(ctx, build, key)
    return InitResult(location.as_dict(), migrations.head(), key or None)


def _refuse_moved_away(backend: Backend) -> None:
    """Raise ``RIVET_STATE_RELOCATED`` when what is at ``backend``'s location is the retired
    old place of a state (the read every open does says so); anything else there is left to
    the caller's ``RIVET_STATE_TARGET_NOT_EMPTY``."""
    try:
        with backend.reading() as conn:
            read_snapshot(backend, conn, integrity=False, progress=False)
    except StateError as err:
        if err.code == "RIVET_STATE_RELOCATED":
            raise
