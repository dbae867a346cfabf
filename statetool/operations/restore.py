"""``statetool restore NAME|PATH``: put a copy of the state back (issue 14 item 3; SPEC §9).

The copy (a backup or keep beside the state, by its file name, or any SQLite state file
by its path) is verified first: ``integrity_check``, a revision this release knows, its
identity and lineage. It is refused when it belongs to another source
(``RIVET_STATE_FOREIGN``), to another lineage (``RIVET_STATE_FOREIGN``: a copy of another
state), or holds older progress than the live state, a lower serial
(``RIVET_STATE_COPY_OLDER``, unless ``allow_older``; the audit row then names both serials).
Every refusal comes before any lease or file.

Over a live state, the restore is a write of the whole state: it holds every run lease and
the write lock, and builds the restored state in a copy of the copy beside the live one
(the migration's machinery, :meth:`~statetool.backends.base.Backend.restoration`), whose
serial is advanced past the live state's and which gets the audit row; after the commit
the live state is kept whole as the backup labelled ``restore`` and the built copy is
renamed over it. A kill at any instant leaves one complete state: the live one until the
rename, the restored one after it; a re-run converges. Where no state is, the copy is
linked into place through the atomic create (``restore --if-absent`` at a container's boot:
an empty volume is never silently a first run). Restores SQLite states; a PostgreSQL state
keeps no copy of ours (``RIVET_STATE_BACKEND_UNSUPPORTED``: ``statetool import``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

from statetool.errors import StateError
from statetool.operations.backups import Copy, diverged, read_copy, unknown_copy
from statetool.operations.context import Context
from statetool.operations.probe import Snapshot, lineage, recorded_key, write_id_of

#: What a restore's backup of the replaced state, and the file that takes its place, are named for.
_REPLACED_BY = "a restore"
#: The files a restore over a live state makes as large as the state: the copy it builds
#: (the replaced state is kept by a link, not copied).
_COPIES = 1
_PENDING = frozenset({"RIVET_STATE_MIGRATION_PENDING"})

#: The steps a restore over a live state announces to :attr:`Context.on_step`, in the order
#: it passes them (tests/test_restore_crashes.py kills it at each): every lease and the write
#: lock held, the copy copied beside the state, the built copy verified (serial advanced,
#: audit row written), the built copy committed and fsynced, the live state's transaction
#: closed, the live state kept as the backup, the built copy renamed into place.
CRASH_POINTS = ("locked", "copied", "verified", "built", "closed", "kept", "swapped")
#: The steps a restore where no state is announces (the atomic create's,
#: :meth:`~statetool.backends.base.Backend.create`): the copy copied into the create's
#: private directory, the new state committed, closed and fsynced, linked into place.
CREATE_POINTS = ("copied", "built", "linked")


class RestoreResult(NamedTuple):
    """What ``restore`` did (or, in a dry run, would do). ``action`` is ``restored`` (over a
    live state), ``created`` (where none was) or ``none`` (``--if-absent`` with a state
    there); ``before``/``after`` are ``{state_key, lineage, serial, revision}`` of the live
    state and of the state restored (``before`` None where none was); ``backup`` the file
    the replaced state is kept as; ``plan`` the dry run's ``{changes, backup, leases, audit,
    warnings}``."""

    action: str
    location: dict[str, object]
    copy: dict[str, object] | None
    before: dict[str, object] | None
    after: dict[str, object] | None
    backup: str | None
    dry_run: bool
    message: str
    plan: dict[str, object] | None = None

    def as_dict(self) -> dict[str, object]:
        """``{action, location, copy, before, after, backup, dry_run, message, plan}``."""
        return {"action": self.action, "location": self.location, "copy": self.copy, "before": self.before,
                "after": self.after, "backup": self.backup, "dry_run": self.dry_run, "message": self.message,
                "plan": self.plan}


def _facts(key: str | None, line: str | None, serial: int | None, revision: str | None) -> dict[str, object]:
    return {"state_key": key, "lineage": line, "serial": serial, "revision": revision}


def find_copy(ctx: Context, what: str) -> Path:
    """The copy ``what`` names: the file name of a copy beside the state
    (:meth:`~statetool.backends.base.Backend.copies`), else the path of a file. Raises
    ``RIVET_STATE_BACKUP_UNKNOWN`` for neither, and for the live state's own file."""
    backend = ctx.backend()
    beside = {path.name: path for path in backend.copies()}
    if what in beside:
        return beside[what]
    path = Path(os.path.abspath(what))
    if not os.path.isfile(path):
        raise unknown_copy(ctx, what)
    live = ctx.location.real_path or ctx.location.path
    if live is not None and os.path.exists(live) and os.path.samefile(path, live):
        raise StateError("RIVET_STATE_BACKUP_UNKNOWN", f"{what} is the live state itself, not a copy of it",
                         {"name": what})
    return path


