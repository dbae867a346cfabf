"""``statetool doctor``: for every export, will the next run resume or be a FIRST RUN, and why.

Read-only. Each reason carries a registered code, the evidence (paths, values, times)
and the fix. The verdict is ``first_run`` when a reason makes the next run start from
nothing (no state, an export with no progress, a CDC checkpoint lost while the state has
progress, a state that belongs elsewhere); ``resumes`` otherwise, with what it resumes
from and how old that is.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from statetool import schema
from statetool.backends import open_leases
from statetool.backends.mounts import mount_of
from statetool.backends.tombstone import read_tombstone
from statetool.config import Export
from statetool.errors import REGISTRY, WARNINGS, StateError, unit_failure, worst
from statetool.identity import identity_verdict
from statetool.location import ENV_VAR, LEASE_DIR, STATE_FILE, Location, checkpoint_relative_message, resolve_checkpoint
from statetool.operations.context import Context
from statetool.operations.probe import Snapshot, read_snapshot

#: Declared directories people commonly use; searched when the state is missing.
WELL_KNOWN_DIRS = ("/var/lib/rivet", "/var/lib/rivet/state", "/srv/rivet", "/srv/rivet/state", "/data/rivet",
                   "/data/rivet/state", "/mnt/rivet", "/opt/rivet/state")
#: How deep and how wide the search under the config's directory goes.
SEARCH_DEPTH, SEARCH_MAX_DIRS = 4, 2000
_SKIP_DIRS = {".git", "node_modules", ".venv", "venv", "__pycache__", ".tox", ".mypy_cache"}

#: Codes whose presence makes an export's next run a first run.
FIRST_RUN_CODES = frozenset({"RIVET_STATE_MISSING", "RIVET_EXPORT_NO_PROGRESS", "RIVET_STATE_CHECKPOINT_MISSING",
                             "RIVET_STATE_CHECKPOINT_UNREADABLE", "RIVET_STATE_FOREIGN", "RIVET_STATE_RELOCATED",
                             "RIVET_STATE_NOT_A_STATE", "RIVET_STATE_CORRUPT"})


@dataclass
class Reason:
    """One finding: a registered code, what it means here, the evidence, and the fix."""

    code: str
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def action(self) -> str:
        """The registered action of the code."""
        return REGISTRY[self.code].action if self.code in REGISTRY else WARNINGS[self.code]

    def as_dict(self) -> dict[str, Any]:
        """``{code, message, evidence, action}``."""
        return {"code": self.code, "message": self.message, "evidence": self.evidence, "action": self.action}


@dataclass
class ExportDiagnosis:
    """The verdict for one export: ``resumes`` (from what, how old) or ``first_run``."""

    name: str
    mode: str
    verdict: str
    resumes_from: str | None
    age_seconds: float | None
    reasons: list[Reason]

    def as_dict(self) -> dict[str, Any]:
        """``{name, mode, verdict, resumes_from, age_seconds, reasons: [...]}``."""
        return {"name": self.name, "mode": self.mode, "verdict": self.verdict, "resumes_from": self.resumes_from,
                "age_seconds": self.age_seconds, "reasons": [r.as_dict() for r in self.reasons]}


@dataclass
class DoctorResult:
    """Every export's diagnosis and what was found about the state itself."""

    exports: list[ExportDiagnosis]
    state: dict[str, Any]

    @property
    def exit_code(self) -> int:
        """0 when every export resumes; 5 (refusal) when any would first-run."""
        return 5 if any(e.verdict == "first_run" for e in self.exports) else 0

    @property
    def worst(self) -> Reason | None:
        """The reason that explains the verdict best, for ``--json-errors``: among the
        first-run exports' reasons, the registered error whose class ranks highest
        (:func:`statetool.errors.worst`), else the first warning; None when every export resumes."""
        reasons = [r for e in self.exports if e.verdict == "first_run" for r in e.reasons]
        code = worst([r.code for r in reasons if r.code in REGISTRY])
        return next((r for r in reasons if r.code == code), reasons[0] if reasons else None)

    @property
    def failures(self) -> list[dict[str, Any]]:
        """The ``failures[]`` of ``--json-errors`` (ADR-0039 D2): each export that would
        start as a first run, with the registered reason whose class ranks highest, else its
        first reason (a warning such as ``RIVET_EXPORT_NO_PROGRESS``)."""
        out = []
        for e in self.exports:
            if e.verdict != "first_run" or not e.reasons:
                continue
            code = worst([r.code for r in e.reasons if r.code in REGISTRY])
            reason = next((r for r in e.reasons if r.code == code), e.reasons[0])  # else its first warning
            out.append(unit_failure(e.name, reason.code, reason.message))
        return out

    def as_dict(self) -> dict[str, Any]:
        """``{"exports": [...], "state": {...}}``."""
        return {"exports": [e.as_dict() for e in self.exports], "state": self.state}


