"""``statetool metrics [--textfile PATH]``: the facts ``info``, ``leases`` and ``backups
list`` read, as OpenMetrics text for monitoring (issue 16 item 3).

Read-only, through the read paths of those commands (:func:`statetool.operations.inspect.info`,
which lists the leases and the CDC checkpoints too, and
:func:`statetool.operations.backups.copies`), plus one read session for what they do not
give: the runs per status, each export's latest success, the state's size. No lease is
taken and no byte of a state changes. A state that cannot be read still gives its
metrics (``statetool_state_up 0`` and ``statetool_state_error{code}``), and the run
fails with that code after the text is out, so that cron or a systemd timer sees the
failure and the scrape sees why (docs/decisions.md, "Metrics").

With ``--textfile PATH`` the text replaces PATH whole (node-exporter's textfile collector
convention): a scrape reads the old file or the new one, never half of one.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from statetool.backends.durable import fitting_name, regular_or_nothing, replace_whole
from statetool.backends.faults import fault, os_fault, read_only_fs, refuse_no_files
from statetool.errors import (StateError, error_object, failure_class, failure_exit_code, internal_error,
                              pipeline_failure, worst)
from statetool.moments import parse_time
from statetool.openmetrics import Family, Sample, exposition
from statetool.operations.backups import copies
from statetool.operations.context import Context
from statetool.operations.inspect import InfoResult, info
from statetool.operations.probe import last_successes, run_statuses

STATE_UP = Family("statetool_state_up", "gauge",
                  "1 when statetool read the state, 0 when it could not (statetool_state_error says why)")
STATE_ERROR = Family("statetool_state_error", "gauge",
                     "1 for the registered code that kept statetool from reading the state (docs/errors.md)")
STATE_INFO = Family("statetool_state_info", "gauge",
                    "Always 1: where the state is (backend, scope, location) and the revision it is at")
REVISION_PENDING = Family("statetool_state_revision_pending", "gauge",
                          "Revisions between the state and the head of this release (statetool migrate)")
IDENTITY_OK = Family("statetool_state_identity_ok", "gauge",
                     "1 when the state records this config's source as its own; verdict as statetool info gives it")
SIZE = Family("statetool_state_size_bytes", "gauge", "The state's size on disk", "bytes")
WARNINGS = Family("statetool_state_warnings", "gauge", "The warnings statetool info gives, by code")
CURSOR_AGE = Family("statetool_export_cursor_age_seconds", "gauge",
                    "Seconds since the export's cursor was last set", "seconds")
LAST_SUCCESS_AGE = Family("statetool_export_last_success_age_seconds", "gauge",
                          "Seconds since the export's latest succeeded run finished", "seconds")
RUNS = Family("statetool_export_runs", "counter",
              "Runs of the export the state's history holds, by status (statetool prune lowers it)")
CHUNKS_PENDING = Family("statetool_export_chunks_pending", "gauge",
                        "Chunk checkpoints of the export not done yet: its next chunked run resumes from them")
POSITION_AGE = Family("statetool_export_position_age_seconds", "gauge",
                      "Seconds since the CDC export's position was saved (committed in the state, or its "
                      "checkpoint file written)", "seconds")
LEASE_HELD = Family("statetool_lease_held", "gauge",
                    "1 while a live holder holds the lease, 0 when it is free or stale")
LEASE_AGE = Family("statetool_lease_age_seconds", "gauge", "Seconds since the live holder acquired the lease",
                   "seconds")
LEASE_HEARTBEAT_AGE = Family("statetool_lease_heartbeat_age_seconds", "gauge",
                             "Seconds since the holder's last heartbeat by the database clock (PostgreSQL leases)",
                             "seconds")
BACKUP_AGE = Family("statetool_backup_age_seconds", "gauge",
                    "Seconds since the newest usable backup or keep beside the SQLite state was taken", "seconds")
BACKUP_COPIES = Family("statetool_backup_copies", "gauge",
                       "Backups and keeps beside the SQLite state, by kind and whether each reads as a state")
#: Every family, in the order the text gives them.
FAMILIES = (STATE_UP, STATE_ERROR, STATE_INFO, REVISION_PENDING, IDENTITY_OK, SIZE, WARNINGS, CURSOR_AGE,
            LAST_SUCCESS_AGE, RUNS, CHUNKS_PENDING, POSITION_AGE, LEASE_HELD, LEASE_AGE, LEASE_HEARTBEAT_AGE,
            BACKUP_AGE, BACKUP_COPIES)
#: What an export's runs are always counted by, even at zero (a counter that appears at 0).
RUN_STATUSES = ("succeeded", "failed")
#: Failures ``info`` describes that leave no state to read (it is missing, or of a revision
#: whose tables this release does not know); a pending revision or a foreign identity is a
#: state that reads, whose metrics say so.
DOWN = frozenset({"RIVET_STATE_MISSING", "RIVET_STATE_SCHEMA_NEWER", "RIVET_STATE_SCHEMA_UNEXPECTED"})

Labels = tuple[tuple[str, str], ...]


class MetricsResult(NamedTuple):
    """One run: ``text`` (OpenMetrics, ``# EOF`` last), ``down`` (the error of each pipeline
    whose state could not be read, in the order given), ``textfile`` (the file written, or
    None for stdout), and ``down_configs`` (the config of each error of ``down``, as given,
    when the samples carry a ``pipeline`` label; else empty)."""

    text: str
    down: list[StateError]
    textfile: str | None
    down_configs: list[str]

    @property
    def worst(self) -> StateError | None:
        """The error of ``down`` whose class ranks highest (:func:`statetool.errors.worst`),
        the first in the pipelines' order among equals (as a fleet's, docs/commands.md)."""
        code = worst([err.code for err in self.down])
        rank = failure_class(code) if code is not None else None
        return next((err for err in self.down if failure_class(err.code) == rank), None)

    @property
    def failures(self) -> list[dict[str, Any]]:
        """The ``failures[]`` of ``--json-errors``: with a ``pipeline`` label, each pipeline
        whose state could not be read, in order (:func:`statetool.errors.pipeline_failure`:
        ``config`` and ``export`` null added); else ``[]``."""
        return [pipeline_failure(config, error_object(err)) for err, config in zip(self.down, self.down_configs)]

    @property
    def exit_code(self) -> int:
        """0 when every state was read, else the exit code of :attr:`worst`."""
        return failure_exit_code(self.worst.code) if self.worst is not None else 0


def _age(now: float, value: object) -> float | None:
    """Seconds from the ISO-8601 time ``value`` to ``now`` (Unix seconds), to the
    millisecond; None when ``value`` is no time."""
    when = parse_time(value) if value is not None else None
    return None if when is None else round(now - when.timestamp(), 3)


class _Pipeline:
    """The samples of one pipeline, each labelled with ``base`` first (its ``pipeline``
    label in a fleet, nothing for one config)."""

    def __init__(self, base: Labels) -> None:
        self.base = base
        self.samples: list[Sample] = []

    def add(self, family: Family, value: float | None, **labels: str) -> None:
        """One sample of ``family`` (none for a ``value`` of None)."""
        if value is not None:
            self.samples.append((family, self.base + tuple(labels.items()), float(value)))


def _state_info(out: _Pipeline, ctx: Context, revision: str) -> None:
    """``statetool_state_info`` where the location resolves (the text names no place otherwise)."""
    try:
        where = ctx.location.as_dict()
    except StateError:
        return
    out.add(STATE_INFO, 1, backend=str(where["backend"]), scope=str(where["scope"]), location=str(where["display"]),
            revision=revision)


def _backups(out: _Pipeline, ctx: Context, now: float) -> None:
    """Copies beside a SQLite state (none on PostgreSQL), read as ``backups list`` reads
    them; also where the state is missing or unreadable, which is when a copy is needed. A
    directory that is not there has none to count."""
    try:
        if not ctx.backend().keeps_copies:
            return
        found = copies(ctx)
    except StateError:  # no place resolved, or no directory: nowhere to look for copies
        return
    for kind in ("backup", "keep"):
        for usable in (True, False):
            out.add(BACKUP_COPIES, sum(1 for c in found if c.kind == kind and c.usable == usable), kind=kind,
                    usable=str(usable).lower())
    ages = [age for c in found if c.usable and (age := _age(now, c.taken_at)) is not None]
    out.add(BACKUP_AGE, min(ages) if ages else None)


def _down_error(described: InfoResult) -> StateError | None:
    """The failure ``info`` described that leaves no state to read (:data:`DOWN`), if any."""
    return next((err for err in described.failures if err.code in DOWN), None)


def _described(out: _Pipeline, ctx: Context, described: InfoResult) -> None:
    """Every sample of a state that reads: ``described`` is its ``info``; one more read
    session gives the runs per status, the latest successes and the size."""
    backend = ctx.backend()
    with backend.reading() as conn:
        statuses, successes, size = run_statuses(conn), last_successes(conn), backend.size_bytes(conn)
    now = time.time()
    revision: dict[str, Any] = described.revision
    out.add(STATE_UP, 1)
    _state_info(out, ctx, str(revision["current"] or ("legacy" if revision["legacy"] else "")))
    out.add(REVISION_PENDING, len(revision["pending"]))
    identity = described.identity
    out.add(IDENTITY_OK, int(identity["verdict"] == "ok"), verdict=str(identity["verdict"]))
    out.add(SIZE, size)
    counted: dict[str, int] = {}
    for warning in described.warnings:
        counted[warning["code"]] = counted.get(warning["code"], 0) + 1
    for code in sorted(counted):
        out.add(WARNINGS, counted[code], code=code)
    exports: list[dict[str, Any]] = described.exports
    for row in exports:
        name = str(row["name"])
        out.add(CURSOR_AGE, _age(now, row["cursor_updated_at"]), export=name)
        out.add(LAST_SUCCESS_AGE, _age(now, successes.get(name)), export=name)
        runs = statuses.get(name, {})
        for status in sorted(set(RUN_STATUSES) | set(runs)):
            out.add(RUNS, runs.get(status, 0), export=name, status=status)
        out.add(CHUNKS_PENDING, row["chunks_total"] - row["chunks_done"], export=name)
    checkpoints: list[dict[str, Any]] = described.checkpoints
    for checkpoint in checkpoints:
        saved = _age(now, checkpoint["committed_at"]) if checkpoint["stored_in"] == "state" \
            else checkpoint["age_seconds"]
        out.add(POSITION_AGE, saved, export=str(checkpoint["export"]))
    leases: list[dict[str, Any]] = described.leases
    for lease in leases:
        key, live = str(lease["key"]), lease["state"] == "live"
        out.add(LEASE_HELD, int(live), key=key)
        out.add(LEASE_AGE, _age(now, lease["acquired_at"]) if live else None, key=key)
        out.add(LEASE_HEARTBEAT_AGE, lease["heartbeat_age"], key=key)
    _backups(out, ctx, now)


def _collect(ctx: Context, base: Labels) -> tuple[list[Sample], StateError | None]:
    """The samples of one pipeline, and the error that kept its state from being read (None
    when it was read). An ``OSError`` met on the way is its environment fault's code
    (``RIVET_INTERNAL`` when it is none), as the CLI's one handler names it; any other
    exception is a bug and propagates."""
    try:
        described = info(ctx)
        down = _down_error(described)
        if down is None:
            out = _Pipeline(base)
            _described(out, ctx, described)
            return out.samples, None
    except StateError as err:
        down = err
    except OSError as exc:
        down = os_fault(exc) or internal_error(exc)
    out = _Pipeline(base)
    out.add(STATE_UP, 0)
    out.add(STATE_ERROR, 1, code=down.code)
    _state_info(out, ctx, "")
    _backups(out, ctx, time.time())
    return out.samples, down


def unwritable(path: Path, why: str) -> StateError:
    """``RIVET_METRICS_TEXTFILE_UNWRITABLE`` for the textfile ``path``, saying ``why`` its
    directory takes no file (never a state's code: the textfile is no state)."""
    return StateError("RIVET_METRICS_TEXTFILE_UNWRITABLE", f"--textfile {path}: metrics cannot write a file in "
                      f"{path.parent}: {why}; nothing was written", {"path": str(path)})


def _why(err: OSError) -> str:
    """What an ``OSError`` met writing in the textfile's directory says of that directory."""
    if err.errno == errno.EROFS:
        return "it is on a filesystem mounted read-only"
    if err.errno in (errno.EACCES, errno.EPERM):
        return f"this user (uid {os.geteuid()}) may not create files there ({err.strerror})"
    if err.errno == errno.ENOTDIR:
        return "a part of it is a file, not a directory"
    if err.errno == errno.ENOENT:
        return "it takes no new file (a kernel filesystem such as /proc or /sys, or it was removed meanwhile)"
    return err.strerror or str(err)


def textfile_path(path: Path) -> Path:
    """``path`` made absolute, checked before any state is read: its directory must exist
    (``RIVET_METRICS_DIR_MISSING``: a collector's directory that is not there is not made
    here), be a directory this user may create files in
    (``RIVET_METRICS_TEXTFILE_UNWRITABLE``: a file, a read-only mount, no permission) on a
    filesystem that holds files (``RIVET_PLACE_HOLDS_NO_FILES`` for /proc, /sys and the
    like: :func:`statetool.backends.faults.refuse_no_files`), and
    what stands at ``path`` must be a regular file or nothing (``RIVET_STATE_UNSAFE_FILE``
    for a symlink, a directory or another kind: never replaced)."""
    path = Path(os.path.abspath(path))
    try:
        there = os.stat(path.parent)
    except FileNotFoundError:
        raise StateError("RIVET_METRICS_DIR_MISSING", f"--textfile {path}: {path.parent} does not exist; metrics "
                         "writes a file into a directory that exists", {"path": str(path)}) from None
    except OSError as err:
        raise unwritable(path, _why(err)) from None
    if not stat.S_ISDIR(there.st_mode):
        raise unwritable(path, "it is a file, not a directory")
    refuse_no_files(path, path.parent)
    if not os.access(path.parent, os.W_OK | os.X_OK):
        why = "it is on a filesystem mounted read-only" if read_only_fs(path.parent) \
            else f"this user (uid {os.geteuid()}) may not create files there"
        raise unwritable(path, why)
    regular_or_nothing(path, "metrics replaces only a regular file there")
    return path


def write_textfile(path: Path, text: str) -> None:
    """Replace ``path`` (checked by :func:`textfile_path`) with ``text`` whole
    (:func:`statetool.backends.durable.replace_whole`, mode 0644 less the umask, so that
    the collector's user reads it): through the temporary file ``.<name>.<pid>.metrics-tmp``
    beside it, which a collector reading ``*.prom`` never reads. A regular file at that name
    is what a killed run with this process's pid left: it is replaced. Anything else there
    is never followed nor removed: ``RIVET_STATE_UNSAFE_FILE``. Any other fault of the
    directory or the file system (read-only, permission) is
    ``RIVET_METRICS_TEXTFILE_UNWRITABLE`` (:func:`unwritable`), a full disk or quota
    ``RIVET_STATE_DISK_FULL``, as for every file statetool writes; no temporary file is left
    behind."""
    tmp = path.with_name(fitting_name(".", path.name, f".{os.getpid()}.metrics-tmp"))
    try:
        with_leftover = os.lstat(tmp)
    except FileNotFoundError:
        with_leftover = None
    except OSError as err:
        raise unwritable(path, _why(err)) from None
    try:
        if with_leftover is not None and stat.S_ISREG(with_leftover.st_mode):
            os.unlink(tmp)
        replace_whole(path, text.encode(), tmp, 0o644)
    except FileExistsError:
        raise StateError("RIVET_STATE_UNSAFE_FILE", f"{tmp} is a symlink or not a regular file, where metrics "
                         "writes its temporary file; nothing was written", {"path": str(tmp)}) from None
    except OSError as err:
        if err.errno == errno.EISDIR:
            raise StateError("RIVET_STATE_UNSAFE_FILE", f"{path} became a directory while metrics ran; nothing "
                             "was written", {"path": str(path)}) from None
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise fault(path, err) from None  # RIVET_STATE_DISK_FULL: free space, not another directory
        raise unwritable(path, _why(err)) from None


def metrics(contexts: Sequence[Context], *, textfile: Path | None = None,
            labelled: bool | None = None) -> MetricsResult:
    """The metrics of every pipeline of ``contexts`` (one context per pipeline config), read
    one after the other, as one text; written to ``textfile`` (:func:`write_textfile`)
    when given, after :func:`textfile_path` checked it before any read.

    With ``labelled`` (default: more than one context) every sample carries a ``pipeline``
    label, the context's config path as given, first (docs/decisions.md, "Metrics"; the CLI
    labels whatever a ``--configs`` GLOB matched, one config too); else none. Raises
    ``RIVET_CLI_USAGE`` for no context or one config path given twice (two identical
    series), :func:`textfile_path`'s and :func:`write_textfile`'s codes. A state that cannot
    be read is not raised: it is in :attr:`MetricsResult.down`, and its samples say so."""
    paths = [str(ctx.config_path) for ctx in contexts]
    if not paths or len(set(paths)) != len(paths):
        raise StateError("RIVET_CLI_USAGE", "metrics needs one or more distinct pipeline configs; given: "
                         f"{', '.join(paths) or 'none'}")
    target = textfile_path(textfile) if textfile is not None else None
    samples: list[Sample] = []
    down: list[StateError] = []
    down_configs: list[str] = []
    label = labelled or (labelled is None and len(contexts) > 1)
    for ctx, path in zip(contexts, paths, strict=True):
        found, error = _collect(ctx, (("pipeline", path),) if label else ())
        samples += found
        if error is not None:
            down.append(error)
            down_configs += [path] if label else []
    text = exposition(FAMILIES, samples)
    if target is not None:
        write_textfile(target, text)
    return MetricsResult(text, down, str(target) if target is not None else None, down_configs)
