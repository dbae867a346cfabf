"""Reading a state: its shape, revision, identity and per-export progress, read-only.

Shared by every operation (info, check, migrate, exports, doctor): one reader, so every
command sees a state the same way. Progress (SPEC §3, §5a: whether an export's next run
resumes or is a first run) is one rule, :func:`has_progress`, over one query set: the
statements of this module (:func:`read_snapshot`'s per-export read, :func:`resume_points`
for ``doctor``'s indexed lookups, and the ``LIMIT 1`` probes of "any progress").
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from statetool import migrations, schema
from statetool.backends.base import Backend
from statetool.errors import StateError


def has_progress(cursor: str | None, succeeded_runs: int, chunks: int, ledger_rows: int) -> bool:
    """THE progress rule (SPEC §3, §5a): an export has progress when the state holds its
    cursor, a succeeded run, a chunk checkpoint or a load-ledger row (counts; any above
    zero counts). Without progress its next run is a first run."""
    return bool(cursor is not None or succeeded_runs or chunks or ledger_rows)


@dataclass
class ExportProgress:
    """What a state holds for one export. Times are ISO-8601 UTC text."""

    name: str
    mode: str | None = None
    cursor: str | None = None
    cursor_updated_at: str | None = None
    runs_total: int = 0
    runs_succeeded: int = 0
    runs_failed: int = 0
    last_run: dict[str, object] | None = None
    chunks_total: int = 0
    chunks_done: int = 0
    ledger_rows: int = 0

    @property
    def has_progress(self) -> bool:
        """SPEC §3 progress of this export (:func:`has_progress`)."""
        return has_progress(self.cursor, self.runs_succeeded, self.chunks_total, self.ledger_rows)

    def as_dict(self) -> dict[str, object]:
        """JSON shape of the export's progress."""
        return asdict(self)


@dataclass
class Snapshot:
    """A state as read. ``revision`` is the version table's value, ``None`` for a legacy
    state (whose shape is revision 0001); ``known`` says whether this release knows it."""

    tables: frozenset[str]
    legacy: bool
    revision: str | None
    known: bool
    recorded_key: str | None = None
    exports: dict[str, ExportProgress] = field(default_factory=dict)
    integrity: list[str] = field(default_factory=list)
    #: Whether any export has progress, when per-export progress was not read.
    any_progress: bool | None = None
    #: Set when the state was read as it was before a write that was killed mid-transaction
    #: (a SQLite hot journal rolled back in a private copy): the sentence that says so.
    interrupted_write: str | None = None

    @property
    def effective_revision(self) -> str | None:
        """The revision whose shape the state has (``0001`` for a legacy state)."""
        return migrations.revisions()[0].id if self.legacy else self.revision

    @property
    def pending(self) -> list[str]:
        """Revisions between the state and head, oldest first (empty when unknown)."""
        if not self.known:
            return []
        return [r.id for r in migrations.steps(self.effective_revision, migrations.head())[1]]

    @property
    def has_progress(self) -> bool:
        """True when any export has progress (SPEC §3)."""
        if self.any_progress is not None:
            return self.any_progress
        return any(e.has_progress for e in self.exports.values())


def _in_flight_error(where: str, conn: Connection) -> StateError:
    """``RIVET_STATE_MOVE_IN_FLIGHT`` for the target ``where`` of an unfinished move, read
    on ``conn`` (its last ``relocate``/``transfer`` audit row names the source and the
    command that finishes the move)."""
    row = conn.execute(sa.text("SELECT detail FROM rivet_audit WHERE action IN ('relocate', 'transfer') "
                               "ORDER BY id DESC LIMIT 1")).first()
    detail: dict[str, Any] = {}
    if row is not None:
        try:
            loaded = json.loads(row[0])
        except ValueError:
            loaded = {}
        detail = loaded if isinstance(loaded, dict) else {}
    source, finish = detail.get("from", "?"), detail.get("finish", "the same relocate or transfer again")
    return StateError("RIVET_STATE_MOVE_IN_FLIGHT",
                      f"{where} is the target of a move from {source} that has not finished: it is not live until "
                      f"the source is retired, and the source stays the live state until then. Finish the move with: "
                      f"{finish}", {"place": where, "from": source, "finish": finish})


