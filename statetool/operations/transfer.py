"""``statetool transfer --to URL``: move a SQLite state into PostgreSQL (SPEC §1, §3, §6, §9).

Order (interrupt it at any instant: the destination has all of the state or nothing,
the source is untouched until the switch, and a re-run converges):

1. Pre-flight of the source (every check; at head) and of the destination (reachable;
   no state of another identity, even though PostgreSQL state is shared by design: a
   transfer must not merge two sources; no progress for any export of this config).
2. Hold off writers on the source: every run lease of its exports, a WAL checkpoint,
   the SQLite write lock; the source's page digest is taken.
3. ONE destination transaction (under the writers' advisory lock): the schema is
   created and migrated to head if absent; every table is streamed with ``COPY`` (rows
   read and written in blocks of COPY text: memory stays flat; a big empty table gets its
   indexes built after its COPY, in the same transaction); each table's row count
   (counted under the write lock) and an additive content checksum (sum of the first 60
   bits of each row's md5) are compared with the source's; a ``transfer`` audit row is
   added; COMMIT.
   The committed destination is in flight (its version reads ``move-in-flight``): every
   open of it refuses (``RIVET_STATE_MOVE_IN_FLIGHT``, naming the command that finishes).
4. Switch: the source gets the tombstone relocation leaves (``RIVET_STATE_RELOCATED``,
   naming the ``RIVET_STATE_URL`` to set, password masked).
5. The destination is made live: its version goes back to head.

At no instant are two places live. A re-run after a crash between 3 and 4 finds the
destination's ``transfer`` row for this source and, if the source's digest is unchanged,
goes straight to the switch (if the source was written since and the transfer had created
the schema, the copy, never live, is dropped and made again). A re-run after 4 finds the
tombstone naming the destination: "already transferred" (exit 0), finishing step 5.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shlex
import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from statetool import migrations, schema
from statetool.backends.postgres import PostgresBackend
from statetool.backends.sqlite import SqliteBackend, content_digest
from statetool.backends.tombstone import (IN_FLIGHT_REVISION, read_tombstone, refuse_unsafe, require_retirable,
                                          stale_tombstones, wait_for_openers)
from statetool.errors import StateError
from statetool.location import (ENV_VAR, Location, checkpoint_relative_message, resolve_checkpoint,
                                resolve_location)
from statetool.operations.context import Context
from statetool.operations.preflight import require, run_preflight
from statetool.operations.probe import read_snapshot
from statetool.operations.relocate import finish_command, retire_source
from statetool.operations.writes import WHOLE_STATE, guarded_write

#: Tables copied, parents first; ``id`` columns of the append-only tables are not copied
#: (the destination assigns its own, so a shared schema's rows never collide).
COPIED = (schema.exports, schema.runs, schema.chunks, schema.run_aggregates, schema.load_ledger, schema.identity,
          schema.audit)
_FRESH_IDS = {schema.load_ledger.name, schema.audit.name}
BATCH_ROWS = 5000
_NULL = "\\N"
#: Every export the state knows (their run leases are taken), from covering indexes.
_EXPORT_NAMES = ("SELECT export_name FROM rivet_exports UNION SELECT export_name FROM rivet_runs "
                 "UNION SELECT export_name FROM rivet_chunks UNION SELECT export_name FROM rivet_load_ledger")
#: What COPY's text format escapes inside a value.
_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def _columns(table: sa.Table) -> list[str]:
    return [c.name for c in table.columns if not (table.name in _FRESH_IDS and c.name == "id")]


def row_checksum(values: Iterable[Any]) -> int:
    """The first 60 bits of the md5 of a row's canonical text (columns as text, NULL as
    ``\\N``, joined by tabs): the same number PostgreSQL computes in :func:`_pg_checksum`."""
    text = "\t".join(_NULL if v is None else str(v) for v in values)
    return _sum60([text.encode()])


def _sum60(lines: Iterable[bytes]) -> int:
    """The sum over ``lines`` of the first 60 bits of each one's md5."""
    total = 0
    md5, from_bytes = hashlib.md5, int.from_bytes
    for line in lines:
        total += from_bytes(md5(line).digest()[:8], "big") >> 4
    return total


