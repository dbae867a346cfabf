"""A SQLite table read in blocks of PostgreSQL ``COPY`` text, with their checksums, and
such blocks written into one (SPEC §9).

What ``statetool transfer`` streams out of a SQLite source: :func:`copy_blocks` reads one
table in rowid order, :data:`BATCH_ROWS` rows at a time, so memory stays flat whatever
the table's size. What it writes into a SQLite destination (a PostgreSQL state moved
into a file): :func:`insert_blocks`, verified by :func:`table_checksum`. The text and the
checksum are those of :mod:`statetool.backends.copy_text`.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from statetool.backends.copy_text import ESCAPES, NULL, Block, Loaded, line_values, row_checksum, sum60
from statetool.errors import StateError

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

#: Rows per block: a block's text is held in memory once, then written to COPY.
BATCH_ROWS = 5000
#: Below every rowid (SQLite's are signed 64-bit integers): the first block's ``after``.
_BEFORE_ROWIDS = -(2**63)


def copy_blocks(conn: Connection, table: str, columns: list[str]) -> Iterator[Block]:
    """``table``'s ``columns`` in rowid order, as :class:`Block` s of COPY text, read on
    ``conn`` (a SQLite connection: under a write lock, the rows of one instant).

    SQLite joins each row's values itself (tab between values, NUL for NULL: no PostgreSQL
    text can hold one) and the rows of a block (:data:`BATCH_ROWS` of them, by rowid, newline
    between rows) with ``group_concat``: one string per block reaches Python, not a row
    object per row (a fifth less time reading 5 M runs: docs/decisions.md, "Relocation and
    transfer"). A block with no backslash, no CR, and exactly the tabs and newlines the joins
    put there holds no value COPY would escape: each row's text is then its COPY line and its
    checksum text at once (NUL spelled ``\\N``), and the block goes out as it is, without a
    Python step per value (the NULs counted against the block's NULLs: a NUL inside a value
    is not a mark). Any other block, and one SQLite cannot join (longer than its string
    limit, ``SQLITE_TOOBIG``), or that is not UTF-8, is read again and escaped value
    by value. Raises ``RIVET_STATE_VALUE_UNTRANSFERABLE`` for a value no PostgreSQL text can
    hold (not UTF-8, or holding a NUL), and what the driver raises (``sqlite3.Error``),
    which the session that yielded ``conn`` translates.
    """
    raw: sqlite3.Connection = conn.connection.driver_connection  # type: ignore[assignment]
    joined = " || :tab || ".join(f'ifnull("{c}", :null)' for c in columns)
    tabs = len(columns) - 1
    # The rows after rowid :after, in rowid order: how many, the last rowid, and their texts
    # joined (group_concat's order does not matter: COPY takes rows in any order, and the
    # checksum is a sum).
    nulls = " + ".join(f'("{c}" IS NULL)' for c in columns)
    # As bytes (CAST AS BLOB): a text that is not UTF-8 is found below, where it sends the
    # block value by value, and never fails the driver's decoding.
    block_sql = (f'SELECT count(*), max(st_rowid), CAST(group_concat(st_line, :newline) AS BLOB), sum(st_nulls) '
                 f'FROM (SELECT rowid AS st_rowid, {joined} AS st_line, {nulls} AS st_nulls FROM "{table}" '
                 f'WHERE rowid > :after ORDER BY rowid LIMIT :rows)')
    size_sql = f'SELECT count(*), max(st_rowid) FROM (SELECT rowid AS st_rowid FROM "{table}" WHERE rowid > :after ' \
               f'ORDER BY rowid LIMIT :rows)'
    params = {"tab": "\t", "null": "\0", "newline": "\n", "rows": BATCH_ROWS, "after": _BEFORE_ROWIDS}
    while True:
        try:
            n, last, joined_rows, marks = raw.execute(block_sql, params).fetchone()
        except sqlite3.DataError:  # too long to join: this block goes value by value
            n, last = raw.execute(size_sql, params).fetchone()
            joined_rows = None
        if not n:
            return
        if joined_rows is None or not _plain(joined_rows, n, tabs, marks):
            data, checksum = _escaped_block(raw, table, columns, params["after"], last)
        else:
            data = joined_rows.replace(b"\0", NULL.encode())
            checksum = sum60(data.split(b"\n"))
        yield Block(data + b"\n", n, checksum)
        params["after"] = last


def _plain(joined_rows: bytes, rows: int, tabs: int, marks: int) -> bool:
    """Whether the ``rows`` rows joined in ``joined_rows`` (``tabs`` tabs a row, ``marks``
    NULs marking NULLs) are their own COPY lines: UTF-8, no backslash or CR, no tab, newline
    or NUL inside a value."""
    try:
        joined_rows.decode()
    except UnicodeDecodeError:
        return False
    return (b"\\" not in joined_rows and b"\r" not in joined_rows and joined_rows.count(b"\n") == rows - 1
            and joined_rows.count(b"\t") == rows * tabs and joined_rows.count(b"\0") == marks)


def _escaped_block(raw: sqlite3.Connection, table: str, columns: list[str], after: int, last: int
                   ) -> tuple[bytes, int]:
    """The rows after rowid ``after`` up to ``last`` as COPY text, each value escaped, and their checksum."""
    lines, checksum = [], 0
    quoted = ", ".join(f'"{c}"' for c in columns)
    raw.text_factory = bytes  # a text that is not UTF-8 is named below, not a decode error of the driver
    try:
        rows = raw.execute(f'SELECT rowid, {quoted} FROM "{table}" WHERE rowid > ? AND rowid <= ? ORDER BY rowid',
                           (after, last)).fetchall()
    finally:
        raw.text_factory = str
    for rowid, *row in rows:
        texts = [None if v is None else _text(v, table, columns[i], rowid) if isinstance(v, bytes) else str(v)
                 for i, v in enumerate(row)]
        checksum += row_checksum(texts)
        lines.append("\t".join(NULL if t is None else t.translate(ESCAPES) for t in texts))
    return "\n".join(lines).encode(), checksum


def _text(value: bytes, table: str, column: str, rowid: int) -> str:
    """``value`` (a TEXT or BLOB of the source) as the text PostgreSQL will hold.
    ``RIVET_STATE_VALUE_UNTRANSFERABLE`` when it is not UTF-8 or holds a NUL, which no
    PostgreSQL text can: refused before the COPY sends it, naming where it is."""
    try:
        text = value.decode()
    except UnicodeDecodeError:
        why = "is not UTF-8 text (a BLOB, or bytes written by hand)"
    else:
        if "\0" not in text:
            return text
        why = "holds a NUL character, which no PostgreSQL text can"
    raise StateError("RIVET_STATE_VALUE_UNTRANSFERABLE",
                     f"{table}.{column} of the row with rowid {rowid} {why}; nothing was written at the destination",
                     {"table": table, "column": column, "rowid": rowid})


def table_checksum(raw: sqlite3.Connection, table: str, columns: list[str]) -> tuple[int, int]:
    """``(rows, checksum)`` of ``table`` over ``columns`` as this file holds them: the sum of
    :func:`~statetool.backends.copy_text.row_checksum` over its rows (each value's text as
    SQLite gives it back: an integer as its digits), read :data:`BATCH_ROWS` rows at a time."""
    quoted = ", ".join(f'"{c}"' for c in columns)
    cursor = raw.execute(f'SELECT {quoted} FROM "{table}"')
    rows = total = 0
    while batch := cursor.fetchmany(BATCH_ROWS):
        rows += len(batch)
        total += sum60(["\t".join(NULL if v is None else str(v) for v in row).encode() for row in batch])
    return rows, total


def insert_blocks(conn: Connection, table: str, columns: list[str], blocks: Iterable[Block],
                  progress: Callable[[int], None]) -> Loaded:
    """Append the rows of ``blocks`` (COPY text) to ``table`` in ``conn``'s transaction (a
    SQLite writing connection), each value as the text the source gave (SQLite's column
    affinity stores an integer column's digits as an integer); ``progress(n)`` after each
    block of ``n`` rows. Returns what was sent and what the table gained by its own count
    and checksum (:func:`table_checksum`, before and after): the caller compares them.
    Driver errors propagate for the session that yielded ``conn`` to translate."""
    raw: sqlite3.Connection = conn.connection.driver_connection  # type: ignore[assignment]
    before_rows, before_sum = table_checksum(raw, table, columns)
    quoted = ", ".join(f'"{c}"' for c in columns)
    insert = f'INSERT INTO "{table}" ({quoted}) VALUES ({", ".join("?" * len(columns))})'
    sent_rows = sent_sum = 0
    for block in blocks:
        raw.executemany(insert, [line_values(line) for line in block.data[:-1].split(b"\n")])
        sent_rows += block.rows
        sent_sum += block.checksum
        progress(block.rows)
    after_rows, after_sum = table_checksum(raw, table, columns)
    return Loaded(sent_rows, sent_sum, after_rows - before_rows, after_sum - before_sum)
