"""The names a command line takes, for shell completion (issue 16 item 4): export names
and lease keys, from the config and the state, read-only.

Best effort on purpose: completion runs at every TAB, so a config or a state that cannot
be read (missing, locked, foreign, unreachable, damaged, moved away) gives no names,
silently, where a command would print an error on the operator's terminal. Each source
fails alone: a state that cannot be read still leaves the config's exports to complete.
Nothing is written or created: the state is read through the backend's read-only open
(:meth:`~statetool.backends.base.Backend.reading`) and the leases through
:func:`~statetool.operations.leases.show_leases`, which takes no lock and creates no file.
"""

from __future__ import annotations

from statetool.errors import StateError
from statetool.operations.context import Context
from statetool.operations.leases import show_leases
from statetool.operations.probe import export_names as state_export_names
from statetool.operations.probe import read_snapshot

#: What a source that cannot be read raises: a registered fault, or a fault of the
#: filesystem that no layer named (a permission, a directory where the file was).
UNREADABLE = (StateError, OSError)
#: The help of an export only the state knows (zsh and fish show it beside the name).
STATE_ONLY = "in the state only"


def export_names(ctx: Context) -> list[tuple[str, str]]:
    """``[(name, help)]``: the config's exports in its order (help: the mode), then those
    only the state knows, sorted (help: :data:`STATE_ONLY`). A config or state that cannot
    be read adds none; never raises :data:`UNREADABLE`."""
    found: dict[str, str] = {}
    try:
        for export in ctx.config.exports:
            found.setdefault(export.name, export.mode)
    except UNREADABLE:
        pass
    for name in sorted(_state_exports(ctx) - set(found)):
        found[name] = STATE_ONLY
    return list(found.items())


def _state_exports(ctx: Context) -> set[str]:
    """Every export name the state knows (exports, runs, chunks), or none when it cannot
    be read or is of a revision this release does not know."""
    try:
        backend = ctx.backend()
        with backend.reading() as conn:
            snap = read_snapshot(backend, conn, integrity=False, progress=False)
            return state_export_names(conn) if snap.known else set()
    except UNREADABLE:
        return set()


def lease_keys(ctx: Context) -> list[tuple[str, str]]:
    """``[(key, help)]`` for every lease the state lists, as ``statetool leases`` lists
    them; the help is the lease's state and its holder (``stale: pid 4242 on web-1``).
    None when the leases cannot be read; never raises :data:`UNREADABLE`."""
    try:
        leases = show_leases(ctx).leases
    except UNREADABLE:
        return []
    return [(str(lease["key"]), _holder_help(lease)) for lease in leases]


def _holder_help(lease: dict[str, object]) -> str:
    """``live: pid 4242 on web-1``, or the bare state (``free``) when no holder is recorded."""
    if lease["holder_pid"] is None:
        return str(lease["state"])
    return f"{lease['state']}: pid {lease['holder_pid']} on {lease['host']}"
