"""Rows streamed into a PostgreSQL state with ``COPY``, and the catalog SQL around it (SPEC §9).

What ``statetool transfer`` does on its destination, inside its one transaction:
:func:`copy_into` loads a table from blocks of COPY text
(:mod:`statetool.backends.copy_text`), read from the source ahead of the COPY on a thread
of their own (:func:`read_ahead`), and counts what the table gained with the server-side
:func:`table_checksum`; a big table that is empty first has its indexes and key
constraints dropped and built again after the COPY (:func:`defer_indexes`). Why text and
one connection: docs/decisions.md, "Relocation and transfer".
:func:`drop_tables` discards a copy that never went live. On a source (a PostgreSQL state
moved out, into SQLite or another schema), :func:`copy_blocks` reads a table with
``COPY … TO STDOUT`` into the same blocks. Every statement runs on the caller's
connection: nothing here commits.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import queue
import threading
from collections.abc import Callable, Iterable, Iterator

import psycopg
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from statetool.backends.copy_text import NULL, Block, Loaded, line_checksums
from statetool.backends.postgres_faults import ident
from statetool.errors import StateError

#: From this many rows on, an empty table's indexes are built after its COPY, not during it.
DEFER_INDEXES_ROWS = 10_000
#: Blocks read from the source ahead of the COPY (:func:`read_ahead`): enough to keep the
#: server busy while the next one is read, few enough to keep memory flat (a block of
#: runs is about 0.7 MB).
READ_AHEAD_BLOCKS = 4
#: Bytes of COPY text a block read from a PostgreSQL source holds (about 1,500 runs).
BLOCK_BYTES = 1 << 20
#: Seconds the reading thread waits for room in the queue before it looks whether the
#: COPY was given up.
_OFFER_SECONDS = 0.1


def table_checksum(conn: Connection, table: str, columns: list[str]) -> tuple[int, int]:
    """``(rows, checksum)`` of ``table`` over ``columns``, computed by the server: the sum
    of :func:`statetool.backends.copy_text.row_checksum` over its rows (0 when empty)."""
    joined = ", ".join(f"coalesce({ident(c)}::text, '{NULL}')" for c in columns)
    row = conn.execute(sa.text(
        f"SELECT count(*), coalesce(sum(('x' || substr(md5(concat_ws(E'\\t', {joined})), 1, 15))::bit(60)::bigint), 0) "
        f"FROM {ident(table)}")).one()
    return int(row[0]), int(row[1])


def defer_indexes(conn: Connection, table: str) -> list[str]:
    """Drop the indexes and key constraints of EMPTY ``table`` and return the statements
    that build them again, identical (definitions as PostgreSQL prints them), once the
    COPY is done: one build at the end costs a fraction of maintaining them row by row.
    All in the caller's one transaction: no one ever sees the table without them."""
    regclass = {"t": ident(table)}
    keys = conn.execute(sa.text(
        "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = CAST(:t AS regclass) "
        "AND contype IN ('p', 'u') ORDER BY conname"), regclass).all()
    indexes = conn.execute(sa.text(
        "SELECT i.relname, pg_get_indexdef(i.oid) FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid "
        "WHERE x.indrelid = CAST(:t AS regclass) AND NOT EXISTS "
        "(SELECT 1 FROM pg_constraint c WHERE c.conindid = x.indexrelid) ORDER BY 1"), regclass).all()
    for name, _definition in keys:
        conn.exec_driver_sql(f"ALTER TABLE {ident(table)} DROP CONSTRAINT {ident(name)}")
    for name, _definition in indexes:
        conn.exec_driver_sql(f"DROP INDEX {ident(name)}")
    return ([f"ALTER TABLE {ident(table)} ADD CONSTRAINT {ident(name)} {definition}" for name, definition in keys]
            + [definition for _name, definition in indexes])


def copy_into(conn: Connection, table: str, columns: list[str], blocks: Iterable[Block], rows: int,
              progress: Callable[[int], None]) -> Loaded:
    """Append ``blocks`` to ``table`` (``columns`` in their order) with ``COPY … FROM STDIN``
    on ``conn``; ``rows`` is how many the source holds (an empty table expecting at least
    :data:`DEFER_INDEXES_ROWS` gets its indexes built after the COPY). ``progress(n)`` is
    called with each block's row count once the block is written. Returns what was sent
    and what the table gained; the caller compares them. Driver errors propagate (the
    session that yielded ``conn`` translates them: those of the COPY, met on the driver's
    own cursor, are handed on as SQLAlchemy's, so a full disk during the COPY is
    ``RIVET_STATE_DISK_FULL`` as anywhere else), but a value the server refuses (SQLSTATE
    class 22, not 22P04, a malformed line of ours: not a number in a ``bigint``, say) is
    ``RIVET_STATE_VALUE_UNTRANSFERABLE``, naming the table and the server's line and
    column; an error of the source's blocks is raised as the source raised it."""
    before_rows, before_sum = table_checksum(conn, table, columns)
    rebuild = defer_indexes(conn, table) if before_rows == 0 and rows >= DEFER_INDEXES_ROWS else []
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    sent_rows = sent_sum = 0
    copy_sql = f"COPY {ident(table)} ({', '.join(map(ident, columns))}) FROM STDIN"
    try:
        with read_ahead(blocks) as ahead, cursor.copy(copy_sql) as pg_copy:
            for block in ahead:
                pg_copy.write(block.data)
                sent_rows += block.rows
                sent_sum += block.checksum
                progress(block.rows)
    except psycopg.Error as err:
        # SQLSTATE class 22 is a value the column cannot hold, but 22P04 a malformed COPY
        # line: that one is statetool's own text, a bug (RIVET_INTERNAL)
        if isinstance(err, psycopg.DataError) and not isinstance(err, psycopg.errors.BadCopyFileFormat):
            where = f" ({err.diag.context.strip()})" if err.diag.context else ""
            raise StateError("RIVET_STATE_VALUE_UNTRANSFERABLE",
                             f"{table}: PostgreSQL refused a value of the source: {err.diag.message_primary}{where}; "
                             "nothing was written at the destination", {"table": table}) from None
        raise sa.exc.DBAPIError(copy_sql, None, err) from err
    for statement in rebuild:
        conn.exec_driver_sql(statement)
    after_rows, after_sum = table_checksum(conn, table, columns)
    return Loaded(sent_rows, sent_sum, after_rows - before_rows, after_sum - before_sum)


