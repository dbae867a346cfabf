"""The copies of a state beside it: ``statetool backups list | verify | prune`` (issue 14
item 2), and what ``check``, ``doctor`` and ``restore`` learn from them (SPEC §9).

A copy is a SQLite state file that statetool made beside the live state's real file: the
verified backup a write takes before its change (``.rivet_state.db.backup-<label>-<UTC
time>``) and the keep a relocation or transfer leaves (``.rivet_state.db.relocated-<UTC
time>``). Each carries the identity, lineage and serial of the state it copied. Every copy
is read through the backend's one read-only open (:func:`statetool.location.file_location`),
which changes no byte of it; a symlink or other non-regular file at a copy's name is
listed as found and never followed (SPEC §8a). PostgreSQL keeps no copy of ours
(:attr:`~statetool.backends.base.Backend.keeps_copies`): its lists are empty.
"""

from __future__ import annotations

import calendar
import errno
import os
import re
import stat
import time
from pathlib import Path
from typing import NamedTuple

from statetool.backends import open_backend
from statetool.errors import StateError, StateWarning
from statetool.location import file_location
from statetool.numbers import MAX_DAYS, MAX_KEEP, require_within
from statetool.operations.context import Context
from statetool.operations.probe import Snapshot, read_snapshot

#: ``<label>-<YYYYmmddTHHMMSSZ>`` after ``.backup-``, or the time alone after ``.relocated-``.
_STAMP = re.compile(r"^(?:(?P<label>.*)-)?(?P<stamp>\d{8}T\d{6}Z)$")


class Copy(NamedTuple):
    """One copy beside the state, as read: ``kind`` is ``backup`` or ``keep``; ``label`` what
    the write that took it was (``set-cursor-orders``, ``migrate``, ``restore``; None for a
    keep); ``taken_at`` its UTC time from its name (ISO-8601, None when the name has none);
    ``size`` in bytes; ``revision``, ``state_key``, ``lineage``, ``serial`` as the copy holds
    them (None where unread or absent); ``problem`` why it is unusable (None when it read
    well) with its registered ``code``; ``checked`` says whether ``integrity_check`` ran."""

    name: str
    path: Path
    kind: str
    label: str | None
    taken_at: str | None
    size: int | None
    revision: str | None = None
    state_key: str | None = None
    lineage: str | None = None
    serial: int | None = None
    problem: str | None = None
    code: str | None = None
    checked: bool = False
    #: The id of the write that gave the copy its serial (None before revision 0005).
    write_id: str | None = None

    @property
    def usable(self) -> bool:
        """True when the copy read as a state this release knows."""
        return self.problem is None

    def as_dict(self) -> dict[str, object]:
        """``{name, path, kind, label, taken_at, size, revision, state_key, lineage, serial,
        problem, code, checked, write_id}``."""
        return {"name": self.name, "path": str(self.path), "kind": self.kind, "label": self.label,
                "taken_at": self.taken_at, "size": self.size, "revision": self.revision, "state_key": self.state_key,
                "lineage": self.lineage, "serial": self.serial, "problem": self.problem, "code": self.code,
                "checked": self.checked, "write_id": self.write_id}


def _named(path: Path, state_name: str) -> tuple[str, str | None, str | None]:
    """``(kind, label, taken_at)`` from a copy's file name."""
    rest = path.name[len(state_name):]
    kind, rest = ("keep", rest[len(".relocated-"):]) if rest.startswith(".relocated-") else \
        ("backup", rest[len(".backup-"):])
    found = _STAMP.match(rest)
    if found is None:
        return kind, rest or None, None
    stamp = found["stamp"]
    taken = f"{stamp[0:4]}-{stamp[4:6]}-{stamp[6:8]}T{stamp[9:11]}:{stamp[11:13]}:{stamp[13:15]}Z"
    return kind, found["label"], taken