def _verified(ctx: Context, path: Path) -> Copy:
    """The copy at ``path`` through ``integrity_check``; raises its problem's code
    (``RIVET_STATE_CORRUPT``, ``RIVET_STATE_SCHEMA_NEWER``, ``RIVET_STATE_UNSAFE_FILE``, ...)."""
    assert ctx.location.path is not None
    copy = read_copy(path, state_name=ctx.location.path.name, full=True, lock_wait=ctx.lock_wait)
    if copy.problem is not None:
        raise StateError(copy.code or "RIVET_STATE_VERIFY_FAILED",
                         f"the copy {path} cannot be restored: {copy.problem}; nothing was changed", {"path": str(path)})
    return copy


def judge(copy: Copy, key: str | None, line: str | None, serial: int | None, *, allow_older: bool,
          write_id: str | None = None) -> None:
    """Refuse restoring ``copy`` over a state of identity ``key``, lineage ``line``, serial
    ``serial`` and ``write_id`` (all None where no state is, ``key`` then the config's
    computed key): ``RIVET_STATE_FOREIGN`` for another source or another lineage;
    ``RIVET_STATE_COPY_OLDER`` for a lower serial (or a copy from before lineages, over a
    state that has one) and ``RIVET_STATE_COPY_DIVERGED`` for the same serial by another
    write, both unless ``allow_older`` (SPEC §9)."""
    if copy.state_key and key and copy.state_key != key:
        raise StateError("RIVET_STATE_FOREIGN", f"the copy {copy.path} belongs to {copy.state_key}, the state here to "
                         f"{key}: a restore never puts another source's progress in place; nothing was changed",
                         {"copy": str(copy.path), "recorded": key, "found": copy.state_key})
    if copy.lineage and line and copy.lineage != line:
        raise StateError("RIVET_STATE_FOREIGN", f"the copy {copy.path} is of lineage {copy.lineage}, the state here of "
                         f"{line}: a copy of another state (made by another init, or before a downgrade); nothing "
                         "was changed", {"copy": str(copy.path), "recorded": line, "found": copy.lineage})
    if serial is None or allow_older:
        return
    if diverged(copy, serial, write_id):
        raise StateError("RIVET_STATE_COPY_DIVERGED", f"the copy {copy.path} and the live state are both at serial "
                         f"{serial} of lineage {line}, written by two different writes: they went apart from one "
                         "earlier state (a rollback written over, one copy restored twice), and either may hold "
                         "progress the other lacks; nothing was changed",
                         {"copy": str(copy.path), "serial": serial})
    if copy.serial is None or copy.serial < serial:
        held = "no serial (it predates lineages)" if copy.serial is None else f"serial {copy.serial}"
        raise StateError("RIVET_STATE_COPY_OLDER", f"the copy {copy.path} holds {held}, older than the live state's "
                         f"serial {serial}: restoring it takes every export back to older progress; nothing was changed",
                         {"copy": str(copy.path), "copy_serial": copy.serial, "live_serial": serial})


def restore(ctx: Context, what: str, *, allow_older: bool = False, if_absent: bool = False,
            dry_run: bool = False) -> RestoreResult:
    """Restore the copy ``what`` (see the module docstring). With ``if_absent`` nothing is
    done where anything is at the state's place (exit 0). ``dry_run`` returns the plan and
    writes nothing.

    Raises ``RIVET_STATE_BACKEND_UNSUPPORTED`` (PostgreSQL), ``RIVET_STATE_BACKUP_UNKNOWN``,
    the copy's problem (``RIVET_STATE_CORRUPT``, ``RIVET_STATE_SCHEMA_NEWER``, ...),
    ``RIVET_STATE_FOREIGN``, ``RIVET_STATE_COPY_OLDER``, ``RIVET_STATE_DIR_MISSING``, and the
    codes of a guarded write or of the atomic create."""
    backend = ctx.backend()
    if not backend.keeps_copies:
        raise StateError("RIVET_STATE_BACKEND_UNSUPPORTED", f"{ctx.location.display} is a PostgreSQL state, whose "
                         "copies are the server's (pg_dump): put an export back with statetool import FILE instead")
    problem = ctx.location.directory_problem()
    if problem is not None:
        raise problem
    if if_absent and backend.present():
        return RestoreResult("none", ctx.location.as_dict(), None, None, None, None, dry_run,
                             f"a state is already at {ctx.location.display}: nothing to do")
    copy = _verified(ctx, find_copy(ctx, what))
    if backend.present():
        if if_absent:  # another task restored it while this one verified the copy: never restored over
            return RestoreResult("none", ctx.location.as_dict(), copy.as_dict(), None, None, None, dry_run,
                                 f"a state appeared at {ctx.location.display} meanwhile: nothing to do")
        return _over_live(ctx, copy, allow_older, dry_run)
    return _where_none(ctx, copy, if_absent, dry_run)


def _after(copy: Copy, serial: int | None) -> dict[str, object]:
    return _facts(copy.state_key, copy.lineage, serial, copy.revision)


def _detail(copy: Copy, before: dict[str, object] | None, allow_older: bool) -> dict[str, Any]:
    return {"copy": str(copy.path), "copy_serial": copy.serial, "lineage": copy.lineage,
            "live_serial": before["serial"] if before else None, "allow_older": allow_older}


