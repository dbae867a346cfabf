"""``statetool relocate --to DIR``: move a SQLite state into a declared directory (SPEC §1, §6, §9).

The order, each step safe to interrupt at any instant:

1. Pre-flight of the source (every check; it must be at head) and of the target (an
   absolute, existing directory holding no state, or the copy an earlier interrupted
   relocation of THIS source left there).
2. Hold off writers: every run lease of the config's and the state's exports, then the
   SQLite write lock (after a WAL checkpoint, so the file alone holds every committed row).
3. Copy the source's pages into ``<target>/.rivet_state.db.relocating`` in one pass over
   them, digested as they are copied, while ``quick_check`` (``--full-verify``:
   ``integrity_check``) reads the source in a second thread; fsync the copy while it is
   read back, its page digest compared with the source's.
4. Copy each CDC checkpoint with a relative path to where it resolves under the target
   (temporary file, fsync, rename; sha256 compared).
5. Write an audit row into the copy (from, to, source digest, the command that finishes
   the move) and mark it in flight (its version reads ``move-in-flight``: every opener
   refuses it, ``RIVET_STATE_MOVE_IN_FLIGHT``), link it into place as
   ``<target>/.rivet_state.db`` (a link never replaces anything), fsync the directory.
6. Switch: hard-link the source to ``.rivet_state.db.relocated-<UTC>`` (its bytes are
   kept), then atomically rename a tombstone over ``.rivet_state.db``
   (statetool/backends/tombstone.py): from then on every release refuses the old place.
7. Make the target live: its version goes back to head.

So at no instant are two places live: the target opens only after the source is retired
(between 6 and 7 neither opens, and a re-run finishes the move). A symlinked state file is
retired where it really is (:attr:`Location.real_path`), never as the link.

A re-run finds the leftovers: a ``.relocating`` file is removed and copied again; an
in-flight target carrying this source's relocation row goes straight to the switch if the
source's digest is unchanged, and is made again otherwise (it was never live); a
tombstone that already names the target means done (the target is made live if a kill
came between 6 and 7).

Each step is a call on the move of the state file (a
:class:`~statetool.backends.base.FileMoves` from :func:`statetool.backends.file_move`:
statetool/backends/moves.py and, for the switch, statetool/backends/tombstone.py); this
module holds their order. The steps are announced to :attr:`Context.on_step` by the names of
:data:`CRASH_POINTS` (and ``copy-page-<n>`` after n pages of the copy): a no-op, but for
the crash tests, which SIGKILL the process at one of them.
"""

from __future__ import annotations

import contextlib
import os
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from statetool.backends import file_move
from statetool.backends.base import FileMoves
from statetool.backends.durable import copy_verified, holds_other_bytes, side_copy
from statetool.backends.faults import WRITE_MARGIN, refuse_unwritable
from statetool.errors import StateError
from statetool.location import Location, resolve_checkpoint, resolve_location
from statetool.operations.context import Context, now_iso
from statetool.operations.leasing import refuse_untakable
from statetool.operations.preflight import Preflight, require, run_preflight
from statetool.operations.probe import export_names, row_counts
from statetool.operations.writes import (WHOLE_STATE, WriteSession, guarded_write, require_writable,
                                         tolerate_read_only)

#: A relocation's name where it replaces the state's file (by the tombstone) and makes it anew
#: at the target: both keep the state's owner (:meth:`~statetool.backends.base.Backend.check_writable`).
REPLACED_BY = "a relocation"

#: The steps a relocation announces to :attr:`Context.on_step`, in the order it passes
#: them (``copy-page-<n>`` come between ``locked`` and ``digested``). ``kept``,
#: ``tombstoned`` and ``swapped`` are the switch's (transfer passes them too).
CRASH_POINTS = ("leases", "checkpointed", "locked", "digested", "copied", "checkpoint-copied", "audited",
                "linked", "kept", "tombstoned", "swapped", "finished")


@dataclass
class CheckpointMove:
    """One CDC checkpoint: where it is now, where it will resolve, and whether it exists."""

    export: str
    configured: str
    source: str
    target: str
    present: bool
    bytes: int | None