def read_snapshot(backend: Backend, conn: Connection, *, integrity: bool = True, progress: bool = True) -> Snapshot:
    """Read the state on a read-only ``conn``.

    Raises ``RIVET_STATE_NOT_A_STATE`` (no table of the state, or a shape of no release)
    and ``RIVET_STATE_CORRUPT`` (``quick_check`` fails), ``RIVET_STATE_MOVE_IN_FLIGHT``
    (the target of a relocate or transfer that has not retired its source). A revision this release does not
    know is returned with ``known=False`` and no progress read (its tables may differ).
    ``integrity=False`` skips ``quick_check`` and ``progress=False`` the per-export
    progress (both read every page of a large state; ``doctor`` reads only what it needs).
    """
    where = backend.location.display
    tables = frozenset(backend.table_names(conn))
    ours = tables & schema.STATE_TABLES
    if not tables:
        raise StateError("RIVET_STATE_NOT_A_STATE", f"{where} is a database with no tables, not a rivet state")
    if not ours:
        sample = ", ".join(sorted(tables)[:5])
        raise StateError("RIVET_STATE_NOT_A_STATE",
                         f"{where} is a database of another application (tables: {sample}), not a rivet state")
    problems = backend.integrity_problems(conn) if integrity else []
    if problems:
        raise StateError("RIVET_STATE_CORRUPT", f"{where} fails its integrity check: {'; '.join(problems[:3])}")
    if schema.VERSION_TABLE in tables:
        versions = [r[0] for r in conn.execute(sa.text(f"SELECT version_num FROM {schema.VERSION_TABLE}")).all()]
        revision = versions[0] if len(versions) == 1 else ",".join(versions) or None
        legacy = False
        if revision == schema.IN_FLIGHT_REVISION:  # the target of an unfinished move
            raise _in_flight_error(where, conn)
    elif schema.LEGACY_TABLES <= tables:
        revision, legacy = None, True
    else:
        raise StateError("RIVET_STATE_NOT_A_STATE",
                         f"{where} has some rivet tables ({', '.join(sorted(ours))}) but neither a version "
                         "table nor the shape of any release")
    try:
        migrations.index_of(revision if not legacy else migrations.revisions()[0].id)
        known = revision is not None or legacy
    except KeyError:
        known = False
    snap = Snapshot(tables, legacy, revision, known, interrupted_write=conn.info.get("interrupted_write"))
    if known:
        if progress:
            snap.exports = _read_exports(conn, tables)
        else:
            snap.any_progress = _any_progress(conn, tables)
        if schema.identity.name in tables:
            snap.recorded_key = recorded_key(conn)
    return snap


def _read_exports(conn: Connection, tables: frozenset[str]) -> dict[str, ExportProgress]:
    out: dict[str, ExportProgress] = {}

    def get(name: str) -> ExportProgress:
        return out.setdefault(name, ExportProgress(name))

    e, r = schema.exports, schema.runs
    for row in conn.execute(sa.select(e.c.export_name, e.c.mode, e.c.cursor_value, e.c.cursor_updated_at)):
        p = get(row.export_name)
        p.mode, p.cursor, p.cursor_updated_at = row.mode, row.cursor_value, row.cursor_updated_at
    counts = sa.select(
        r.c.export_name,
        sa.func.count(),
        sa.func.sum(sa.case((r.c.status == "succeeded", 1), else_=0)),
        sa.func.sum(sa.case((r.c.status == "failed", 1), else_=0)),
        sa.func.max(r.c.started_at),
    ).group_by(r.c.export_name)
    for name, total, ok, failed, last_started in conn.execute(counts):
        p = get(name)
        p.runs_total, p.runs_succeeded, p.runs_failed = int(total), int(ok or 0), int(failed or 0)
        last = conn.execute(
            sa.select(r.c.run_id, r.c.mode, r.c.status, r.c.started_at, r.c.finished_at, r.c.rows, r.c.files, r.c.error)
            .where(r.c.export_name == name, r.c.started_at == last_started).order_by(r.c.run_id.desc()).limit(1)
        ).first()
        if last is not None:
            p.last_run = dict(last._mapping)
            p.mode = p.mode or last.mode
    for name, total, done in conn.execute(_chunk_counts()):
        p = get(name)
        p.chunks_total, p.chunks_done = int(total), int(done or 0)
    if schema.load_ledger.name in tables:
        ledger = schema.load_ledger
        for name, total in conn.execute(sa.select(ledger.c.export_name, sa.func.count()).group_by(ledger.c.export_name)):
            get(name).ledger_rows = int(total)
    return out


def _chunk_counts() -> sa.Select[Any]:
    """``(export_name, chunks, chunks done)`` per export: the chunk checkpoints."""
    c = schema.chunks
    return sa.select(c.c.export_name, sa.func.count(),
                     sa.func.sum(sa.case((c.c.status == "done", 1), else_=0))).group_by(c.c.export_name)


def _any_progress(conn: Connection, tables: frozenset[str]) -> bool:
    """:func:`has_progress` of any export, by one ``LIMIT 1`` probe per fact of the rule
    (a cursor, a succeeded run, a chunk checkpoint, a ledger row): no full scan."""
    probes = [
        sa.select(schema.exports.c.export_name).where(schema.exports.c.cursor_value.is_not(None)),
        sa.select(schema.runs.c.run_id).where(schema.runs.c.status == "succeeded"),
        sa.select(schema.chunks.c.run_id),
    ]
    if schema.load_ledger.name in tables:
        probes.append(sa.select(schema.load_ledger.c.id))
    return any(conn.execute(probe.limit(1)).first() is not None for probe in probes)