def _age(iso: str | None) -> float | None:
    if not iso:
        return None
    try:
        then = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        return None
    return round((datetime.now(UTC) - then).total_seconds(), 3)


def _candidate(path: Path) -> dict[str, Any] | None:
    """What a possible state file at ``path`` is, read-only (None when it is not one)."""
    from statetool.backends.sqlite import SqliteBackend

    tomb = read_tombstone(path)
    if tomb is not None:
        found = {"path": str(path), "kind": "relocated", "moved_to": tomb.get("to"), "state_url": tomb.get("state_url")}
        target = tomb.get("to")
        if isinstance(target, str) and os.path.isabs(target) and read_tombstone(Path(target)) is None:
            moved = _candidate(Path(target)) if os.path.isfile(target) else None
            # What the state it names holds (identity, last run, progress), when it is a readable file.
            for key in ("identity", "revision", "last_run_finished_at", "exports_with_cursor"):
                found[key] = moved.get(key) if moved else None
        return found
    directory = path.parent
    backend = SqliteBackend(Location("sqlite", "declared_dir", "flag", directory=directory, path=path), 5.0)
    try:
        with backend.reading() as conn:
            snap = read_snapshot(backend, conn, integrity=False, progress=False)
            last = conn.execute(sa.select(sa.func.max(schema.runs.c.finished_at))).scalar()
            cursors = conn.execute(sa.select(sa.func.count()).select_from(schema.exports)
                                   .where(schema.exports.c.cursor_value.is_not(None))).scalar()
    except (StateError, sa.exc.DBAPIError):
        return None
    return {"path": str(path), "kind": "state", "identity": snap.recorded_key, "revision": snap.revision or "legacy",
            "last_run_finished_at": last, "exports_with_cursor": int(cursors or 0),
            "state_url": f"sqlite:{directory}"}


def _search(ctx: Context, key: str) -> list[dict[str, Any]]:
    """Where the state probably is: beside the config, well-known directories, and states
    of the same identity under the config's directory."""
    seen: set[str] = set()
    found: list[dict[str, Any]] = []

    def consider(path: Path, same_identity_only: bool) -> None:
        real = os.path.realpath(path)
        if real in seen or real == os.path.realpath(ctx.location.path or "") or not os.path.isfile(path):
            return
        seen.add(real)
        candidate = _candidate(path)
        if candidate is None:
            return
        if same_identity_only and candidate["kind"] == "state" and key and candidate["identity"] != key:
            return
        if path.parent == ctx.config.directory and candidate["kind"] == "state":
            candidate["state_url"] = ""  # RIVET_STATE_URL unset (or empty): the state beside the config
        found.append(candidate)

    consider(ctx.config.directory / STATE_FILE, same_identity_only=False)
    here = read_tombstone(ctx.location.path) if ctx.location.path is not None else None
    if here is not None and isinstance(here.get("to"), str) and os.path.isabs(here["to"]):
        consider(Path(here["to"]), same_identity_only=False)  # where the state at this place was moved
    for directory in WELL_KNOWN_DIRS:
        consider(Path(directory) / STATE_FILE, same_identity_only=False)
    root = ctx.config.directory
    visited = 0
    for current, dirs, files in os.walk(root):
        depth = len(Path(current).relative_to(root).parts)
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and depth < SEARCH_DEPTH]
        visited += 1
        if STATE_FILE in files:
            consider(Path(current) / STATE_FILE, same_identity_only=True)
        if visited >= SEARCH_MAX_DIRS:
            break
    return found


