"""``statetool import FILE``: a state made from its ``rivet-state/1`` export, or one export's
progress put back into a live state (SPEC §9: an older or foreign copy is never imported
silently).

Where no state exists, the file becomes the state, the same state: its identity, lineage
and serial, every row the file holds, through the atomic create path ``init`` uses
(:func:`~statetool.operations.writes.create_state`). Into a live state, one export's
progress (cursor, chunk checkpoints, ledger rows) replaces that export's, through
:func:`~statetool.operations.writes.guarded_write` with the export's run lease, backed up
and audited. A file of another identity or lineage is refused (``RIVET_STATE_FOREIGN``).
"""

from __future__ import annotations

import json
import uuid

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from statetool import migrations, schema
from statetool.errors import StateError, StateWarning
from statetool.operations.context import Context, now_iso
from statetool.operations.portable import load_document, read_state, state_document
from statetool.operations.positions import put_position
from statetool.operations.probe import lineage
from statetool.operations.writes import create_state, guarded_write, one_export, require_writable
from statetool.tables import LINEAGE


@dataclass
class ImportResult:
    """What an import did (or, with ``dry_run``, would do): ``action`` ``create`` or
    ``export``, the place, each export's progress before and after, the backup."""

    action: str
    location: str
    dry_run: bool
    changes: list[dict[str, Any]]
    state: dict[str, Any]
    backup: str | None = None
    warnings: list[StateWarning] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        """``{action, location, dry_run, state, changes, backup, warnings}``."""
        return {"action": self.action, "location": self.location, "dry_run": self.dry_run, "state": self.state,
                "changes": self.changes, "backup": self.backup, "warnings": [w.as_dict() for w in self.warnings]}


def _progress(one: dict[str, Any] | None) -> dict[str, Any] | None:
    """The progress of one export object, as an import shows it before and after."""
    if one is None:
        return None
    position = one.get("cdc_position")
    return {"cursor": one["cursor"]["value"], "chunks": len(one["chunks"]), "ledger": len(one["ledger"]),
            "cdc_position": None if position is None else position["position"]}


def _foreign(where: str, mine: Any, theirs: Any, what: str) -> StateError:
    return StateError("RIVET_STATE_FOREIGN", f"the file belongs to {what} {theirs}, the state at {where} to {mine}: "
                      "an import never mixes two states; nothing was written", {"recorded": mine, "file": theirs})


def _computed_key(ctx: Context) -> str:
    return ctx.computed_key if ctx.config_or_none() is not None else ""


def _rows(conn: Connection, doc: dict[str, Any], names: list[str]) -> None:
    """Insert every row of ``doc`` for exports ``names`` into the new state on ``conn``."""
    now = now_iso()
    for name in names:
        one = doc["exports"][name]
        if one["registered"]:
            conn.execute(sa.insert(schema.exports).values(
                export_name=name, mode=one["mode"] or "incremental", cursor_value=one["cursor"]["value"],
                cursor_updated_at=one["cursor"]["updated_at"], updated_at=one["updated_at"] or now))
        for chunk in one["chunks"]:
            conn.execute(sa.insert(schema.chunks).values(export_name=name, **chunk))
        for row in one["ledger"]:
            conn.execute(sa.insert(schema.load_ledger).values(export_name=name, **row))
        for run in one.get("runs", []):
            conn.execute(sa.insert(schema.runs).values(export_name=name, **{k: v for k, v in run.items()
                                                                            if v is not None}))
        _put_position(conn, name, one["cdc_position"])
    for aggregate in doc.get("run_aggregates", []):
        conn.execute(sa.insert(schema.run_aggregates).values(**aggregate))


def _put_position(conn: Connection, name: str, position: dict[str, Any] | None) -> None:
    """Make export ``name``'s CDC position in the state the file's (revision 0006): the row
    replaced, or removed where the file holds none (:func:`~statetool.operations.positions.put_position`)."""
    if position is None:
        put_position(conn, name, "", None)
        return
    put_position(conn, name, position["engine"], json.dumps(position["position"], sort_keys=True, allow_nan=False),
                 committed_at=position["committed_at"], run_id=position["run_id"], token=position["fencing_token"])


