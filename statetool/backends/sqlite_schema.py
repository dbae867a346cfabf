"""Column type changes SQLite can make without copying a row (issue 13, item 2).

SQLite has no ``ALTER COLUMN``: the general way to change a column's declared type is to
rebuild the table (create a new one, copy every row, drop the old one), which on a state
with millions of runs is most of a migration and leaves the old table's pages free in the
file. But a declared type only chooses the column's *affinity* (SQLite's "Datatypes In
SQLite", section 3.1), and a row is stored the same whatever its column's declared type.
So a change between two types of the same affinity (``INTEGER`` to ``BIGINT``: both
INTEGER affinity, and SQLite integers are 64-bit already) changes no stored byte, only the
table's ``CREATE TABLE`` text in ``sqlite_master``. SQLite documents that edit (``PRAGMA
writable_schema``, then ``schema_version`` incremented) for changes that leave the stored
content as it is ("ALTER TABLE", section 7).

:func:`retyped_sql` decides whether the edit applies and writes the new text, proving it
first: both texts are created in a private in-memory database, and every column must come
out the same (name, NOT NULL, default, key position, affinity, indexes) apart from the new
declared types. Anything it cannot prove (a column without a declared type, one of another
affinity, a name found twice, text it cannot parse) gives None, and the caller rebuilds
the table as before. Loads no SQLAlchemy: the migrate plan asks it too.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable, Mapping
from typing import Any

from statetool.errors import StateError

#: Words that end a column's type name and start its constraints (SQLite's column-def grammar).
_CONSTRAINT_WORDS = ("constraint", "primary", "not", "null", "unique", "check", "default", "collate", "references",
                     "generated", "as")
_WORD = r"(?!(?:" + "|".join(_CONSTRAINT_WORDS) + r")\b)[A-Za-z_][A-Za-z0-9_]*"
#: A type name: words, then an optional ``(n)`` or ``(n, m)``.
_TYPE = rf"{_WORD}(?:\s+{_WORD})*(?:\s*\(\s*[+-]?\d+\s*(?:,\s*[+-]?\d+\s*)?\))?"


def affinity(declared: str) -> str:
    """The affinity SQLite gives a column declared ``declared`` ("Datatypes In SQLite",
    3.1, rules in order): ``INTEGER``, ``TEXT``, ``BLOB``, ``REAL`` or ``NUMERIC``."""
    name = declared.upper()
    if "INT" in name:
        return "INTEGER"
    if any(word in name for word in ("CHAR", "CLOB", "TEXT")):
        return "TEXT"
    if not name.strip() or "BLOB" in name:
        return "BLOB"
    if any(word in name for word in ("REAL", "FLOA", "DOUB")):
        return "REAL"
    return "NUMERIC"


def _column_pattern(column: str) -> re.Pattern[str]:
    """The start of ``column``'s definition (bare, ``"quoted"``, ```quoted``` or
    ``[quoted]``; case-insensitive, as SQLite's names are) and its type name."""
    name = re.escape(column)
    return re.compile(rf"(?P<lead>[(,]\s*)(?P<name>{name}|\"{name}\"|`{name}`|\[{name}\])(?P<gap>\s+)"
                      rf"(?P<type>{_TYPE})(?=[\s,)])", re.IGNORECASE)


def _shape(create_sql: str) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]] | None:
    """The columns (``table_xinfo`` rows) and indexes (``index_list`` rows without the
    sequence number) of the table ``create_sql`` creates, in a private in-memory
    database; None when SQLite refuses the text."""
    db = sqlite3.connect(":memory:")
    try:
        db.execute(create_sql)
        (table,) = db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchone()
        quoted = table.replace('"', '""')
        columns = db.execute(f'PRAGMA table_xinfo("{quoted}")').fetchall()
        indexes = [row[1:] for row in db.execute(f'PRAGMA index_list("{quoted}")')]
        return columns, indexes
    except sqlite3.Error:
        return None
    finally:
        db.close()


def retyped_sql(create_sql: str, changes: Mapping[str, str]) -> str | None:
    """``create_sql`` (a table's ``CREATE TABLE`` text from ``sqlite_master``) with each
    column of ``changes`` (column name -> new declared type, e.g. ``{"rows": "BIGINT"}``)
    declared with its new type; None unless the change is provably one of declared types
    only, of the same affinity (see the module's docstring): the caller must then rebuild."""
    new = create_sql
    for column, declared in changes.items():
        matches = list(_column_pattern(column).finditer(new))
        if len(matches) != 1 or affinity(matches[0]["type"]) != affinity(declared):
            return None
        found = matches[0]
        new = new[:found.start("type")] + declared + new[found.end("type"):]
    before, after = _shape(create_sql), _shape(new)
    if before is None or after is None or before[1] != after[1] or len(before[0]) != len(after[0]):
        return None
    wanted = {column.lower(): declared for column, declared in changes.items()}
    for old, now in zip(before[0], after[0]):
        expected_type = wanted.get(old[1].lower(), old[2])
        if now[:2] != old[:2] or now[3:] != old[3:] or now[2] != expected_type:
            return None
    return new


