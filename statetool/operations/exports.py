"""``statetool exports set-cursor | reset``: deliberate changes to one export's progress.

Each holds the export's run lease (``chunk-run:<export>``, waited on up to
``--lock-wait``), passes the whole pre-flight, backs a SQLite state up first (verified),
writes an audit row with what was there before, and says what the next run will do. Each
is planned first (:func:`~statetool.operations.writes.plan_write`), by the one function
its ``--dry-run`` returns the plan of.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sqlalchemy as sa

from statetool import schema
from statetool.errors import StateError, StateWarning
from statetool.operations.context import Context, now_iso
from statetool.operations.doctor import Planned, doctor, next_run_words
from statetool.operations.probe import ExportProgress, Snapshot
from statetool.operations.writes import WritePlan, one_export, plan_write, write_planned


@dataclass
class ExportChange:
    """The outcome of a change: before and after, the backup, and what the next run will do.

    In a dry run (``dry_run``) nothing was done: ``before`` and ``after`` are the planned
    change, ``backup`` and ``diagnosis`` are None, and ``plan`` (also given by the real
    run: what it planned) says what the real run would write
    (:class:`~statetool.operations.writes.WritePlan`)."""

    export: str
    action: str
    before: dict[str, object]
    after: dict[str, object]
    next_run: str
    backup: str | None
    warnings: list[StateWarning] = field(default_factory=list)
    #: What ``doctor --export`` says of the export once the change is committed (its
    #: ``exports[0]``), None when the state could not be read again (or in a dry run).
    diagnosis: dict[str, object] | None = None
    dry_run: bool = False
    plan: dict[str, object] | None = None

    def as_dict(self) -> dict[str, object]:
        """JSON shape of the change."""
        return {"export": self.export, "action": self.action, "before": self.before, "after": self.after,
                "next_run": self.next_run, "backup": self.backup, "warnings": [w.as_dict() for w in self.warnings],
                "diagnosis": self.diagnosis, "dry_run": self.dry_run, "plan": self.plan}


def _diagnosis(ctx: Context, name: str, planned: Planned | None = None) -> dict[str, object] | None:
    """``doctor``'s verdict on export ``name`` after a change (issue 12 item 3: the next run
    is described by the one judge of it, not by the cursor alone): once it is committed,
    or, with ``planned`` (a dry run), as it will be once the planned change is
    (:class:`~statetool.operations.doctor.Planned`). Its ``exports[0]`` document, or None
    for an export not in the config or a state that cannot be read (again: that read is
    only the change's description)."""
    if ctx.config.export(name) is None:
        return None
    try:
        return doctor(ctx, name, planned).exports[0].as_dict()
    except StateError:
        return None


def _next_run(diagnosis: dict[str, object] | None, unjudged: str) -> str:
    """``next_run`` of a change, the dry run's and the real run's by one rule: doctor's
    words for ``diagnosis`` (:func:`_diagnosis`), or ``unjudged`` (the change's own words)
    where doctor gives none (an export only the state knows, a state it could not read)."""
    return unjudged if diagnosis is None else next_run_words(diagnosis)


def _known(ctx: Context, snapshot: Snapshot, name: str) -> str:
    export = ctx.config.export(name)
    if export is None and name not in snapshot.exports:
        raise StateError("RIVET_EXPORT_UNKNOWN", f"export '{name}' is in neither {ctx.config.path} nor the state")
    return export.mode if export else (snapshot.exports[name].mode or "incremental")


def _plan(ctx: Context, name: str, action: str, dry_run: bool) -> tuple[WritePlan, ExportProgress]:
    """The plan of ``exports <action> NAME`` (its lease, backup, pre-flight and the
    unknown-export check, run by its dry run and its real run alike) and the export's
    progress as the pre-flight read it (empty for an export only the config knows)."""
    plan = plan_write(ctx, one_export(name), f"exports.{action}", backup_label=f"{action}-{name}",
                      check=lambda snap: _known(ctx, snap, name), dry_run=dry_run)
    return plan, plan.snapshot.exports.get(name) or ExportProgress(name)


def _planned(name: str, action: str, plan: WritePlan, before: dict[str, object], after: dict[str, object],
             next_run: str) -> ExportChange:
    """The result of a dry run: the planned change; nothing done."""
    return ExportChange(name, action, before, after, next_run, None, plan.warnings, dry_run=True,
                        plan=plan.as_dict())


def set_cursor(ctx: Context, name: str, value: str, *, dry_run: bool = False) -> ExportChange:
    """Set export ``name``'s cursor to ``value`` (rewind or advance, on purpose).

    Raises ``RIVET_CLI_USAGE`` for an empty cursor or one holding control characters (a
    terminal escape, a newline: never a value a source would give), ``RIVET_EXPORT_UNKNOWN``
    and every pre-flight code; nothing is written then. ``dry_run`` makes the same checks
    and returns the plan: the cursor before and after, the backup, the lease; it writes
    nothing and creates no file.
    """
    if not value.strip() or any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise StateError("RIVET_CLI_USAGE", f"cursor {value!r} is empty or holds control characters; give the value "
                         "the export's cursor column holds (to start over, use statetool exports reset)")
    plan, progress = _plan(ctx, name, "set-cursor", dry_run)
    plan.change("cursor", progress.cursor, value)
    unjudged = f"resumes after cursor {value!r}"
    if dry_run:
        foreseen = _diagnosis(ctx, name, Planned(name, value))
        return _planned(name, "set-cursor", plan, {"cursor": progress.cursor}, {"cursor": value},
                        _next_run(foreseen, unjudged))
    e = schema.exports
    with write_planned(ctx, plan) as session:
        mode = _known(ctx, session.snapshot, name)
        conn = session.conn
        old = conn.execute(sa.select(e.c.cursor_value).where(e.c.export_name == name)).scalar()
        now = now_iso()
        updated = conn.execute(sa.update(e).where(e.c.export_name == name)
                               .values(cursor_value=value, cursor_updated_at=now, updated_at=now)).rowcount
        if not updated:
            conn.execute(sa.insert(e).values(export_name=name, mode=mode, cursor_value=value,
                                             cursor_updated_at=now, updated_at=now))
        session.audit(plan.audit[0], {"export": name, "old": old, "new": value})
        backup, warnings = session.backup, session.warnings
    diagnosis = _diagnosis(ctx, name)
    return ExportChange(name, "set-cursor", {"cursor": old}, {"cursor": value}, _next_run(diagnosis, unjudged),
                        str(backup) if backup else None, warnings, diagnosis, plan=plan.as_dict())


def reset(ctx: Context, name: str, *, dry_run: bool = False) -> ExportChange:
    """Make export ``name``'s next run a FIRST RUN: clear its cursor and chunk checkpoints.

    Run history and the load ledger are kept (they are history, not progress to resume
    from), and so is a CDC export's stream position (its next run resumes from it).
    ``next_run`` is doctor's verdict on the export once reset, in the dry run foreseen by
    the same rule (:func:`_next_run`). Raises ``RIVET_EXPORT_UNKNOWN`` and every pre-flight code. ``dry_run`` makes
    the same checks and returns the plan: the cursor and the chunk checkpoints it would
    remove (with their count), the runs and ledger rows it keeps, the backup, the lease;
    it writes nothing and creates no file.
    """
    plan, progress = _plan(ctx, name, "reset", dry_run)
    plan.change("cursor", progress.cursor, None)
    plan.change("chunk checkpoints", progress.chunks_total, 0)
    plan.change("runs", progress.runs_total, progress.runs_total)
    plan.change("load-ledger rows", progress.ledger_rows, progress.ledger_rows)
    unjudged = "FIRST RUN: reads everything from the start"
    if dry_run:
        foreseen = _diagnosis(ctx, name, Planned(name, None, reset=True, by=ctx.actor))
        return _planned(name, "reset", plan, {"cursor": progress.cursor, "chunks": progress.chunks_total},
                        {"cursor": None, "chunks": 0}, _next_run(foreseen, unjudged))
    e, c = schema.exports, schema.chunks
    with write_planned(ctx, plan) as session:
        _known(ctx, session.snapshot, name)
        conn = session.conn
        old = conn.execute(sa.select(e.c.cursor_value).where(e.c.export_name == name)).scalar()
        chunks = conn.execute(sa.delete(c).where(c.c.export_name == name)).rowcount
        conn.execute(sa.update(e).where(e.c.export_name == name)
                     .values(cursor_value=None, cursor_updated_at=None, updated_at=now_iso()))
        session.audit(plan.audit[0], {"export": name, "old_cursor": old, "chunks_removed": chunks})
        backup, warnings = session.backup, session.warnings
    diagnosis = _diagnosis(ctx, name)
    return ExportChange(name, "reset", {"cursor": old, "chunks": chunks}, {"cursor": None, "chunks": 0},
                        _next_run(diagnosis, unjudged), str(backup) if backup else None, warnings, diagnosis,
                        plan=plan.as_dict())