def _create(ctx: Context, doc: dict[str, Any], names: list[str], dry_run: bool) -> ImportResult:
    location = ctx.location
    problem = location.directory_problem()
    if problem is not None:
        raise problem
    state = doc["state"]
    if not doc["with_history"]:
        raise StateError("RIVET_CLI_USAGE", "the file was exported without --with-history: a state made from it "
                         "would lose its runs, and an export whose progress is a succeeded run would start as a "
                         "FIRST RUN; export it again with statetool export --with-history")
    try:
        migrations.index_of(state["revision"])
    except KeyError:
        raise StateError("RIVET_STATE_SCHEMA_NEWER", f"the file was exported from a state at revision "
                         f"{state['revision']}, unknown to this release") from None
    key, computed = state["state_key"] or "", _computed_key(ctx)
    if key and computed and key != computed:  # in any scope, as restore: a new state is never another source's
        raise _foreign(str(location.directory or location.display), computed, key, "source")
    changes = [{"export": n, "before": None, "after": _progress(doc["exports"][n])} for n in names]
    warnings = require_writable(ctx, dry_run=True) if dry_run else []
    result = ImportResult("create", location.display, dry_run, changes, state, warnings=warnings)
    if dry_run:
        return result
    backend = ctx.backend()

    def build(conn: Connection) -> None:
        migrations.apply(conn, migrations.head(), backend.schema, "up")
        _rows(conn, doc, names)
        if state["lineage"] is not None and LINEAGE in backend.table_names(backend.reader(conn)):
            conn.execute(sa.delete(schema.lineage))  # the one the revision gave the new state
            conn.execute(sa.insert(schema.lineage).values(id=1, lineage=state["lineage"], serial=state["serial"] or 1,
                                                          write_id=str(uuid.uuid4()), updated_at=now_iso()))

    create_state(ctx, build, key, action="import", detail={"exports": names, "lineage": state["lineage"],
                                                            "serial": state["serial"]})
    return result


def _into_live(ctx: Context, doc: dict[str, Any], name: str, dry_run: bool) -> ImportResult:
    """Replace export ``name``'s cursor, chunk checkpoints and ledger rows with the file's."""
    backend = ctx.backend()
    where = ctx.location.display
    with read_state(backend) as (conn, snap):
        live = state_document(backend, conn, snap)

    def same_state(live_state: dict[str, Any]) -> None:
        theirs = doc["state"]
        if live_state["state_key"] and theirs["state_key"] and live_state["state_key"] != theirs["state_key"]:
            raise _foreign(where, live_state["state_key"], theirs["state_key"], "source")
        if live_state["lineage"] and theirs["lineage"] and live_state["lineage"] != theirs["lineage"]:
            raise _foreign(where, live_state["lineage"], theirs["lineage"], "lineage")

    same_state(live["state"])
    one = doc["exports"][name]
    change = [{"export": name, "before": _progress(live["exports"].get(name)), "after": _progress(one)}]
    if dry_run:
        return ImportResult("export", where, True, change, live["state"],
                            warnings=require_writable(ctx, copies=2, dry_run=True))
    e, c, ledger = schema.exports, schema.chunks, schema.load_ledger
    with guarded_write(ctx, one_export(name), backup_label=f"import-{name}") as session:
        current_key = session.snapshot.recorded_key
        current_lineage, _serial = lineage(session.reader, session.snapshot.tables)
        same_state({"state_key": current_key, "lineage": current_lineage})
        wc = session.conn
        now = now_iso()
        values = {"cursor_value": one["cursor"]["value"], "cursor_updated_at": one["cursor"]["updated_at"],
                  "updated_at": now}
        if not wc.execute(sa.update(e).where(e.c.export_name == name).values(**values)).rowcount:
            wc.execute(sa.insert(e).values(export_name=name, mode=one["mode"] or "incremental", **values))
        wc.execute(sa.delete(c).where(c.c.export_name == name))
        wc.execute(sa.delete(ledger).where(ledger.c.export_name == name))
        for chunk in one["chunks"]:
            wc.execute(sa.insert(c).values(export_name=name, **chunk))
        for row in one["ledger"]:
            wc.execute(sa.insert(ledger).values(export_name=name, **{k: v for k, v in row.items() if k != "id"}))
        _put_position(wc, name, one["cdc_position"])
        session.audit("import", {"export": name, "before": change[0]["before"], "after": change[0]["after"]})
        backup, warnings = session.backup, session.warnings
    return ImportResult("export", where, False, change, live["state"], str(backup) if backup else None, warnings)


def import_state(ctx: Context, path: Path, *, export: str | None = None, dry_run: bool = False) -> ImportResult:
    """``statetool import FILE``: where no state exists, create it from the file (every
    export, or only ``export``); into a live state, replace export ``export``'s progress.
    ``dry_run`` returns the change (before -> after) and writes nothing.

    Raises ``RIVET_STATE_EXPORT_FORMAT`` (not a ``rivet-state/1`` file),
    ``RIVET_STATE_FOREIGN`` (a file of another identity or lineage),
    ``RIVET_EXPORT_UNKNOWN`` (``export`` not in the file), ``RIVET_STATE_TARGET_NOT_EMPTY``
    (a live state and no ``export`` named), ``RIVET_CLI_USAGE`` (a state to create from a
    file without history), and the codes of ``init`` and of a guarded write."""
    doc = load_document(path)
    if export is not None and export not in doc["exports"]:
        raise StateError("RIVET_EXPORT_UNKNOWN", f"export '{export}' is not in {path}", {"export": export})
    if not ctx.backend().present():
        return _create(ctx, doc, [export] if export is not None else sorted(doc["exports"]), dry_run)
    if export is None:
        raise StateError("RIVET_STATE_TARGET_NOT_EMPTY", f"a state is already at {ctx.location.display}: import "
                         "makes a state only where none is; to put one export's progress back into it, name it "
                         "with --export NAME")
    return _into_live(ctx, doc, export, dry_run)
