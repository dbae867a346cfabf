"""``statetool checkpoints``: every CDC export's checkpoint file, resolved (SPEC §6). Read-only."""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from statetool.config import Export
from statetool.errors import StateError, StateWarning
from statetool.location import checkpoint_relative_message, file_identity, resolve_checkpoint
from statetool.moments import moment, parse_time
from statetool.operations.checkpoint_file import read_checkpoint
from statetool.operations.context import Context
from statetool.operations.probe import position_rows

@dataclass
class CheckpointReport:
    """One CDC export's checkpoint: configured and resolved path, why, the file's presence
    at the resolved path (``present``: a regular file is there, whatever holds the
    position), its size (bytes) and age (seconds since last write), the position a run
    resumes from (the state's where it holds one, else the file's), or why it cannot be read."""

    export: str
    engine: str
    configured: str | None
    path: str | None
    why: str
    present: bool
    size_bytes: int | None = None
    age_seconds: float | None = None
    position: object = None
    error: str | None = None
    warnings: list[StateWarning] = field(default_factory=list)
    #: Where the position a run resumes from lives: ``state`` (revision 0006: the file is
    #: not read for it), ``file`` or ``server_slot`` (issue 15 item 5); ``unknown`` when the
    #: state, or its row for this export, could not be read (``error`` says why).
    stored_in: str = "file"
    #: When the state's position was committed, and by which run (``stored_in`` ``state``).
    committed_at: str | None = None
    run_id: str | None = None

    def as_dict(self) -> dict[str, object]:
        """JSON shape of one checkpoint."""
        doc = asdict(self)
        doc["warnings"] = [w.as_dict() for w in self.warnings]
        return doc


@dataclass
class CheckpointsResult:
    """Every CDC export's checkpoint, and all their warnings."""

    checkpoints: list[CheckpointReport]

    @property
    def warnings(self) -> list[StateWarning]:
        """The warnings of every checkpoint, in export order."""
        return [w for c in self.checkpoints for w in c.warnings]

    def as_dict(self) -> dict[str, object]:
        """``{"checkpoints": [...], "warnings": [...]}``."""
        return {"checkpoints": [c.as_dict() for c in self.checkpoints],
                "warnings": [w.as_dict() for w in self.warnings]}


def checkpoint_warning(code: str, export: str, path: object) -> StateWarning:
    """The warning a resolved checkpoint place carries (``place.warning``: SPEC §6), with its
    one text: ``RIVET_STATE_CHECKPOINT_RELATIVE`` or ``RIVET_STATE_CHECKPOINT_BESIDE_CONFIG``
    for CDC export ``export`` whose checkpoint resolves to ``path``."""
    if code == "RIVET_STATE_CHECKPOINT_RELATIVE":
        return StateWarning(code, checkpoint_relative_message(export, path))  # type: ignore[arg-type]
    return StateWarning(code, f"CDC export {export}: its checkpoint was not found under the declared state "
                              f"directory and is read from beside the config, {path}; move it into the state "
                              "directory so it lives and moves with the state")


def file_differs_warning(export: str, path: Path | None, stored: dict[str, Any]) -> StateWarning | None:
    """The warning when CDC export ``export``'s checkpoint file at ``path`` holds another
    position than the state's ``stored`` one, naming both values and both times, neither
    merged into the other (issue 15 item 5): ``RIVET_STATE_CHECKPOINT_FILE_NEWER`` when the
    file was written after the state's position was committed (a worker that still writes
    it), ``RIVET_STATE_CHECKPOINT_FILE_OLDER`` otherwise (a restored backup, a copy: a file
    that differs is a fact to see whichever is newer; finding 4 of issue 15's fresh user).
    None when no such file is there, it holds the state's position, or the one reader
    (:func:`~statetool.operations.checkpoint_file.read_checkpoint`) refuses it: the state's
    position is the one in force, and no run reads that file."""
    if path is None:
        return None
    try:
        found = read_checkpoint(path)
    except StateError:
        return None
    if not found.present or found.position == stored["position"]:
        return None
    written = datetime.fromtimestamp(found.modified or 0, UTC)
    committed = parse_time(stored["committed_at"])
    state = f"the state holds position {json.dumps(stored['position'])} (committed {moment(stored['committed_at'])})"
    if committed is not None and written > committed:
        return StateWarning("RIVET_STATE_CHECKPOINT_FILE_NEWER",
                            f"CDC export {export}: {state}, and {path}, written later ({moment(written)}), holds "
                            f"{json.dumps(found.position)}; the state's is the one a run resumes from")
    when = f"earlier ({moment(written)})" if committed is not None else \
        f"{moment(written)} (the state's commit time cannot be read)"
    return StateWarning("RIVET_STATE_CHECKPOINT_FILE_OLDER",
                        f"CDC export {export}: {state}, and {path}, written {when}, holds "
                        f"{json.dumps(found.position)} (an older copy: a restored backup, a file copied back); the "
                        "state's is the one a run resumes from")


