"""Reading a state: its shape, revision, identity and per-export progress, read-only.

Shared by every operation (info, check, migrate, exports, doctor): one reader, so every
command sees a state the same way. Progress (SPEC §3, §5a: whether an export's next run
resumes or is a first run) is one rule, :func:`has_progress`, over one query set: the
statements of this module (:func:`read_snapshot`'s per-export read, :func:`resume_points`
for ``doctor``'s indexed lookups, and the ``LIMIT 1`` probes of "any progress").

Every statement is SQL text with ``:name`` parameters, held here and nowhere else, read
through the :class:`~statetool.backends.base.Reader` of a read session (the backend's own
driver: ``sqlite3`` or psycopg, no SQLAlchemy) or of a write's connection
(:meth:`~statetool.backends.base.Backend.reader`). The SQL is the same on both backends:
table names are unqualified (a PostgreSQL session's ``search_path`` is the state's schema)
and the backend binds the parameters in its driver's style.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from statetool import migrations
from statetool.backends.base import Backend, Reader
from statetool.errors import StateError, moved_away
from statetool.operations.checkpoint_file import MAX_POSITION_DEPTH, json_depth
from statetool.tables import (AUDIT, CDC_POSITIONS, CHUNKS, IDENTITY, IN_FLIGHT_REVISION, LEGACY_TABLES, LINEAGE, LOAD_LEDGER,
                              RELOCATED_REVISION, RUN_AGGREGATES, RUNS, STATE_TABLES, VERSION_TABLE, retired_detail)


def has_progress(cursor: str | None, succeeded_runs: int, chunks: int, ledger_rows: int,
                 position: bool = False) -> bool:
    """THE progress rule (SPEC §3, §5a): an export has progress when the state holds its
    cursor, a succeeded run, a chunk checkpoint, a load-ledger row (counts; any above
    zero counts) or a CDC position (revision 0006: a stream resumes from it, issue 15).
    Without progress its next run is a first run."""
    return bool(cursor is not None or succeeded_runs or chunks or ledger_rows or position)


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
    #: When the CDC position the state holds for it was committed; None without one.
    position_committed_at: str | None = None

    @property
    def has_progress(self) -> bool:
        """SPEC §3 progress of this export (:func:`has_progress`)."""
        return has_progress(self.cursor, self.runs_succeeded, self.chunks_total, self.ledger_rows,
                            self.position_committed_at is not None)

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
    #: The state's lineage id and serial (SPEC §9, revision 0005); None before that
    #: revision, or for a state whose lineage row was removed by hand.
    lineage: str | None = None
    serial: int | None = None
    #: The id of the write that gave the state its serial (revision 0005): two states of one
    #: lineage at one serial with other ids went apart.
    write_id: str | None = None
    #: ``{export: its CDC position's JSON text}`` (revision 0006; ``{}`` before), read in the
    #: same transaction when the read asked for them (``positions``); None otherwise.
    positions: dict[str, str] | None = None

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

    def unknown_revision(self) -> StateError | None:
        """Why this release cannot use the state's revision, or None when it knows it (SPEC
        §7, schema_drift): ``RIVET_STATE_SCHEMA_UNEXPECTED`` for a version table edited by
        hand (empty, or several rows: no release writes either), ``RIVET_STATE_SCHEMA_NEWER``
        for a revision of another or newer release."""
        if self.known:
            return None
        if self.revision is None or "," in self.revision:
            found = "no revision" if self.revision is None else \
                f"several revisions ({self.revision.replace(',', ', ')})"
            return StateError("RIVET_STATE_SCHEMA_UNEXPECTED",
                              f"the state's version table ({VERSION_TABLE}) holds {found}, where every release "
                              "keeps exactly one: it was edited by hand, and which revision its tables have is not "
                              "known")
        return StateError("RIVET_STATE_SCHEMA_NEWER",
                          f"the state is at revision {self.revision}, unknown to this release (its newest is "
                          f"{migrations.head()}): written by a newer or another release")

    @property
    def has_progress(self) -> bool:
        """True when any export has progress (SPEC §3)."""
        if self.any_progress is not None:
            return self.any_progress
        return any(e.has_progress for e in self.exports.values())


def _in_flight_error(where: str, conn: Reader) -> StateError:
    """``RIVET_STATE_MOVE_IN_FLIGHT`` for the target ``where`` of an unfinished move, read
    on ``conn`` (its last ``relocate``/``transfer`` audit row names the source and the
    command that finishes the move)."""
    row = conn.one("SELECT detail FROM rivet_audit WHERE action IN ('relocate', 'transfer') ORDER BY id DESC LIMIT 1")
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


def read_snapshot(backend: Backend, conn: Reader, *, integrity: bool = True, progress: bool = True,
                  full: bool = False, positions: bool = False) -> Snapshot:
    """Read the state on a read-only ``conn``.

    Raises ``RIVET_STATE_NOT_A_STATE`` (no table of the state, or a shape of no release)
    and ``RIVET_STATE_CORRUPT`` (``quick_check`` fails), ``RIVET_STATE_MOVE_IN_FLIGHT``
    (the target of a relocate or transfer that has not retired its source),
    ``RIVET_STATE_RELOCATED`` (a PostgreSQL schema a transfer retired). A revision this release does not
    know is returned with ``known=False`` and no progress read (its tables may differ).
    ``integrity=False`` skips ``quick_check`` and ``progress=False`` the per-export
    progress (both read every page of a large state; ``doctor`` reads only what it needs);
    ``full`` makes the check ``integrity_check`` (``backups verify``, ``restore``);
    ``positions`` reads the CDC positions' texts too (:attr:`Snapshot.positions`).
    """
    where = backend.location.display
    tables = frozenset(backend.table_names(conn))
    ours = tables & STATE_TABLES
    if not tables:
        raise StateError("RIVET_STATE_NOT_A_STATE", f"{where} is a database with no tables, not a rivet state")
    if not ours:
        sample = ", ".join(sorted(tables)[:5])
        raise StateError("RIVET_STATE_NOT_A_STATE",
                         f"{where} is a database of another application (tables: {sample}), not a rivet state")
    problems = backend.integrity_problems(conn, full=full) if integrity else []
    if problems:
        raise StateError("RIVET_STATE_CORRUPT", f"{where} fails its integrity check: {'; '.join(problems[:3])}")
    if VERSION_TABLE in tables:
        versions = [r[0] for r in conn.rows(f"SELECT version_num FROM {VERSION_TABLE}")]
        revision = versions[0] if len(versions) == 1 else ",".join(versions) or None
        legacy = False
        if revision == IN_FLIGHT_REVISION:  # the target of an unfinished move
            raise _in_flight_error(where, conn)
        if revision == RELOCATED_REVISION:  # the old place of a state a transfer moved away
            raise moved_away(where, retired_detail(conn), {"place": where})
    elif LEGACY_TABLES <= tables:
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
        if IDENTITY in tables:
            snap.recorded_key = recorded_key(conn)
        snap.lineage, snap.serial = lineage(conn, tables)
        snap.write_id = write_id_of(conn, tables)
        if positions:
            snap.positions = position_texts(conn, tables)
    return snap


#: The columns of a run as ``last_run`` and ``exports show`` give them, in this order.
RUN_COLUMNS = ("run_id", "mode", "status", "started_at", "finished_at", "rows", "files", "error")
_RUN_SELECT = f"SELECT {', '.join(RUN_COLUMNS)} FROM rivet_runs"
#: ``(export_name, chunks, chunks done)`` per export: the chunk checkpoints.
_CHUNK_COUNTS = ("SELECT export_name, count(*), sum(CASE WHEN status = 'done' THEN 1 ELSE 0 END) "
                 "FROM rivet_chunks GROUP BY export_name")
_CURSORS = "SELECT export_name, cursor_value, cursor_updated_at FROM rivet_exports"


def _read_exports(conn: Reader, tables: frozenset[str]) -> dict[str, ExportProgress]:
    out: dict[str, ExportProgress] = {}

    def get(name: str) -> ExportProgress:
        return out.setdefault(name, ExportProgress(name))

    for name, mode, cursor, cursor_updated_at in conn.rows(
            "SELECT export_name, mode, cursor_value, cursor_updated_at FROM rivet_exports"):
        p = get(name)
        p.mode, p.cursor, p.cursor_updated_at = mode, cursor, cursor_updated_at
    counts = ("SELECT export_name, count(*), sum(CASE WHEN status = 'succeeded' THEN 1 ELSE 0 END), "
              "sum(CASE WHEN status = 'failed' THEN 1 ELSE 0 END), max(started_at) "
              "FROM rivet_runs GROUP BY export_name")
    for name, total, ok, failed, last_started in conn.rows(counts):
        p = get(name)
        p.runs_total, p.runs_succeeded, p.runs_failed = int(total), int(ok or 0), int(failed or 0)
        last = conn.one(f"{_RUN_SELECT} WHERE export_name = :name AND started_at = :started "
                        "ORDER BY run_id DESC LIMIT 1", {"name": name, "started": last_started})
        if last is not None:
            p.last_run = dict(zip(RUN_COLUMNS, last, strict=True))
            p.mode = p.mode or p.last_run["mode"]  # type: ignore[assignment]
    for name, total, done in conn.rows(_CHUNK_COUNTS):
        p = get(name)
        p.chunks_total, p.chunks_done = int(total), int(done or 0)
    if LOAD_LEDGER in tables:
        for name, total in conn.rows("SELECT export_name, count(*) FROM rivet_load_ledger GROUP BY export_name"):
            get(name).ledger_rows = int(total)
    if CDC_POSITIONS in tables:
        for name, committed_at in conn.rows(f"SELECT export_name, committed_at FROM {CDC_POSITIONS}"):
            get(name).position_committed_at = committed_at
    return out


def _any_progress(conn: Reader, tables: frozenset[str]) -> bool:
    """:func:`has_progress` of any export, by one ``LIMIT 1`` probe per fact of the rule
    (a cursor, a succeeded run, a chunk checkpoint, a ledger row, a CDC position): no full scan."""
    probes = [
        "SELECT export_name FROM rivet_exports WHERE cursor_value IS NOT NULL",
        "SELECT run_id FROM rivet_runs WHERE status = 'succeeded'",
        "SELECT run_id FROM rivet_chunks",
    ]
    if LOAD_LEDGER in tables:
        probes.append("SELECT id FROM rivet_load_ledger")
    if CDC_POSITIONS in tables:
        probes.append(f"SELECT export_name FROM {CDC_POSITIONS}")
    return any(conn.one(f"{probe} LIMIT 1") is not None for probe in probes)


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
    #: Whether the state holds a CDC position of it (revision 0006).
    position: bool = False

    @property
    def chunks_pending(self) -> int:
        """Chunk checkpoints not yet done."""
        return self.chunks_total - self.chunks_done

    @property
    def has_progress(self) -> bool:
        """SPEC §3 progress of this export (:func:`has_progress`)."""
        return has_progress(self.cursor, int(self.succeeded), self.chunks_total, int(self.ledger), self.position)


#: Export names per lookup statement (bind parameters stay far below every backend's limit).
_BATCH = 500


def resume_points(conn: Reader, tables: frozenset[str], names: list[str]) -> dict[str, ResumePoint]:
    """Per export of ``names``, only what a first-run verdict needs, by indexed lookups
    (fast on large states): the cursor row, the chunk counts, the CDC positions, and per batch of names one
    statement for the last succeeded run (a backward scan of ``ix_rivet_runs_export_started``)
    and whether a ledger row exists. ``tables`` are the state's (the ledger is optional)."""
    out = {name: ResumePoint() for name in names}
    for name, cursor, cursor_updated_at in conn.rows(_CURSORS):
        if name in out:
            out[name].cursor, out[name].cursor_updated_at = cursor, cursor_updated_at
    for name, total, done in conn.rows(_CHUNK_COUNTS):
        if name in out:
            out[name].chunks_total, out[name].chunks_done = int(total), int(done or 0)
    if CDC_POSITIONS in tables:
        for (name,) in conn.rows(f"SELECT export_name FROM {CDC_POSITIONS}"):
            if name in out:
                out[name].position = True
    with_ledger = LOAD_LEDGER in tables
    for start in range(0, len(names), _BATCH):
        batch = names[start:start + _BATCH]
        values = ", ".join(f"(:n{i})" for i in range(len(batch)))
        ledger = (f", EXISTS (SELECT 1 FROM {LOAD_LEDGER} AS l WHERE l.export_name = names.name)"
                  if with_ledger else "")
        succeeded = "FROM rivet_runs AS r WHERE r.export_name = names.name AND r.status = 'succeeded'"
        query = (f"WITH names(name) AS (VALUES {values}) "
                 f"SELECT names.name, (SELECT r.finished_at {succeeded} ORDER BY r.started_at DESC LIMIT 1), "
                 f"EXISTS (SELECT 1 {succeeded}){ledger} FROM names")
        for row in conn.rows(query, {f"n{i}": name for i, name in enumerate(batch)}):
            point = out[row[0]]
            point.last_success, point.succeeded = row[1], bool(row[2])
            point.ledger = bool(row[3]) if with_ledger else False
    return out


