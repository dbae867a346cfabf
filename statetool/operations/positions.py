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
and a re-run converges (tests/test_position_crashes.py kills both at every step).

Each move decides under the run lease, from the file and the state's row read in its own
transaction, never from what it read before it waited for the lease (a run holding the
lease meanwhile may have committed a position: an import then leaves the export, an
export writes that position); and the import's rename is its last step under the lease,
so that an export never writes the file back between the commit and the rename, to see it
renamed away (no position anywhere, a silent first run; SPEC §5a).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from statetool.errors import StateError
from statetool.location import resolve_checkpoint
from statetool.operations.checkpoint_file import read_checkpoint
from statetool.operations.context import Context, now_iso
from statetool.operations.probe import position_text

#: The steps ``checkpoints import`` announces to :attr:`Context.on_step` for each export it
#: moves, in order: the run lease held and the transaction open, the position written and
#: read back (not committed), committed, the file renamed.
CRASH_POINTS = ("leased", "stored", "committed", "renamed")
#: The steps ``checkpoints export`` announces, in order: the run lease held and the
#: transaction open, the temporary file written and fsynced, the file renamed into place
#: and read back, the state's row removed (not committed), committed.
EXPORT_POINTS = ("leased", "temp-written", "file-written", "removed", "committed")

#: Why an export is left as it is.
_HOLDS_ANOTHER = "the state holds another position already; checkpoints export first to go back to the file"
_HOLDS_NONE = "the state holds no position"

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
    with why (no checkpoint file configured, or nothing at its place). Raises
    ``RIVET_EXPORT_UNKNOWN`` (``export`` is no CDC export of the config) and the one
    reader's codes (:func:`read_checkpoint_file`): a FIFO, a directory or a file this user
    may not read is never "no file"."""
    files: list[FilePosition] = []
    skipped: list[dict[str, str]] = []
    for name, engine, path in _cdc_exports(ctx, export):
        found = read_checkpoint(path) if path is not None else None
        if found is None or found.text is None:
            skipped.append({"export": name, "why": "no checkpoint file" if path is None else f"no file at {path}"})
            continue
        files.append(FilePosition(name, engine, found.path, found.text, found.position))
    return files, skipped


def _stored(ctx: Context) -> dict[str, dict[str, Any]]:
    """The CDC positions the state holds, read after the pre-flight of a write passed:
    a state that cannot be read, is missing, retired, foreign or not at head is refused by
    its code (a dry run too), never taken for one that holds no position (a rollback
    reporting "nothing to move" while the state holds the position is a silent re-anchor
    later). Raises every pre-flight code of SPEC §5a's write path."""
    from statetool.operations.preflight import require, run_preflight
    from statetool.operations.probe import position_rows

    require(run_preflight(ctx, for_write=True, progress=False))
    backend = ctx.backend()
    with backend.reading() as conn:
        return position_rows(conn, frozenset(backend.table_names(conn)))