def _blocks(raw: sqlite3.Connection, table: str, columns: list[str]) -> Iterator[tuple[bytes, int, int]]:
    """``table``'s rows in rowid order, as blocks of COPY text: ``(data, rows, checksum)``.

    SQLite joins each row's values itself (tab between values, NUL for NULL: no PostgreSQL
    text can hold one). A block with no backslash, no CR, and exactly the tabs and newlines
    the joins put there holds no value COPY would escape: each row's text is then its COPY
    line and its checksum text at once (NUL spelled ``\\N``), and the block goes out as it
    is, without a Python step per value. Any other block is read again and escaped value
    by value (:func:`_escaped_block`).
    """
    quoted = ", ".join(f'"{c}"' for c in columns)
    joined = " || :tab || ".join(f'ifnull("{c}", :null)' for c in columns)
    tabs = len(columns) - 1
    rows = raw.execute(f'SELECT rowid, {joined} FROM "{table}" ORDER BY rowid', {"tab": "\t", "null": "\0"})
    while batch := rows.fetchmany(BATCH_ROWS):
        n = len(batch)
        text = "\n".join([r[1] for r in batch])
        if "\\" in text or "\r" in text or text.count("\n") != n - 1 or text.count("\t") != n * tabs:
            data, checksum = _escaped_block(raw, table, quoted, batch[0][0], batch[-1][0])
        else:
            data = text.replace("\0", _NULL).encode()
            checksum = _sum60(data.split(b"\n"))
        yield data + b"\n", n, checksum


def _escaped_block(raw: sqlite3.Connection, table: str, quoted: str, first: int, last: int) -> tuple[bytes, int]:
    """The rows ``first``..``last`` (rowids) as COPY text, each value escaped, and their checksum."""
    lines, checksum = [], 0
    for row in raw.execute(f'SELECT {quoted} FROM "{table}" WHERE rowid BETWEEN ? AND ? ORDER BY rowid',
                           (first, last)):
        texts = [None if v is None else v.decode() if isinstance(v, bytes) else str(v) for v in row]
        checksum += row_checksum(texts)
        lines.append("\t".join(_NULL if t is None else t.translate(_COPY_ESCAPES) for t in texts))
    return "\n".join(lines).encode(), checksum


#: From this many rows on, an empty table's indexes are built after its COPY, not during it.
DEFER_INDEXES_ROWS = 10_000


def _defer_indexes(conn: Connection, table: str) -> list[str]:
    """Drop the indexes and key constraints of EMPTY ``table`` and return the statements
    that build them again, identical (definitions as PostgreSQL prints them), once the
    COPY is done: one build at the end costs a fraction of maintaining them row by row.
    All in the one transaction: no one ever sees the table without them."""
    regclass = {"t": f'"{table}"'}
    keys = conn.execute(sa.text(
        "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = CAST(:t AS regclass) "
        "AND contype IN ('p', 'u') ORDER BY conname"), regclass).all()
    indexes = conn.execute(sa.text(
        "SELECT i.relname, pg_get_indexdef(i.oid) FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid "
        "WHERE x.indrelid = CAST(:t AS regclass) AND NOT EXISTS "
        "(SELECT 1 FROM pg_constraint c WHERE c.conindid = x.indexrelid) ORDER BY 1"), regclass).all()
    for name, _definition in keys:
        conn.exec_driver_sql(f'ALTER TABLE "{table}" DROP CONSTRAINT "{name}"')
    for name, _definition in indexes:
        conn.exec_driver_sql(f'DROP INDEX "{name}"')
    return ([f'ALTER TABLE "{table}" ADD CONSTRAINT "{name}" {definition}' for name, definition in keys]
            + [definition for _name, definition in indexes])


def _pg_checksum(conn: Connection, table: str, columns: list[str]) -> tuple[int, int]:
    joined = ", ".join(f"coalesce(\"{c}\"::text, '{_NULL}')" for c in columns)
    row = conn.execute(sa.text(
        f"SELECT count(*), coalesce(sum(('x' || substr(md5(concat_ws(E'\\t', {joined})), 1, 15))::bit(60)::bigint), 0) "
        f'FROM "{table}"')).one()
    return int(row[0]), int(row[1])


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

    def as_dict(self) -> dict[str, object]:
        """JSON shape of the plan and outcome."""
        return asdict(self)


