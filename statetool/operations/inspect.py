"""Read-only operations: ``info``, ``revisions``, ``exports list`` and ``exports show``."""

from __future__ import annotations

from dataclasses import dataclass, field

from statetool import migrations
from statetool.backends import orphan_companions
from statetool.errors import StateError, StateWarning
from statetool.identity import identity_message
from statetool.operations.context import Context
from statetool.operations.leasing import list_leases
from statetool.operations.preflight import DESCRIBABLE, raise_failures, run_preflight
from statetool.operations.probe import ExportProgress, Snapshot, recent_runs


@dataclass
class InfoResult:
    """Everything ``statetool info`` shows. ``as_dict`` keys are stable (SPEC §10)."""

    location: dict[str, object]
    revision: dict[str, object]
    identity: dict[str, object]
    exports: list[dict[str, object]]
    warnings: list[dict[str, str]]
    leases: list[dict[str, object]]
    #: ``{"id": lineage UUID, "serial": int}`` (SPEC §9; both null before revision 0005 or
    #: without a state).
    lineage: dict[str, object] = field(default_factory=dict)
    #: Every CDC export's checkpoint as ``statetool checkpoints`` reports it, with
    #: ``stored_in`` (SPEC §8 lists checkpoints among what info shows; issue 15 item 5).
    checkpoints: list[dict[str, object]] = field(default_factory=list)
    #: The pre-flight's failures a read describes instead of refusing (``DESCRIBABLE``: a
    #: missing state, a revision pending or unknown, a foreign identity), in check order.
    #: Not in ``as_dict`` (``check`` reports them); ``statetool metrics`` reads some as a
    #: state that is down (issue 16 item 3).
    failures: list[StateError] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, object]:
        """``{location, revision, identity, exports, warnings, leases, lineage, checkpoints}``
        (the first five never change; later keys are only ever added)."""
        return {"location": self.location, "revision": self.revision, "identity": self.identity,
                "exports": self.exports, "warnings": self.warnings, "leases": self.leases, "lineage": self.lineage,
                "checkpoints": self.checkpoints}


def _revision_doc(snap: Snapshot | None) -> dict[str, object]:
    head = migrations.head()
    if snap is None:
        return {"current": None, "head": head, "pending": [], "legacy": False, "status": "missing"}
    status = "unknown" if not snap.known else "legacy" if snap.legacy else "pending" if snap.pending else "head"
    return {"current": snap.revision, "head": head, "pending": snap.pending, "legacy": snap.legacy, "status": status}


def _export_rows(ctx: Context, snap: Snapshot | None) -> list[dict[str, object]]:
    in_state = snap.exports if snap else {}
    rows: list[dict[str, object]] = []
    for export in ctx.config.exports:
        progress = in_state.get(export.name, ExportProgress(export.name))
        doc = progress.as_dict()
        doc.update(mode=export.mode, in_config=True, in_state=export.name in in_state)
        rows.append(doc)
    for name in sorted(set(in_state) - {e.name for e in ctx.config.exports}):
        doc = in_state[name].as_dict()
        doc.update(in_config=False, in_state=True)
        rows.append(doc)
    return rows


def info(ctx: Context) -> InfoResult:
    """Where the state is and why, its revision, identity, per-export progress and warnings.

    A missing state is reported (revision status ``missing``), not refused. Raises the
    resolver's and config's codes, and ``RIVET_STATE_NOT_A_STATE``,
    ``RIVET_STATE_CORRUPT``, ``RIVET_STATE_INTERRUPTED_WRITE``,
    ``RIVET_STATE_UNREACHABLE`` when there is no state to describe.
    """
    pf = run_preflight(ctx)
    raise_failures(pf, allow=DESCRIBABLE)
    snap = pf.snapshot
    verdict = pf.verdict
    identity: dict[str, object] = {
        "recorded": snap.recorded_key if snap else None,
        "computed": ctx.computed_key,
        "verdict": verdict.action if verdict else ("skip" if not ctx.computed_key else "none"),
        "code": verdict.code if verdict else None,
        "message": identity_message(verdict, str(ctx.location.directory or ctx.location.display), False)
        if verdict else "no state: nothing recorded",
    }
    from statetool.operations.checkpoints import checkpoints

    cdc = checkpoints(ctx)
    warnings = [w.as_dict() for w in pf.warnings + _companion_warnings(ctx, pf.warnings) + cdc.warnings]
    leases = list_leases(ctx).leases if snap is not None and snap.known else []
    location = ctx.location
    # A symlinked state file: the configured path and the file it resolves to, both shown.
    where = {**location.as_dict(), "real_path": str(location.real_path) if location.real_path else None}
    return InfoResult(where, _revision_doc(snap), identity, _export_rows(ctx, snap), warnings,
                      leases, {"id": snap.lineage if snap else None, "serial": snap.serial if snap else None},
                      [c.as_dict() for c in cdc.checkpoints], [c.error for c in pf.failures if c.error is not None])


def _companion_warnings(ctx: Context, given: list[StateWarning]) -> list[StateWarning]:
    """``RIVET_STATE_ORPHAN_WAL`` for a ``-wal``/``-shm`` the state did not leave, judged where
    ``doctor`` and ``check`` judge it (:func:`statetool.backends.orphan_companions`), unless
    ``given`` already has it: a write refuses such a file (``RIVET_STATE_FOREIGN_WAL``), and
    info shows the warnings a write would give (issue 12 fixB item 5)."""
    orphans = orphan_companions(ctx.location)
    if orphans is None or any(w.code == "RIVET_STATE_ORPHAN_WAL" for w in given):
        return []
    return [StateWarning("RIVET_STATE_ORPHAN_WAL", orphans.message)]


@dataclass
class RevisionsResult:
    """Every revision, oldest first, with ``applied`` for the state at hand."""

    revisions: list[dict[str, object]] = field(default_factory=list)
    current: str | None = None

    def as_dict(self) -> dict[str, object]:
        """``{"revisions": [{"id", "description", "applied"}], "current"}``."""
        return {"revisions": self.revisions, "current": self.current}


def revisions(ctx: Context) -> RevisionsResult:
    """The revisions of this release and which the state has (none when there is no state)."""
    pf = run_preflight(ctx)
    raise_failures(pf, allow=DESCRIBABLE)
    snap = pf.snapshot
    applied_upto = -1
    if snap is not None and snap.known:
        applied_upto = migrations.index_of(snap.effective_revision)
    rows = [dict(r.as_dict(), applied=i <= applied_upto) for i, r in enumerate(migrations.revisions())]
    return RevisionsResult(rows, snap.revision if snap else None)


@dataclass
class ExportDetail:
    """One export: its progress and its most recent runs (newest first)."""

    export: dict[str, object]
    recent_runs: list[dict[str, object]]
    warnings: list[dict[str, str]] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        """``{"export": {...}, "recent_runs": [...], "warnings": [...]}``."""
        return {"export": self.export, "recent_runs": self.recent_runs, "warnings": self.warnings}


def export_show(ctx: Context, name: str, limit: int = 10) -> ExportDetail:
    """One export's progress and last ``limit`` runs. Raises ``RIVET_EXPORT_UNKNOWN``."""
    described = info(ctx)
    rows = {row["name"]: row for row in described.exports}
    if name not in rows:
        raise StateError("RIVET_EXPORT_UNKNOWN", f"export '{name}' is in neither {ctx.config.path} nor the state")
    recent: list[dict[str, object]] = []
    if rows[name]["in_state"]:
        with ctx.backend().reading() as conn:
            recent = recent_runs(conn, name, limit)
    return ExportDetail(rows[name], recent, described.warnings)