def stored_in_of(export: Export, in_state: bool) -> str:
    """Where CDC export ``export``'s position lives (issue 15 item 5; the one rule of
    ``checkpoints``, ``doctor`` and ``info``): ``state`` when the state holds it
    (``in_state``: revision 0006, the file is not read), ``server_slot`` for a postgres
    stream without a checkpoint file (SPEC §6), ``file`` otherwise."""
    assert export.cdc is not None
    if in_state:
        return "state"
    return "server_slot" if not export.cdc.checkpoint and export.cdc.engine == "postgres" else "file"


def shared_files(ctx: Context, export: str | None = None) -> dict[str, list[str]]:
    """``{file: [exports]}``: each checkpoint file that two or more CDC exports of ``ctx``'s
    config resolve their ``cdc.checkpoint`` to (:func:`file_identity`), named by its real
    path (each real path, where hard links give it more than one), with its exports in
    config order; only the file of ``export`` when given. ``{}`` when each has a file of
    its own (or none). Raises the resolver's and config loader's codes."""
    location, config = ctx.location, ctx.config
    files: dict[tuple[object, ...], list[tuple[str, str]]] = {}
    for e in config.exports:
        if e.cdc is None:
            continue
        where = resolve_checkpoint(e.cdc.checkpoint, e.cdc.engine, location, config.directory).path
        if where is not None:
            files.setdefault(file_identity(where), []).append((e.name, os.path.realpath(where)))
    shared = {}
    for users in files.values():
        names = [name for name, _ in users]
        if len(users) > 1 and (export is None or export in names):
            paths = list(dict.fromkeys(path for _, path in users))
            label = paths[0] if len(paths) == 1 else f"{paths[0]} (also named {', '.join(paths[1:])})"
            shared[label] = names
    return shared


def shared_text(shared: dict[str, list[str]]) -> str:
    """What sharing the files ``shared`` (:func:`shared_files`) means, naming each file and
    its exports: the text of ``RIVET_STATE_CHECKPOINT_SHARED`` wherever it is given."""
    named = "; ".join(f"{' and '.join(names)} keep their position in one file, {path}" for path, names in shared.items())
    return (f"the CDC exports {named}: each run overwrites the other's position, and the next run of either resumes "
            "from the other stream's position or re-anchors, losing changes without an error")


def shared_checkpoint(ctx: Context, export: str | None = None) -> StateError | None:
    """``RIVET_STATE_CHECKPOINT_SHARED`` when CDC exports of ``ctx``'s config resolve their
    ``cdc.checkpoint`` to one file (:func:`shared_files`: by device and inode where it
    exists, by real path otherwise; SPEC §6), naming each such file and its exports (only
    the file of ``export`` when given); None when each has a file of its own (or none).
    One file holds one stream's position: each run overwrites the other's, and an import or
    export of one moves the other's too. ``checkpoints import|export`` refuse it before any
    write, ``check`` fails with it, the runtime's ``StateStore.run`` (and a transaction's
    write of such an export) refuses it before its lease is taken, and ``doctor`` and
    ``checkpoints`` report it for each export involved; the fleet's pre-flight applies the
    same rule across pipelines. Reads the config and ``stat``s paths only; raises the
    resolver's and config loader's codes."""
    shared = shared_files(ctx, export)
    if not shared:
        return None
    return StateError("RIVET_STATE_CHECKPOINT_SHARED", f"{shared_text(shared)}; nothing was changed",
                      {"files": shared})


def stored_positions(ctx: Context,
                     invalid: dict[str, StateError] | None = None) -> dict[str, dict[str, Any]]:
    """The CDC positions the state holds (revision 0006, :func:`position_rows`), read
    read-only; ``{}`` where there is no state, or its revision has no position table.
    Raises the read's ``StateError`` (permission denied, unreachable, corrupt, a row that
    holds no position unless ``invalid`` is given, which gets ``{export: its
    RIVET_STATE_POSITION_INVALID}`` instead): a state that cannot be read is never taken
    for one that holds no position (issue 15, finding 6); each caller says what that means
    for it."""
    backend = ctx.backend()
    if not backend.present():
        return {}
    with backend.reading() as conn:
        return position_rows(conn, frozenset(backend.table_names(conn)), invalid)


def _position_unknown(report: CheckpointReport, why: str) -> None:
    """``report`` of an export whose position cannot be known (``why``, ``CODE: ...``): a
    state that could not be read, or a row of it that holds no position. ``stored_in`` is
    ``unknown`` and the file is not reported as the position (its own error, if any,
    follows)."""
    report.stored_in, report.position = "unknown", None
    report.error = why + (f"; the file: {report.error}" if report.error else "")