def read_copy(path: Path, *, state_name: str = ".rivet_state.db", full: bool = False, lock_wait: float = 30.0) -> Copy:
    """The copy at ``path``, read read-only (``integrity_check`` first with ``full``): its
    revision, identity, lineage and serial, or why it is unusable (``problem`` and ``code``:
    ``RIVET_STATE_UNSAFE_FILE`` for a symlink or non-regular file, which is never followed;
    the read's own codes, ``RIVET_STATE_CORRUPT`` for a failed check,
    ``RIVET_STATE_SCHEMA_NEWER`` for a revision this release does not know). Raises
    nothing of its own; changes no byte (SPEC §9)."""
    kind, label, taken = _named(path, state_name)
    try:
        st = os.lstat(path)
    except OSError as err:
        return Copy(path.name, path, kind, label, taken, None, problem=f"cannot be looked at: {err.strerror}",
                    code="RIVET_STATE_PERMISSION_DENIED")
    if not stat.S_ISREG(st.st_mode):
        return Copy(path.name, path, kind, label, taken, None, problem="a symlink or not a regular file: not read",
                    code="RIVET_STATE_UNSAFE_FILE")
    backend = open_backend(file_location(path), lock_wait)
    try:
        with backend.reading() as conn:
            snap = read_snapshot(backend, conn, progress=False, integrity=full, full=full)
    except StateError as err:
        return Copy(path.name, path, kind, label, taken, st.st_size, problem=err.message, code=err.code, checked=full)
    except OSError as err:
        return Copy(path.name, path, kind, label, taken, st.st_size, problem=f"cannot be read: {err.strerror}",
                    code="RIVET_STATE_PERMISSION_DENIED", checked=full)
    unknown = snap.unknown_revision()
    return Copy(path.name, path, kind, label, taken, st.st_size, snap.revision or "legacy", snap.recorded_key,
                snap.lineage, snap.serial, unknown.message if unknown else None, unknown.code if unknown else None,
                checked=full, write_id=snap.write_id)


def copies(ctx: Context, *, full: bool = False) -> list[Copy]:
    """Every copy beside the state (:meth:`~statetool.backends.base.Backend.copies`), read
    (:func:`read_copy`), oldest first by the time in its name. A missing or retired state
    still has its copies: nothing here opens the state itself."""
    backend = ctx.backend()
    if not backend.keeps_copies:
        return []
    problem = ctx.location.directory_problem()
    if problem is not None:
        raise problem
    assert ctx.location.path is not None
    name = ctx.location.path.name
    found = [read_copy(path, state_name=name, full=full, lock_wait=ctx.lock_wait) for path in backend.copies()]
    return sorted(found, key=lambda c: (c.taken_at or "", c.name))


class BackupsResult(NamedTuple):
    """``backups list`` / ``verify``: the state's place and its copies, oldest first; the
    live state's lineage and serial, to read them against (None without a live state)."""

    location: dict[str, object]
    copies: list[Copy]
    lineage: str | None
    serial: int | None
    verified: bool

    @property
    def exit_code(self) -> int:
        """0, or for ``verify`` the exit code of the worst unusable copy (a corrupt one: 4)."""
        from statetool.errors import failure_exit_code, worst

        bad = [c.code for c in self.copies if c.code]
        return failure_exit_code(worst(bad)) if self.verified and bad else 0

    def as_dict(self) -> dict[str, object]:
        """``{location, copies: [...], live: {lineage, serial}, verified}``."""
        return {"location": self.location, "copies": [c.as_dict() for c in self.copies],
                "live": {"lineage": self.lineage, "serial": self.serial}, "verified": self.verified}


def _live(ctx: Context) -> Snapshot | None:
    """The live state as a read pre-flight reads it, or None where there is none to read."""
    from statetool.operations.preflight import run_preflight

    return run_preflight(ctx).snapshot


def list_backups(ctx: Context, name: str | None = None, *, verify: bool = False) -> BackupsResult:
    """``statetool backups list`` (every copy, read without a full check) or, with
    ``verify``, ``backups verify [NAME]`` (each copy, or the one named by its file name,
    through ``integrity_check``). Read-only. Raises ``RIVET_STATE_BACKUP_UNKNOWN`` for a
    ``name`` that is no copy beside the state, ``RIVET_STATE_DIR_MISSING``."""
    found = copies(ctx, full=verify)
    if name is not None:
        found = [c for c in found if c.name == name]
        if not found:
            raise unknown_copy(ctx, name)
    snap = _live(ctx)
    return BackupsResult(ctx.location.as_dict(), found, snap.lineage if snap else None,
                         snap.serial if snap else None, verify)