@dataclass
class ResumePoint:
    """What one export's next run resumes from (SPEC §5a), as ``doctor`` reads it: its
    cursor and when it was set, the ``finished_at`` of its last succeeded run, its chunk
    checkpoints, whether the load ledger holds a row of it. Times are ISO-8601 UTC text."""

    cursor: str | None = None
    cursor_updated_at: str | None = None
    succeeded: bool = False
    last_success: str | None = None
    chunks_total: int = 0
    chunks_done: int = 0
    ledger: bool = False

    @property
    def chunks_pending(self) -> int:
        """Chunk checkpoints not yet done."""
        return self.chunks_total - self.chunks_done

    @property
    def has_progress(self) -> bool:
        """SPEC §3 progress of this export (:func:`has_progress`)."""
        return has_progress(self.cursor, int(self.succeeded), self.chunks_total, int(self.ledger))


#: Export names per lookup statement (bind parameters stay far below every backend's limit).
_BATCH = 500


def resume_points(conn: Connection, tables: frozenset[str], names: list[str]) -> dict[str, ResumePoint]:
    """Per export of ``names``, only what a first-run verdict needs, by indexed lookups
    (fast on large states): the cursor row, the chunk counts, and per batch of names one
    statement for the last succeeded run (a backward scan of ``ix_rivet_runs_export_started``)
    and whether a ledger row exists. ``tables`` are the state's (the ledger is optional)."""
    e, r = schema.exports, schema.runs
    out = {name: ResumePoint() for name in names}
    for row in conn.execute(sa.select(e.c.export_name, e.c.cursor_value, e.c.cursor_updated_at)):
        if row.export_name in out:
            out[row.export_name].cursor, out[row.export_name].cursor_updated_at = row.cursor_value, row.cursor_updated_at
    for name, total, done in conn.execute(_chunk_counts()):
        if name in out:
            out[name].chunks_total, out[name].chunks_done = int(total), int(done or 0)
    with_ledger = schema.load_ledger.name in tables
    for start in range(0, len(names), _BATCH):
        batch = names[start:start + _BATCH]
        values = ", ".join(f"(:n{i})" for i in range(len(batch)))
        ledger = (f", EXISTS (SELECT 1 FROM {schema.load_ledger.name} AS l WHERE l.export_name = names.name)"
                  if with_ledger else "")
        succeeded = f"FROM {r.name} AS r WHERE r.export_name = names.name AND r.status = 'succeeded'"
        query = sa.text(
            f"WITH names(name) AS (VALUES {values}) "
            f"SELECT names.name, (SELECT r.finished_at {succeeded} ORDER BY r.started_at DESC LIMIT 1), "
            f"EXISTS (SELECT 1 {succeeded}){ledger} FROM names")
        for row in conn.execute(query, {f"n{i}": name for i, name in enumerate(batch)}):
            point = out[row[0]]
            point.last_success, point.succeeded = row[1], bool(row[2])
            point.ledger = bool(row[3]) if with_ledger else False
    return out


def last_resets(conn: Connection, tables: frozenset[str]) -> dict[str, dict[str, Any]]:
    """``{export: {at, by, detail}}``: the latest ``exports.reset`` audit row of each export
    (a reset clears its progress), in one pass over those rows; ``{}`` without an audit table."""
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


def activity(conn: Connection) -> tuple[str | None, int]:
    """``(finished_at of the latest run, how many exports have a cursor)``: what tells two
    candidate states apart (``doctor``'s state search)."""
    last = conn.execute(sa.select(sa.func.max(schema.runs.c.finished_at))).scalar()
    cursors = conn.execute(sa.select(sa.func.count()).select_from(schema.exports)
                           .where(schema.exports.c.cursor_value.is_not(None))).scalar()
    return last, int(cursors or 0)


def recorded_key(conn: Connection) -> str | None:
    """The ``state_key`` the state records (SPEC §3), None when it records none."""
    return conn.execute(sa.select(schema.identity.c.state_key)).scalar() or None


def export_names(conn: Connection) -> set[str]:
    """Every export name the state knows (exports, runs, chunks), without reading progress."""
    e, r, c = schema.exports, schema.runs, schema.chunks
    query = sa.union(sa.select(e.c.export_name), sa.select(r.c.export_name).distinct(),
                     sa.select(c.c.export_name).distinct())
    return {row[0] for row in conn.execute(query)}


def row_counts(conn: Connection, tables: set[str] | frozenset[str]) -> dict[str, int]:
    """``{table: rows}`` for the given tables, counted on ``conn``."""
    return {t: int(conn.execute(sa.text(f'SELECT count(*) FROM "{t}"')).scalar() or 0) for t in sorted(tables)}