def last_resets(conn: Reader, tables: frozenset[str]) -> dict[str, dict[str, Any]]:
    """``{export: {at, by, detail}}``: the latest ``exports.reset`` audit row of each export
    (a reset clears its progress), in one pass over those rows; ``{}`` without an audit table."""
    if AUDIT not in tables:
        return {}
    found: dict[str, dict[str, Any]] = {}
    for at, actor, text in conn.rows("SELECT at, actor, detail FROM rivet_audit WHERE action = 'exports.reset' "
                                     "ORDER BY id DESC"):
        try:
            detail = json.loads(text)
        except ValueError:
            continue
        name = detail.get("export") if isinstance(detail, dict) else None
        if isinstance(name, str) and name not in found:
            found[name] = {"at": at, "by": actor, "detail": detail}
    return found


def activity(conn: Reader) -> tuple[str | None, int]:
    """``(finished_at of the latest run, how many exports have a cursor)``: what tells two
    candidate states apart (``doctor``'s state search)."""
    last = conn.scalar("SELECT max(finished_at) FROM rivet_runs")
    cursors = conn.scalar("SELECT count(*) FROM rivet_exports WHERE cursor_value IS NOT NULL")
    return last, int(cursors or 0)


def recorded_key(conn: Reader) -> str | None:
    """The ``state_key`` the state records (SPEC §3), None when it records none."""
    return conn.scalar("SELECT state_key FROM rivet_identity") or None


