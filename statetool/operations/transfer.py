"""``statetool transfer --to URL``: move a state between SQLite and PostgreSQL, or between
two PostgreSQL schemas (SPEC §1, §3, §6, §9).

Order (interrupt it at any instant: the destination has all of the state or nothing,
the source is untouched until the switch, and a re-run converges):

1. Pre-flight of the source (every check; at head) and of the destination (reachable;
   no state of another identity, even though PostgreSQL state is shared by design: a
   transfer must not merge two sources; no progress for any export of this config).
2. Hold off writers on the source: every run lease of its exports, the source's write
   lock (SQLite: a WAL checkpoint first; PostgreSQL: the writers' advisory lock); the
   source's content digest is taken (SQLite: its pages; PostgreSQL: the server's checksum
   of every table).
3. ONE destination transaction (PostgreSQL: under the writers' advisory lock; SQLite: a
   new file built aside, linked into place once committed): the schema is created and
   migrated to head if absent; every table is streamed as ``COPY`` text (rows read once,
   in blocks checksummed as they are sent: memory stays flat); each table's row count
   (counted under the write lock) and an additive content checksum (sum of the first 60
   bits of each row's md5, the destination's computed by the destination itself) are
   compared with the source's; a ``transfer`` audit row is added; COMMIT.
   The committed destination is in flight (its version reads ``move-in-flight``): every
   open of it refuses (``RIVET_STATE_MOVE_IN_FLIGHT``, naming the command that finishes).
4. Switch: the source is retired (:class:`~statetool.backends.base.Retirement`): a SQLite
   file gets the tombstone relocation leaves; a PostgreSQL schema keeps its rows, its
   version reads ``state-relocated`` and a ``retired`` audit row names the destination, in
   the source's write transaction, committed when it ends. From then on every open of the
   old place refuses ``RIVET_STATE_RELOCATED``, naming the ``RIVET_STATE_URL`` to set.
5. The destination is made live: its version goes back to head.

At no instant are two places live. A re-run after a crash between 3 and 4 finds the
destination's ``transfer`` row for this source and, if the source's digest is unchanged,
goes straight to the switch (if the source was written since and the transfer had created
the schema, the copy, never live, is dropped and made again). A re-run after 4 finds the
old place retired naming the destination: "already transferred" (exit 0), finishing step 5.

Every difference between the stores is the backends' (``sends_transfer``,
``accepts_transfer``, ``relocatable`` and the protocols of :mod:`statetool.backends.base`;
the source is checked and retired through its
:class:`~statetool.backends.base.Retirement`): this module holds the order of the steps only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from statetool import migrations, schema
from statetool.backends import open_backend, retirement
from statetool.errors import StateError, StateWarning
from statetool.identity import identity_verdict
from statetool.location import ENV_VAR, Location, checkpoint_relative_message, resolve_checkpoint, resolve_location
from statetool.operations.checkpoints import shared_checkpoint
from statetool.operations.context import Context
from statetool.operations.leasing import refuse_untakable
from statetool.operations.positions import (FilePosition, MoveResult, Moved, kept_path, put_position,
                                            read_checkpoint_file, require_renamable, retire_file)
from statetool.operations.preflight import require, run_preflight
from statetool.operations.probe import (ResumePoint, position_rows, position_text, read_snapshot, resume_points,
                                        row_counts)
from statetool.operations.relocate import finish_command, retirement_doc
from statetool.operations.writes import (WHOLE_STATE, WriteSession, guarded_write, require_writable,
                                         tolerate_read_only)

if TYPE_CHECKING:
    from statetool.backends.base import Reader, Retirement, TransferDestination, TransferSource

#: Tables copied: every table of the schema at head (:data:`statetool.schema.metadata`,
#: parents first), so a table a new revision adds travels without code of its own; the
#: version table is the destination's own (built at head) and the lease tables hold only
#: this transfer's own leases. ``id`` columns of the append-only tables are not copied
#: (the destination assigns its own, so a shared schema's rows never collide).
COPIED = tuple(schema.metadata.sorted_tables)
#: Tables whose one row the destination's own creation (or its ``init``) wrote, replaced by
#: the source's: the transferred state keeps its lineage and serial (SPEC §9).
_REPLACED = {schema.lineage.name}
_FRESH_IDS = {schema.load_ledger.name, schema.audit.name}
#: Every export the state knows (their run leases are taken), from covering indexes.
_EXPORT_NAMES = ("SELECT export_name FROM rivet_exports UNION SELECT export_name FROM rivet_runs "
                 "UNION SELECT export_name FROM rivet_chunks UNION SELECT export_name FROM rivet_load_ledger")
#: A transfer's name where its tombstone replaces the state's file, which keeps the state's
#: owner (:meth:`~statetool.backends.base.Backend.check_writable`).
_REPLACED_BY = "a transfer"
#: The identity verdicts (SPEC §3) of a recorded key that is another source's: a transfer
#: refuses each of them, "report" (a shared schema) too, as it never merges two sources.
_ANOTHER_SOURCE = frozenset({"refuse", "warn", "report"})


def _columns(table: sa.Table) -> list[str]:
    return [c.name for c in table.columns if not (table.name in _FRESH_IDS and c.name == "id")]


def _counts(conn: Reader) -> dict[str, int]:
    """``{table: rows}`` of every table of :data:`COPIED`, in its order, counted on ``conn``."""
    counted = row_counts(conn, {t.name for t in COPIED})
    return {t.name: counted[t.name] for t in COPIED}


@dataclass
class TableCopy:
    """One table: rows in the source, and what the destination gained (rows, checksum)."""

    table: str
    rows: int
    checksum: int | None = None
    verified: bool = False


@dataclass
class TransferResult:
    """The plan and, unless ``dry_run``, what was done."""

    source: str
    destination: str
    state_url: str
    size_bytes: int
    tables: list[TableCopy]
    checkpoints: list[dict[str, str]]
    dry_run: bool = False
    done: bool = False
    resumed: bool = False
    kept_as: str | None = None
    message: str = ""
    warnings: list[dict[str, str]] = field(default_factory=list)
    #: True when an earlier run had finished this transfer: this one copied nothing (it
    #: only finished the last step when a kill had interrupted it). For the sentence people read.
    already: bool = False
    #: ``--with-checkpoints`` (issue 15 item 4): the positions moved from checkpoint files
    #: into the destination (``{direction, moved, skipped, dry_run}``, as ``checkpoints
    #: import`` gives them); None without the option.
    positions: dict[str, object] | None = None

    def as_dict(self) -> dict[str, object]:
        """JSON shape of the plan and outcome."""
        return asdict(self)


def transfer(ctx: Context, to: str, *, dry_run: bool = False, to_setting: str = "--to",
             with_checkpoints: bool = False) -> TransferResult:
    """Move the state at the resolved location into the state at ``to``: SQLite into
    PostgreSQL, PostgreSQL into SQLite (``sqlite:/dir``: ``/dir/.rivet_state.db``), or
    PostgreSQL into another database or schema (SPEC §9).

    Raises ``RIVET_STATE_BACKEND_UNSUPPORTED`` (a source or destination that cannot take
    part, a move between two files: relocate's, or ``to`` the source itself),
    ``RIVET_STATE_UNREACHABLE`` / ``RIVET_STATE_AUTH_FAILED`` (destination),
    ``RIVET_STATE_DIR_MISSING`` (a destination directory that does not exist),
    ``RIVET_STATE_FOREIGN`` / ``RIVET_STATE_TARGET_NOT_EMPTY`` (destination holds another
    source or this config's progress), ``RIVET_STATE_RELOCATED`` (the destination is the
    retired old place of a state), ``RIVET_STATE_RUN_IN_PROGRESS`` (a live run past
    ``--lock-wait``), ``RIVET_STATE_VERIFY_FAILED`` (rolled back; nothing committed),
    ``RIVET_STATE_MOVE_IN_FLIGHT`` (another source's move into the destination is
    unfinished), ``RIVET_STATE_READ_ONLY`` / ``RIVET_STATE_PERMISSION_DENIED`` (the source
    cannot be retired, or the destination not written: refused before any lease), and every
    pre-flight code of the source. ``dry_run`` runs the same checks and writes nothing
    anywhere (a source on a read-only mount gives its plan with warning
    ``RIVET_STATE_READ_ONLY_DRY_RUN``). The re-run of a completed transfer answers "already transferred" (exit 0).
    ``to_setting`` is the setting that gave ``to`` (``--to``, ``--to-env NAME``), which a
    refusal of the destination's URL names first.

    ``with_checkpoints`` (issue 15 item 4, ADR-0039 D5): the position in each CDC export's
    checkpoint file (resolved where the source is) goes into the destination's position
    table in the same transaction as the state, read back before the commit, and each file
    is renamed ``<name>.imported-<UTC time>`` once the destination is live. A kill at any
    instant leaves every position live in exactly one place: in the files while the source
    is live, in the destination once it is (a file left beside it holds the same position
    and is never read: the state's wins), and a re-run renames what is left. An export whose
    position the source state holds already keeps it (its file is not read); a file that is
    not a position in JSON, or something at the file's place that is no regular file, is
    refused (``RIVET_STATE_CHECKPOINT_UNREADABLE``) before anything, and so is an export with
    progress whose position is nowhere (``RIVET_STATE_CHECKPOINT_MISSING``, SPEC §5a:
    :func:`_position_plan`).
    """
    source = _source(ctx)
    dest = _destination(ctx, source, to, to_setting)
    old = retirement(source)  # the source's old place, retired at the switch
    tomb = old.moved_to()
    if tomb is not None and tomb.get("to") == dest.location.display:
        return _already_transferred(ctx, dest, old, tomb, dry_run)
    # step 1: the pre-flight of both places
    retirable = tolerate_read_only(old.require_retirable, dry_run=dry_run)  # before the pre-flight
    # per-export progress is not needed (only which exports the state knows, read below):
    # on a large state that read costs seconds
    pf = run_preflight(ctx, for_write=True, progress=False)
    snap = require(pf)
    source_key = snap.recorded_key or ctx.computed_key or None
    with source.reading() as conn:
        counts = _counts(conn)
        in_state = {row[0] for row in conn.rows(_EXPORT_NAMES)}
        moving, checkpoints, warnings, positions = _positions(ctx, source, conn, dest.location, with_checkpoints,
                                                              dry_run)
    with dest.inspecting() as conn:
        dest.check_rights("create", conn)  # the dry run refuses what the real run would, before any lease
        earlier = _check_destination(ctx, dest, conn, source_key, old.place)
    result = TransferResult(old.place, dest.location.display, dest.location.state_url, old.size_bytes(),
                            [TableCopy(t.name, counts[t.name]) for t in COPIED],
                            checkpoints, dry_run=dry_run, resumed=earlier is not None, warnings=warnings,
                            positions=positions)
    # the guarded write's own first refusal, before any lease or file; the dry run the same
    read_only = retirable or require_writable(ctx, replaced_by=_REPLACED_BY, dry_run=dry_run)
    result.warnings += [w.as_dict() for w in read_only]
    if dry_run:
        result.message = f"dry run: nothing was changed; after the transfer every task must run with " \
                         f"{ENV_VAR}={result.state_url}"
        return result
    exports = sorted({e.name for e in ctx.config.exports} | in_state)
    refuse_untakable(ctx, exports)  # before the first file is touched: a refusal changes nothing
    old.remove_stale()  # a kill before the switch left it

    # step 2: writers held off the source
    with contextlib.ExitStack() as stack:
        session = stack.enter_context(guarded_write(ctx, WHOLE_STATE, preflight=pf, exports=exports, claim=False,
                                                    advance=False, prepare=old.hold_off_writers,
                                                    lock_code="RIVET_STATE_RUN_IN_PROGRESS",
                                                    replaced_by=_REPLACED_BY))
        old.require_frozen()
        if with_checkpoints:  # decided again under every run lease: a run waited for may have written a file since
            moving, result.checkpoints, relative, result.positions = _positions(
                ctx, source, source.reader(session.conn), dest.location, True, False)
            result.warnings = [w for w in result.warnings if w["code"] != "RIVET_STATE_CHECKPOINT_RELATIVE"] + relative
        digest = old.digest(session.conn)
        ctx.on_step("digested")
        # counted again under the write lock: a run waited for above may have added rows
        counts = _counts(source.reader(session.conn))
        for copy in result.tables:
            copy.rows = counts[copy.table]
        # step 3: the one destination transaction
        with dest.receiving() as conn:
            _fill(ctx, source, session, dest, conn, result, source_key, digest, counts, moving)
            ctx.on_step("copied")
        ctx.on_step("committed")
        # step 4: the switch (a PostgreSQL source's commits with the source's write)
        old.wait_for_openers()  # again, at the last instant before the switch
        result.kept_as = old.retire(session.conn, retirement_doc(ctx, result.destination, result.state_url, digest,
                                                                 "statetool transfer"),
                                    session.audit, ctx.on_step)
    ctx.on_step("retired")
    old.finish_retired()
    # step 5: the destination made live, then the checkpoint files it took over renamed
    dest.make_live()
    if result.positions is not None:
        result.positions["moved"] = [m.as_dict() for m in _retire_files(ctx, moving)]
    ctx.on_step("finished")
    result.done = True
    result.message = f"transferred; every task must now run with {ENV_VAR}={result.state_url}"
    return result


def _source(ctx: Context) -> TransferSource:
    """The backend of the resolved state; ``RIVET_STATE_BACKEND_UNSUPPORTED`` unless a
    transfer may move it out."""
    backend = ctx.backend()
    if not backend.sends_transfer:
        raise StateError("RIVET_STATE_BACKEND_UNSUPPORTED",
                         f"transfer cannot move the state at {backend.location.display} out")
    return cast("TransferSource", backend)


def _destination(ctx: Context, source: TransferSource, url: str, setting: str) -> TransferDestination:
    """The backend at ``url`` (resolved as a state location that ``setting`` gave); ``RIVET_STATE_BACKEND_UNSUPPORTED``
    unless it accepts a transfer, is not the source itself, and the move is not one between
    two files (``relocatable`` both: relocate's, page for page, with the checkpoints)."""
    backend = open_backend(resolve_location(None, url, ctx.config_path, setting=setting), ctx.lock_wait)
    if not backend.accepts_transfer:
        raise StateError("RIVET_STATE_BACKEND_UNSUPPORTED",
                         f"transfer cannot move a state into '{backend.location.display}'")
    if source.relocatable and backend.relocatable:
        raise StateError("RIVET_STATE_BACKEND_UNSUPPORTED",
                         f"transfer moves a state between SQLite and PostgreSQL, or between PostgreSQL schemas; "
                         f"'{backend.location.display}' is a SQLite place like the source: to move a SQLite state "
                         "into another directory, use statetool relocate")
    if backend.location.same_state_key() == source.location.same_state_key():
        raise StateError("RIVET_STATE_BACKEND_UNSUPPORTED",
                         f"'{backend.location.display}' is where the state already is; name another database or "
                         "schema (?schema=NAME)")
    return cast("TransferDestination", backend)


def _transfer_row(conn: Reader, tables: set[str], source: str) -> dict[str, Any] | None:
    if schema.audit.name not in tables:
        return None
    for (detail,) in conn.rows("SELECT detail FROM rivet_audit WHERE action = 'transfer' ORDER BY id DESC"):
        doc = json.loads(detail)
        if doc.get("from") == source:
            return doc
    return None


def _check_destination(ctx: Context, dest: TransferDestination, conn: Reader, source_key: str | None,
                       source: str) -> dict[str, Any] | None:
    """Refuse a destination that holds another source's state or progress of this config,
    or another source's unfinished move (``RIVET_STATE_MOVE_IN_FLIGHT``); return an earlier
    transfer of THIS source (in flight or completed: to converge on), else None."""
    tables = dest.table_names(conn)
    if not tables:
        return None
    try:
        snap = read_snapshot(dest, conn, integrity=False)
    except StateError as err:
        earlier = _transfer_row(conn, set(tables), source) if err.code == "RIVET_STATE_MOVE_IN_FLIGHT" else None
        if earlier is None or err.details.get("from") != source:
            raise  # not in flight, or another source's move: it must be finished first
        return earlier  # this very transfer, killed before its switch
    if not snap.known or snap.pending:
        raise StateError("RIVET_STATE_MIGRATION_PENDING" if snap.known else "RIVET_STATE_SCHEMA_NEWER",
                         f"the destination {dest.location.display} is at revision {snap.revision or 'legacy'}, not "
                         f"at this release's head {migrations.head()}; bring it to head first")
    earlier = _transfer_row(conn, set(tables), source)
    if earlier is not None:
        return earlier
    verdict = identity_verdict(snap.recorded_key, source_key or "", dest.location.scope, False)
    if verdict.action in _ANOTHER_SOURCE:
        raise StateError("RIVET_STATE_FOREIGN",
                         f"the destination {dest.location.display} holds the state of {verdict.recorded}, not of "
                         f"{verdict.computed}; a transfer never merges two sources: choose another schema "
                         "(?schema=NAME)", {"recorded": verdict.recorded, "computed": verdict.computed})
    busy = sorted(e.name for e in ctx.config.exports if e.name in snap.exports and snap.exports[e.name].has_progress)
    if busy:
        raise StateError("RIVET_STATE_TARGET_NOT_EMPTY",
                         f"the destination {dest.location.display} already holds progress for {', '.join(busy)}; "
                         "a transfer never overwrites progress")
    return None


def _positions(ctx: Context, source: TransferSource, conn: Reader, target: Location, with_checkpoints: bool,
               dry_run: bool) -> tuple[list[FilePosition], list[dict[str, str]], list[dict[str, str]],
                                       dict[str, object] | None]:
    """Where each CDC export's position is and will be, read on ``conn``: the source's read
    session for the plan, then its write connection under every run lease for the transfer
    itself (a run waited for meanwhile may have written its file or committed a position
    into the state: what moves is what is there once every writer is held off). Returns the
    files whose positions move (:func:`_position_plan`, with ``with_checkpoints``), the
    checkpoint rows and warnings (:func:`_checkpoint_plan`), and the ``positions`` document
    (None without ``with_checkpoints``). Raises :func:`_position_plan`'s codes."""
    tables = frozenset(source.table_names(conn))
    held = set(position_rows(conn, tables))
    if not with_checkpoints:
        checkpoints, warnings = _checkpoint_plan(ctx, target, held, {e.name: "state" if e.name in held else "file"
                                                                     for e in ctx.config.exports})
        return [], checkpoints, warnings, None
    progress = resume_points(conn, tables, [e.name for e in ctx.config.exports if e.cdc is not None])
    moving, skipped, before = _position_plan(ctx, held, progress)
    checkpoints, warnings = _checkpoint_plan(ctx, target, held | {f.export for f in moving}, before)
    for f in moving:  # each file is renamed once the destination is live: proved possible first
        warnings += [w.as_dict() for w in tolerate_read_only(
            lambda path=f.path: require_renamable(path, "the transfer"), dry_run=dry_run)]
    return moving, checkpoints, warnings, MoveResult(
        "into_state", [Moved(f.export, str(f.path), f.position, None) for f in moving], skipped, dry_run).as_dict()


def _checkpoint_plan(ctx: Context, target: Location, in_state: set[str], before: dict[str, str]
                     ) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Where each CDC checkpoint resolves once the state is at ``target``, where its position
    is before the transfer (``stored_in_before``, from ``before``: ``state``, ``file`` or
    ``none``) and where it is after (``stored_in``: ``state`` for the exports of ``in_state``,
    whose position the state holds then, the file not read for it; else ``file``), and the
    warnings of the files that will be relative to a worker's own disk
    (``RIVET_STATE_CHECKPOINT_RELATIVE``; none for a position in the state). Finding 2 of
    issue 15's fresh user: a dry run names both places, never the one to come as the one now."""
    plan, warnings = [], []
    for export in ctx.config.exports:
        if export.cdc is None or not export.cdc.checkpoint:
            continue
        place = resolve_checkpoint(export.cdc.checkpoint, export.cdc.engine, target, ctx.config.directory)
        stored_in = "state" if export.name in in_state else "file"
        plan.append({"export": export.name, "configured": export.cdc.checkpoint, "resolves_to": str(place.path),
                     "set_to": str(place.path) if place.warning and stored_in == "file" else export.cdc.checkpoint,
                     "stored_in": stored_in, "stored_in_before": before[export.name]})
        if place.warning == "RIVET_STATE_CHECKPOINT_RELATIVE" and stored_in == "file":
            message = checkpoint_relative_message(export.name, place.path)  # type: ignore[arg-type]
            warnings.append(StateWarning(place.warning, message).as_dict())
    return plan, warnings


def _position_plan(ctx: Context, held: set[str], progress: dict[str, ResumePoint]
                   ) -> tuple[list[FilePosition], list[dict[str, str]], dict[str, str]]:
    """``--with-checkpoints``: where each CDC export's position is before the transfer, and
    what moves. Returns the checkpoint files whose positions move (each read once, here),
    the exports skipped with why, and ``{export: stored_in_before}``: ``state`` (``held``:
    the source state holds it, the file is not read), ``server_slot`` (a postgres stream
    without a file), ``file``, or ``none``.

    ``none`` is an export with no position anywhere and no progress in the source state
    (``progress``, :func:`statetool.operations.probe.resume_points`, the rule by which
    ``doctor`` calls a missing checkpoint lost, SPEC §3): it never ran, so no position is
    lost, and its first run starts the stream either way. An export WITH progress and no
    position anywhere (its file missing, or no ``cdc.checkpoint`` for an engine that needs
    one) is refused, ``RIVET_STATE_CHECKPOINT_MISSING``: after the transfer its next run
    would be a first run, the changes between the lost position and the new anchor gone
    without an error (SPEC §5a; finding 1 of issue 15's fresh user). A place that holds no
    regular file, a file this user may not read or one that holds no position is refused by
    the one reader's codes (:func:`~statetool.operations.positions.read_checkpoint_file`:
    ``RIVET_STATE_CHECKPOINT_NOT_A_FILE``, ``RIVET_STATE_PERMISSION_DENIED``,
    ``RIVET_STATE_CHECKPOINT_UNREADABLE``); two exports whose checkpoints are one file are
    ``RIVET_STATE_CHECKPOINT_SHARED`` (:func:`~statetool.operations.checkpoints.shared_checkpoint`:
    one file cannot be two streams' positions in the state). Both before any lease or write."""
    shared = shared_checkpoint(ctx)
    if shared is not None:
        raise shared
    files: list[FilePosition] = []
    skipped: list[dict[str, str]] = []
    before: dict[str, str] = {}
    for export in ctx.config.exports:
        if export.cdc is None:
            continue
        name, engine = export.name, export.cdc.engine
        place = resolve_checkpoint(export.cdc.checkpoint, engine, ctx.location, ctx.config.directory)
        text, position = read_checkpoint_file(place.path) if place.path is not None and name not in held \
            else (None, None)
        if name in held:
            before[name] = "state"
            skipped.append({"export": name, "why": "the state holds its position already; the file is not read"})
        elif place.path is None and engine == "postgres":
            before[name] = "server_slot"
            skipped.append({"export": name, "why": "its position is in the postgres stream's replication slot"})
        elif text is not None and place.path is not None:
            before[name] = "file"
            files.append(FilePosition(name, engine, place.path, text, position))
        elif name in progress and progress[name].has_progress:
            lost = f"its checkpoint {place.path} is missing" if place.path is not None else place.why
            raise StateError("RIVET_STATE_CHECKPOINT_MISSING",
                             f"the state shows progress for CDC export {name}, and holds no position of it, but "
                             f"{lost}: after the transfer its next run would be a first run, the stream re-anchored "
                             "and the changes between the lost position and the new anchor gone; nothing was changed",
                             {"export": name, "path": str(place.path) if place.path is not None else None})
        else:
            before[name] = "none"
            skipped.append({"export": name, "why": "no position yet: no checkpoint file and no progress in the "
                                                   "state (it never ran), so none is lost"})
    return files, skipped, before


def _moved_doc(moving: list[FilePosition]) -> list[dict[str, str]]:
    """The positions a transfer moves as its audit row names them: export, file and the
    sha256 of the file's text (a re-run compares them: a file written since is a change)."""
    return [{"export": f.export, "file": str(f.path), "sha256": hashlib.sha256(f.text.encode()).hexdigest()}
            for f in moving]


def _put_positions(dest: TransferDestination, conn: Connection, moving: list[FilePosition]) -> None:
    """Each position of ``moving`` into the destination's transaction ``conn``, read back:
    ``RIVET_STATE_VERIFY_FAILED`` (rolled back) when one does not read back as its file."""
    for f in moving:
        put_position(conn, f.export, f.engine, f.text)
        reader = dest.reader(conn)
        if position_text(reader, frozenset(dest.table_names(reader)), f.export) != f.text:
            raise StateError("RIVET_STATE_VERIFY_FAILED", f"the position of {f.export} read back from the "
                             "destination is not its file's; the transaction was rolled back, nothing was changed")


def _retire_files(ctx: Context, moving: list[FilePosition]) -> list[Moved]:
    """Rename each checkpoint file of ``moving`` ``<name>.imported-<UTC time>`` once the
    destination holding its position is live, each file read once, here; a file that no
    longer holds the moved text (or is gone, or cannot be read) is left where it is
    (``kept_as`` None; ``checkpoints`` then reports both values). A rename that fails is
    ``RIVET_STATE_CHECKPOINT_NOT_RENAMED``, saying the transfer is done and how to finish
    the renames (the same transfer again)."""
    moved = []
    for f in moving:
        kept = kept_path(f.path)
        try:
            current = read_checkpoint_file(f.path)[0]
        except StateError:
            current = None
        if current == f.text:
            try:
                retire_file(f.path, kept)
            except StateError as err:
                raise StateError("RIVET_STATE_CHECKPOINT_NOT_RENAMED",
                                 f"the transfer is done: the destination is live and holds the position of "
                                 f"{f.export}, which every run reads from there; but {f.path} could not be renamed "
                                 f"to {kept.name} ({err.message.removesuffix('; nothing was written')}; {err.code}): the file is "
                                 "still there, with the same position, and is not read for it. Once its directory "
                                 "can be written, run the same transfer again with --with-checkpoints (it finds the "
                                 "destination live and only renames the files left)",
                                 {"export": f.export, "path": str(f.path), "kept_as": str(kept),
                                  "cause": err.code}) from None
            ctx.on_step("checkpoint-renamed")
        moved.append(Moved(f.export, str(f.path), f.position, str(kept) if current == f.text else None))
    return moved


def _fill(ctx: Context, source: TransferSource, session: WriteSession, dest: TransferDestination, conn: Connection,
          result: TransferResult, source_key: str | None, digest: str, counts: dict[str, int],
          moving: list[FilePosition]) -> None:
    """Step 3 inside the destination's transaction ``conn``: converge on an earlier transfer
    of this very source (the same source digest and the same checkpoint files), or copy
    every table and the positions of ``moving``, audit it and mark the destination in flight."""
    source_path = result.source
    earlier = _check_destination(ctx, dest, dest.reader(conn), source_key, source_path)
    if earlier is not None and (earlier.get("source_digest") != digest
                                or earlier.get("checkpoints", []) != _moved_doc(moving)):
        if not earlier.get("created_schema") or not dest.in_flight(conn):
            raise StateError("RIVET_STATE_TARGET_NOT_EMPTY",
                             f"an earlier transfer of {source_path} is in {dest.location.display}, and the "
                             "source changed since; nothing was changed")
        # Killed before its switch, then the source was written: the copy in flight
        # was never live and the schema is the transfer's own, so it is made again.
        dest.drop_tables(conn)
        earlier = None
    if earlier is not None:
        return
    created = not dest.table_names(dest.reader(conn))
    _copy(ctx, source, session.conn, dest, conn, result)
    _put_positions(dest, conn, moving)
    finish = finish_command(ctx, f"transfer --to {shlex.quote(result.state_url)}"
                            + (" --with-checkpoints" if result.positions is not None else ""))
    session.audit("transfer", {"from": source_path, "to": result.destination, "source_digest": digest,
                               "rows": counts, "created_schema": created, "finish": finish,
                               "checkpoints": _moved_doc(moving)}, into=conn)
    dest.mark_in_flight(conn)  # every open of the destination refuses until the source is retired


def _already_transferred(ctx: Context, dest: TransferDestination, old: Retirement, tomb: dict[str, Any],
                         dry_run: bool) -> TransferResult:
    """The re-run of a transfer whose switch was done: exit 0, "already transferred". A
    run killed after the switch is finished here (the destination made live, what the
    retired source left removed: a SQLite file's ``-wal``/``-shm`` and temporary files, and
    the checkpoint files its positions came from renamed: :func:`_left_files`)."""
    url = dest.location.state_url
    result = TransferResult(old.place, dest.location.display, url, 0, [], [], dry_run=dry_run, done=True,
                            resumed=True, kept_as=tomb.get("kept_as"),
                            message=f"already transferred to {dest.location.display}; every task must run with "
                                    f"{ENV_VAR}={url}", already=True)
    if not dry_run:
        old.finish_retired()
        dest.make_live()
        renamed = [m for m in _retire_files(ctx, _left_files(dest, old.place)) if m.kept_as is not None]
        if renamed:
            result.positions = MoveResult("into_state", renamed, [], dry_run).as_dict()
    return result


def _left_files(dest: TransferDestination, source: str) -> list[FilePosition]:
    """The checkpoint files that the transfer of ``source`` into ``dest`` moved (its audit
    row names them), each with the text the destination holds as its position: a kill
    may have left them at their place, and :func:`_retire_files` renames those that still
    hold that very text (reading each once: finding 3 of issue 15's fresh user). No file
    is read here."""
    with dest.reading() as conn:
        tables = frozenset(dest.table_names(conn))
        done = _transfer_row(conn, set(tables), source) or {}
        texts = {c["export"]: position_text(conn, tables, c["export"]) for c in done.get("checkpoints", [])}
    return [FilePosition(c["export"], "", Path(c["file"]), text, json.loads(text))
            for c in done.get("checkpoints", []) if (text := texts[c["export"]]) is not None]


def _copy(ctx: Context, source: TransferSource, source_conn: Connection, dest: TransferDestination,
          conn: Connection, result: TransferResult) -> None:
    """Every table of :data:`COPIED` from ``source_conn`` into ``conn`` (the schema built at
    head first when empty), each verified by its rows and checksum:
    ``RIVET_STATE_VERIFY_FAILED`` on any difference (the transaction is rolled back)."""
    if not dest.table_names(dest.reader(conn)):
        migrations.apply(conn, migrations.head(), dest.schema, "up")
    has_identity = conn.execute(sa.select(sa.func.count()).select_from(schema.identity)).scalar()
    total = sum(t.rows for t in result.tables)
    done = 0
    with ctx.progress("transferring rows") as update:
        update(0, total)

        def advance(rows: int) -> None:
            nonlocal done
            done += rows
            update(done, total)

        for table, copy in zip(COPIED, result.tables, strict=True):
            if table is schema.identity and has_identity:
                copy.verified = True  # the destination already records this very identity
                continue
            if table.name in _REPLACED:
                conn.execute(sa.delete(table))
            columns = _columns(table)
            loaded = dest.copy_into(conn, table.name, columns, source.copy_blocks(source_conn, table.name, columns),
                                    copy.rows, advance)
            copy.checksum = loaded.sent_checksum
            if loaded.gained_rows != copy.rows or loaded.gained_checksum != loaded.sent_checksum:
                raise StateError("RIVET_STATE_VERIFY_FAILED",
                                 f"{table.name}: the destination gained {loaded.gained_rows} rows (checksum "
                                 f"{loaded.gained_checksum}), the source has {copy.rows} (checksum "
                                 f"{loaded.sent_checksum}); the transaction was rolled back, nothing was changed")
            copy.verified = True
    if schema.VERSION_TABLE not in dest.table_names(dest.reader(conn)):
        raise StateError("RIVET_STATE_VERIFY_FAILED", "the destination has no version table after the copy")
