"""The state search of ``statetool doctor``: where a state that is missing here probably is.

Read-only. Looked at, in this order: the state beside the config, the place a relocation
at this location moved the state to (its tombstone), the well-known declared directories
(:data:`WELL_KNOWN_DIRS`), and states of the same identity under the config's directory
(at most :data:`SEARCH_DEPTH` levels, :data:`SEARCH_MAX_DIRS` directories). Every place
is a resolved :class:`~statetool.location.Location` and every state is opened through
:func:`statetool.backends.open_backend`: the read-only open of the backend.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from statetool.backends import open_backend, tombstone_at
from statetool.errors import StateError
from statetool.location import STATE_FILE, Location, resolve_location
from statetool.operations.context import Context
from statetool.operations.probe import activity, read_snapshot

#: Declared directories people commonly use; searched when the state is missing.
WELL_KNOWN_DIRS = ("/var/lib/rivet", "/var/lib/rivet/state", "/srv/rivet", "/srv/rivet/state", "/data/rivet",
                   "/data/rivet/state", "/mnt/rivet", "/opt/rivet/state")
#: How deep and how wide the search under the config's directory goes.
SEARCH_DEPTH, SEARCH_MAX_DIRS = 4, 2000
_SKIP_DIRS = {".git", "node_modules", ".venv", "venv", "__pycache__", ".tox", ".mypy_cache"}
#: Seconds a candidate's read waits for a database lock.
_LOCK_WAIT = 5.0


def _declared(directory: Path) -> Location:
    """The location ``sqlite:<directory>`` names (the resolver's)."""
    return resolve_location(None, f"sqlite:{directory}", directory)


def _candidate(location: Location) -> dict[str, Any] | None:
    """What a possible state file at ``location`` is, read-only: ``{path, kind: "state",
    identity, revision, last_run_finished_at, exports_with_cursor, state_url}``, or for a
    tombstone ``{path, kind: "relocated", moved_to, state_url, ...}`` with what the state
    it names holds; None when it is not a state."""
    assert location.path is not None
    path = location.path
    tomb = tombstone_at(location)
    if tomb is not None:
        found = {"path": str(path), "kind": "relocated", "moved_to": tomb.get("to"), "state_url": tomb.get("state_url")}
        target = tomb.get("to")
        if isinstance(target, str) and os.path.isabs(target):
            moved = _declared(Path(target).parent)
            named = moved.path == Path(target)  # the state file of a declared directory, as a move names it
            if not (named and tombstone_at(moved) is not None):  # a tombstone there: a chain is not followed
                state = _candidate(moved) if named and os.path.isfile(target) else None
                # What the state it names holds (identity, last run, progress), when it is a readable file.
                for key in ("identity", "revision", "last_run_finished_at", "exports_with_cursor"):
                    found[key] = state.get(key) if state else None
        return found
    try:
        backend = open_backend(location, _LOCK_WAIT)
        with backend.reading() as conn:
            snap = read_snapshot(backend, conn, integrity=False, progress=False)
            last, cursors = activity(conn)
    except StateError:  # the reader's errors are registered errors too
        return None
    return {"path": str(path), "kind": "state", "identity": snap.recorded_key, "revision": snap.revision or "legacy",
            "last_run_finished_at": last, "exports_with_cursor": cursors, "state_url": location.state_url}


def search(ctx: Context, key: str) -> list[dict[str, Any]]:
    """Where the state probably is (see the module docstring), each place once and never
    the resolved location itself: a list of :func:`_candidate` documents. Under the
    config's directory only states whose identity is ``key`` (or records none) count.
    Raises nothing of its own: a place that cannot be read is no candidate."""
    seen: set[str] = set()
    found: list[dict[str, Any]] = []
    beside = resolve_location(None, None, ctx.config.path)

    def consider(location: Location, same_identity_only: bool) -> None:
        path = location.path
        assert path is not None
        real = os.path.realpath(path)
        if real in seen or real == os.path.realpath(ctx.location.path or "") or not os.path.isfile(path):
            return
        seen.add(real)
        candidate = _candidate(beside if path == beside.path else location)
        if candidate is None:
            return
        if same_identity_only and candidate["kind"] == "state" and key and candidate["identity"] != key:
            return
        found.append(candidate)

    consider(beside, same_identity_only=False)
    here = tombstone_at(ctx.location)
    if here is not None and isinstance(here.get("to"), str) and os.path.isabs(here["to"]):
        moved = _declared(Path(here["to"]).parent)
        if moved.path == Path(here["to"]):
            consider(moved, same_identity_only=False)  # where the state at this place was moved
    for directory in WELL_KNOWN_DIRS:
        consider(_declared(Path(directory)), same_identity_only=False)
    root = ctx.config.directory
    visited = 0
    for current, dirs, files in os.walk(root):
        depth = len(Path(current).relative_to(root).parts)
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and depth < SEARCH_DEPTH]
        visited += 1
        if STATE_FILE in files:
            consider(_declared(Path(current)), same_identity_only=True)
        if visited >= SEARCH_MAX_DIRS:
            break
    return found