@dataclass
class RelocateResult:
    """The plan and, unless ``dry_run``, what was done."""

    source: str
    target: str
    state_url: str
    size_bytes: int
    tables: dict[str, int]
    checkpoints: list[CheckpointMove]
    lock: str
    dry_run: bool = False
    done: bool = False
    resumed: bool = False
    kept_as: str | None = None
    source_digest: str | None = None
    message: str = ""
    #: True when an earlier run had finished this relocation: this one moved nothing (it
    #: only finished the last step when a kill had interrupted it). For the sentence people read.
    already: bool = False
    #: Warnings of the plan (a dry run of a state on a read-only mount:
    #: ``RIVET_STATE_READ_ONLY_DRY_RUN``), as ``{code, message, action}``.
    warnings: list[dict[str, str]] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        """JSON shape of the plan and outcome (a missing checkpoint has ``present: false``)."""
        return asdict(self)


def relocate(ctx: Context, to: str, *, create_dir: bool = False, dry_run: bool = False,
             full_verify: bool = False) -> RelocateResult:
    """Move the SQLite state at the resolved location into directory ``to`` (SPEC §9), in
    the steps of the module docstring.

    Raises ``RIVET_STATE_BACKEND_UNSUPPORTED`` (not a SQLite state),
    ``RIVET_STATE_DIR_RELATIVE`` / ``RIVET_STATE_DIR_MISSING`` (target),
    ``RIVET_STATE_FOREIGN`` / ``RIVET_STATE_TARGET_NOT_EMPTY`` (target holds something),
    ``RIVET_STATE_MOVE_IN_FLIGHT`` (another source's move into the target is unfinished),
    ``RIVET_STATE_UNSAFE_FILE`` (a symlink where a file of the move belongs),
    ``RIVET_STATE_READ_ONLY`` / ``RIVET_STATE_PERMISSION_DENIED`` (the source's directory,
    or a symlinked state's real directory, cannot be written; or this user cannot give the
    moved file and the tombstone the state's owner: refused before any lease or file),
    ``RIVET_STATE_RUN_IN_PROGRESS`` (a live run past ``--lock-wait``),
    ``RIVET_STATE_VERIFY_FAILED`` (the copy differs; the source is untouched),
    ``RIVET_STATE_DISK_FULL`` (the target filled up; what was copied is removed), and every
    pre-flight code of the source. ``dry_run`` runs every one of these checks, in this
    function, then prints the plan and writes nothing (a source on a read-only mount gives
    its plan with warning ``RIVET_STATE_READ_ONLY_DRY_RUN``). A re-run of a finished relocation
    answers "already relocated" (and finishes one killed after the switch).
    """
    backend = ctx.backend()
    if not backend.relocatable:
        raise StateError("RIVET_STATE_BACKEND_UNSUPPORTED",
                         "relocate moves a SQLite state; to move a PostgreSQL state use pg_dump")
    move = file_move(backend)
    target = _target(ctx, move, to, create_dir, dry_run=True)  # created below, once the source passed
    tomb = move.tombstone()
    if tomb is not None and tomb.get("to") == str(target.path):
        return _already_relocated(move, target, tomb, dry_run)
    # 1. pre-flight of the source and the target
    pf, resume, result, exports = _pre_flight(ctx, move, target, dry_run)
    if dry_run:
        result.message = (f"dry run: nothing was changed; after the move every task must run with "
                          f"RIVET_STATE_URL={result.state_url}")
        return result
    refuse_untakable(ctx, exports)  # before the target is created: a refusal creates nothing
    _target(ctx, move, to, create_dir, dry_run=False)
    move.remove_leftovers(target, [side_copy(Path(m.target)) for m in result.checkpoints])
    with contextlib.ExitStack() as stack:
        # 2. hold off writers: the run leases, a WAL checkpoint, the write lock
        session = _hold_off_writers(ctx, stack, move, pf, exports)
        if resume is not None:
            resume = _resumable(ctx, move, target, resume, result)
        with move.removed_when_full(target, [Path(m.target) for m in result.checkpoints]):
            if resume is None:
                # 3. copy and verify; 4. the checkpoints; 5. audit, in flight, linked into place
                copy = _copy_and_verify(ctx, move, session, target, result, full_verify)
                _copy_checkpoints(result.checkpoints)
                ctx.on_step("checkpoint-copied")
                _audit_in_flight(ctx, session, move, copy, target, result)
                ctx.on_step("audited")
                move.link_into_place(copy, target, ctx.on_step)
            else:
                _copy_checkpoints(result.checkpoints)
        # 6. switch: the source retired (again waiting for openers, at the last instant)
        move.wait_for_openers()
        result.kept_as = retire_source(ctx, move, result.target, result.state_url, result.source_digest,
                                       "statetool relocate")
    # 7. make the target live
    move.finish_target(target)
    ctx.on_step("finished")
    result.done = True
    result.message = f"relocated; every task must now run with RIVET_STATE_URL={result.state_url}"
    return result


