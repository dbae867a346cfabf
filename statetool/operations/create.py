"""``statetool init``: a new empty state at head, stamped with its identity (SPEC §8)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.engine import Connection

from statetool import migrations
from statetool.errors import StateError
from statetool.operations.context import Context
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

    Refuses ``RIVET_STATE_TARGET_NOT_EMPTY`` when a state or any file is already there,
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
        raise StateError("RIVET_STATE_TARGET_NOT_EMPTY",
                         f"something is already at {location.display}; init never overwrites "
                         "(statetool info shows what it is)")

    def build(conn: Connection) -> None:
        migrations.apply(conn, migrations.head(), backend.schema, "up")

    create_state(ctx, build, key)
    return InitResult(location.as_dict(), migrations.head(), key or None)