@contextlib.contextmanager
def read_ahead(blocks: Iterable[Block]) -> Iterator[Iterator[Block]]:
    """``blocks`` in their order, read by a thread of their own up to
    :data:`READ_AHEAD_BLOCKS` ahead of the caller, so that reading and checksumming the
    source (SQLite steps and hashing) overlaps the server taking the COPY (the caller waits
    on the socket, the GIL released). An error of the reading thread is raised here, in the
    caller's thread, as it was raised there. On leaving (done, or an error of the caller's
    COPY) the thread is stopped and joined: the source's connection is the caller's again.
    """
    ahead: queue.Queue[Block | BaseException | None] = queue.Queue(READ_AHEAD_BLOCKS)
    stop = threading.Event()

    def offer(item: Block | BaseException | None) -> bool:
        while not stop.is_set():
            try:
                ahead.put(item, timeout=_OFFER_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            for block in blocks:
                if not offer(block):
                    return
        except BaseException as err:  # handed to the caller's thread, raised there
            offer(err)
        else:
            offer(None)

    def taken() -> Iterator[Block]:
        while (item := ahead.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    reader = threading.Thread(target=read, name="statetool-read-ahead", daemon=True)
    reader.start()
    try:
        yield taken()
    finally:
        stop.set()
        reader.join()


def drop_tables(conn: Connection, tables: Iterable[str]) -> None:
    """Drop ``tables`` (with what depends on them) in the caller's transaction."""
    for table in sorted(tables):
        conn.exec_driver_sql(f"DROP TABLE {ident(table)} CASCADE")


def copy_blocks(conn: Connection, table: str, columns: list[str]) -> Iterator[Block]:
    """``table``'s ``columns`` read on ``conn`` (the source's write transaction) with
    ``COPY (SELECT … ORDER BY <primary key>) TO STDOUT``, as :class:`Block` s of about
    :data:`BLOCK_BYTES` bytes cut at line ends, each with the sum of its rows' checksums
    (:func:`~statetool.backends.copy_text.line_checksums`: the same number the destination
    computes for the same values). In primary key order: an append-only table whose ids the
    destination assigns keeps its rows' order. Driver errors are handed on as SQLAlchemy's,
    for the session that yielded ``conn`` to translate."""
    key = [r[0] for r in conn.execute(sa.text(
        "SELECT a.attname FROM pg_index x JOIN pg_attribute a ON a.attrelid = x.indrelid "
        "AND a.attnum = ANY(x.indkey) WHERE x.indrelid = CAST(:t AS regclass) AND x.indisprimary "
        "ORDER BY array_position(x.indkey::int2[], a.attnum)"), {"t": ident(table)})]
    order = f" ORDER BY {', '.join(map(ident, key))}" if key else ""
    copy_sql = f"COPY (SELECT {', '.join(map(ident, columns))} FROM {ident(table)}{order}) TO STDOUT"
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    pending = bytearray()
    try:
        with cursor.copy(copy_sql) as pg_copy:
            for data in pg_copy:
                pending += data
                if len(pending) >= BLOCK_BYTES:
                    cut = pending.rindex(b"\n") + 1
                    yield _block(bytes(pending[:cut]))
                    del pending[:cut]
    except psycopg.Error as err:
        raise sa.exc.DBAPIError(copy_sql, None, err) from err
    if pending:
        yield _block(bytes(pending))


def _block(data: bytes) -> Block:
    """Whole lines of COPY text (each ending in a newline) as a :class:`Block`."""
    lines = data[:-1].split(b"\n")
    return Block(data, len(lines), line_checksums(lines))


def content_digest(conn: Connection, tables: dict[str, list[str]]) -> str:
    """sha256 (hex) over ``(rows, checksum)`` of each of ``tables`` (``{table: columns}``),
    computed by the server (:func:`table_checksum`): equal for equal content."""
    sums = {table: table_checksum(conn, table, columns) for table, columns in sorted(tables.items())}
    return hashlib.sha256(json.dumps(sums, sort_keys=True).encode()).hexdigest()