# -- 1. pre-flight ------------------------------------------------------------------------

def _target(ctx: Context, move: FileMoves, to: str, create: bool, dry_run: bool) -> Location:
    """The state location ``sqlite:<to>`` (the resolver's), its directory checked the same
    way by a dry run and a real run (which creates it with ``--create-dir``); a dry run or a
    refusal creates nothing. Refused with ``RIVET_STATE_TARGET_NOT_EMPTY`` when it is where
    the state already is."""
    if not os.path.isabs(to):
        raise StateError("RIVET_STATE_DIR_RELATIVE",
                         f"target directory '{to}' is relative; every task must see the same absolute path")
    target = resolve_location(None, f"sqlite:{to}", ctx.config_path)
    directory = target.directory
    assert directory is not None and target.path is not None
    if os.path.lexists(directory) and not directory.is_dir():
        raise StateError("RIVET_STATE_TARGET_NOT_EMPTY", f"target {directory} exists and is not a directory")
    if not directory.is_dir():
        if not create:
            raise StateError("RIVET_STATE_DIR_MISSING",
                             f"target directory {directory} does not exist; mount it (or pass --create-dir)")
        parent = directory.parent
        while not parent.is_dir() and parent != parent.parent:
            parent = parent.parent
        refuse_unwritable(directory, directories=(parent,), need=0)  # READ_ONLY / PERMISSION_DENIED, naming it
        if not dry_run:
            try:
                directory.mkdir(parents=True)
            except OSError as err:
                raise StateError("RIVET_STATE_DIR_MISSING",
                                 f"target directory {directory} cannot be created: {err.strerror}") from None
    else:
        refuse_unwritable(target.path, directories=(directory,), need=0)
    if directory in (ctx.location.directory, move.source.parent):
        raise StateError("RIVET_STATE_TARGET_NOT_EMPTY", f"the state is already in {directory}")
    return target


def _already_relocated(move: FileMoves, target: Location, tomb: dict[str, Any], dry_run: bool) -> RelocateResult:
    """The re-run of a relocation whose switch was done: "already relocated". A run killed
    after the switch is finished here (the target made live, leftovers removed)."""
    assert target.path is not None
    move.refuse_unsafe(*move.own_files(target), *move.stale_tombstones())
    if not dry_run:
        if target.path.is_file() and not target.path.is_symlink():
            move.finish_target(target)
        move.remove_leftovers(target, [])
        move.remove_companions()
    return RelocateResult(str(move.source), tomb["to"], target.state_url, 0, {}, [], "none", dry_run, True, True,
                          tomb.get("kept_as"), tomb.get("source_digest"),
                          f"already relocated to {target.directory}; every task must run with "
                          f"RIVET_STATE_URL={target.state_url}", already=True)


def _pre_flight(ctx: Context, move: FileMoves, target: Location, dry_run: bool
                ) -> tuple[Preflight, dict[str, object] | None, RelocateResult, list[str]]:
    """Every check of the source and the target (a dry run the same), before anything is
    written: the pre-flight, the plan (checkpoints, the exports whose run leases are taken;
    row counts for a dry run or a resume, since a copy counts the rows it copies), the room
    on the target. Returns the pre-flight, the audit detail of this
    source's own unfinished relocation into the target (to resume it) or None, the plan,
    and the exports."""
    assert target.path is not None and target.directory is not None
    # The source's own integrity is proven by the copy instead: page digests equal, and
    # the copy passes quick_check. Per-export progress is not needed, only export names.
    warnings = tolerate_read_only(move.require_retirable, dry_run=dry_run)  # these before the pre-flight
    move.refuse_unsafe(*move.own_files(target), *move.stale_tombstones())
    pf = run_preflight(ctx, for_write=True, progress=False, integrity=False)
    snap = require(pf)
    # the guarded write's own first refusal, before the real run creates the target or a lease; the dry run the same
    warnings = warnings or require_writable(ctx, replaced_by=REPLACED_BY, dry_run=dry_run)
    resume = _check_target(ctx, move, target) if target.directory.is_dir() else None
    with ctx.backend().reading() as conn:
        # a copy counts the rows it copied, beside its check of the pages (copy_pages)
        tables = row_counts(conn, snap.tables) if dry_run or resume is not None else {}
        exports = sorted({e.name for e in ctx.config.exports} | export_names(conn))
    result = RelocateResult(
        str(move.source), str(target.path), target.state_url, move.source.stat().st_size, tables,
        _checkpoints(ctx, target), f"the run lease of every export ({len(exports)}) and the SQLite write lock",
        dry_run=dry_run, resumed=resume is not None, warnings=[w.as_dict() for w in warnings])
    check_checkpoints(move, result.checkpoints, resuming=resume is not None)
    room = next(p for p in (target.directory, *target.directory.parents) if p.is_dir())
    refuse_unwritable(target.path if room == target.directory else room, directories=(room,),
                      need=2 * result.size_bytes + WRITE_MARGIN +
                      sum(c.bytes or 0 for c in result.checkpoints),
                      room_for="the copy of the state, its journal, and the CDC checkpoints")
    return pf, resume, result, exports