def _destination(ctx: Context, url: str) -> PostgresBackend:
    location = resolve_location(None, url, ctx.config_path)
    if location.backend != "postgres":
        raise StateError("RIVET_STATE_BACKEND_UNSUPPORTED",
                         f"transfer moves a state into PostgreSQL; '{location.display}' is not a PostgreSQL URL "
                         "(to move a SQLite state into a directory, use statetool relocate)")
    return PostgresBackend(location, ctx.lock_wait)


def _transfer_row(conn: Connection, tables: set[str], source: str) -> dict[str, Any] | None:
    if schema.audit.name not in tables:
        return None
    a = schema.audit
    for (detail,) in conn.execute(sa.select(a.c.detail).where(a.c.action == "transfer").order_by(a.c.id.desc())):
        doc = json.loads(detail)
        if doc.get("from") == source:
            return doc
    return None


def _check_destination(ctx: Context, dest: PostgresBackend, conn: Connection, source_key: str | None,
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
    if snap.recorded_key and source_key and snap.recorded_key != source_key:
        raise StateError("RIVET_STATE_FOREIGN",
                         f"the destination {dest.location.display} holds the state of {snap.recorded_key}, not of "
                         f"{source_key}; a transfer never merges two sources: choose another schema (?schema=NAME)",
                         {"recorded": snap.recorded_key, "computed": source_key})
    busy = sorted(e.name for e in ctx.config.exports if e.name in snap.exports and snap.exports[e.name].has_progress)
    if busy:
        raise StateError("RIVET_STATE_TARGET_NOT_EMPTY",
                         f"the destination {dest.location.display} already holds progress for {', '.join(busy)}; "
                         "a transfer never overwrites progress")
    return None


def _checkpoint_plan(ctx: Context, dest_location: Location) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    plan, warnings = [], []
    for export in ctx.config.exports:
        if export.cdc is None or not export.cdc.checkpoint:
            continue
        place = resolve_checkpoint(export.cdc.checkpoint, export.cdc.engine, dest_location, ctx.config.directory)
        plan.append({"export": export.name, "configured": export.cdc.checkpoint, "resolves_to": str(place.path),
                     "set_to": str(place.path) if place.warning else export.cdc.checkpoint})
        if place.warning == "RIVET_STATE_CHECKPOINT_RELATIVE":
            warnings.append({"code": place.warning,
                             "message": checkpoint_relative_message(export.name, place.path),  # type: ignore[arg-type]
                             "action": "set cdc.checkpoint to an absolute path on storage that outlives the worker"})
    return plan, warnings


def transfer(ctx: Context, to: str, *, dry_run: bool = False) -> TransferResult:
    """Move the SQLite state at the resolved location into the PostgreSQL state at ``to``.

    Raises ``RIVET_STATE_BACKEND_UNSUPPORTED`` (source not SQLite, or ``to`` not
    PostgreSQL), ``RIVET_STATE_UNREACHABLE`` / ``RIVET_STATE_AUTH_FAILED`` (destination),
    ``RIVET_STATE_FOREIGN`` / ``RIVET_STATE_TARGET_NOT_EMPTY`` (destination holds another
    source or this config's progress), ``RIVET_STATE_RUN_IN_PROGRESS`` (a live run past
    ``--lock-wait``), ``RIVET_STATE_VERIFY_FAILED`` (rolled back; nothing committed),
    ``RIVET_STATE_MOVE_IN_FLIGHT`` (another source's move into the destination is
    unfinished), ``RIVET_STATE_READ_ONLY`` / ``RIVET_STATE_PERMISSION_DENIED`` (the source's
    directory, or a symlinked state's real one, cannot take the tombstone), and every
    pre-flight code of the source. ``dry_run`` runs the same checks and writes nothing
    anywhere. The re-run of a completed transfer answers "already transferred" (exit 0).
    """
    location = ctx.location
    if location.backend != "sqlite":
        raise StateError("RIVET_STATE_BACKEND_UNSUPPORTED", "transfer moves a SQLite state; this state is already "
                         "in PostgreSQL")
    assert location.path is not None
    dest = _destination(ctx, to)
    source_path = location.real_path or location.path  # a symlinked state: its real file is retired
    tomb = read_tombstone(source_path)
    if tomb is not None and tomb.get("to") == dest.location.display:
        return _already_transferred(dest, source_path, tomb, dry_run)
    # per-export progress is not needed (only which exports the state knows, read below):
    # on a large state that read costs seconds
    require_retirable(location)  # before the pre-flight
    refuse_unsafe(*stale_tombstones(source_path))
    pf = run_preflight(ctx, for_write=True, progress=False)
    snap = require(pf)
    source_key = snap.recorded_key or ctx.computed_key or None
    backend = SqliteBackend(location, ctx.lock_wait)
    with backend.reading() as conn:
        counts = {t.name: int(conn.execute(sa.select(sa.func.count()).select_from(t)).scalar() or 0) for t in COPIED}
        in_state = set(conn.execute(sa.text(_EXPORT_NAMES)).scalars())
    with dest._connect(read_only=True) as conn:  # noqa: SLF001 - the destination's read-only session
        dest.check_rights("create", conn)  # the dry run refuses what the real run would, before any lease
        earlier = _check_destination(ctx, dest, conn, source_key, str(source_path))
    checkpoints, warnings = _checkpoint_plan(ctx, dest.location)
    result = TransferResult(str(source_path), dest.location.display, dest.location.state_url,
                            source_path.stat().st_size, [TableCopy(t.name, counts[t.name]) for t in COPIED],
                            checkpoints, dry_run=dry_run, resumed=earlier is not None, warnings=warnings)
    if dry_run:
        result.message = f"dry run: nothing was changed; after the transfer every task must run with " \
                         f"{ENV_VAR}={result.state_url}"
        return result
    exports = sorted({e.name for e in ctx.config.exports} | in_state)
    for stale in stale_tombstones(source_path):  # a kill before the switch left it
        stale.unlink()

    def hold_off_writers() -> None:
        wait_for_openers(source_path, ctx.lock_wait)
        backend.checkpoint_wal()

    with contextlib.ExitStack() as stack:
        session = stack.enter_context(guarded_write(ctx, WHOLE_STATE, preflight=pf, exports=exports, claim=False,
                                                    prepare=hold_off_writers, lock_code="RIVET_STATE_RUN_IN_PROGRESS"))
        source_conn = session.conn
        if not backend.wal_is_empty():
            raise StateError("RIVET_STATE_RUN_IN_PROGRESS", f"a writer wrote to {source_path} during the checkpoint")
        digest = content_digest(source_path)
        ctx.on_step("digested")
        raw: sqlite3.Connection = source_conn.connection.driver_connection  # type: ignore[assignment]
        # counted again under the write lock: a run waited for above may have added rows
        counts = {t.name: int(raw.execute(f'SELECT count(*) FROM "{t.name}"').fetchone()[0]) for t in COPIED}
        for copy in result.tables:
            copy.rows = counts[copy.table]
        with dest.receiving() as conn:
            earlier = _check_destination(ctx, dest, conn, source_key, str(source_path))
            if earlier is not None and earlier.get("source_digest") != digest:
                if not earlier.get("created_schema") or not _in_flight(conn):
                    raise StateError("RIVET_STATE_TARGET_NOT_EMPTY",
                                     f"an earlier transfer of {source_path} is in {dest.location.display}, and the "
                                     "source changed since; nothing was changed")
                # Killed before its switch, then the source was written: the copy in flight
                # was never live and the schema is the transfer's own, so it is made again.
                for table in sorted(dest.table_names(conn)):
                    conn.exec_driver_sql(f'DROP TABLE "{table}" CASCADE')
                earlier = None
            if earlier is None:
                created = not dest.table_names(conn)
                _copy(ctx, raw, dest, conn, result)
                finish = finish_command(ctx, f"transfer --to {shlex.quote(result.state_url)}")
                session.audit("transfer", {"from": str(source_path), "to": result.destination,
                                           "source_digest": digest, "rows": counts, "created_schema": created,
                                           "finish": finish}, into=conn)
                # in flight: every open of the destination refuses until the source is retired
                conn.execute(sa.text(f"UPDATE {schema.VERSION_TABLE} SET version_num = :v"),
                             {"v": IN_FLIGHT_REVISION})
            ctx.on_step("copied")
        ctx.on_step("committed")
        wait_for_openers(source_path, ctx.lock_wait)  # again, at the last instant before the switch
        result.kept_as = retire_source(ctx, source_path, result.destination, result.state_url, digest,
                                       "statetool transfer")
    _finish_destination(dest)
    ctx.on_step("finished")
    result.done = True
    result.message = f"transferred; every task must now run with {ENV_VAR}={result.state_url}"
    return result


def _in_flight(conn: Connection) -> bool:
    return conn.execute(sa.text(f"SELECT count(*) FROM {schema.VERSION_TABLE} WHERE version_num = :v"),
                        {"v": IN_FLIGHT_REVISION}).scalar() == 1


def _finish_destination(dest: PostgresBackend) -> None:
    """Make the destination live once the source is retired: its version goes from
    :data:`IN_FLIGHT_REVISION` back to head (idempotent; nothing to do when already live)."""
    with dest.receiving() as conn:
        if schema.VERSION_TABLE in dest.table_names(conn):
            conn.execute(sa.text(f"UPDATE {schema.VERSION_TABLE} SET version_num = :head WHERE version_num = :v"),
                         {"head": migrations.head(), "v": IN_FLIGHT_REVISION})


def _already_transferred(dest: PostgresBackend, source: Path, tomb: dict[str, Any], dry_run: bool
                         ) -> TransferResult:
    """The re-run of a transfer whose switch was done: exit 0, "already transferred". A
    run killed after the switch is finished here (the destination made live, the old
    inode's ``-wal``/``-shm`` and temporary files removed)."""
    if not dry_run:
        for leftover in [Path(f"{source}-wal"), Path(f"{source}-shm"), *stale_tombstones(source)]:
            refuse_unsafe(leftover)
            leftover.unlink(missing_ok=True)
        _finish_destination(dest)
    url = dest.location.state_url
    return TransferResult(str(source), dest.location.display, url, 0, [], [], dry_run=dry_run, done=True,
                          resumed=True, kept_as=tomb.get("kept_as"),
                          message=f"already transferred to {dest.location.display}; every task must run with "
                                  f"{ENV_VAR}={url}")


def _copy(ctx: Context, raw: sqlite3.Connection, dest: PostgresBackend, conn: Connection,
          result: TransferResult) -> None:
    if not dest.table_names(conn):
        migrations.apply(conn, migrations.head(), dest.schema, "up")
    has_identity = conn.execute(sa.select(sa.func.count()).select_from(schema.identity)).scalar()
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    total = sum(t.rows for t in result.tables)
    done = 0
    with ctx.progress("transferring rows") as update:
        update(0, total)
        for table, copy in zip(COPIED, result.tables, strict=True):
            if table is schema.identity and has_identity:
                copy.verified = True  # the destination already records this very identity
                continue
            columns = _columns(table)
            before_rows, before_sum = _pg_checksum(conn, table.name, columns)
            big_and_empty = before_rows == 0 and copy.rows >= DEFER_INDEXES_ROWS
            rebuild = _defer_indexes(conn, table.name) if big_and_empty else []
            quoted = ", ".join(f'"{c}"' for c in columns)
            source_sum = 0
            with cursor.copy(f'COPY "{table.name}" ({quoted}) FROM STDIN') as pg_copy:
                for data, rows, checksum in _blocks(raw, table.name, columns):
                    pg_copy.write(data)
                    source_sum += checksum
                    done += rows
                    update(done, total)
            for statement in rebuild:
                conn.exec_driver_sql(statement)
            after_rows, after_sum = _pg_checksum(conn, table.name, columns)
            copy.checksum = source_sum
            if after_rows - before_rows != copy.rows or after_sum - before_sum != source_sum:
                raise StateError("RIVET_STATE_VERIFY_FAILED",
                                 f"{table.name}: the destination gained {after_rows - before_rows} rows (checksum "
                                 f"{after_sum - before_sum}), the source has {copy.rows} (checksum {source_sum}); "
                                 "the transaction was rolled back, nothing was changed")
            copy.verified = True
    if schema.VERSION_TABLE not in dest.table_names(conn):
        raise StateError("RIVET_STATE_VERIFY_FAILED", "the destination has no version table after the copy")