def _where_none(ctx: Context, copy: Copy, if_absent: bool, dry_run: bool) -> RestoreResult:
    from statetool.operations.writes import create_from_copy, require_writable

    judge(copy, ctx.computed_key or None, None, None, allow_older=False)
    planned = None if copy.serial is None else copy.serial + 1
    if dry_run:
        plan = {"changes": [{"what": "state", "before": None, "after": f"{copy.name} (serial {planned})"}],
                "backup": None, "leases": [], "audit": ["restore"],
                "warnings": [w.as_dict() for w in require_writable(ctx, dry_run=True)]}
        return RestoreResult("created", ctx.location.as_dict(), copy.as_dict(), None, _after(copy, planned), None, True,
                             f"would restore {copy.path} at {ctx.location.display}, where no state is", plan)
    try:
        serial = create_from_copy(ctx, copy.path, _detail(copy, None, False))
    except StateError as err:
        if if_absent and err.code == "RIVET_STATE_TARGET_NOT_EMPTY":  # another task restored it meanwhile
            return RestoreResult("none", ctx.location.as_dict(), copy.as_dict(), None, None, None, False,
                                 f"a state appeared at {ctx.location.display} meanwhile: nothing to do")
        raise
    return RestoreResult("created", ctx.location.as_dict(), copy.as_dict(), None, _after(copy, serial), None, False,
                         f"restored {copy.path} at {ctx.location.display}, where no state was")


def _over_live(ctx: Context, copy: Copy, allow_older: bool, dry_run: bool) -> RestoreResult:
    from statetool.operations.preflight import run_preflight
    from statetool.operations.writes import WHOLE_STATE, plan_write

    pf = run_preflight(ctx, for_write=True)

    def check(snap: Snapshot) -> None:
        judge(copy, snap.recorded_key or ctx.computed_key or None, snap.lineage, snap.serial, allow_older=allow_older,
              write_id=snap.write_id)

    plan = plan_write(ctx, WHOLE_STATE, "restore", claim=False, allow=_PENDING, check=check, preflight=pf,
                      copies=_COPIES, replaced_by=_REPLACED_BY, dry_run=dry_run)
    snap = plan.snapshot
    before = _facts(snap.recorded_key, snap.lineage, snap.serial, snap.revision or "legacy")
    planned = None if copy.lineage is None else max(copy.serial or 0, snap.serial or 0) + 1
    if dry_run:
        plan.backup = ctx.backend().planned_backup("restore")
        for field in ("state_key", "lineage", "serial", "revision"):
            plan.change(field, before[field], _after(copy, planned)[field])
        return RestoreResult("restored", ctx.location.as_dict(), copy.as_dict(), before, _after(copy, planned),
                             plan.backup, True, f"would restore {copy.path} over the state at {ctx.location.display}",
                             plan.as_dict())
    backup, serial = _replace(ctx, copy, pf, check, before, allow_older)
    return RestoreResult("restored", ctx.location.as_dict(), copy.as_dict(), before, _after(copy, serial), backup,
                         False, f"restored {copy.path} over the state at {ctx.location.display}; the state it "
                         f"replaced is kept as {backup}")


def _replace(ctx: Context, copy: Copy, pf: Any, check: Any, before: dict[str, object],
             allow_older: bool) -> tuple[str, int | None]:
    """The restore over a live state, as one guarded write of the whole state; returns the
    backup the replaced state is kept as and the restored state's serial."""
    from statetool.operations.writes import WHOLE_STATE, guarded_write
    from statetool.tables import AUDIT, IDENTITY, LINEAGE

    backend = ctx.backend()
    with guarded_write(ctx, WHOLE_STATE, preflight=pf, allow=_PENDING, check=check, claim=False, advance=False,
                       at_head=False, copies=_COPIES, replaced_by=_REPLACED_BY,
                       prepare=backend.hold_off_writers) as session:
        backend.require_frozen()
        ctx.on_step("locked")
        reader = session.reader
        tables = frozenset(backend.table_names(reader))
        line, serial = lineage(reader, tables)
        recorded = recorded_key(reader) if IDENTITY in tables else None  # a legacy state records none
        judge(copy, recorded or ctx.computed_key or None, line, serial, allow_older=allow_older,
              write_id=write_id_of(reader, tables))
        with ctx.progress("copying") as update:
            restoration = backend.restoration(session.conn, copy.path, update, ctx.on_step)
        session.on_abort(restoration.discard)
        session.after_commit(restoration.switch)
        with restoration.connection() as new:
            new_reader = backend.reader(new)
            new_tables = set(backend.table_names(new_reader))
            if LINEAGE in new_tables:
                session.advance(into=new, past=serial or 0)
            if AUDIT in new_tables:
                session.audit("restore", {**_detail(copy, before, allow_older), "backup": str(restoration.backup)},
                              into=new)
            problems = backend.integrity_problems(new_reader)
            if problems:
                raise StateError("RIVET_STATE_VERIFY_FAILED", f"the restored copy did not verify ({problems[:3]}); "
                                 "nothing was changed")
            ctx.on_step("verified")
    return str(restoration.backup), session.lineage[1] if session.lineage else None