def export_names(conn: Reader) -> set[str]:
    """Every export name the state knows (exports, runs, chunks), without reading progress."""
    return {row[0] for row in conn.rows("SELECT export_name FROM rivet_exports UNION SELECT export_name "
                                        "FROM rivet_runs UNION SELECT export_name FROM rivet_chunks")}


def recent_runs(conn: Reader, name: str, limit: int) -> list[dict[str, object]]:
    """The last ``limit`` runs of export ``name``, newest first, as :data:`RUN_COLUMNS` dicts."""
    query = f"{_RUN_SELECT} WHERE export_name = :name ORDER BY started_at DESC LIMIT :limit"
    return [dict(zip(RUN_COLUMNS, row, strict=True)) for row in conn.rows(query, {"name": name, "limit": limit})]


def row_counts(conn: Reader, tables: set[str] | frozenset[str]) -> dict[str, int]:
    """``{table: rows}`` for the given tables, counted on ``conn``."""
    return {t: int(conn.scalar(f'SELECT count(*) FROM "{t}"') or 0) for t in sorted(tables)}


#: The columns of each table a ``rivet-state/1`` document carries (docs/commands.md,
#: "statetool export"), in this order; those a revision lacks read as null.
CHUNK_COLUMNS = ("run_id", "chunk_index", "lower_bound", "upper_bound", "status", "rows", "updated_at")
LEDGER_COLUMNS = ("id", "table_name", "part", "rows", "loaded_at")
HISTORY_RUN_COLUMNS = (*RUN_COLUMNS, "bytes_read", "duration_ms", "error_code")
AGGREGATE_COLUMNS = ("run_id", "config_path", "started_at", "finished_at", "status", "details_json")
#: The run columns revision 0002 added (with the ledger and the aggregates): absent before it.
_RUN_COLUMNS_0002 = ("bytes_read", "duration_ms", "error_code")