def _check_target(ctx: Context, move: FileMoves, target: Location) -> dict[str, object] | None:
    """Refuse a target that holds anything but this source's own unfinished relocation
    (in flight: never live); return that relocation's audit detail to resume it."""
    assert target.path is not None
    if not os.path.lexists(target.path):
        return None
    move.refuse_unsafe(target.path)
    target_ctx = Context(ctx.config_path, target.state_url, ctx.env, ctx.lock_wait, ctx.command)
    pf = run_preflight(target_ctx)
    foreign = next((c for c in pf.checks if c.code == "RIVET_STATE_FOREIGN"), None)
    if foreign is not None:
        raise StateError("RIVET_STATE_FOREIGN", f"the target {target.directory} holds the state of another source: "
                         f"{foreign.message}", {"directory": str(target.directory)})
    in_flight = next((c for c in pf.checks if c.code == "RIVET_STATE_MOVE_IN_FLIGHT"), None)
    if in_flight is not None:
        detail = move.relocation_detail(target)
        if detail is not None and detail.get("from") == str(move.source):
            return detail
        assert in_flight.error is not None
        raise in_flight.error  # another source's move: it must be finished first
    raise StateError("RIVET_STATE_TARGET_NOT_EMPTY",
                     f"{target.path} already exists ({'a state' if pf.snapshot else 'not a state of this source'}); "
                     "relocate only into a directory without a state")


def _checkpoints(ctx: Context, target: Location) -> list[CheckpointMove]:
    """Each relative checkpoint: where it resolves now, and where it will resolve after the move."""
    moves = []
    for export in ctx.config.exports:
        if not export.cdc or not export.cdc.checkpoint or os.path.isabs(export.cdc.checkpoint):
            continue
        now = resolve_checkpoint(export.cdc.checkpoint, export.cdc.engine, ctx.location, ctx.config.directory)
        after = resolve_checkpoint(export.cdc.checkpoint, export.cdc.engine, target, ctx.config.directory,
                                   exists=lambda _path: True)
        assert now.path is not None and after.path is not None
        present = now.path.is_file()
        moves.append(CheckpointMove(export.name, export.cdc.checkpoint, str(now.path), str(after.path), present,
                                    now.path.stat().st_size if present else None))
    return moves


def check_checkpoints(move: FileMoves, checkpoints: list[CheckpointMove], resuming: bool) -> None:
    """Refuse, before anything is written (a dry run the same), a checkpoint target that
    already holds other bytes (``RIVET_STATE_TARGET_NOT_EMPTY``; an interrupted relocation
    of this source may overwrite its own), or a symlink / non-regular file where a
    checkpoint or its temporary copy goes (``RIVET_STATE_UNSAFE_FILE``)."""
    for checkpoint in checkpoints:
        if not checkpoint.present:
            continue
        target = Path(checkpoint.target)
        move.refuse_unsafe(target, side_copy(target))
        if not resuming and holds_other_bytes(target, Path(checkpoint.source)):
            raise StateError("RIVET_STATE_TARGET_NOT_EMPTY",
                             f"{target} already exists with other content (checkpoint of export {checkpoint.export}); "
                             "move it aside (or remove it if it is stale) and re-run", {"path": str(target)})


# -- 2. hold off writers ------------------------------------------------------------------

def _hold_off_writers(ctx: Context, stack: contextlib.ExitStack, move: FileMoves, pf: Preflight,
                      exports: list[str]) -> WriteSession:
    """Every run lease of ``exports``, then (no other opener, the WAL checkpointed) the
    SQLite write lock, held until ``stack`` closes: the file alone holds every committed
    row and nobody can add one. Raises ``RIVET_STATE_RUN_IN_PROGRESS``."""

    def prepare() -> None:
        ctx.on_step("leases")
        move.hold_off_writers()
        ctx.on_step("checkpointed")

    session = stack.enter_context(guarded_write(ctx, WHOLE_STATE, preflight=pf, exports=exports, claim=False,
                                                advance=False, prepare=prepare, lock_code="RIVET_STATE_RUN_IN_PROGRESS",
                                                replaced_by=REPLACED_BY))
    move.require_frozen()
    ctx.on_step("locked")
    return session