def unknown_copy(ctx: Context, name: str) -> StateError:
    """``RIVET_STATE_BACKUP_UNKNOWN`` for ``name``, which is no copy beside the state."""
    return StateError("RIVET_STATE_BACKUP_UNKNOWN", f"{name} is not a backup or keep beside {ctx.location.display}",
                      {"name": name})


def diverged(copy: Copy, serial: int | None, write_id: str | None) -> bool:
    """True when ``copy`` and a state of its lineage at ``serial`` and ``write_id`` are at
    one serial by two different writes: they went apart from one earlier state."""
    return copy.serial == serial and copy.write_id is not None and write_id is not None and copy.write_id != write_id


def newer_copies(ctx: Context, snap: Snapshot) -> list[Copy]:
    """The copies of the live state's own lineage with a higher serial than it has, or the
    same serial by another write (:func:`diverged`): the live state was rolled back or
    replaced by an older copy, and maybe written since (SPEC §9). Empty without a lineage."""
    if snap.lineage is None or snap.serial is None:
        return []
    return [c for c in copies(ctx) if c.lineage == snap.lineage and
            ((c.serial or 0) > snap.serial or diverged(c, snap.serial, snap.write_id))]


def rolled_back(snap: Snapshot, ahead: list[Copy]) -> StateWarning | None:
    """Warning ``RIVET_STATE_ROLLED_BACK`` naming the newest of ``ahead``, the copies ahead of
    the live state ``snap`` (:func:`newer_copies`); None when there is none."""
    if not ahead:
        return None
    newest = max(ahead, key=lambda c: c.serial or 0)
    where = f"{newest.path} is a copy of this state (lineage {snap.lineage}) at serial {newest.serial}"
    if newest.serial == snap.serial:
        return StateWarning("RIVET_STATE_ROLLED_BACK",
                            f"{where}, as the live state is, but written by another write: the live state was rolled "
                            "back and written again since, and the two went apart; its exports resume from the "
                            "progress of one of them only")
    return StateWarning("RIVET_STATE_ROLLED_BACK",
                        f"{where}, ahead of the live state's {snap.serial}: the live state was rolled back or replaced "
                        f"by an older copy, and its exports would resume from older progress")


class PruneResult(NamedTuple):
    """``backups prune``: the copies removed (or, in a dry run, that would be) and kept,
    and the warnings (a dry run on a read-only mount: ``RIVET_STATE_READ_ONLY_DRY_RUN``)."""

    location: dict[str, object]
    removed: list[Copy]
    kept: list[Copy]
    dry_run: bool
    warnings: list[StateWarning]

    def as_dict(self) -> dict[str, object]:
        """``{location, removed: [...], kept: [...], dry_run, warnings}``."""
        return {"location": self.location, "removed": [c.as_dict() for c in self.removed],
                "kept": [c.as_dict() for c in self.kept], "dry_run": self.dry_run,
                "warnings": [w.as_dict() for w in self.warnings]}


def _to_prune(found: list[Copy], keep: int | None, older_than: float | None, live: Snapshot) -> list[Copy]:
    """The copies ``prune`` removes: of those that verified, are of the live state's lineage
    and behind it, beyond the ``keep`` newest (by serial), and (with ``older_than``, days)
    taken longer ago than that; never the newest of them. A copy that did not verify, could
    not be read, is no regular file or is of another lineage is never removed: prune cannot
    tell what it holds (a fresh user's finding: one lost the only copy of its lineage); nor
    is one ahead of the live state or gone apart from it (:func:`newer_copies`): after a
    rollback it is the only record of the newer progress (another fresh user's finding)."""
    ahead = {c.path for c in found if c.lineage == live.lineage and live.serial is not None and
             ((c.serial or 0) > live.serial or diverged(c, live.serial, live.write_id))}
    ours = sorted((c for c in found if c.usable and c.lineage == live.lineage and c.path not in ahead),
                  key=lambda c: (c.serial or 0, c.taken_at or "", c.name))
    cutoff = time.time() - older_than * 86_400 if older_than is not None else None
    doomed: list[Copy] = []
    for index, copy in enumerate(ours[:-1]):
        beyond = keep is not None and index < len(ours) - keep
        old = cutoff is not None and copy.taken_at is not None and \
            calendar.timegm(time.strptime(copy.taken_at, "%Y-%m-%dT%H:%M:%SZ")) < cutoff
        if beyond or old:
            doomed.append(copy)
    return doomed