def _file_there(report: CheckpointReport, path: Path) -> None:
    """Fill ``present``, ``size_bytes`` and ``age_seconds`` of ``report`` from the file at
    ``path`` (through a symlink), without reading it: the file beside a position the state
    holds, which no run reads (nothing there, or no regular file: not present)."""
    try:
        st = os.stat(path)
    except OSError:
        return
    if stat.S_ISREG(st.st_mode):
        report.present, report.size_bytes = True, st.st_size
        report.age_seconds = round(time.time() - st.st_mtime, 3)


#: ``why`` of a CDC export with no checkpoint file configured whose position the state holds.
_IN_STATE_ONLY = "no cdc.checkpoint configured: the state holds the position (revision 0006), no file is needed"


def _read_file(report: CheckpointReport, path: Path) -> None:
    """Fill ``report`` from the checkpoint file at ``path`` as the one reader reads it: its
    size, age and position, or the reader's error (``CODE: message``); ``present`` is
    whether a regular file is there."""
    try:
        found = read_checkpoint(path)
    except StateError as err:
        report.error = f"{err.code}: {err.message}"
        if err.code != "RIVET_STATE_CHECKPOINT_NOT_A_FILE":
            report.present = True
        return
    if found.present:
        report.present, report.size_bytes = True, found.size_bytes
        report.age_seconds = round(time.time() - (found.modified or 0), 3)
        report.position = found.position


def checkpoints(ctx: Context) -> CheckpointsResult:
    """Resolve and read every CDC checkpoint of the config. Never writes. Raises the
    resolver's and config loader's codes only; a file the one reader refuses is reported
    in ``error``, and so are a state that cannot be read, a row of the state that holds no
    position (``RIVET_STATE_POSITION_INVALID``: that export only, every other export keeps
    its own ``stored_in``; both are ``stored_in`` ``unknown``, the file then not reported as
    the position) and a file two exports share (:func:`_shared`)."""
    config = ctx.config
    state_error: StateError | None = None
    invalid: dict[str, StateError] = {}
    try:
        stored = stored_positions(ctx, invalid) if any(e.cdc is not None for e in config.exports) else {}
    except StateError as err:
        stored, state_error = {}, err
    shared = {name: {path: names} for path, names in shared_files(ctx).items() for name in names}
    out = []
    for export in config.exports:
        if export.cdc is not None:
            report = _report(ctx, export, stored, state_error, invalid.get(export.name))
            out.append(_shared(report, shared[export.name]) if export.name in shared else report)
    return CheckpointsResult(out)


def _shared(report: CheckpointReport, shared: dict[str, list[str]]) -> CheckpointReport:
    """``report`` of an export whose checkpoint file another export of the config shares
    (``shared``, :func:`shared_files`): ``error`` names ``RIVET_STATE_CHECKPOINT_SHARED``
    and both exports (the runtime refuses a run of either), before the file's own error."""
    report.error = (f"RIVET_STATE_CHECKPOINT_SHARED: {shared_text(shared)}"
                    + (f"; {report.error}" if report.error else ""))
    return report


def _report(ctx: Context, export: Export, stored: dict[str, dict[str, Any]], state_error: StateError | None,
            invalid: StateError | None) -> CheckpointReport:
    """The :class:`CheckpointReport` of CDC export ``export``: its resolved place and file,
    and the position a run resumes from, the state's (``stored``) where it holds one; a
    ``state_error``, or ``invalid`` (``RIVET_STATE_POSITION_INVALID`` of this export's
    row), makes ``stored_in`` ``unknown``."""
    assert export.cdc is not None
    place = resolve_checkpoint(export.cdc.checkpoint, export.cdc.engine, ctx.location, ctx.config.directory)
    report = CheckpointReport(export.name, export.cdc.engine, export.cdc.checkpoint,
                              str(place.path) if place.path else None, place.why, False)
    report.stored_in = stored_in_of(export, export.name in stored)
    if export.name in stored:
        row = stored[export.name]
        report.position = row["position"]
        report.committed_at, report.run_id = row["committed_at"], row["run_id"]
        if place.path is None:
            report.why = _IN_STATE_ONLY
        else:
            _file_there(report, place.path)
        differs = file_differs_warning(export.name, place.path, row)
        report.warnings += [differs] if differs is not None else []
        return report
    if place.warning and invalid is None:  # a row is there: the file is no position to lose (its error says how)
        report.warnings.append(checkpoint_warning(place.warning, export.name, place.path))
    if place.path is not None:
        _read_file(report, place.path)
    if state_error is not None:
        _position_unknown(report, f"{state_error.code}: the state could not be read ({state_error.message}); "
                                  f"whether it holds the position of {export.name} is not known, so its file "
                                  "is not taken for it")
    elif invalid is not None:
        _position_unknown(report, f"{invalid.code}: {invalid.message}; its file is not taken for the position while "
                                  "that row is there")
    return report