def lineage(conn: Reader, tables: frozenset[str]) -> tuple[str | None, int | None]:
    """``(lineage id, serial)`` of the state's ``rivet_lineage`` row (revision 0005), or
    ``(None, None)`` where the state has no such table or row (SPEC §9; a row removed by
    hand: the next write gives the state a new lineage)."""
    if LINEAGE not in tables:
        return None, None
    row = conn.one(f"SELECT lineage, serial FROM {LINEAGE} WHERE id = 1")
    return (None, None) if row is None else (row[0], None if row[1] is None else int(row[1]))


def position_rows(conn: Reader, tables: frozenset[str],
                  invalid: dict[str, StateError] | None = None) -> dict[str, dict[str, Any]]:
    """``{export: {engine, position, committed_at, run_id, fencing_token}}``: the CDC
    positions the state holds (revision 0006), each position its JSON value
    (:func:`decode_position`); ``{}`` before. A row that holds no position raises its
    ``RIVET_STATE_POSITION_INVALID``, or, given ``invalid``, is put there (``{export:
    error}``) and left out, so that one bad row does not hide the others (a listing)."""
    if CDC_POSITIONS not in tables:
        return {}
    query = f"SELECT export_name, engine, position, committed_at, run_id, fencing_token FROM {CDC_POSITIONS}"
    out = {}
    for name, engine, text, committed_at, run_id, token in conn.rows(query):
        try:
            position = decode_position(name, text)
        except StateError as err:
            if invalid is None:
                raise
            invalid[name] = err
            continue
        out[name] = {"engine": engine, "position": position, "committed_at": committed_at, "run_id": run_id,
                     "fencing_token": None if token is None else int(token)}
    return out


