"""Alembic glue: the revision graph of the state schema and how to move along it.

The revisions live in ``alembic/`` at the top of the source tree and ship inside the
wheel as ``statetool/_alembic`` (pyproject.toml), so a plain ``pip install .`` can
migrate. Every path uses the version table :data:`statetool.schema.VERSION_TABLE`
(alembic/env.py).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.util
import io
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from statetool.errors import StateError


def script_location() -> Path:
    """The alembic script directory: packaged (``statetool/_alembic``) or the source tree's."""
    packaged = Path(__file__).parent / "_alembic"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parent.parent / "alembic"


@dataclass(frozen=True)
class Revision:
    """One revision of the state schema: id, one-line description, parent, and what it costs.

    ``rebuilds``: tables the upgrade copies row by row. ``retypes``: table -> column -> new
    declared type, the only reason a table of ``rebuilds`` is rebuilt (a backend that can
    make them in place rebuilds nothing: :meth:`~statetool.backends.base.Backend.rebuilt_tables`).
    ``down_rebuilds``: tables the downgrade copies row by row. ``loses``: table -> SQL
    predicate of rows whose data the downgrade drops (None: every row).
    """

    id: str
    description: str
    down: str | None
    rebuilds: tuple[str, ...]
    retypes: dict[str, dict[str, str]]
    down_rebuilds: tuple[str, ...]
    loses: dict[str, str | None]

    def as_dict(self) -> dict[str, object]:
        """``{"id", "description"}`` for JSON output."""
        return {"id": self.id, "description": self.description}


#: The module-level names a revision file declares its place and cost with.
_DECLARED = ("revision", "down_revision", "UPGRADE_REBUILDS", "UPGRADE_RETYPES", "DOWNGRADE_REBUILDS",
             "DOWNGRADE_LOSES")


