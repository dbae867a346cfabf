"""``statetool diff A B``: two states, state files or exports, compared field by field.

Each side is read into its ``rivet-state/1`` document (:mod:`statetool.operations.portable`):
a state location through its backend's read-only open, a SQLite state file of any name (a
backup a write left) through the same open (:func:`statetool.location.file_location`),
an export file by :func:`~statetool.operations.portable.load_document`. So every side is
compared in one shape, and reading one changes no byte (SPEC §9).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from statetool.backends import open_backend
from statetool.errors import StateError
from statetool.location import file_location
from statetool.operations.context import Context
from statetool.operations.portable import load_document, read_input, read_state, state_document
from statetool.redact import redact_text

#: What a side argument that names a state location starts with (SPEC §1).
_URL_PREFIXES = ("sqlite:", "postgres://", "postgresql://", "postgresql+psycopg://")
#: The file names read as a pipeline config (SPEC §2).
_CONFIG_SUFFIXES = (".yaml", ".yml")
#: The state's fields compared, in this order (docs/commands.md, "statetool diff").
STATE_FIELDS = ("state_key", "lineage", "serial", "revision")
#: Each export's single-valued fields compared, as ``(name, path into the export's object)``.
EXPORT_FIELDS = (("mode", ("mode",)), ("cursor.value", ("cursor", "value")),
                 ("cursor.updated_at", ("cursor", "updated_at")), ("runs.total", ("runs_summary", "total")),
                 ("runs.succeeded", ("runs_summary", "succeeded")), ("runs.failed", ("runs_summary", "failed")),
                 ("last_success", ("runs_summary", "last_success")), ("cdc_position", ("cdc_position", "position")),
                 ("cdc_position.engine", ("cdc_position", "engine")))


@dataclass
class Side:
    """One side of a diff: the argument as given (redacted), what it named (``state``,
    ``state_file`` or ``export_file``), the place read, and its document."""

    argument: str
    kind: str
    location: str
    document: dict[str, Any] = field(repr=False)

    def as_dict(self) -> dict[str, object]:
        """``{argument, kind, location}``."""
        return {"argument": self.argument, "kind": self.kind, "location": self.location}


def _state_side(argument: str, ctx: Context, kind: str = "state") -> Side:
    backend = ctx.backend()
    with read_state(backend) as (conn, snap):
        doc = state_document(backend, conn, snap)
    return Side(redact_text(argument), kind, backend.location.display, doc)


def open_side(ctx: Context, argument: str) -> Side:
    """Read the side ``argument`` names: a state location (``sqlite:/dir``, a PostgreSQL
    URL), a pipeline config (``.yaml``/``.yml``: its state, resolved as ``statetool -c
    PATH`` resolves it, ``RIVET_STATE_URL`` included), an export file (a file whose first
    character is ``{``), else a SQLite state file by its own path (a backup). Raises
    ``RIVET_STATE_MISSING`` when nothing is at a path, ``RIVET_CLI_USAGE`` for a directory
    (name it ``sqlite:DIR``), ``RIVET_STATE_EXPORT_FORMAT``, and every read code of
    :func:`~statetool.operations.portable.read_state`."""
    if argument.lower().startswith(_URL_PREFIXES):
        return _state_side(argument, Context(ctx.config_path, argument, ctx.env, ctx.lock_wait, ctx.command))
    path = Path(argument)
    if not os.path.lexists(path):
        raise StateError("RIVET_STATE_MISSING", f"{argument}: no state, state file, export or config is there",
                         {"path": argument})
    if path.is_dir():
        raise StateError("RIVET_CLI_USAGE", f"{argument} is a directory; name a state directory as "
                         f"sqlite:{os.path.abspath(path)}, or give a file (a state file, an export, a config)")
    if path.suffix in _CONFIG_SUFFIXES:
        return _state_side(argument, Context(path, None, ctx.env, ctx.lock_wait, ctx.command, config_given=True))
    start = read_input(path, 64).lstrip(b" \t\r\n\xef\xbb\xbf")  # JSON may start with a BOM
    if start.startswith(b"{"):
        return Side(redact_text(argument), "export_file", os.path.abspath(path), load_document(path))
    backend = open_backend(file_location(path), ctx.lock_wait)
    with read_state(backend) as (conn, snap):
        doc = state_document(backend, conn, snap)
    return Side(redact_text(argument), "state_file", backend.location.display, doc)


def _dig(doc: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = doc
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _keyed(rows: list[dict[str, Any]], key: tuple[str, ...], drop: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """``{"k1#k2": row without ``drop``}``; a key seen again gets ``~2``, ``~3``, ... (a
    ledger may name one part twice)."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        name = "#".join(str(row.get(k)) for k in key)
        seen, n = name, 1
        while seen in out:
            n += 1
            seen = f"{name}~{n}"
        out[seen] = {k: v for k, v in row.items() if k not in drop}
    return out


def _rows_difference(export: str, name: str, a: dict[str, dict[str, Any]],
                     b: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    changed = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    if not (only_a or only_b or changed):
        return None
    return {"scope": "export", "export": export, "field": name, "a": len(a), "b": len(b), "only_a": only_a,
            "only_b": only_b, "changed": changed}


def _export_differences(name: str, a: dict[str, Any] | None, b: dict[str, Any] | None) -> list[dict[str, Any]]:
    if a is None or b is None:
        return [{"scope": "export", "export": name, "field": "present", "a": a is not None, "b": b is not None}]
    out = [{"scope": "export", "export": name, "field": label, "a": _dig(a, path), "b": _dig(b, path)}
           for label, path in EXPORT_FIELDS if _dig(a, path) != _dig(b, path)]
    chunk_key = ("run_id", "chunk_index")
    rows = [("chunks", _keyed(a["chunks"], chunk_key), _keyed(b["chunks"], chunk_key)),
            ("ledger", _keyed(a["ledger"], ("table_name", "part"), ("id",)),
             _keyed(b["ledger"], ("table_name", "part"), ("id",)))]
    out += [d for label, left, right in rows if (d := _rows_difference(name, label, left, right)) is not None]
    return out


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Every difference between two ``rivet-state/1`` documents, in a stable order: the
    state's :data:`STATE_FIELDS`, then per export (by name) its presence, its
    :data:`EXPORT_FIELDS`, its chunk checkpoints (keyed ``run_id#chunk_index``) and ledger
    rows (keyed ``table_name#part``, ids not compared: an id is where a row was stored,
    not what was loaded). Each is ``{scope, export, field, a, b}``; for rows ``a``/``b``
    are the counts, with ``only_a``, ``only_b`` and ``changed`` keys. History (``runs``)
    is compared by its counts only."""
    out = [{"scope": "state", "export": None, "field": f, "a": a["state"].get(f), "b": b["state"].get(f)}
           for f in STATE_FIELDS if a["state"].get(f) != b["state"].get(f)]
    for name in sorted(set(a["exports"]) | set(b["exports"])):
        out += _export_differences(name, a["exports"].get(name), b["exports"].get(name))
    return out


@dataclass
class DiffResult:
    """Two sides and their differences (empty: equal)."""

    a: Side
    b: Side
    differences: list[dict[str, Any]]

    @property
    def equal(self) -> bool:
        """True when no compared field differs."""
        return not self.differences

    def as_dict(self) -> dict[str, object]:
        """``{equal, a, b, differences}`` (stable keys, SPEC §10)."""
        return {"equal": self.equal, "a": self.a.as_dict(), "b": self.b.as_dict(), "differences": self.differences}


def diff(ctx: Context, a: str, b: str) -> DiffResult:
    """``statetool diff A B``: read both sides (:func:`open_side`), read-only, and list
    their :func:`differences`. Raises :func:`open_side`'s codes."""
    left, right = open_side(ctx, a), open_side(ctx, b)
    return DiffResult(left, right, differences(left.document, right.document))
