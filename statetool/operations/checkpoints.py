"""``statetool checkpoints``: every CDC export's checkpoint file, resolved (SPEC §6). Read-only."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from statetool.errors import StateError, StateWarning
from statetool.moments import moment, parse_time
from statetool.location import checkpoint_relative_message, resolve_checkpoint
from statetool.operations.context import Context

#: Largest checkpoint file read for its position (bytes); a position is a few hundred.
MAX_READ = 1 << 20


@dataclass
class CheckpointReport:
    """One CDC export's checkpoint: configured and resolved path, why, presence, size
    (bytes), age (seconds since last write), the position it holds, or why it cannot be read."""

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
    #: not read for it), ``file`` or ``server_slot`` (issue 15 item 5).
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


def file_newer_warning(export: str, path: Path | None, stored: dict[str, Any]) -> StateWarning | None:
    """Warning ``RIVET_STATE_CHECKPOINT_FILE_NEWER`` when CDC export ``export``'s checkpoint
    file at ``path`` holds another position than the state's ``stored`` one and was written
    after it was committed (a worker that still writes the file): both values are named,
    neither is merged into the other (issue 15 item 5). None otherwise."""
    if path is None or not path.is_file():
        return None
    try:
        position = json.loads(path.read_bytes()[:MAX_READ])
        written = datetime.fromtimestamp(path.stat().st_mtime, UTC)
    except (OSError, ValueError):
        return None
    committed = parse_time(stored["committed_at"])
    if position == stored["position"] or committed is None or written <= committed:
        return None
    return StateWarning("RIVET_STATE_CHECKPOINT_FILE_NEWER",
                        f"CDC export {export}: the state holds position {json.dumps(stored['position'])} (committed "
                        f"{moment(stored['committed_at'])}), and {path}, written later ({moment(written)}), holds "
                        f"{json.dumps(position)}; the state's is the one a run resumes from")


def shared_checkpoint(ctx: Context) -> StateError | None:
    """``RIVET_STATE_CHECKPOINT_SHARED`` when CDC exports of ``ctx``'s config resolve their
    ``cdc.checkpoint`` to one file (by real path, through every symlink; SPEC §6), naming
    each such file and its exports; None when each has a file of its own (or none). One
    file holds one stream's position: each run overwrites the other's, and an import or
    export of one moves the other's too. ``checkpoints import|export`` refuse it before
    any write, ``check`` fails with it; the fleet's pre-flight applies the same rule across
    pipelines. Reads the config and resolves paths only; raises the resolver's and config
    loader's codes."""
    location, config = ctx.location, ctx.config
    files: dict[str, list[str]] = {}
    for export in config.exports:
        if export.cdc is None:
            continue
        where = resolve_checkpoint(export.cdc.checkpoint, export.cdc.engine, location, config.directory).path
        if where is not None:
            files.setdefault(os.path.realpath(where), []).append(export.name)
    shared = {path: names for path, names in files.items() if len(names) > 1}
    if not shared:
        return None
    named = "; ".join(f"{' and '.join(names)} keep their position in one file, {path}" for path, names in shared.items())
    return StateError("RIVET_STATE_CHECKPOINT_SHARED",
                      f"the CDC exports {named}: each run overwrites the other's position, and the next run of either "
                      "resumes from the other stream's position or re-anchors, losing changes without an error; "
                      "nothing was changed", {"files": shared})


def stored_positions(ctx: Context) -> dict[str, dict[str, Any]]:
    """The CDC positions the state holds (revision 0006), read read-only; ``{}`` where no
    state can be read (the pre-flight rows say why)."""
    from statetool.errors import StateError
    from statetool.operations.probe import position_rows

    backend = ctx.backend()
    try:
        if not backend.present():
            return {}
        with backend.reading() as conn:
            return position_rows(conn, frozenset(backend.table_names(conn)))
    except StateError:
        return {}


def checkpoints(ctx: Context) -> CheckpointsResult:
    """Resolve and read every CDC checkpoint of the config. Never writes. Raises the
    resolver's and config loader's codes only; an unreadable file is reported in ``error``."""
    location, config = ctx.location, ctx.config
    stored = stored_positions(ctx) if any(e.cdc is not None for e in config.exports) else {}
    out = []
    for export in config.exports:
        if export.cdc is None:
            continue
        place = resolve_checkpoint(export.cdc.checkpoint, export.cdc.engine, location, config.directory)
        report = CheckpointReport(export.name, export.cdc.engine, export.cdc.checkpoint,
                                  str(place.path) if place.path else None, place.why, False)
        if export.name in stored:
            row = stored[export.name]
            report.stored_in, report.present, report.position = "state", True, row["position"]
            report.committed_at, report.run_id = row["committed_at"], row["run_id"]
            newer = file_newer_warning(export.name, place.path, row)
            report.warnings += [newer] if newer is not None else []
            out.append(report)
            continue
        if place.path is None and export.cdc.engine == "postgres":
            report.stored_in = "server_slot"
        if place.warning:
            report.warnings.append(checkpoint_warning(place.warning, export.name, place.path))
        if place.path is not None and place.path.is_file():
            stat = place.path.stat()
            report.present, report.size_bytes = True, stat.st_size
            report.age_seconds = round(time.time() - stat.st_mtime, 3)
            try:
                with open(place.path, "rb") as fh:
                    report.position = json.loads(fh.read(MAX_READ))
            except (OSError, UnicodeDecodeError, ValueError) as err:
                report.error = f"{place.path} is not readable JSON: {err}"
        elif place.path is not None and place.path.exists():
            report.error = f"{place.path} is not a regular file"
        out.append(report)
    return CheckpointsResult(out)