def position_texts(conn: Reader, tables: frozenset[str]) -> dict[str, str]:
    """``{export: its CDC position's JSON text exactly}`` (:func:`position_text` of every
    export that has one); ``{}`` before revision 0006."""
    if CDC_POSITIONS not in tables:
        return {}
    return {row[0]: str(row[1]) for row in conn.rows(f"SELECT export_name, position FROM {CDC_POSITIONS}")}


def write_id_of(conn: Reader, tables: frozenset[str]) -> str | None:
    """The id of the write that gave the state its serial (revision 0005), None before it
    or without a lineage row."""
    return conn.scalar(f"SELECT write_id FROM {LINEAGE} WHERE id = 1") if LINEAGE in tables else None


def decode_position(export: str, text: str) -> object:
    """The value of CDC export ``export``'s position row ``text`` (revision 0006). A row
    holding JSON ``null`` (committed by a release before ``commit_position(None)`` was
    refused or a hand edit), text that is not JSON, or JSON nested deeper than
    :data:`~statetool.operations.checkpoint_file.MAX_POSITION_DEPTH` levels (an older
    release committed it; counted on the text before any parse, which would recurse once
    per level) holds no position, and is never read as "no row", which would make a run
    read the checkpoint file again (issue 15, finding 5): ``RIVET_STATE_POSITION_INVALID``,
    its message saying why."""
    depth = json_depth(str(text))
    if depth > MAX_POSITION_DEPTH:
        raise _invalid(export, f"JSON nested {depth} levels deep, deeper than a position may ({MAX_POSITION_DEPTH} "
                               "levels of arrays and objects; an older release committed it)")
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        value = None
    if value is None:
        raise _invalid(export, f"{str(text)[:80]!r}, which is no position")
    return value


def _invalid(export: str, held: str) -> StateError:
    return StateError("RIVET_STATE_POSITION_INVALID", f"the state's position row for CDC export {export} holds "
                      f"{held}; a run of {export} is refused until it holds one: write the right position to its "
                      f"checkpoint file, then statetool checkpoints import --export {shlex.quote(export)} replaces "
                      "the row with it", {"export": export})


def position_text(conn: Reader, tables: frozenset[str], export: str) -> str | None:
    """THE test of whether the state holds a position row for CDC export ``export``: its
    JSON text exactly, as it was committed or imported from a checkpoint file (so
    ``checkpoints export`` gives the file back byte for byte), or None where there is no
    row (no table before revision 0006). The column is ``NOT NULL``: None is never a row;
    a row holding JSON null is the text ``"null"`` (:func:`decode_position` refuses it)."""
    if CDC_POSITIONS not in tables:
        return None
    text = conn.scalar(f"SELECT position FROM {CDC_POSITIONS} WHERE export_name = :e", {"e": export})
    return None if text is None else str(text)


