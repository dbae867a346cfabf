"""The rows a transfer streams, as PostgreSQL's ``COPY`` text, and the checksum both ends compute (SPEC §9).

A row's canonical text is its values as text joined by tabs, NULL spelled ``\\N``; its
checksum is the first 60 bits of that text's md5, and a table's checksum is the sum over
its rows (additive: what a table gained is its sum after minus its sum before). The
SQLite side computes it in Python (:mod:`statetool.backends.sqlite_rows`), PostgreSQL in
SQL (:mod:`statetool.backends.postgres_copy`): the two agree exactly when every row
arrived value for value.
"""

from __future__ import annotations

import re
import sys
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

try:  # CPython's own md5: for a row-sized text, a third of OpenSSL's per-call cost (an EVP context per hash)
    from _md5 import md5
except ImportError:  # an interpreter built without it
    from hashlib import md5

#: How COPY's text format (and the canonical text) spells NULL.
NULL = "\\N"
#: What COPY's text format escapes inside a value.
ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


#: What COPY's text format spells with a backslash (PostgreSQL's ``COPY TO`` writes
#: these, never an octal or hex escape), and what each stands for.
_UNESCAPES = {b"\\": b"\\", b"t": b"\t", b"n": b"\n", b"r": b"\r", b"b": b"\b", b"f": b"\f", b"v": b"\v"}
_ESCAPED = re.compile(rb"\\(.)", re.DOTALL)


def line_values(line: bytes) -> list[str | None]:
    """The values of one line of COPY text (no newline), None for NULL: what a destination
    that is not PostgreSQL inserts."""
    return [None if field == NULL.encode() else
            _ESCAPED.sub(lambda m: _UNESCAPES.get(m.group(1), m.group(1)), field).decode()
            for field in line.split(b"\t")]


def line_checksums(lines: list[bytes]) -> int:
    """The sum of the row checksums of ``lines`` (COPY text, no newlines): a line without a
    backslash is its own canonical text; any other is unescaped value by value first."""
    return sum60([line if b"\\" not in line else
                  "\t".join(NULL if v is None else v for v in line_values(line)).encode() for line in lines])


@dataclass(frozen=True)
class Block:
    """Consecutive rows of one table: ``data`` is their COPY text (one line per row, each
    ending in a newline), ``rows`` how many, ``checksum`` the sum of their row checksums."""

    data: bytes
    rows: int
    checksum: int


@dataclass(frozen=True)
class Loaded:
    """One table's COPY into PostgreSQL: what the blocks carried (``sent_rows``,
    ``sent_checksum``) and what the table gained (``gained_rows``, ``gained_checksum``:
    after the COPY minus before, counted by the server)."""

    sent_rows: int
    sent_checksum: int
    gained_rows: int
    gained_checksum: int


#: Each byte's low four bits: what the shift of :func:`sum60` drops from a digest's eighth byte.
_LOW_NIBBLE = bytes(b & 15 for b in range(256))


def sum60(lines: Iterable[bytes]) -> int:
    """The sum over ``lines`` (each a row's canonical text, UTF-8) of the first 60 bits of
    each one's md5 (its first 8 bytes, big-endian, shifted right by 4).

    Computed without a Python step per row beyond the hash itself: the digests are joined,
    their first halves summed as unsigned 64-bit integers by ``array``, and the bits the
    shift drops (the low nibble of each digest's eighth byte) subtracted before one shift.
    """
    digests = b"".join([md5(line).digest() for line in lines])
    halves = array("Q", digests)
    if sys.byteorder == "little":
        halves.byteswap()
    return (sum(halves[::2]) - sum(digests[7::16].translate(_LOW_NIBBLE))) >> 4


def row_checksum(values: Iterable[Any]) -> int:
    """The checksum of one row (its values in column order, None for NULL): the same number
    PostgreSQL computes for it in :func:`statetool.backends.postgres_copy.table_checksum`."""
    text = "\t".join(NULL if v is None else str(v) for v in values)
    return sum60([text.encode()])