def retype_in_place(conn: Any, table: str, changes: Mapping[str, str]) -> bool:
    """Give the columns of ``table`` their new declared types (``changes`` as for
    :func:`retyped_sql`) by editing ``sqlite_master`` in ``conn``'s open transaction (a
    SQLAlchemy connection to a SQLite database: ``writable_schema`` on for the one
    ``UPDATE``, ``schema_version`` incremented so every statement after it reads the new
    text). Returns False, having changed nothing, when the edit does not apply; the caller
    rebuilds the table. Errors of the driver propagate (the migration's copy is then
    discarded, docs/decisions.md "A SQLite migration is its own backup")."""
    create_sql = conn.exec_driver_sql("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?",
                                      (table,)).scalar()
    new = retyped_sql(create_sql, changes) if create_sql else None
    if new is None:
        return False
    version = int(conn.exec_driver_sql("PRAGMA schema_version").scalar())
    conn.exec_driver_sql("PRAGMA writable_schema = ON")
    try:
        conn.exec_driver_sql("UPDATE sqlite_master SET sql = ? WHERE type = 'table' AND name = ?", (new, table))
        conn.exec_driver_sql(f"PRAGMA schema_version = {version + 1}")
    finally:
        conn.exec_driver_sql("PRAGMA writable_schema = OFF")
    return True


def rebuild_losses(query: Callable[[str], list[tuple[Any, ...]]], table: str) -> list[str]:
    """What a rebuild of ``table`` by alembic's batch mode (reflect, create anew, copy,
    drop, rename) would not carry over, as phrases for a refusal; empty when it carries
    everything. ``query(sql)`` runs one read on the state (a migration's connection or a
    plan's reader). Batch mode rebuilds from the reflected columns, keys and plain
    indexes, so it loses the table's triggers (dropped with the old table), indexes on
    expressions, CHECK constraints, the STRICT and WITHOUT ROWID options and generated
    columns (found by a fresh user: migrate dropped them and said "verified")."""
    quoted = table.replace("'", "''")
    (create_sql,) = query(f"SELECT sql FROM sqlite_master WHERE type = 'table' AND name = '{quoted}'")[0]
    lost = [f"trigger {name}" for (name,) in
            query(f"SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = '{quoted}' ORDER BY name")]
    for _seq, index, *_ in query(f"PRAGMA index_list('{quoted}')"):
        if any(row[1] == -2 for row in query(f"PRAGMA index_xinfo('{index.replace(chr(39), chr(39) * 2)}')")):
            lost.append(f"index {index} on an expression")
    if re.search(r"\bCHECK\s*\(", create_sql, re.IGNORECASE):
        lost.append("its CHECK constraints")
    options = create_sql[create_sql.rindex(")") + 1:].upper()
    lost += [f"its {option} option" for option in ("STRICT", "WITHOUT ROWID") if option in " ".join(options.split())]
    lost += [f"generated column {row[1]}" for row in query(f"PRAGMA table_xinfo('{quoted}')") if row[6] in (2, 3)]
    return lost


#: The key of a migration's SQLAlchemy ``Connection.info`` that names the state it migrates
#: (its copy is what the connection opens), for the messages of a revision's refusals.
STATE_NAME = "statetool_state"


def require_rebuildable(query: Callable[[str], list[tuple[Any, ...]]], table: str, where: str) -> None:
    """Refuse, before a rebuild of ``table`` starts (and in the plan of a dry run), one that
    would lose part of the table (:func:`rebuild_losses`): ``RIVET_STATE_SCHEMA_UNEXPECTED``,
    naming the state ``where``. A CHECK written inside a string counts as one: refusing too
    much changes nothing."""
    lost = rebuild_losses(query, table)
    if lost:
        raise StateError("RIVET_STATE_SCHEMA_UNEXPECTED",
                         f"{where}: {table} must be rebuilt by this migration (its declared types cannot be changed in "
                         f"place), and a rebuild would lose {', '.join(lost)}; nothing was changed: declare its "
                         "counts INTEGER by hand (or remove what would be lost), then re-run", {"path": where})
