"""The read session a backend hands out (:class:`~statetool.backends.base.Reader`), on the
backend's own driver, and the same interface over a SQLAlchemy connection a write holds.

Every query of the read paths (statetool/operations/probe.py and the catalog queries of
each backend) is SQL text with ``:name`` parameters, the style of SQLAlchemy's
``text()``: :class:`DriverReader` passes it to ``sqlite3`` as it is (its ``named`` style)
and turns it into ``%(name)s`` for psycopg (``pyformat``); :class:`CoreReader` gives it to
``sqlalchemy.text`` on a write's own connection. So one statement serves both backends
and both kinds of session, and no operation learns which driver runs it
(docs/decisions.md, "Reads without SQLAlchemy"). This module imports no driver.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from statetool.errors import StateError

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

#: A ``:name`` bind parameter, as ``sqlalchemy.text`` finds it (not ``::type`` casts, not ``\:``).
_BIND = re.compile(r"(?<![:\w\\]):(\w+)(?!:)")
#: A driver's error, as the owning backend turns it into its registered error.
Translate = Callable[[BaseException], StateError]
Params = Mapping[str, object] | None


@functools.cache
def pyformat(sql: str) -> str:
    """``sql`` with each ``:name`` turned into ``%(name)s`` and each literal ``%`` doubled
    (psycopg's ``pyformat`` parameter style)."""
    return _BIND.sub(r"%(\1)s", sql.replace("%", "%%"))


class DriverReader:
    """A :class:`~statetool.backends.base.Reader` over one DB-API connection (``sqlite3`` or
    psycopg) in its read transaction. ``convert`` rewrites the ``:name`` SQL for the
    driver (None: the driver takes it as it is); every error of the driver class ``errors``
    is raised as ``translate(error)``, chained from the driver's error; ``info`` carries
    what the open found (``interrupted_write``: the sentence of a rolled-back hot journal)."""

    def __init__(self, raw: Any, errors: type[BaseException] | tuple[type[BaseException], ...], translate: Translate,
                 convert: Callable[[str], str] | None = None) -> None:
        self.raw = raw
        self.info: dict[str, str] = {}
        self._errors = errors
        self._translate = translate
        self._convert = convert

    def rows(self, sql: str, params: Params = None) -> list[tuple[Any, ...]]:
        """Every row of ``sql`` (``:name`` parameters from ``params``) as tuples."""
        text = self._convert(sql) if self._convert is not None else sql
        try:
            cursor = self.raw.cursor()
            try:
                cursor.execute(text, params or {})
                return [tuple(row) for row in cursor.fetchall()]
            finally:
                cursor.close()
        except self._errors as err:
            raise self._translate(err) from err

    def one(self, sql: str, params: Params = None) -> tuple[Any, ...] | None:
        """The first row of ``sql``, or None when it returns none."""
        found = self.rows(sql, params)
        return found[0] if found else None

    def scalar(self, sql: str, params: Params = None) -> Any:
        """The first column of the first row of ``sql``, or None when it returns no row."""
        row = self.one(sql, params)
        return None if row is None else row[0]


class CoreReader(DriverReader):
    """The same interface on a SQLAlchemy connection a write opened (``writing``,
    ``receiving``), in that connection's transaction: ``sqlalchemy.text`` binds the
    ``:name`` parameters for either dialect, and errors are translated as on a read session."""

    def __init__(self, conn: Connection, translate: Translate) -> None:
        from sqlalchemy.exc import DBAPIError

        super().__init__(conn, DBAPIError, translate)

    def rows(self, sql: str, params: Params = None) -> list[tuple[Any, ...]]:
        """Every row of ``sql`` on the write's connection, as tuples."""
        from sqlalchemy import text

        try:
            return [tuple(row) for row in self.raw.execute(text(sql), dict(params or {}))]
        except self._errors as err:
            raise self._translate(err) from getattr(err, "orig", None) or err