def _declared(path: Path) -> tuple[str, dict[str, Any]]:
    """The docstring of one revision file and the literal values of its :data:`_DECLARED`
    names, read with ``ast`` without running the file (which imports SQLAlchemy: a read
    command loads neither it nor alembic, docs/decisions.md "Reading the revision graph").
    A value that is not a literal raises ``ValueError`` (``ast.literal_eval``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    values: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id in _DECLARED:
            values[target.id] = ast.literal_eval(value)
    return ast.get_docstring(tree) or "", values


@functools.cache
def revisions() -> tuple[Revision, ...]:
    """Every revision, oldest first (a single line of history: no branches).

    Read from the revision files' own literal values (``revision``, ``down_revision``,
    ``UPGRADE_REBUILDS``, ``UPGRADE_RETYPES``, ``DOWNGRADE_REBUILDS``, ``DOWNGRADE_LOSES``, the first line of the docstring) without
    running them: ``check`` and ``info`` need the list, not the engine, and load neither
    alembic nor SQLAlchemy (docs/decisions.md, "Reading the revision graph").
    """
    found: dict[str, Revision] = {}
    for path in sorted((script_location() / "versions").glob("*.py")):
        doc, values = _declared(path)
        rev = Revision(values["revision"], doc.splitlines()[0] if doc else "", values.get("down_revision"),
                       tuple(values.get("UPGRADE_REBUILDS", ())), dict(values.get("UPGRADE_RETYPES", {})),
                       tuple(values.get("DOWNGRADE_REBUILDS", ())), dict(values.get("DOWNGRADE_LOSES", {})))
        found[rev.id] = rev
    ordered: list[Revision] = []
    parent: str | None = None
    while True:
        children = [r for r in found.values() if r.down == parent]
        if len(children) > 1:
            raise RuntimeError(f"the revision history branches after {parent}: {[r.id for r in children]}")
        if not children:
            break
        ordered.append(children[0])
        parent = children[0].id
    if len(ordered) != len(found):
        raise RuntimeError(f"revisions not on the line from base: {sorted(set(found) - {r.id for r in ordered})}")
    return tuple(ordered)


def head() -> str:
    """The newest revision id."""
    return revisions()[-1].id


def index_of(rev: str | None) -> int:
    """Position of ``rev`` in :func:`revisions` (-1 for ``None``/``base``); KeyError if unknown."""
    if rev in (None, "base"):
        return -1
    for i, r in enumerate(revisions()):
        if r.id == rev:
            return i
    raise KeyError(rev)


def resolve_target(target: str | None) -> str:
    """Turn ``--to`` (None, ``head`` or a revision id) into a revision id.

    ``base`` is not a target: a state with no revision is no state at all. Raises
    ``RIVET_STATE_REVISION_UNKNOWN`` for anything else.
    """
    if target in (None, "head"):
        return head()
    try:
        if target == "base":
            raise KeyError(target)
        index_of(target)
    except KeyError:
        known = ", ".join(r.id for r in revisions())
        raise StateError("RIVET_STATE_REVISION_UNKNOWN",
                         f"revision '{target}' is not one of this release's: {known}, head") from None
    return target  # type: ignore[return-value]


def steps(current: str | None, target: str) -> tuple[str, list[Revision]]:
    """The revisions crossed from ``current`` to ``target``: ``("up"|"down"|"none", [...])``.

    Upward steps are listed in the order applied; downward steps too (newest first).
    """
    a, b = index_of(current), index_of(target)
    revs = revisions()
    if b > a:
        return "up", list(revs[a + 1:b + 1])
    if b < a:
        return "down", list(reversed(revs[b + 1:a + 1]))
    return "none", []


@contextlib.contextmanager
def alembic_loading_behind(enabled: bool = True) -> Iterator[None]:
    """While the block runs, import alembic (its ``command`` module, the engine a migration
    runs on) in a thread of its own, joined on the way out (no thread outlives the block).
    ``migrate`` wraps its pre-flight in it, and loads nothing of SQLAlchemy itself before
    the pre-flight is done (statetool/operations/migrate.py): the import is Python work
    that holds the GIL, the pre-flight's ``quick_check`` is SQLite's C code that releases
    it, so on a second core the two overlap instead of adding up (issue 13). An import error surfaces again
    where alembic is first used. ``enabled`` False (a dry run) does nothing."""

    def load() -> None:
        with contextlib.suppress(ImportError):
            importlib.import_module("alembic.command")

    worker = threading.Thread(target=load, name="statetool-load-alembic") if enabled else None
    if worker is not None:
        worker.start()
    try:
        yield
    finally:
        if worker is not None:
            worker.join()


def _config(schema: str | None, **attributes: Any):  # noqa: ANN202 - alembic Config
    from alembic.config import Config

    cfg = Config(output_buffer=io.StringIO())
    cfg.set_main_option("script_location", str(script_location()))
    cfg.attributes["schema"] = schema
    cfg.attributes.update(attributes)
    return cfg


def apply(connection: Any, target: str, schema: str | None, direction: str,
          on_step: Callable[[str], None] | None = None) -> None:
    """Run the upgrade or downgrade to ``target`` on ``connection``, inside ITS transaction.

    The caller begins the transaction and commits it after verifying; alembic adds none
    of its own (``transaction_per_migration=False`` on an open transaction).
    """
    from alembic import command

    def report(ctx: Any, step: Any, heads: Any, run_args: Any) -> None:
        if on_step is not None:
            on_step(step.up_revision_id)

    cfg = _config(schema, connection=connection, on_version_apply=report)
    if direction == "up":
        command.upgrade(cfg, target)
    else:
        command.downgrade(cfg, target)


def stamp(connection: Any, revision: str, schema: str | None) -> None:
    """Write ``revision`` into the version table without running it (legacy states)."""
    from alembic import command

    command.stamp(_config(schema, connection=connection), revision)


def offline_sql(dialect_name: str, schema: str | None, current: str | None, target: str, direction: str) -> str:
    """The SQL a DBA would run to go from ``current`` to ``target`` (alembic offline mode)."""
    from alembic import command

    cfg = _config(schema, dialect_name=dialect_name)
    span = f"{current or 'base'}:{target}"
    if direction == "up":
        command.upgrade(cfg, span, sql=True)
    else:
        command.downgrade(cfg, span, sql=True)
    return cfg.output_buffer.getvalue()  # type: ignore[union-attr]


def offline_stamp_sql(dialect_name: str, schema: str | None, revision: str) -> str:
    """The SQL that creates the version table at ``revision`` (a legacy state, for ``--sql``)."""
    from alembic import command

    cfg = _config(schema, dialect_name=dialect_name)
    command.stamp(cfg, revision, sql=True)
    return cfg.output_buffer.getvalue()  # type: ignore[union-attr]