def _by_export(conn: Reader, table: str, columns: tuple[str, ...], order: str,
               absent: tuple[str, ...] = ()) -> dict[str, list[dict[str, Any]]]:
    """``{export: [row as {column: value}]}`` of ``table`` in ``order``; ``absent`` columns
    (not in this revision) read as null."""
    select = ", ".join("NULL" if c in absent else c for c in columns)
    out: dict[str, list[dict[str, Any]]] = {}
    for row in conn.rows(f"SELECT export_name, {select} FROM {table} ORDER BY export_name, {order}"):
        out.setdefault(row[0], []).append(dict(zip(columns, row[1:], strict=True)))
    return out


def chunk_rows(conn: Reader) -> dict[str, list[dict[str, Any]]]:
    """Every chunk checkpoint, per export, by run and chunk index (:data:`CHUNK_COLUMNS`)."""
    return _by_export(conn, CHUNKS, CHUNK_COLUMNS, "run_id, chunk_index")


def ledger_rows(conn: Reader, tables: frozenset[str]) -> dict[str, list[dict[str, Any]]]:
    """Every load-ledger row, per export, by id (:data:`LEDGER_COLUMNS`); ``{}`` before revision 0002."""
    return _by_export(conn, LOAD_LEDGER, LEDGER_COLUMNS, "id") if LOAD_LEDGER in tables else {}


def run_rows(conn: Reader, tables: frozenset[str]) -> dict[str, list[dict[str, Any]]]:
    """Every run, per export, oldest first (:data:`HISTORY_RUN_COLUMNS`; the columns of
    revision 0002 null before it)."""
    absent = () if LOAD_LEDGER in tables else _RUN_COLUMNS_0002
    return _by_export(conn, RUNS, HISTORY_RUN_COLUMNS, "started_at, run_id", absent)


def aggregate_rows(conn: Reader, tables: frozenset[str]) -> list[dict[str, Any]]:
    """Every ``rivet_run_aggregates`` row by start and run id (:data:`AGGREGATE_COLUMNS`); ``[]`` before 0002."""
    if RUN_AGGREGATES not in tables:
        return []
    rows = conn.rows(f"SELECT {', '.join(AGGREGATE_COLUMNS)} FROM {RUN_AGGREGATES} ORDER BY started_at, run_id")
    return [dict(zip(AGGREGATE_COLUMNS, row, strict=True)) for row in rows]


def export_rows(conn: Reader) -> dict[str, tuple[str, str | None, str | None, str]]:
    """``{export: (mode, cursor_value, cursor_updated_at, updated_at)}``: the ``rivet_exports`` rows."""
    return {row[0]: row[1:] for row in conn.rows(  # type: ignore[misc]
        "SELECT export_name, mode, cursor_value, cursor_updated_at, updated_at FROM rivet_exports")}


def last_successes(conn: Reader) -> dict[str, str | None]:
    """``{export: finished_at of its latest succeeded run}`` (by ``started_at``)."""
    rows = conn.rows("SELECT r.export_name, r.finished_at FROM rivet_runs AS r WHERE r.status = 'succeeded' AND "
                     "r.started_at = (SELECT max(s.started_at) FROM rivet_runs AS s WHERE s.export_name = "
                     "r.export_name AND s.status = 'succeeded') ORDER BY r.run_id")
    return {name: finished for name, finished in rows}


def run_statuses(conn: Reader) -> dict[str, dict[str, int]]:
    """``{export: {status: runs}}``: the runs the state holds, counted per export and
    status (``succeeded``, ``failed``, ``running``, whatever a run recorded)."""
    out: dict[str, dict[str, int]] = {}
    for name, status, total in conn.rows("SELECT export_name, status, count(*) FROM rivet_runs "
                                         "GROUP BY export_name, status"):
        out.setdefault(name, {})[str(status)] = int(total)
    return out