def _directory_reasons(location: Location) -> list[Reason]:
    if location.scope != "declared_dir":
        return []
    directory = location.directory
    assert directory is not None
    if not directory.is_dir():
        return [Reason("RIVET_STATE_DIR_MISSING", f"the declared state directory {directory} does not exist: "
                       "the volume is probably not mounted in this task", {"directory": str(directory)})]
    reasons = []
    # A lease folder whose sidecars name no holder is what a refused or finished command may
    # leave: it does not make a new volume a used one.
    if not any(p.name != LEASE_DIR for p in directory.iterdir()) and not any(
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


def _orphans(location: Location, snapshot_header: bytes | None) -> list[Reason]:
    if location.path is None or snapshot_header is None or len(snapshot_header) < 100:
        return []
    reasons = []
    wal, shm = Path(f"{location.path}-wal"), Path(f"{location.path}-shm")
    rollback_mode = snapshot_header[18] == 1
    if rollback_mode and (wal.exists() or shm.exists()):
        reasons.append(Reason("RIVET_STATE_ORPHAN_WAL",
                              f"{wal.name}/{shm.name} lie beside a state in rollback-journal mode: left from another "
                              "copy of the file (a restore or a copy without them)",
                              {"wal": str(wal) if wal.exists() else None, "shm": str(shm) if shm.exists() else None}))
    elif shm.exists() and not wal.exists():
        reasons.append(Reason("RIVET_STATE_ORPHAN_WAL", f"{shm.name} lies beside the state without its -wal",
                              {"shm": str(shm)}))
    return reasons


def _header(location: Location) -> bytes | None:
    if location.path is None or not location.path.is_file():
        return None
    with open(location.path, "rb") as fh:
        return fh.read(100)


@dataclass
class _Progress:
    cursor: str | None = None
    cursor_at: str | None = None
    last_success: str | None = None
    chunks_pending: int = 0
    chunks_total: int = 0
    ledger: bool = False

    @property
    def any(self) -> bool:
        return bool(self.cursor is not None or self.last_success or self.chunks_total or self.ledger)


def _progress(conn: Connection, tables: frozenset[str], names: list[str]) -> dict[str, _Progress]:
    """Per export, only what a verdict needs, by indexed lookups (fast on large states)."""
    e, r, c = schema.exports, schema.runs, schema.chunks
    out = {name: _Progress() for name in names}
    for row in conn.execute(sa.select(e.c.export_name, e.c.cursor_value, e.c.cursor_updated_at)):
        if row.export_name in out:
            out[row.export_name].cursor, out[row.export_name].cursor_at = row.cursor_value, row.cursor_updated_at
    for name, total, pending in conn.execute(
            sa.select(c.c.export_name, sa.func.count(), sa.func.sum(sa.case((c.c.status != "done", 1), else_=0)))
            .group_by(c.c.export_name)):
        if name in out:
            out[name].chunks_total, out[name].chunks_pending = int(total), int(pending or 0)
    # The last succeeded run of each export (a backward scan of ix_rivet_runs_export_started)
    # and whether it has a ledger row: one statement per batch of names, not two per export.
    with_ledger = schema.load_ledger.name in tables
    for start in range(0, len(names), _BATCH):
        batch = names[start:start + _BATCH]
        values = ", ".join(f"(:n{i})" for i in range(len(batch)))
        ledger = (f", EXISTS (SELECT 1 FROM {schema.load_ledger.name} AS l WHERE l.export_name = names.name)"
                  if with_ledger else "")
        query = sa.text(
            f"WITH names(name) AS (VALUES {values}) "
            f"SELECT names.name, (SELECT r.finished_at FROM {r.name} AS r WHERE r.export_name = names.name "
            f"AND r.status = 'succeeded' ORDER BY r.started_at DESC LIMIT 1){ledger} FROM names")
        for row in conn.execute(query, {f"n{i}": name for i, name in enumerate(batch)}):
            out[row[0]].last_success = row[1]
            out[row[0]].ledger = bool(row[2]) if with_ledger else False
    return out


#: Export names per lookup statement (bind parameters stay far below every backend's limit).
_BATCH = 500


def _last_resets(conn: Connection, tables: frozenset[str]) -> dict[str, dict[str, Any]]:
    """The latest ``exports.reset`` audit row of each export, in one pass over those rows."""
    if schema.audit.name not in tables:
        return {}
    a = schema.audit
    found: dict[str, dict[str, Any]] = {}
    for row in conn.execute(sa.select(a.c.at, a.c.actor, a.c.detail).where(a.c.action == "exports.reset")
                            .order_by(a.c.id.desc())):
        try:
            detail = json.loads(row.detail)
        except ValueError:
            continue
        name = detail.get("export") if isinstance(detail, dict) else None
        if isinstance(name, str) and name not in found:
            found[name] = {"at": row.at, "by": row.actor, "detail": detail}
    return found


def _checkpoint(ctx: Context, export: Export, has_progress: bool) -> tuple[list[Reason], str | None, float | None]:
    """Reasons about a CDC export's checkpoint, and the position it resumes from."""
    assert export.cdc is not None
    place = resolve_checkpoint(export.cdc.checkpoint, export.cdc.engine, ctx.location, ctx.config.directory)
    reasons: list[Reason] = []
    if place.warning == "RIVET_STATE_CHECKPOINT_RELATIVE":
        reasons.append(Reason(place.warning, checkpoint_relative_message(export.name, place.path),  # type: ignore[arg-type]
                              {"path": str(place.path)}))
    elif place.warning:
        reasons.append(Reason(place.warning, f"the checkpoint is read from beside the config, {place.path}",
                              {"path": str(place.path)}))
    if place.path is None:
        if export.cdc.engine == "postgres":
            return reasons, "the replication slot's position", None
        reasons.append(Reason("RIVET_STATE_CHECKPOINT_MISSING", place.why, {"configured": None}))
        return reasons, None, None
    if not place.path.is_file():
        if has_progress:
            reasons.append(Reason(
                "RIVET_STATE_CHECKPOINT_MISSING",
                f"the state shows progress for {export.name} but its checkpoint {place.path} is missing: the stream "
                "will re-anchor and the changes between the lost position and the new anchor are lost",
                {"path": str(place.path), "why": place.why}))
        return reasons, None, None
    age = None
    try:
        position = json.loads(place.path.read_bytes())
        age = round(datetime.now(UTC).timestamp() - place.path.stat().st_mtime, 3)
    except (OSError, ValueError) as err:
        reasons.append(Reason("RIVET_STATE_CHECKPOINT_UNREADABLE", f"{place.path} is not readable JSON: {err}",
                              {"path": str(place.path)}))
        return reasons, None, None
    return reasons, f"CDC position {json.dumps(position, sort_keys=True)} in {place.path}", age


def _diagnose(ctx: Context, export: Export, progress: _Progress | None, state_reasons: list[Reason],
              reset: dict[str, Any] | None) -> ExportDiagnosis:
    reasons = list(state_reasons)
    resumes_from: str | None = None
    age: float | None = None
    if progress is not None:
        # A reset clears the cursor and chunk checkpoints and keeps run history and the ledger
        # (history, not progress to resume from): nothing committed since the reset is no progress.
        reset_since = (reset is not None and export.cdc is None and progress.cursor is None
                       and not progress.chunks_total and (progress.last_success or "") <= str(reset["at"]))
        if (not progress.any or reset_since) and export.mode != "full":
            evidence: dict[str, Any] = {"export": export.name, "state": ctx.location.display}
            message = f"the state holds no progress for {export.name}"
            if reset is not None:
                evidence["reset"] = reset
                message += f": it was reset on {reset['at']} by {reset['by']}"
            else:
                message += ": it never finished a run with this state"
            reasons.append(Reason("RIVET_EXPORT_NO_PROGRESS", message, evidence))
        elif export.mode == "incremental" and progress.cursor is not None:
            resumes_from, age = f"cursor {progress.cursor!r}", _age(progress.cursor_at)
        elif export.mode == "chunked" and progress.chunks_pending:
            resumes_from = f"chunk checkpoint: {progress.chunks_total - progress.chunks_pending} of " \
                           f"{progress.chunks_total} chunks done"
        elif progress.last_success:
            resumes_from, age = f"the run finished at {progress.last_success}", _age(progress.last_success)
        if export.mode == "full":
            resumes_from, age = "a full read (by design: a full export keeps no position)", None
    if export.cdc is not None:
        cdc_reasons, position, position_age = _checkpoint(ctx, export, bool(progress and progress.any))
        reasons += cdc_reasons
        if position is not None and progress is not None and progress.any:
            resumes_from, age = position, position_age
    first = any(r.code in FIRST_RUN_CODES for r in reasons)
    return ExportDiagnosis(export.name, export.mode, "first_run" if first else "resumes",
                           None if first else resumes_from, None if first else age, reasons)


def doctor(ctx: Context, export: str | None = None) -> DoctorResult:
    """Diagnose every export (or only ``export``). Never writes.

    Raises the resolver's and config loader's codes and ``RIVET_EXPORT_UNKNOWN``; every
    other finding is a reason in the result.
    """
    location, config = ctx.location, ctx.config
    exports = list(config.exports)
    if export is not None:
        exports = [e for e in exports if e.name == export]
        if not exports:
            raise StateError("RIVET_EXPORT_UNKNOWN", f"export '{export}' is not in {config.path}")
    state: dict[str, Any] = {
        "location": location.as_dict(),
        "set_by": {"default": "nothing (the default: beside the config)", "env": ENV_VAR,
                   "flag": "--state-url"}[location.origin],
        "every_task_must_share": f"{ENV_VAR}={location.state_url}" if location.state_url
        else f"{ENV_VAR} unset (or empty) and the same config path",
    }
    state_reasons = _directory_reasons(location)
    header = _header(location)
    state_reasons += _orphans(location, header)
    backend = ctx.backend()
    snap: Snapshot | None = None
    progress: dict[str, _Progress] = {}
    resets: dict[str, dict[str, Any]] = {}
    try:
        present = backend.present()
        if present:
            with backend.reading() as conn:
                snap = read_snapshot(backend, conn, integrity=False, progress=False)
                if snap.interrupted_write:
                    state_reasons.append(Reason("RIVET_STATE_HOT_JOURNAL", snap.interrupted_write,
                                                {"journal": f"{location.path}-journal"}))
                if snap.known:
                    progress = _progress(conn, snap.tables, [e.name for e in exports])
                    resets = _last_resets(conn, snap.tables)
    except StateError as err:
        if err.code in {r.code for r in state_reasons}:
            present = False  # a declared directory that is missing, already a reason
        elif err.code not in FIRST_RUN_CODES:
            raise  # unreachable, locked, interrupted: no verdict can be given, say why
        else:
            state_reasons.append(Reason(err.code, err.message, err.details))
            present = True
    if not present and not any(r.code == "RIVET_STATE_MISSING" for r in state_reasons):
        state_reasons.append(Reason("RIVET_STATE_MISSING", f"no state at {location.display}: every export starts "
                                    "from nothing", {"path": str(location.path) if location.path else None,
                                                     "state": location.display}))
    if snap is not None:
        state["revision"] = snap.revision or "legacy"
        if snap.pending:
            state_reasons.append(Reason("RIVET_STATE_MIGRATION_PENDING",
                                        f"the state was written by an older release (pending: {', '.join(snap.pending)})",
                                        {"state": location.display, "revision": snap.revision or "legacy",
                                         "pending": snap.pending}))
        if not snap.known:
            state_reasons.append(Reason("RIVET_STATE_SCHEMA_NEWER", f"revision {snap.revision} is unknown here",
                                        {"revision": snap.revision}))
        verdict = identity_verdict(snap.recorded_key, ctx.computed_key, location.scope,
                                   any(p.any for p in progress.values()))
        state["identity"] = {"recorded": snap.recorded_key, "computed": ctx.computed_key, "verdict": verdict.action}
        if verdict.code in ("RIVET_STATE_FOREIGN", "RIVET_STATE_FOREIGN_BESIDE_CONFIG"):
            state_reasons.append(Reason(verdict.code, f"the state at {location.display} belongs to {verdict.recorded}, "
                                        f"this config's source is {verdict.computed}",
                                        {"state": location.display, "recorded": verdict.recorded,
                                         "computed": verdict.computed}))
    if any(r.code in ("RIVET_STATE_MISSING", "RIVET_STATE_DIR_MISSING", "RIVET_STATE_RELOCATED", "RIVET_STATE_FOREIGN")
           for r in state_reasons):
        state["candidates"] = _search(ctx, ctx.computed_key)
    state["reasons"] = [r.as_dict() for r in state_reasons]
    diagnoses = [_diagnose(ctx, e, progress.get(e.name) if snap is not None and snap.known else None, state_reasons,
                           resets.get(e.name)) for e in exports]
    return DoctorResult(diagnoses, state)
