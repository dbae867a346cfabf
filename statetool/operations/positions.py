"""``statetool checkpoints import | export``: a CDC export's position moved from its
checkpoint file into the state, and back (issue 15 item 3; SPEC §6, ADR-0039 D5).

``import`` reads each CDC export's checkpoint file (or the one named), writes its position
into the state's ``rivet_cdc_positions`` (revision 0006) under that export's run lease, in
one guarded write with an audit row, reads it back in the same transaction, and after the
commit renames the file ``<name>.imported-<UTC time>``, so that a stale file can never be
read as the position again. ``export`` is the rollback: it writes the state's position to
the file (a temporary file renamed into place, read back), then removes it from the state,
under the run lease, audited. A kill between the commit and the rename (or the file and
the removal) leaves the state's position in force, which every reader takes over a file,
and a re-run converges.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

from statetool.errors import StateError
from statetool.location import resolve_checkpoint
from statetool.operations.context import Context, now_iso
from statetool.operations.probe import position_text

#: The largest checkpoint file moved (bytes), as ``statetool checkpoints`` reads them.
_MAX = 1 << 20


class Moved(NamedTuple):
    """One export's position moved (or, in a dry run, that would be): ``file`` the
    checkpoint file, ``kept_as`` what it was renamed to (``import``), ``position`` the value."""

    export: str
    file: str
    position: object
    kept_as: str | None

    def as_dict(self) -> dict[str, object]:
        """``{export, file, position, kept_as}``."""
        return {"export": self.export, "file": self.file, "position": self.position, "kept_as": self.kept_as}


class MoveResult(NamedTuple):
    """``checkpoints import`` / ``export``: ``direction`` (``into_state`` or ``to_file``),
    the positions moved, and the exports skipped with why."""

    direction: str
    moved: list[Moved]
    skipped: list[dict[str, str]]
    dry_run: bool

    def as_dict(self) -> dict[str, object]:
        """``{direction, moved, skipped, dry_run}``."""
        return {"direction": self.direction, "moved": [m.as_dict() for m in self.moved], "skipped": self.skipped,
                "dry_run": self.dry_run}


class FilePosition(NamedTuple):
    """A CDC export's position as its checkpoint file holds it: ``text`` the file's JSON
    exactly, ``position`` its value."""

    export: str
    engine: str
    path: Path
    text: str
    position: object


def checkpoint_files(ctx: Context, export: str | None = None) -> tuple[list[FilePosition], list[dict[str, str]]]:
    """The position of each CDC export of the config (or only ``export``) read from its
    checkpoint file, resolved where ``ctx``'s state is (SPEC §6), and the exports skipped
    with why (no checkpoint file configured, or none at its place). Raises
    ``RIVET_EXPORT_UNKNOWN`` (``export`` is no CDC export of the config) and
    ``RIVET_STATE_CHECKPOINT_UNREADABLE`` (a file that holds no position in JSON)."""
    files: list[FilePosition] = []
    skipped: list[dict[str, str]] = []
    for name, engine, path in _cdc_exports(ctx, export):
        if path is None or not path.is_file():
            skipped.append({"export": name, "why": "no checkpoint file" if path is None else f"no file at {path}"})
            continue
        files.append(FilePosition(name, engine, path, *read_checkpoint_file(path)))
    return files, skipped


def _cdc_exports(ctx: Context, export: str | None) -> list[tuple[str, str, Path | None]]:
    """``(name, engine, checkpoint path)`` of each CDC export of the config, or only
    ``export`` (``RIVET_EXPORT_UNKNOWN`` when it is no CDC export of the config)."""
    found = [(e.name, e.cdc.engine, resolve_checkpoint(e.cdc.checkpoint, e.cdc.engine, ctx.location,
                                                       ctx.config.directory).path)
             for e in ctx.config.exports if e.cdc is not None and (export is None or e.name == export)]
    if export is not None and not found:
        raise StateError("RIVET_EXPORT_UNKNOWN", f"'{export}' is no CDC export of {ctx.config.path}",
                         {"export": export})
    return found


def kept_path(path: Path) -> Path:
    """The name an imported checkpoint file ``path`` is renamed to: ``<name>.imported-<UTC
    time>``, so that it can never be read as the position again (issue 15 item 3)."""
    return path.with_name(f"{path.name}.imported-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")


def _stored(ctx: Context) -> dict[str, dict[str, Any]]:
    from statetool.operations.checkpoints import stored_positions

    return stored_positions(ctx)


def _write_file(path: Path, text: str) -> None:
    """Write ``text`` to the checkpoint file ``path``: a temporary file beside it, created
    never through a link, fsynced, renamed into place, read back
    (``RIVET_STATE_VERIFY_FAILED`` when it does not read back); the directory's faults by
    their registered codes."""
    from statetool.backends.durable import CREATE_FLAGS, fsync_dir
    from statetool.backends.faults import fault

    tmp = path.with_name(f".{path.name}.{os.getpid()}.export-tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, CREATE_FLAGS, 0o644)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise fault(path, err) or err from None
    if read_checkpoint_file(path)[0] != text:
        raise StateError("RIVET_STATE_VERIFY_FAILED", f"{path} does not read back as the state's position")


def retire_file(path: Path, kept: Path) -> None:
    """Rename the imported checkpoint file ``path`` to ``kept`` (:func:`kept_path`); a fault
    by its registered code (the position is in the state already: a re-run only renames)."""
    from statetool.backends.faults import fault

    try:
        os.rename(path, kept)
    except OSError as err:
        raise fault(path, err) or err from None


def _stored_text(ctx: Context, name: str) -> str:
    """The JSON text of export ``name``'s position as the state holds it (read-only)."""
    backend = ctx.backend()
    with backend.reading() as conn:
        text = position_text(conn, frozenset(backend.table_names(conn)), name)
    assert text is not None, "listed by stored_positions a moment before"
    return text


