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
renamed away (no position anywhere, a silent first run; SPEC §5a). Before any of that,
both decide every export from a read-only look and make every check of every move (the
rename or the file possible, the position no larger than a file may be, nothing foreign at
the file's place, no checkpoint file shared by two exports): a refusal writes nothing,
and an export with nothing to move takes no lease (docs/decisions.md, "CDC positions, the
write side").
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from statetool.errors import StateError, StateWarning
from statetool.location import resolve_checkpoint
from statetool.operations.checkpoint_file import (MAX_CHECKPOINT_BYTES, MAX_POSITION_DEPTH, json_depth, read_checkpoint,
                                                   value_depth)
from statetool.operations.checkpoints import shared_checkpoint
from statetool.operations.context import Context, now_iso
from statetool.operations.leasing import run_lease_key
from statetool.operations.probe import decode_position, position_text

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

#: The name a kept file gets after its checkpoint's (:func:`kept_path`): the time, then ``-N``.
_KEPT = re.compile(r"\.imported-(\d{8}T\d{6}Z)(?:-(\d+))?")


def require_fits(export: str, text: str, *, held: bool = False) -> None:
    """Refuse CDC export ``export``'s position ``text`` (its JSON) that no checkpoint file
    may hold: ``RIVET_STATE_POSITION_TOO_LARGE`` when it is larger than
    :data:`~statetool.operations.checkpoint_file.MAX_CHECKPOINT_BYTES` bytes (UTF-8),
    ``RIVET_STATE_POSITION_TOO_DEEP`` when it nests deeper than
    :data:`~statetool.operations.checkpoint_file.MAX_POSITION_DEPTH` levels (counted on the
    text, :func:`~statetool.operations.checkpoint_file.json_depth`). A position committed
    that no file can hold could never go back to its file (``checkpoints export``, a
    downgrade), nor be read by a release that reads files; one nested that deep crashed
    every command that read it (issue 15, the fresh user's findings). ``held``: the position
    is the state's already (an export refused: it stays there)."""
    size = len(text.encode())
    if size > MAX_CHECKPOINT_BYTES:
        raise StateError("RIVET_STATE_POSITION_TOO_LARGE",
                         f"the position of CDC export {export} is {size} bytes of JSON, larger than a checkpoint "
                         f"file may be ({MAX_CHECKPOINT_BYTES} bytes, 1 MiB): {_nothing_written(held)}",
                         {"export": export, "bytes": size, "limit": MAX_CHECKPOINT_BYTES})
    _refuse_deep(export, json_depth(text), held)


def require_shallow(export: str, value: object) -> None:
    """``RIVET_STATE_POSITION_TOO_DEEP`` when CDC export ``export``'s position ``value``
    (the runtime's, not yet serialized) nests deeper than
    :data:`~statetool.operations.checkpoint_file.MAX_POSITION_DEPTH` levels, counted without
    recursion (:func:`~statetool.operations.checkpoint_file.value_depth`), so that
    ``json.dumps`` never recurses past the limit. Raises ``ValueError`` for a value that
    contains itself."""
    _refuse_deep(export, value_depth(value), False)


def _nothing_written(held: bool) -> str:
    return "it stays in the state, and no file was written" if held else "nothing was written"


def _refuse_deep(export: str, depth: int, held: bool) -> None:
    if depth > MAX_POSITION_DEPTH:
        raise StateError("RIVET_STATE_POSITION_TOO_DEEP",
                         f"the position of CDC export {export} nests {depth} levels of JSON arrays and objects, "
                         f"deeper than a position may ({MAX_POSITION_DEPTH}; an engine's nests a few): "
                         f"{_nothing_written(held)}", {"export": export, "depth": depth, "limit": MAX_POSITION_DEPTH})


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
    the positions moved, the exports skipped with why, and the warnings (a dry run's
    ``RIVET_STATE_READ_ONLY_DRY_RUN``)."""

    direction: str
    moved: list[Moved]
    skipped: list[dict[str, str]]
    dry_run: bool
    warnings: tuple[StateWarning, ...] = ()

    def as_dict(self) -> dict[str, object]:
        """``{direction, moved, skipped, dry_run, warnings}``."""
        return {"direction": self.direction, "moved": [m.as_dict() for m in self.moved], "skipped": self.skipped,
                "dry_run": self.dry_run, "warnings": [w.as_dict() for w in self.warnings]}


def _cdc_exports(ctx: Context, export: str | None) -> list[tuple[str, str, Path | None]]:
    """``(name, engine, checkpoint path)`` of each CDC export of the config, or only
    ``export`` (``RIVET_EXPORT_UNKNOWN`` when it is no CDC export of the config);
    ``RIVET_STATE_CHECKPOINT_SHARED`` when one of them shares its checkpoint file with
    another export of the config (:func:`~statetool.operations.checkpoints.shared_checkpoint`):
    the file holds the position of whichever wrote it last, so moving it would move the
    other's too (issue 15, the fresh user's finding 5)."""
    found = [(e.name, e.cdc.engine, resolve_checkpoint(e.cdc.checkpoint, e.cdc.engine, ctx.location,
                                                       ctx.config.directory).path)
             for e in ctx.config.exports if e.cdc is not None and (export is None or e.name == export)]
    if export is not None and not found:
        raise StateError("RIVET_EXPORT_UNKNOWN", f"'{export}' is no CDC export of {ctx.config.path}",
                         {"export": export})
    shared = shared_checkpoint(ctx)
    if shared is not None and any(name in names for names in shared.details["files"].values()
                                  for name, _engine, _path in found):
        raise shared
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


def _stored(ctx: Context) -> dict[str, str]:
    """``{export: JSON text}``: the CDC positions the state holds, read by the pre-flight of
    a write in its one read: a state that cannot be read, is missing, retired, foreign or
    not at head is refused by its code (a dry run too), never taken for one that holds no
    position (a rollback reporting "nothing to move" while the state holds the position is
    a silent re-anchor later). Raises every pre-flight code of SPEC §5a's write path."""
    from statetool.operations.preflight import require, run_preflight

    positions = require(run_preflight(ctx, for_write=True, progress=False, positions=True)).positions
    assert positions is not None
    return positions


def require_renamable(path: Path, by: str = "the import") -> None:
    """Prove, before anything is written, that the checkpoint file ``path`` can be renamed
    beside itself once its position is committed (issue 15, the fresh user's finding 2;
    ``by`` names the command in the messages: ``checkpoints import``'s and ``transfer
    --with-checkpoints``'s):
    its directory on a filesystem mounted read-write (``RIVET_STATE_READ_ONLY``), writable
    and searchable by this user, and not a sticky directory that keeps this user from
    renaming another's file (``RIVET_STATE_PERMISSION_DENIED``); the file on its
    directory's filesystem, not a mount point of its own (a file bind-mounted alone, which
    no rename can move: ``RIVET_STATE_CHECKPOINT_MOUNTED``)."""
    from statetool.access import denied
    from statetool.backends.faults import refuse_unwritable
    from statetool.mounts import mount_of

    directory = path.parent
    try:
        refuse_unwritable(directory, directories=(directory,), need=0)
    except StateError as err:
        raise StateError(err.code, f"{err.message.removesuffix('; nothing was written')}: {by} renames {path} "
                         "once its position is in the state, and cannot there; nothing was written",
                         err.details) from None
    held, mine = os.stat(directory), os.lstat(path)
    if held.st_mode & stat.S_ISVTX and os.geteuid() not in (0, held.st_uid, mine.st_uid):
        raise denied(path, "rename (a sticky directory that is not this user's, a file of another user)")
    mount = mount_of(path)
    if mine.st_dev != held.st_dev or (mount is not None and mount.point == os.path.realpath(path)):
        raise StateError("RIVET_STATE_CHECKPOINT_MOUNTED",
                         f"{path} is a mount point of its own (a file mounted alone, as a container's volume of "
                         f"one file): {by} renames it once its position is in the state, and no rename can "
                         "move a mount point; nothing was written", {"path": str(path)})


def _writable_place(path: Path, size: int) -> None:
    """Prove, before anything is written, that ``checkpoints export`` can write the file
    ``path`` of ``size`` bytes: the nearest directory of it that exists on a filesystem
    mounted read-write, writable by this user, with room (``RIVET_STATE_READ_ONLY``,
    ``RIVET_STATE_PERMISSION_DENIED``, ``RIVET_STATE_DISK_FULL``)."""
    from statetool.backends.faults import refuse_unwritable

    directory = path.parent
    while not directory.is_dir() and directory != directory.parent:
        directory = directory.parent
    refuse_unwritable(directory, directories=(directory,), need=size, room_for="the checkpoint file")


def _owner_model(path: Path) -> tuple[os.stat_result, bool]:
    """The file whose owner and group the checkpoint file ``path`` gets when ``checkpoints
    export`` writes it, and whether its mode too (issue 15, the fresh user's finding 3):
    the file at ``path`` (a re-run's, holding that very position), else the newest file
    ``path`` was kept as when its position was imported (``<name>.imported-<time>``, by
    ``checkpoints import`` or ``transfer --with-checkpoints``: the original file, renamed),
    else ``path``'s directory, owner and group only (a position the runtime committed has
    no original). Symlinks are never followed."""
    if os.path.isfile(path) and not os.path.islink(path):
        return os.lstat(path), True
    kept = []
    for entry in os.scandir(path.parent):
        found = _KEPT.fullmatch(entry.name[len(path.name):]) if entry.name.startswith(path.name) else None
        if found and entry.is_file(follow_symlinks=False):
            kept.append(((found[1], int(found[2] or 1)), entry.path))
    if kept:
        return os.lstat(max(kept)[1]), True
    return os.stat(path.parent), False


def _write_file(path: Path, text: str, on_step: Callable[[str], None]) -> None:
    """Write ``text`` to the checkpoint file ``path``: a temporary file beside it, created
    never through a link, given the owner, group and mode of :func:`_owner_model` (as far
    as this user may: root all of them), fsynced (``temp-written`` told to ``on_step``),
    renamed into place, read back (``RIVET_STATE_VERIFY_FAILED`` when it does not read
    back); the directory's faults by their registered codes."""
    from statetool.backends.durable import CREATE_FLAGS, fsync_dir, share_owner
    from statetool.backends.faults import fault

    tmp = path.with_name(f".{path.name}.export-tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)  # a killed export's: the run lease keeps every other writer of this name out
        model, with_mode = _owner_model(path)
        fd = os.open(tmp, CREATE_FLAGS, 0o600 if with_mode else 0o644)
        if with_mode:
            os.fchmod(fd, stat.S_IMODE(model.st_mode))
        share_owner(fd, model)
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


def _rename(name: str, path: Path, kept: Path, on_step: Callable[[str], None]) -> None:
    """Rename CDC export ``name``'s imported checkpoint file ``path`` to ``kept`` once its
    position is committed (``committed`` then ``renamed`` told to ``on_step``). A rename that
    fails there (:func:`require_renamable` proved it possible before the commit; the directory
    changed since) is ``RIVET_STATE_CHECKPOINT_NOT_RENAMED``, saying what is where: the
    position in the state, which every reader takes, the file still in place, and the
    command that finishes (a re-run only renames; issue 15, the fresh user's finding 2)."""
    on_step("committed")
    try:
        retire_file(path, kept)
    except StateError as err:
        again = f"statetool checkpoints import --export {shlex.quote(name)}"
        raise StateError("RIVET_STATE_CHECKPOINT_NOT_RENAMED",
                         f"the position of {name} is in the state now (committed and audited), and every run reads "
                         f"it from there; but {path} could not be renamed to {kept.name} "
                         f"({err.message.removesuffix('; nothing was written')}; {err.code}): the file is still there, with the "
                         f"same position, and is not read for it. Once its directory can be written, run {again} "
                         "(it only renames the file)",
                         {"export": name, "path": str(path), "kept_as": str(kept), "cause": err.code}) from None
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
    """``statetool checkpoints import``: see the module docstring. Every export is decided
    first from a read-only look (the pre-flight's one read of the state, and the files),
    and every check of every move is made before the first is written: a move the look
    finds nothing for takes no lease and changes no byte (not even a lease record: the
    fresh user's finding 6), and a file that could not be renamed after its commit
    (:func:`require_renamable`) refuses the import before any write. Each move is then made by
    :func:`_import_one`, which decides again under its run lease; the dry run stops before
    them. Raises ``RIVET_EXPORT_UNKNOWN``, ``RIVET_STATE_CHECKPOINT_SHARED``,
    ``RIVET_STATE_CHECKPOINT_UNREADABLE``, ``RIVET_STATE_MIGRATION_PENDING`` (a state before
    revision 0006), :func:`require_renamable`'s codes, ``RIVET_STATE_CHECKPOINT_NOT_RENAMED`` (the
    rename failed after the commit) and a guarded write's codes."""
    from statetool.operations.writes import require_writable, tolerate_read_only

    stored = _stored(ctx)  # the pre-flight, for the dry run as for the real run
    files, skipped = checkpoint_files(ctx, export)  # an unreadable file is refused before any lease is taken
    moving: list[FilePosition] = []
    warnings: list[StateWarning] = []
    for f in files:
        held = stored.get(f.export)
        why = None if held is None else _leaves(f.export, held, f.position, named=export is not None)
        if why is not None:
            skipped.append({"export": f.export, "why": why})
            continue
        warnings += tolerate_read_only(lambda path=f.path: require_renamable(path), dry_run=dry_run)
        if held is None or _holds_none(f.export, held):
            warnings += require_writable(ctx, dry_run=dry_run)
        moving.append(f)
    if dry_run:
        moved = [Moved(f.export, str(f.path), f.position, str(kept_path(f.path))) for f in moving]
        return MoveResult("into_state", moved, skipped, dry_run, _once(warnings))
    moved = []
    for f in moving:
        _record(_import_one(ctx, f.export, f.engine, f.path, named=export is not None), moved, skipped)
    return MoveResult("into_state", moved, skipped, dry_run)


def _holds_none(name: str, held: str) -> bool:
    """Whether the state's position row ``held`` (its JSON text) of CDC export ``name``
    holds no position (``RIVET_STATE_POSITION_INVALID``, :func:`decode_position`)."""
    try:
        decode_position(name, held)
    except StateError:
        return True
    return False


def _leaves(name: str, held: str, position: object, *, named: bool) -> str | None:
    """Why the import leaves CDC export ``name`` as it is, the state's row holding ``held``
    (its JSON text) and the file ``position``; None when it moves. A row holding the
    file's very position moves (the rename is what is left to do); another position is
    never replaced (:data:`_HOLDS_ANOTHER`); a row that holds no position
    (``RIVET_STATE_POSITION_INVALID``) is replaced only when the export was named
    (``--export NAME``: on purpose, one export at a time; docs/decisions.md, "Replacing a
    position row that holds none")."""
    if _holds_none(name, held):
        return None if named else (f"the state's position row of {name} holds no position "
                                   "(RIVET_STATE_POSITION_INVALID); to replace it with this file's: statetool "
                                   f"checkpoints import --export {shlex.quote(name)}")
    return None if decode_position(name, held) == position else _HOLDS_ANOTHER


def _once(warnings: list[StateWarning]) -> tuple[StateWarning, ...]:
    """``warnings`` without repeats (each export's checks may give the same one)."""
    return tuple(dict.fromkeys(warnings))


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


def _import_one(ctx: Context, name: str, engine: str, path: Path, *, named: bool = False) -> Moved | dict[str, str]:
    """Move CDC export ``name``'s position from its checkpoint file ``path`` into the state
    in one guarded write under its run lease, deciding there: the file and the state's row
    are read in the write's transaction, so that a position a run committed while this
    waited for the lease is never overwritten, nor a file another import renamed read. The
    state holding no position, or (``named``: ``--export NAME``) a row that holds none
    (``RIVET_STATE_POSITION_INVALID``): the file's text is written, read back and audited,
    the replaced row's text in the audit row (``replaced``). The state holding the file's
    very position (a re-run after a kill between the commit and the
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
        why = None if held is None else _leaves(name, held, position, named=named)
        if why is not None:
            return {"export": name, "why": why}
        if held is None or _holds_none(name, held):
            session.warnings = session.claim()
            session.advance()
            lease = next((held for held in session.leases if held.key == run_lease_key(name)), None)
            put_position(session.conn, name, engine, text, token=None if lease is None else lease.token)
            if position_text(session.reader, session.snapshot.tables, name) != text:
                raise StateError("RIVET_STATE_VERIFY_FAILED", f"the position of {name} read back from the state is "
                                 "not the file's; nothing was changed")
            replaced = {} if held is None else {"replaced": held}
            session.audit("checkpoints.import", {"export": name, "file": str(path), "position": position,
                                                 "kept_as": str(kept), **replaced})
            ctx.on_step("stored")
        session.after_commit(lambda: _rename(name, path, kept, ctx.on_step))
    return Moved(name, str(path), position, str(kept))


def put_position(conn: Any, name: str, engine: str, text: str | None, *, committed_at: str | None = None,
                 run_id: str | None = None, token: int | None = None) -> None:
    """THE writer of CDC export ``name``'s row in the state's position table (revision
    0006), in the writing transaction ``conn`` of a guarded write: the row replaced by one
    holding the JSON ``text`` exactly (committed ``committed_at``, default now, by run
    ``run_id`` under the lease of fencing token ``token``), or removed with ``text`` None.
    Used by the runtime's ``commit_position``, ``checkpoints import/export`` and ``import``.
    Raises ``RIVET_STATE_POSITION_TOO_LARGE`` and ``RIVET_STATE_POSITION_TOO_DEEP``
    (:func:`require_fits`) before any SQL."""
    import sqlalchemy as sa

    from statetool import schema

    if text is not None:
        require_fits(name, text)
    p = schema.cdc_positions
    conn.execute(sa.delete(p).where(p.c.export_name == name))
    if text is not None:
        conn.execute(sa.insert(p).values(export_name=name, engine=engine, position=text,
                                         committed_at=committed_at or now_iso(), run_id=run_id, fencing_token=token))


def export_positions(ctx: Context, export: str | None = None, *, dry_run: bool = False) -> MoveResult:
    """``statetool checkpoints export``: see the module docstring. Every export is decided
    first from a read-only look, and everything a move needs is proved for every export
    before the first is written (:func:`_refuse_unfit`: the position fits a file, nothing
    that is not that position stands at the file's place; the place can be written): an
    export with nothing to move takes no lease and changes no byte. Each move is then made
    by :func:`_export_one`, which decides again under its run lease; the dry run stops
    before them. An export whose row holds no position is skipped, saying why, and refused
    (``RIVET_STATE_POSITION_INVALID``, exit 4) when it is the one named. Raises
    ``RIVET_EXPORT_UNKNOWN``, ``RIVET_STATE_CHECKPOINT_SHARED``, :func:`_refuse_unfit`'s
    codes and a guarded write's codes."""
    from statetool.operations.writes import require_writable, tolerate_read_only

    stored = _stored(ctx)
    moving: list[tuple[str, Path, object]] = []
    skipped: list[dict[str, str]] = []
    warnings: list[StateWarning] = []
    for name, _engine, path in _cdc_exports(ctx, export):
        text = stored.get(name)
        if text is None or path is None:
            skipped.append({"export": name, "why": _HOLDS_NONE if text is None else "no checkpoint file is configured"})
            continue
        try:
            position = _refuse_unfit(name, path, text)  # before any lease is taken
        except StateError as err:
            if export is not None or err.code != "RIVET_STATE_POSITION_INVALID":
                raise
            skipped.append({"export": name, "why": f"{err.message} ({err.code}); there is no position to write back"})
            continue
        warnings += tolerate_read_only(lambda p=path, t=text: _writable_place(p, len(t.encode())), dry_run=dry_run)
        warnings += require_writable(ctx, dry_run=dry_run)
        moving.append((name, path, position))
    if dry_run:
        return MoveResult("to_file", [Moved(name, str(path), position, None) for name, path, position in moving],
                          skipped, dry_run, _once(warnings))
    moved: list[Moved] = []
    for name, path, _position in moving:
        _record(_export_one(ctx, name, path), moved, skipped)
    return MoveResult("to_file", moved, skipped, dry_run)


def _refuse_unfit(name: str, path: Path, text: str) -> object:
    """Refuse, before a byte is written, an export of CDC export ``name``'s position (the
    JSON ``text`` the state holds) to its checkpoint file ``path`` that could not end
    whole, and return the position: ``RIVET_STATE_POSITION_TOO_LARGE`` and
    ``RIVET_STATE_POSITION_TOO_DEEP`` (no file may hold it: the reader of files would
    refuse it, the fresh user's finding 1; :func:`require_fits`);
    ``RIVET_STATE_UNSAFE_FILE`` (a symlink, a directory or another non-regular file at
    ``path``, never followed nor replaced, SPEC §8a); ``RIVET_STATE_TARGET_NOT_EMPTY`` (a
    file at ``path`` that holds another position, or none at all: not JSON, not a
    position, too large; no checkpoint file of this export, which the export must not
    replace, finding 4); and first ``RIVET_STATE_POSITION_INVALID`` for a row that holds no
    position (``null``, not JSON, nested deeper than a position may: :func:`decode_position`),
    which no file can take back (a re-check's finding: ``null`` was written to the file, text
    that is not JSON was RIVET_INTERNAL, a deep row RIVET_STATE_POSITION_TOO_DEEP)."""
    position = decode_position(name, text)
    require_fits(name, text, held=True)
    if not os.path.lexists(path):
        return position
    kind = os.lstat(path).st_mode
    if not stat.S_ISREG(kind):
        what = "a symlink" if stat.S_ISLNK(kind) else "a directory" if stat.S_ISDIR(kind) else "not a regular file"
        raise StateError("RIVET_STATE_UNSAFE_FILE", f"{path} is {what}, where the checkpoint file of {name} goes: "
                         "statetool neither follows nor replaces it; nothing was changed", {"path": str(path)})
    try:
        there = read_checkpoint_file(path)[1]
    except StateError as err:
        if err.code != "RIVET_STATE_CHECKPOINT_UNREADABLE":
            raise
        raise StateError("RIVET_STATE_TARGET_NOT_EMPTY", f"{path} holds no position ({err.message}): it is no "
                         f"checkpoint file of {name}, and the state's position would replace it; move it aside "
                         "first; nothing was changed", {"path": str(path)}) from None
    if there != position:
        raise StateError("RIVET_STATE_TARGET_NOT_EMPTY", f"{path} holds another position; move it aside first "
                         "(the state's would replace it); nothing was changed", {"path": str(path)})
    return position


def _export_one(ctx: Context, name: str, path: Path) -> Moved | dict[str, str]:
    """Move CDC export ``name``'s position from the state to its checkpoint file ``path``
    in one guarded write under its run lease, deciding there: the state's position is read
    in the write's transaction (a run that held the lease meanwhile may have committed
    another: that one is written, never the one read before), and checked again as
    before (:func:`_refuse_unfit`) before the file is written (read back), the row
    removed, audited. Returns the :class:`Moved`, or ``{export, why}`` when the state no
    longer holds a position."""
    from statetool.operations.writes import guarded_write, one_export

    with guarded_write(ctx, one_export(name), claim=False, advance=False) as session:
        ctx.on_step("leased")
        text = position_text(session.reader, session.snapshot.tables, name)
        if text is None:
            return {"export": name, "why": _HOLDS_NONE}
        position = _refuse_unfit(name, path, text)
        session.warnings = session.claim()
        session.advance()
        _write_file(path, text, ctx.on_step)
        ctx.on_step("file-written")
        put_position(session.conn, name, "", None)
        session.audit("checkpoints.export", {"export": name, "file": str(path), "position": position})
        ctx.on_step("removed")
    ctx.on_step("committed")
    return Moved(name, str(path), position, None)
