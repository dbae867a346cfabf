"""A SQLite table read in blocks of PostgreSQL ``COPY`` text, with their checksums (SPEC §9).

What ``statetool transfer`` streams out of the source: :func:`copy_blocks` reads one
table in rowid order, :data:`BATCH_ROWS` rows at a time, so memory stays flat whatever
the table's size. The text and the checksum are those of
:mod:`statetool.backends.copy_text`.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from typing import TYPE_CHECKING

from statetool.backends.copy_text import ESCAPES, NULL, Block, row_checksum, sum60

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

#: Rows per block: a block's text is held in memory once, then written to COPY.
BATCH_ROWS = 5000


def copy_blocks(conn: Connection, table: str, columns: list[str]) -> Iterator[Block]:
    """``table``'s ``columns`` in rowid order, as :class:`Block` s of COPY text, read on
    ``conn`` (a SQLite connection: under a write lock, the rows of one instant).

    SQLite joins each row's values itself (tab between values, NUL for NULL: no PostgreSQL
    text can hold one). A block with no backslash, no CR, and exactly the tabs and newlines
    the joins put there holds no value COPY would escape: each row's text is then its COPY
    line and its checksum text at once (NUL spelled ``\\N``), and the block goes out as it
    is, without a Python step per value. Any other block is read again and escaped value
    by value. Raises what the driver raises (``sqlite3.Error``); the session that yielded
    ``conn`` translates it.
    """
    raw: sqlite3.Connection = conn.connection.driver_connection  # type: ignore[assignment]
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
            data = text.replace("\0", NULL).encode()
            checksum = sum60(data.split(b"\n"))
        yield Block(data + b"\n", n, checksum)


def _escaped_block(raw: sqlite3.Connection, table: str, quoted: str, first: int, last: int) -> tuple[bytes, int]:
    """The rows ``first``..``last`` (rowids) as COPY text, each value escaped, and their checksum."""
    lines, checksum = [], 0
    for row in raw.execute(f'SELECT {quoted} FROM "{table}" WHERE rowid BETWEEN ? AND ? ORDER BY rowid',
                           (first, last)):
        texts = [None if v is None else v.decode() if isinstance(v, bytes) else str(v) for v in row]
        checksum += row_checksum(texts)
        lines.append("\t".join(NULL if t is None else t.translate(ESCAPES) for t in texts))
    return "\n".join(lines).encode(), checksum