def _write_file(path: Path, text: str, on_step: Callable[[str], None]) -> None:
    """Write ``text`` to the checkpoint file ``path``: a temporary file beside it, created
    never through a link, fsynced (``temp-written`` told to ``on_step``), renamed into place, read back
    (``RIVET_STATE_VERIFY_FAILED`` when it does not read back); the directory's faults by
    their registered codes."""
    from statetool.backends.durable import CREATE_FLAGS, fsync_dir
    from statetool.backends.faults import fault

    tmp = path.with_name(f".{path.name}.export-tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)  # a killed export's: the run lease keeps every other writer of this name out
        fd = os.open(tmp, CREATE_FLAGS, 0o644)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        on_step("temp-written")
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise fault(path, err) or err from None
    if read_checkpoint_file(path)[0] != text:
        raise StateError("RIVET_STATE_VERIFY_FAILED", f"{path} does not read back as the state's position")


def _rename(path: Path, kept: Path, on_step: Callable[[str], None]) -> None:
    """Rename the imported checkpoint file ``path`` to ``kept`` once its position is
    committed (``committed`` then ``renamed`` told to ``on_step``); a fault by its registered
    code (the position is in the state already: a re-run only renames)."""
    on_step("committed")
    retire_file(path, kept)
    on_step("renamed")


def retire_file(path: Path, kept: Path) -> None:
    """Rename the imported checkpoint file ``path`` to ``kept`` (:func:`kept_path`); a fault
    by its registered code. Also ``transfer --with-checkpoints``'s, once the destination
    holding the position is live."""
    from statetool.backends.faults import fault

    try:
        os.rename(path, kept)
    except OSError as err:
        raise fault(path, err) or err from None


def read_checkpoint_file(path: Path) -> tuple[str | None, object]:
    """The text of the checkpoint file at ``path`` and the position it holds, read by the
    one reader (:func:`~statetool.operations.checkpoint_file.read_checkpoint`); ``(None,
    None)`` when nothing is there. Raises its ``RIVET_STATE_CHECKPOINT_UNREADABLE`` (not
    UTF-8 JSON, a byte-order mark, over the cap, JSON null),
    ``RIVET_STATE_CHECKPOINT_NOT_A_FILE`` and ``RIVET_STATE_PERMISSION_DENIED``."""
    found = read_checkpoint(path)
    return found.text, found.position


def import_positions(ctx: Context, export: str | None = None, *, dry_run: bool = False) -> MoveResult:
    """``statetool checkpoints import``: see the module docstring. Each export with a file
    is moved by :func:`_import_one`, which decides under its run lease; the dry run decides
    the same way from a read-only look. Raises ``RIVET_EXPORT_UNKNOWN``,
    ``RIVET_STATE_CHECKPOINT_UNREADABLE``, ``RIVET_STATE_MIGRATION_PENDING`` (a state before
    revision 0006) and a guarded write's codes."""
    from statetool.operations.writes import require_writable

    stored = _stored(ctx)  # the pre-flight, for the dry run as for the real run
    moved: list[Moved] = []
    files, skipped = checkpoint_files(ctx, export)  # an unreadable file is refused before any lease is taken
    for name, engine, path, _text, position in files:
        if not dry_run:
            _record(_import_one(ctx, name, engine, path), moved, skipped)
        elif name in stored and stored[name]["position"] != position:
            skipped.append({"export": name, "why": _HOLDS_ANOTHER})
        else:
            if name not in stored:
                require_writable(ctx, dry_run=True)
            moved.append(Moved(name, str(path), position, str(kept_path(path))))
    return MoveResult("into_state", moved, skipped, dry_run)


def _record(outcome: Moved | dict[str, str], moved: list[Moved], skipped: list[dict[str, str]]) -> None:
    """Add the outcome of one export's move to ``moved`` or (``{export, why}``) ``skipped``."""
    if isinstance(outcome, Moved):
        moved.append(outcome)
    else:
        skipped.append(outcome)


def kept_path(path: Path) -> Path:
    """The name an imported checkpoint file ``path`` is renamed to: ``<name>.imported-<UTC
    time>``, so that it can never be read as the position again (issue 15 item 3), with
    ``-2``, ``-3``… where a file of that second is there already (an import, an export and
    an import again in one second: the rename must never replace the older kept file)."""
    base = f"{path.name}.imported-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    kept, n = path.with_name(base), 1
    while os.path.lexists(kept):
        n += 1
        kept = path.with_name(f"{base}-{n}")
    return kept


def _import_one(ctx: Context, name: str, engine: str, path: Path) -> Moved | dict[str, str]:
    """Move CDC export ``name``'s position from its checkpoint file ``path`` into the state
    in one guarded write under its run lease, deciding there: the file and the state's row
    are read in the write's transaction, so that a position a run committed while this
    waited for the lease is never overwritten, nor a file another import renamed read. The
    state holding no position: the file's text is written, read back and audited. The state
    holding the file's very position (a re-run after a kill between the commit and the
    rename): nothing is written. Either way the file is renamed ``<name>.imported-<time>``
    after the commit, still under the lease: an export between the commit and the rename
    would write the file back and remove the row, then see the file renamed away (no
    position anywhere: a first run). Returns the :class:`Moved`, or ``{export, why}`` for an
    export left as it is (the state holds another position, the file is gone)."""
    from statetool.operations.writes import guarded_write, one_export

    with guarded_write(ctx, one_export(name), claim=False, advance=False) as session:
        ctx.on_step("leased")
        text, position = read_checkpoint_file(path)
        if text is None:
            return {"export": name, "why": f"no file at {path}"}
        kept = kept_path(path)
        held = position_text(session.reader, session.snapshot.tables, name)
        if held is not None and json.loads(held) != position:
            return {"export": name, "why": _HOLDS_ANOTHER}
        if held is None:
            session.warnings = session.claim()
            session.advance()
            put_position(session.conn, name, engine, text)
            if position_text(session.reader, session.snapshot.tables, name) != text:
                raise StateError("RIVET_STATE_VERIFY_FAILED", f"the position of {name} read back from the state is "
                                 "not the file's; nothing was changed")
            session.audit("checkpoints.import", {"export": name, "file": str(path), "position": position,
                                                 "kept_as": str(kept)})
            ctx.on_step("stored")
        session.after_commit(lambda: _rename(path, kept, ctx.on_step))
    return Moved(name, str(path), position, str(kept))


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
    """``statetool checkpoints export``: see the module docstring. Each export whose
    position the state holds is moved by :func:`_export_one`, which decides under its run
    lease; the dry run decides the same way from a read-only look. Raises
    ``RIVET_EXPORT_UNKNOWN``, ``RIVET_STATE_TARGET_NOT_EMPTY`` (a file with another position
    is at the checkpoint's place) and a guarded write's codes."""
    from statetool.operations.writes import require_writable

    stored = _stored(ctx)
    moved: list[Moved] = []
    skipped: list[dict[str, str]] = []
    for name, _engine, path in _cdc_exports(ctx, export):
        if name not in stored or path is None:
            skipped.append({"export": name, "why": _HOLDS_NONE if name not in stored else
                            "no checkpoint file is configured"})
            continue
        position = stored[name]["position"]
        _refuse_another_file(path, position)  # before any lease is taken
        if dry_run:
            require_writable(ctx, dry_run=True)
            moved.append(Moved(name, str(path), position, None))
            continue
        _record(_export_one(ctx, name, path), moved, skipped)
    return MoveResult("to_file", moved, skipped, dry_run)


def _refuse_another_file(path: Path, position: object) -> None:
    """``RIVET_STATE_TARGET_NOT_EMPTY`` when something other than a file holding
    ``position`` is at the checkpoint's place ``path``."""
    if path.exists() and (not path.is_file() or read_checkpoint_file(path)[1] != position):
        raise StateError("RIVET_STATE_TARGET_NOT_EMPTY", f"{path} holds another position; move it aside first "
                         "(the state's would replace it); nothing was changed", {"path": str(path)})


def _export_one(ctx: Context, name: str, path: Path) -> Moved | dict[str, str]:
    """Move CDC export ``name``'s position from the state to its checkpoint file ``path``
    in one guarded write under its run lease, deciding there: the state's position is read
    in the write's transaction (a run that held the lease meanwhile may have committed
    another: that one is written, never the one read before), the file's place is checked
    again, the file written (read back), the row removed, audited. Returns the
    :class:`Moved`, or ``{export, why}`` when the state no longer holds a position."""
    from statetool.operations.writes import guarded_write, one_export

    with guarded_write(ctx, one_export(name), claim=False, advance=False) as session:
        ctx.on_step("leased")
        text = position_text(session.reader, session.snapshot.tables, name)
        if text is None:
            return {"export": name, "why": _HOLDS_NONE}
        position = json.loads(text)
        _refuse_another_file(path, position)
        session.warnings = session.claim()
        session.advance()
        _write_file(path, text, ctx.on_step)
        ctx.on_step("file-written")
        put_position(session.conn, name, "", None)
        session.audit("checkpoints.export", {"export": name, "file": str(path), "position": position})
        ctx.on_step("removed")
    ctx.on_step("committed")
    return Moved(name, str(path), position, None)