def prune(ctx: Context, *, keep: int | None = None, older_than: float | None = None,
          dry_run: bool = False) -> PruneResult:
    """``statetool backups prune``: remove the copies beyond the ``keep`` newest and/or those
    older than ``older_than`` days, each read through ``integrity_check`` first so the newest
    copy that verifies is never removed. The removal is audited in the live state (one
    ``backups.prune`` row naming every file), through the guarded write path, before any
    file goes; a copy that cannot be removed is reported by its fault's code after the
    audited ones are gone. ``dry_run`` returns the same lists and removes nothing.

    Raises ``RIVET_CLI_USAGE`` without ``keep`` or ``older_than``, for a ``keep`` outside 0 to
    :data:`~statetool.numbers.MAX_KEEP` or an ``older_than`` outside 0 to
    :data:`~statetool.numbers.MAX_DAYS` (``nan`` and ``inf`` included),
    ``RIVET_STATE_MISSING`` where no live state is to hold the audit row, and the guarded
    write's codes."""
    if keep is None and older_than is None:
        raise StateError("RIVET_CLI_USAGE", "say what to prune: --keep N (the N newest stay) and/or "
                         "--older-than DAYS")
    if keep is not None:
        require_within("--keep", keep, 0, MAX_KEEP)
    if older_than is not None:
        require_within("--older-than", older_than, 0, MAX_DAYS, "days")
    from statetool.operations.writes import NO_LEASE, guarded_write, require_writable

    live = _live(ctx)
    if live is None:
        raise StateError("RIVET_STATE_MISSING", f"no live state at {ctx.location.display} to record the prune in "
                         "(statetool info says what is there)", {"path": ctx.location.display})
    warnings = require_writable(ctx, dry_run=dry_run)
    found = copies(ctx, full=True)
    doomed = _to_prune(found, keep, older_than, live)
    if dry_run or not doomed:
        return PruneResult(ctx.location.as_dict(), doomed, [c for c in found if c not in doomed], dry_run, warnings)
    with guarded_write(ctx, NO_LEASE, claim=False) as session:
        removed, failed = _remove(doomed)
        session.audit("backups.prune", {"removed": [c.name for c in removed],
                                        "failed": [c.name for c, _err in failed], "keep": keep,
                                        "older_than": older_than})
    if failed:
        copy, err = failed[0]
        code = "RIVET_STATE_PERMISSION_DENIED" if isinstance(err, PermissionError) else "RIVET_STATE_WRITE_REFUSED"
        raise StateError(code, f"{copy.path} could not be removed ({err.strerror}); "
                         f"{len(removed)} other copies were, as the audit row records", {"path": str(copy.path)})
    return PruneResult(ctx.location.as_dict(), removed, [c for c in found if c not in removed], False, warnings)


def _remove(doomed: list[Copy]) -> tuple[list[Copy], list[tuple[Copy, OSError]]]:
    """Remove each copy of ``doomed`` that is still the regular file it was read as (one that
    changed kind meanwhile is left, as failed), then fsync the directory. Returns the copies
    removed and those that could not be, with their error."""
    from statetool.backends.durable import fsync_dir

    removed: list[Copy] = []
    failed: list[tuple[Copy, OSError]] = []
    for copy in doomed:
        try:
            if not stat.S_ISREG(os.lstat(copy.path).st_mode):  # it changed kind since it was read
                failed.append((copy, OSError(errno.EISDIR, "no longer a regular file", str(copy.path))))
                continue
            copy.path.unlink()
            removed.append(copy)
        except FileNotFoundError:
            removed.append(copy)  # gone already: what prune was to do
        except OSError as err:
            failed.append((copy, err))
    fsync_dir(doomed[0].path.parent)
    return removed, failed
