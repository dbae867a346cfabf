"""``statetool doctor``: for every export, will the next run resume or be a FIRST RUN, and why.

Read-only. Each reason carries a registered code, the evidence (paths, values, times)
and the fix. The verdict is ``first_run`` when a reason makes the next run start from
nothing (no state, an export with no progress, a CDC checkpoint lost while the state has
progress, a state that belongs elsewhere); ``resumes`` otherwise, with what it resumes
from and how old that is.

The steps, in order (:func:`doctor`):

1. the exports asked about (``RIVET_EXPORT_UNKNOWN`` for a name the config lacks);
2. how the location was set, and the ``RIVET_STATE_URL`` every task must share;
3. the declared directory: missing, empty, on an ephemeral or a network filesystem;
4. companion files beside the state that it did not leave (the backend judges them);
5. the state, read once on the backend's read-only open: an interrupted write, the
   revision (pending, unknown), each export's resume point and last reset
   (:func:`statetool.operations.probe.resume_points`), the identity verdict;
6. when the state is missing, relocated or foreign: where it probably is
   (:func:`statetool.operations.search.search`);
7. per export: its progress, its CDC checkpoint, and the verdict; a checkpoint file it
   shares with another CDC export is a reason of each (``RIVET_STATE_CHECKPOINT_SHARED``:
   the runtime refuses their runs; the verdict is what the state and the file say).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from statetool.backends import open_leases, orphan_companions
from statetool.config import Export
from statetool.errors import REGISTRY, WARNINGS, StateError, StateWarning, failure_exit_code, unit_failure, worst
from statetool.identity import identity_message, identity_verdict, identity_warning
from statetool.location import ENV_VAR, Location, resolve_checkpoint
from statetool.moments import moment, parse_time
from statetool.mounts import mount_of
from statetool.operations.checkpoint_file import read_checkpoint
from statetool.operations.checkpoints import (checkpoint_warning, file_differs_warning, shared_files, shared_text,
                                              stored_in_of)
from statetool.operations.context import Context, now_iso
from statetool.operations.probe import (ResumePoint, Snapshot, last_resets, position_rows, read_snapshot,
                                        resume_points)
from statetool.operations.search import search

#: Codes whose presence makes an export's next run a first run.
FIRST_RUN_CODES = frozenset({"RIVET_STATE_MISSING", "RIVET_EXPORT_NO_PROGRESS", "RIVET_STATE_CHECKPOINT_MISSING",
                             "RIVET_STATE_CHECKPOINT_UNREADABLE", "RIVET_STATE_CHECKPOINT_NOT_A_FILE",
                             "RIVET_STATE_FOREIGN", "RIVET_STATE_RELOCATED", "RIVET_STATE_NOT_A_STATE",
                             "RIVET_STATE_CORRUPT", "RIVET_STATE_DIR_MISSING"})
#: Codes whose presence makes the runtime refuse an export's next run (verdict ``refused``):
#: neither a resume nor a first run until someone repairs what the reason names.
REFUSED_CODES = frozenset({"RIVET_STATE_POSITION_INVALID"})


@dataclass
class Reason:
    """One finding: a registered code, what it means here, the evidence, and the fix."""

    code: str
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, warning: StateWarning, evidence: dict[str, Any]) -> Reason:
        """The reason of a registered warning, its one text (a factory's), with ``evidence``."""
        return cls(warning.code, warning.message, evidence)

    @property
    def action(self) -> str:
        """The registered action of the code."""
        return REGISTRY[self.code].action if self.code in REGISTRY else WARNINGS[self.code]

    def as_dict(self) -> dict[str, Any]:
        """``{code, message, evidence, action}``."""
        return {"code": self.code, "message": self.message, "evidence": self.evidence, "action": self.action}


@dataclass
class ExportDiagnosis:
    """The verdict for one export: ``resumes`` (from what, how old), ``first_run``, or
    ``refused`` (a reason of :data:`REFUSED_CODES`: the runtime refuses the run)."""

    name: str
    mode: str
    verdict: str
    resumes_from: str | None
    age_seconds: float | None
    reasons: list[Reason]
    #: The exact time ``resumes_from`` names (ISO-8601, as the state holds it) when it
    #: resumes from a finished run, so people read it to the second (issue 12 item 4).
    resumes_from_at: str | None = None
    #: Where a CDC export's position lives, as ``checkpoints`` says it (issue 15 item 5):
    #: ``state``, ``file`` or ``server_slot`` (``unknown`` for a row that holds no position:
    #: ``RIVET_STATE_POSITION_INVALID``); None for an export that is not CDC.
    stored_in: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """``{name, mode, verdict, resumes_from, resumes_from_at, age_seconds, reasons: [...], stored_in}``."""
        return {"name": self.name, "mode": self.mode, "verdict": self.verdict, "resumes_from": self.resumes_from,
                "resumes_from_at": self.resumes_from_at, "age_seconds": self.age_seconds,
                "reasons": [r.as_dict() for r in self.reasons], "stored_in": self.stored_in}


@dataclass
class DoctorResult:
    """Every export's diagnosis and what was found about the state itself."""

    exports: list[ExportDiagnosis]
    state: dict[str, Any]

    @property
    def exit_code(self) -> int:
        """0 when every export resumes; else the process exit code of the reason on top
        (:attr:`worst`, the one ``--json-errors`` reports, so that its ``exit_code`` is the
        process's): a registered error's own (``RIVET_STATE_CHECKPOINT_UNREADABLE``,
        ``RIVET_STATE_POSITION_INVALID``: 4; ``RIVET_STATE_MISSING``: 5), a warning's class
        refusal (5, SPEC §7: a first run is refused until someone decides it on purpose). A
        declared directory that is missing or a file is on top wherever it is a reason and
        exits as every other command refuses it (``RIVET_STATE_DIR_MISSING``, usage: 1): the
        fix is the mount or the setting, never ``init`` (docs/decisions.md, "doctor and a
        missing declared directory")."""
        top = self.worst
        return 0 if top is None else failure_exit_code(top.code)

    @property
    def worst(self) -> Reason | None:
        """The reason that explains the verdict best, for ``--json-errors``: a missing
        declared directory (``RIVET_STATE_DIR_MISSING``) where it is a reason, else among the
        first-run and refused exports' reasons the registered error whose class ranks highest
        (:func:`statetool.errors.worst`), else the first warning; None when every export resumes."""
        failing = [r for e in self.exports if e.verdict != "resumes" for r in e.reasons]
        return next((r for r in failing if r.code == "RIVET_STATE_DIR_MISSING"), None) or _explaining(failing)

    @property
    def failures(self) -> list[dict[str, Any]]:
        """The ``failures[]`` of ``--json-errors`` (ADR-0039 D2): each export that would
        start as a first run or be refused, with the registered reason whose class ranks highest, else its
        first reason (a warning such as ``RIVET_EXPORT_NO_PROGRESS``)."""
        out = []
        for e in self.exports:
            reason = _explaining(e.reasons) if e.verdict != "resumes" else None
            if reason is not None:
                out.append(unit_failure(e.name, reason.code, reason.message))
        return out

    def as_dict(self) -> dict[str, Any]:
        """``{"exports": [...], "state": {...}}``."""
        return {"exports": [e.as_dict() for e in self.exports], "state": self.state}


def _explaining(reasons: list[Reason]) -> Reason | None:
    """The first reason with the registered error whose class ranks highest
    (:func:`statetool.errors.worst`), else the first reason (a warning); None for none."""
    code = worst([r.code for r in reasons if r.code in REGISTRY])
    return next((r for r in reasons if r.code == code), reasons[0] if reasons else None)


def _age(iso: str | None) -> float | None:
    """Seconds from the state's time ``iso`` to now, to the millisecond; None when it is
    missing or no time (:func:`statetool.moments.parse_time`)."""
    then = parse_time(iso) if iso else None
    return None if then is None else round((datetime.now(UTC) - then).total_seconds(), 3)


def _directory_reasons(location: Location) -> list[Reason]:
    """Step 3: a declared directory that is missing, empty (a new or the wrong volume), or on
    an ephemeral or a network filesystem (:func:`statetool.mounts.mount_of`)."""
    if location.scope != "declared_dir":
        return []
    directory = location.directory
    assert directory is not None
    problem = location.directory_problem()
    if problem is not None:
        return [Reason(problem.code, problem.message, {"directory": str(directory)})]
    reasons = []
    # A lease folder whose sidecars name no holder is what a refused or finished command may
    # leave: it does not make a new volume a used one.
    if not any(p != location.lease_dir for p in directory.iterdir()) and not any(
            info.holder for info in open_leases(location).list()):
        reasons.append(Reason("RIVET_STATE_MISSING", f"the declared state directory {directory} is empty: a volume "
                              "that is mounted but new, or the wrong one", {"directory": str(directory)}))
    mount = mount_of(directory)
    if mount is not None and mount.ephemeral:
        reasons.append(Reason("RIVET_STATE_DIR_EPHEMERAL",
                              f"{directory} is on the container's own filesystem ({mount.fstype} at {mount.point}): "
                              "the state is lost with the container",
                              {"directory": str(directory), "fstype": mount.fstype, "mount_point": mount.point}))
    if mount is not None and mount.network:
        reasons.append(Reason("RIVET_STATE_DIR_NETWORK",
                              f"{directory} is on a network filesystem ({mount.fstype} from {mount.source}): SQLite's "
                              "WAL and flock leases are only as reliable as that filesystem",
                              {"directory": str(directory), "fstype": mount.fstype, "source": mount.source}))
    return reasons


def _checkpoint(ctx: Context, export: Export, has_progress: bool,
                stored: dict[str, Any] | None) -> tuple[list[Reason], str | None, float | None]:
    """Reasons about a CDC export's checkpoint, and the position it resumes from: the
    state's where it holds one (``stored``, revision 0006: no file is needed, and the file
    a worker or a restore may have left is only compared, :func:`file_differs_warning`), else the file's."""
    assert export.cdc is not None
    place = resolve_checkpoint(export.cdc.checkpoint, export.cdc.engine, ctx.location, ctx.config.directory)
    reasons: list[Reason] = []
    if stored is not None:
        differs = file_differs_warning(export.name, place.path, stored)
        if differs is not None:
            reasons.append(Reason.of(differs, {"path": str(place.path), "state_position": stored["position"]}))
        by = f" by run {stored['run_id']}" if stored["run_id"] else ""
        return (reasons, f"CDC position {json.dumps(stored['position'], sort_keys=True)} in the state (committed "
                f"{moment(stored['committed_at'])}{by})", _age(stored["committed_at"]))
    if place.warning:
        reasons.append(Reason.of(checkpoint_warning(place.warning, export.name, place.path), {"path": str(place.path)}))
    if place.path is None:
        if export.cdc.engine == "postgres":
            return reasons, "the replication slot's position", None
        reasons.append(Reason("RIVET_STATE_CHECKPOINT_MISSING", place.why, {"configured": None}))
        return reasons, None, None
    try:
        found = read_checkpoint(place.path)
    except StateError as err:
        if err.code not in FIRST_RUN_CODES:
            raise  # this user may not read it: no verdict can be given, and never a first run (SPEC §8a)
        reasons.append(Reason(err.code, err.message, {"path": str(place.path)}))
        return reasons, None, None
    if not found.present:
        if has_progress:
            reasons.append(Reason(
                "RIVET_STATE_CHECKPOINT_MISSING",
                f"the state shows progress for {export.name} but its checkpoint {place.path} is missing: the stream "
                "will re-anchor and the changes between the lost position and the new anchor are lost",
                {"path": str(place.path), "why": place.why}))
        return reasons, None, None
    age = round(datetime.now(UTC).timestamp() - (found.modified or 0), 3)
    return reasons, f"CDC position {json.dumps(found.position, sort_keys=True)} in {place.path}", age


def _diagnose(ctx: Context, export: Export, progress: ResumePoint | None, state_reasons: list[Reason],
              reset: dict[str, Any] | None, stored: dict[str, Any] | None = None,
              invalid: StateError | None = None) -> ExportDiagnosis:
    """Step 7: one export's verdict from its resume point (None when the state could not be
    read), the state's reasons, its last reset and its CDC position: ``stored``, the one the
    state holds (revision 0006), is progress of its own, else its checkpoint file's. A
    position row that holds no position (``invalid``, its ``RIVET_STATE_POSITION_INVALID``)
    is this export's reason and verdict ``refused``: its file is not read (a run never
    falls back to it), and no other export's verdict depends on it."""
    reasons = list(state_reasons)
    resumes_from: str | None = None
    resumes_from_at: str | None = None
    age: float | None = None
    if progress is not None:
        # A reset clears the cursor and chunk checkpoints and keeps run history and the ledger
        # (history, not progress to resume from): nothing committed since the reset is no progress.
        reset_since = (reset is not None and export.cdc is None and progress.cursor is None
                       and not progress.chunks_total and (progress.last_success or "") <= str(reset["at"]))
        if (not progress.has_progress or reset_since) and export.mode != "full" and stored is None:
            evidence: dict[str, Any] = {"export": export.name, "state": ctx.location.display}
            message = f"the state holds no progress for {export.name}"
            if reset is not None:
                evidence["reset"] = reset
                message += f": it was reset on {reset['at']} by {reset['by']}"
            else:
                message += ": it never finished a run with this state"
            reasons.append(Reason("RIVET_EXPORT_NO_PROGRESS", message, evidence))
        elif export.mode == "incremental" and progress.cursor is not None:
            resumes_from, age = f"cursor {progress.cursor!r}", _age(progress.cursor_updated_at)
        elif export.mode == "chunked" and progress.chunks_pending:
            resumes_from = f"chunk checkpoint: {progress.chunks_done} of " \
                           f"{progress.chunks_total} chunks done"
        elif progress.last_success:
            resumes_from, age = f"the run finished at {progress.last_success}", _age(progress.last_success)
            resumes_from_at = progress.last_success
        elif progress.cursor is not None:  # a chunked export with a cursor and no run or chunk to go on
            resumes_from, age = f"cursor {progress.cursor!r}", _age(progress.cursor_updated_at)
        else:  # progress in the ledger or in finished chunks only
            resumes_from = "the progress the state holds (finished chunks or load ledger rows)"
        if export.mode == "full":
            resumes_from, age, resumes_from_at = "a full read (by design: a full export keeps no position)", None, None
    stored_in = None
    if export.cdc is not None and invalid is not None:
        reasons.append(Reason(invalid.code, invalid.message, dict(invalid.details)))
        stored_in = "unknown"
    elif export.cdc is not None:
        cdc_reasons, position, position_age = _checkpoint(ctx, export, bool(progress and progress.has_progress),
                                                          stored)
        reasons += cdc_reasons
        if position is not None and progress is not None and (progress.has_progress or stored is not None):
            resumes_from, age, resumes_from_at = position, position_age, None
        stored_in = stored_in_of(export, stored is not None)
    refused = any(r.code in REFUSED_CODES for r in reasons)
    first = refused or any(r.code in FIRST_RUN_CODES for r in reasons)
    return ExportDiagnosis(export.name, export.mode, "refused" if refused else "first_run" if first else "resumes",
                           None if first else resumes_from, None if first else age, reasons,
                           None if first else resumes_from_at, stored_in)


@dataclass(frozen=True)
class Planned:
    """A change of one export's progress not yet written (the dry run of ``exports
    set-cursor`` or ``exports reset``), for :func:`doctor` to foresee the next run after it
    by the rule it judges the state with once the change is committed: ``export`` the
    export, ``cursor`` the cursor it sets (None: cleared), ``reset`` whether it is a reset
    (chunk checkpoints deleted, an ``exports.reset`` audit row written now by ``by``; a CDC
    position, in its file or in the state, is kept)."""

    export: str
    cursor: str | None
    reset: bool = False
    by: str = ""

    def applied(self, point: ResumePoint, last_reset: dict[str, Any] | None
                ) -> tuple[ResumePoint, dict[str, Any] | None]:
        """``point`` and ``last_reset`` (the export's resume point and last reset, as the
        state holds them now) as they will be once the change is committed."""
        now = now_iso()
        if not self.reset:
            return replace(point, cursor=self.cursor, cursor_updated_at=now), last_reset
        return (replace(point, cursor=None, cursor_updated_at=None, chunks_total=0, chunks_done=0),
                {"at": now, "by": self.by, "detail": {"export": self.export}})


def next_run_words(diagnosis: dict[str, Any]) -> str:
    """What the next run does, in words, from one export's diagnosis (``doctor --json``'s
    ``exports[i]``): ``FIRST RUN: reads everything from the start``, ``REFUSED (CODE): …``
    (the reason of :data:`REFUSED_CODES`, its message saying how to repair), or ``resumes
    from …`` (``next_run`` of ``exports set-cursor``/``reset``, their dry runs alike)."""
    if diagnosis["verdict"] == "refused":
        reason = next(r for r in diagnosis["reasons"] if r["code"] in REFUSED_CODES)
        return f"REFUSED ({reason['code']}): {reason['message']}"
    if diagnosis["verdict"] != "resumes":
        return "FIRST RUN: reads everything from the start"
    return f"resumes from {diagnosis['resumes_from']}" if diagnosis["resumes_from"] else "resumes"


@dataclass
class _Read:
    """What step 5 read from the state: the snapshot (None when nothing could be read),
    each export's resume point and last reset (empty for a revision this release does not know)."""

    snap: Snapshot | None = None
    progress: dict[str, ResumePoint] = field(default_factory=dict)
    resets: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: The CDC positions the state holds (revision 0006), per export.
    positions: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Each export whose position row holds no position: its ``RIVET_STATE_POSITION_INVALID``.
    invalid: dict[str, StateError] = field(default_factory=dict)


def _where(location: Location) -> dict[str, Any]:
    """Step 2: the location, what set it, and the setting every task must share."""
    return {
        "location": location.as_dict(),
        "set_by": {"default": "nothing (the default: beside the config)", "env": ENV_VAR,
                   "flag": "--state-url"}[location.origin],
        "every_task_must_share": f"{ENV_VAR}={location.state_url}" if location.state_url
        else f"{ENV_VAR} unset (or empty) and the same config path",
    }


def _companion_reasons(location: Location) -> list[Reason]:
    """Step 4: ``-wal``/``-shm`` beside the state that it did not leave (the backend judges them)."""
    orphans = orphan_companions(location)
    return [] if orphans is None else [Reason("RIVET_STATE_ORPHAN_WAL", orphans.message, dict(orphans.evidence))]


def _read_state(ctx: Context, names: list[str], state_reasons: list[Reason]) -> _Read:
    """Step 5: one read-only open of the state. A finding becomes a reason appended to
    ``state_reasons`` (an interrupted write; a state that is missing, not a state, corrupt
    or relocated). Raises the read's ``StateError`` when no verdict can be given
    (unreachable, locked, interrupted)."""
    location, backend, read = ctx.location, ctx.backend(), _Read()
    try:
        present = backend.present()
        if present:
            with backend.reading() as conn:
                read.snap = read_snapshot(backend, conn, integrity=False, progress=False)
                if read.snap.interrupted_write:
                    state_reasons.append(Reason("RIVET_STATE_HOT_JOURNAL", read.snap.interrupted_write,
                                                {"journal": str(location.companion("-journal"))}))
                if read.snap.known:
                    read.progress = resume_points(conn, read.snap.tables, names)
                    read.resets = last_resets(conn, read.snap.tables)
                    read.positions = position_rows(conn, read.snap.tables, read.invalid)
    except StateError as err:
        if err.code in {r.code for r in state_reasons}:
            present = False  # a declared directory that is missing, already a reason
        elif err.code not in FIRST_RUN_CODES:
            raise  # unreachable, locked, interrupted: no verdict can be given, say why
        else:
            state_reasons.append(Reason(err.code, err.message, err.details))
            present = True
    if not present and not any(r.code in {"RIVET_STATE_MISSING", "RIVET_STATE_DIR_MISSING"} for r in state_reasons):
        state_reasons.append(Reason("RIVET_STATE_MISSING", f"no state at {location.display}: every export starts "
                                    "from nothing", {"path": str(location.path) if location.path else None,
                                                     "state": location.display}))
    return read


def _snapshot_reasons(ctx: Context, read: _Read, state: dict[str, Any]) -> list[Reason]:
    """Step 5, continued: the revision (pending, unknown) and the identity verdict of the
    state read; records both in ``state``."""
    location, snap = ctx.location, read.snap
    assert snap is not None
    reasons = []
    state["revision"] = snap.revision or "legacy"
    if snap.pending:
        reasons.append(Reason("RIVET_STATE_MIGRATION_PENDING",
                              f"the state was written by an older release (pending: {', '.join(snap.pending)})",
                              {"state": location.display, "revision": snap.revision or "legacy",
                               "pending": snap.pending}))
    unknown = snap.unknown_revision()
    if unknown is not None:
        reasons.append(Reason(unknown.code, unknown.message, {"revision": snap.revision}))
    from statetool.operations.backups import newer_copies, rolled_back

    ahead = newer_copies(ctx, snap)
    behind = rolled_back(snap, ahead)
    if behind is not None:
        reasons.append(Reason.of(behind, {"state": location.display, "lineage": snap.lineage, "serial": snap.serial,
                                          "newer": [c.as_dict() for c in ahead]}))
    verdict = identity_verdict(snap.recorded_key, ctx.computed_key, location.scope,
                               any(p.has_progress for p in read.progress.values()))
    state["identity"] = {"recorded": snap.recorded_key, "computed": ctx.computed_key, "verdict": verdict.action}
    where = str(location.directory or location.display)
    evidence = {"state": location.display, "recorded": verdict.recorded, "computed": verdict.computed}
    warning = identity_warning(verdict, where, for_write=False)
    if verdict.code == "RIVET_STATE_FOREIGN":
        reasons.append(Reason(verdict.code, identity_message(verdict, where, for_write=False), evidence))
    elif warning is not None and warning.code == "RIVET_STATE_FOREIGN_BESIDE_CONFIG":
        reasons.append(Reason.of(warning, evidence))
    return reasons


#: State reasons after which doctor searches for where the state probably is (step 6).
SEARCH_CODES = frozenset({"RIVET_STATE_MISSING", "RIVET_STATE_DIR_MISSING", "RIVET_STATE_RELOCATED",
                          "RIVET_STATE_FOREIGN"})


def doctor(ctx: Context, export: str | None = None, planned: Planned | None = None) -> DoctorResult:
    """Diagnose every export (or only ``export``), in the steps of the module docstring.
    Never writes. With ``planned``, its export is judged as it will be once that change is
    committed (:meth:`Planned.applied`): the dry run's foresight by the real run's rule.

    Raises the resolver's and config loader's codes and ``RIVET_EXPORT_UNKNOWN``; every
    other finding is a reason in the result.
    """
    location, config = ctx.location, ctx.config
    exports = [e for e in config.exports if export is None or e.name == export]
    if not exports and export is not None:
        raise StateError("RIVET_EXPORT_UNKNOWN", f"export '{export}' is not in {config.path}")
    state = _where(location)
    state_reasons = _directory_reasons(location) + _companion_reasons(location)
    read = _read_state(ctx, [e.name for e in exports], state_reasons)
    if read.snap is not None:
        state_reasons += _snapshot_reasons(ctx, read, state)
    if any(r.code in SEARCH_CODES for r in state_reasons):
        state["candidates"] = search(ctx, ctx.computed_key)
    state["reasons"] = [r.as_dict() for r in state_reasons]
    known = read.snap is not None and read.snap.known
    if planned is not None and known and planned.export in read.progress:
        read.progress[planned.export], read.resets[planned.export] = planned.applied(
            read.progress[planned.export], read.resets.get(planned.export))
    diagnoses = [_diagnose(ctx, e, read.progress.get(e.name) if known else None, state_reasons,
                           read.resets.get(e.name), read.positions.get(e.name), read.invalid.get(e.name))
                 for e in exports]
    for path, names in shared_files(ctx).items():
        for diagnosis in diagnoses:
            if diagnosis.name in names:
                diagnosis.reasons.append(Reason("RIVET_STATE_CHECKPOINT_SHARED", shared_text({path: names}),
                                                {"path": path, "exports": names}))
    return DoctorResult(diagnoses, state)