def read_checkpoint_file(path: Path) -> tuple[str, object]:
    """The text of the checkpoint file at ``path`` and the position it holds;
    ``RIVET_STATE_CHECKPOINT_UNREADABLE`` for a file that is not UTF-8 JSON or is larger than
    a position is."""
    data = path.read_bytes()[:_MAX + 1]
    try:
        if len(data) > _MAX:
            raise ValueError(f"larger than {_MAX} bytes")
        text = data.decode()
        return text, json.loads(text)
    except ValueError as err:
        raise StateError("RIVET_STATE_CHECKPOINT_UNREADABLE", f"{path} is not a position in JSON ({err}); nothing "
                         "was moved", {"path": str(path)}) from None


def import_positions(ctx: Context, export: str | None = None, *, dry_run: bool = False) -> MoveResult:
    """``statetool checkpoints import``: see the module docstring. Raises
    ``RIVET_EXPORT_UNKNOWN``, ``RIVET_STATE_CHECKPOINT_UNREADABLE``,
    ``RIVET_STATE_MIGRATION_PENDING`` (a state before revision 0006) and a guarded write's codes."""
    from statetool.operations.writes import guarded_write, one_export, require_writable

    stored = _stored(ctx)
    moved: list[Moved] = []
    files, skipped = checkpoint_files(ctx, export)
    for name, engine, path, text, position in files:
        kept = kept_path(path)
        if name in stored and stored[name]["position"] == position:
            if not dry_run:
                retire_file(path, kept)  # a re-run after a kill between the commit and the rename
            moved.append(Moved(name, str(path), position, str(kept)))
            continue
        if name in stored:
            skipped.append({"export": name, "why": "the state holds another position already; checkpoints export "
                            "first to go back to the file"})
            continue
        if dry_run:
            require_writable(ctx, dry_run=True)
            moved.append(Moved(name, str(path), position, str(kept)))
            continue
        with guarded_write(ctx, one_export(name)) as session:
            put_position(session.conn, name, engine, text)
            back = position_text(session.reader, session.snapshot.tables, name)
            if back != text:
                raise StateError("RIVET_STATE_VERIFY_FAILED", f"the position of {name} read back from the state is "
                                 "not the file's; nothing was changed")
            session.audit("checkpoints.import", {"export": name, "file": str(path), "position": position,
                                                 "kept_as": str(kept)})
        retire_file(path, kept)
        moved.append(Moved(name, str(path), position, str(kept)))
    return MoveResult("into_state", moved, skipped, dry_run)


def put_position(conn: Any, name: str, engine: str, text: str | None, *, committed_at: str | None = None,
                 run_id: str | None = None, token: int | None = None) -> None:
    """THE writer of CDC export ``name``'s row in the state's position table (revision
    0006), in the writing transaction ``conn`` of a guarded write: the row replaced by one
    holding the JSON ``text`` exactly (committed ``committed_at``, default now, by run
    ``run_id`` under the lease of fencing token ``token``), or removed with ``text`` None.
    Used by the runtime's ``commit_position``, ``checkpoints import/export`` and ``import``."""
    import sqlalchemy as sa

    from statetool import schema

    p = schema.cdc_positions
    conn.execute(sa.delete(p).where(p.c.export_name == name))
    if text is not None:
        conn.execute(sa.insert(p).values(export_name=name, engine=engine, position=text,
                                         committed_at=committed_at or now_iso(), run_id=run_id, fencing_token=token))


def export_positions(ctx: Context, export: str | None = None, *, dry_run: bool = False) -> MoveResult:
    """``statetool checkpoints export``: see the module docstring. Raises
    ``RIVET_EXPORT_UNKNOWN``, ``RIVET_STATE_TARGET_NOT_EMPTY`` (a file with another position
    is at the checkpoint's place) and a guarded write's codes."""
    from statetool.operations.writes import guarded_write, one_export, require_writable

    stored = _stored(ctx)
    moved: list[Moved] = []
    skipped: list[dict[str, str]] = []
    for name, _engine, path in _cdc_exports(ctx, export):
        if name not in stored or path is None:
            skipped.append({"export": name, "why": "the state holds no position" if name not in stored else
                            "no checkpoint file is configured"})
            continue
        position = stored[name]["position"]
        text = _stored_text(ctx, name)
        if path.exists() and (not path.is_file() or read_checkpoint_file(path)[1] != position):
            raise StateError("RIVET_STATE_TARGET_NOT_EMPTY", f"{path} holds another position; move it aside first "
                             "(the state's would replace it); nothing was changed", {"path": str(path)})
        if dry_run:
            require_writable(ctx, dry_run=True)
            moved.append(Moved(name, str(path), position, None))
            continue
        with guarded_write(ctx, one_export(name)) as session:  # the file too is written under the run lease
            _write_file(path, text)
            put_position(session.conn, name, "", None)
            session.audit("checkpoints.export", {"export": name, "file": str(path), "position": position})
        moved.append(Moved(name, str(path), position, None))
    return MoveResult("to_file", moved, skipped, dry_run)