def _resumable(ctx: Context, move: FileMoves, target: Location, resume: dict[str, object],
               result: RelocateResult) -> dict[str, object] | None:
    """``resume`` when the source's digest is what this source's relocation in flight
    recorded (straight to the switch); else None, the copy in flight removed. The source
    was written after the kill: the copy was never live (no one could open it), so it is
    simply made again."""
    result.source_digest = move.digest()
    ctx.on_step("digested")
    if resume.get("source_digest") == result.source_digest:
        return resume
    move.discard_target(target)
    return None


# -- 3. to 5. copy, verify, checkpoints, audit, link --------------------------------------

def _copy_and_verify(ctx: Context, move: FileMoves, session: WriteSession, target: Location, result: RelocateResult,
                     full_verify: bool) -> Path:
    """The verified copy of the frozen source beside the target: one pass over the source
    (copied, digested, its pages checked and its rows counted at once: the plan's row
    counts are those of the copy), then the copy fsynced and read back, its page digest
    equal to the source's. Returns its path."""

    with ctx.progress("copying") as update:
        def progress(done: int, total: int) -> None:
            update(done, total)
            ctx.on_step(f"copy-page-{done}")

        copy = move.copy_pages(session.conn, target, progress, full_verify)
    result.source_digest, result.tables = copy.digest, copy.tables
    ctx.on_step("digested")
    move.verify_pages(copy.path, copy.digest)
    ctx.on_step("copied")
    return copy.path


def _copy_checkpoints(moves: list[CheckpointMove]) -> None:
    """Copy each present checkpoint to where it resolves under the target (verified);
    :func:`check_checkpoints` has refused every conflict before."""
    for move in moves:
        if move.present:
            copy_verified(Path(move.source), Path(move.target))


def _audit_in_flight(ctx: Context, session: WriteSession, move: FileMoves, copy: Path, target: Location,
                     result: RelocateResult) -> None:
    """The ``relocate`` audit row in the copy (from, to, source digest, the command that
    finishes the move, the checkpoints), redacted like every audit row, and the copy
    marked in flight: no one opens it until the source is retired."""
    finish = finish_command(ctx, f"relocate --to {shlex.quote(str(target.directory))}")
    with move.in_flight(copy) as conn:
        session.audit("relocate", {"from": result.source, "to": result.target, "source_digest": result.source_digest,
                                   "finish": finish,
                                   "checkpoints": [m.target for m in result.checkpoints if m.present]}, into=conn)


# -- 6. switch ----------------------------------------------------------------------------

def finish_command(ctx: Context, verb: str) -> str:
    """The command line that finishes (or re-runs) this move: recorded in the target, shown
    by ``RIVET_STATE_MOVE_IN_FLIGHT``."""
    location = ctx.location
    url = f" --state-url {shlex.quote(location.state_url)}" if location.state_url else ""
    return f"statetool -c {shlex.quote(os.path.abspath(ctx.config_path))}{url} {verb}"


def retirement_doc(ctx: Context, to: str, state_url: str, digest: str | None, how: str) -> dict[str, Any]:
    """What a move's old place says once it is retired (a tombstone, or a PostgreSQL
    schema's ``retired`` audit row): ``to``, ``state_url`` (every task's new
    ``RIVET_STATE_URL``), ``at``, ``by``, ``source_digest``, ``how`` (the command)."""
    return {"to": to, "state_url": state_url, "at": now_iso(), "by": ctx.actor, "source_digest": digest, "how": how}


def retire_source(ctx: Context, move: FileMoves, to: str, state_url: str, digest: str | None, how: str) -> str:
    """Keep the bytes of ``move``'s source as ``.rivet_state.db.relocated-<UTC>`` and put a
    tombstone (:func:`retirement_doc`) at its path in one atomic rename (:meth:`FileMoves.retire
    <statetool.backends.base.FileMoves.retire>`; the steps ``kept``, ``tombstoned``,
    ``swapped`` told to ``ctx.on_step``). Returns the path the old bytes are kept at."""
    return str(move.retire(retirement_doc(ctx, to, state_url, digest, how), ctx.on_step))