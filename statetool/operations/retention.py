"""``statetool prune``: history retention (issue 16 item 2; SPEC §3, §5, §5a).

Removes run history (``rivet_runs``) and load-ledger rows (``rivet_load_ledger``) that
started (were loaded) before ``--before`` or lie beyond the ``--keep-runs`` newest runs of
each export, in batches. A batch finds its rows on a read session that takes no lock
(:meth:`~statetool.backends.base.Backend.scanning`), then is one guarded write
(:func:`~statetool.operations.writes.guarded_write`: fenced by the export's run lease, held
for the whole export, the serial advanced) that reads that key range again, removes it and
writes its own ``prune`` audit row counting what it removed per table; with ``--archive``
the batch's rows are appended to the archive as one gzip member and fsynced before the batch
commits. Before a batch takes the write lock, it is left free for as long as a waiting
writer takes to try it again, whenever one may be waiting
(:attr:`~statetool.backends.base.Backend.writer_retry_seconds`), so a live run of another
export is held off about one batch at most. The copies beside a SQLite state are
``statetool backups prune``'s (:mod:`statetool.operations.backups`), another thing.

Never removed, whatever the options say (one rule, :func:`_bounds` and the statements
below, for the dry run's counts and the real run's batches alike):

* the latest succeeded run of an export (the succeeded run with its latest ``started_at``);
* an unfinished run (``running``, or no ``finished_at``: it may be live), a run that has
  chunk checkpoints, and the load-ledger rows loaded since the oldest run a chunked run
  resumes (one with a chunk not ``done``, or an unfinished run of mode ``chunked``);
* the newest load-ledger row of an export whose only progress is its ledger
  (:func:`~statetool.operations.probe.has_progress`: without it the next run would be a
  silent first run, SPEC §5a);
* anything but those two tables: cursors (``rivet_exports``), chunk checkpoints
  (``rivet_chunks``), CDC positions (``rivet_cdc_positions``), the run aggregates.

The steps of a batch are told to :attr:`~statetool.operations.context.Context.on_step`
(the crash tests kill the process at them): ``archived-<n>`` once batch ``n``'s rows are in
the archive, fsynced, before its delete; ``deleted-<n>`` after the delete, before the commit;
``committed-<n>`` after the commit (1-based over the whole prune).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import stat
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from statetool import schema
from statetool.backends.base import Backend, HeldLease, Reader
from statetool.backends.durable import CREATE_FLAGS, fsync_dir
from statetool.backends.faults import WRITE_MARGIN, fault, os_fault, refuse_unwritable
from statetool.errors import StateError, StateWarning, internal_error, interrupted
from statetool.moments import parse_time
from statetool.numbers import MAX_KEEP, require_within
from statetool.operations.context import Context
from statetool.operations.leasing import acquire, lease_store, run_lease_key
from statetool.operations.preflight import Preflight, require, run_preflight
from statetool.operations.probe import has_progress, resume_points
from statetool.operations.writes import NO_LEASE, WHOLE_STATE, guarded_write, require_writable, tolerate_read_only
from statetool.tables import LOAD_LEDGER, RUNS

#: The tables a prune removes rows from, in the order it empties them.
TABLES = (RUNS, LOAD_LEDGER)
#: Rows per batch by default, and at most (docs/decisions.md, "prune: batches").
DEFAULT_BATCH, MAX_BATCH = 1000, 10_000
#: How much longer than a waiting writer's longest sleep the lock stays free between batches.
_PAUSE_FACTOR = 1.5
#: Runs of one export, each with its place in the order the batches go (oldest first).
_RUN_ORDER = "ORDER BY r.started_at, r.run_id"
_RUN_COLUMNS = tuple(schema.runs.columns.keys())
_LEDGER_COLUMNS = tuple(schema.load_ledger.columns.keys())
#: What keeps a run whatever its age (the module docstring).
_RUN_KEPT = ("r.status <> 'running' AND r.finished_at IS NOT NULL AND NOT EXISTS (SELECT 1 FROM rivet_chunks AS c "
             "WHERE c.export_name = r.export_name AND c.run_id = r.run_id)")
#: What keeps the latest succeeded run of the export (by ``started_at``, as ``doctor`` and
#: :func:`~statetool.operations.probe.last_successes` read it; a tie keeps every one).
_NOT_LATEST = ("NOT (r.status = 'succeeded' AND r.started_at = (SELECT max(s.started_at) FROM rivet_runs AS s "
               "WHERE s.export_name = :e AND s.status = 'succeeded'))")
_RESUMED_FROM = (
    "SELECT min(r.started_at) FROM rivet_runs AS r WHERE r.export_name = :e AND ((r.mode = 'chunked' AND "
    "(r.status = 'running' OR r.finished_at IS NULL)) OR EXISTS (SELECT 1 FROM rivet_chunks AS c WHERE "
    "c.export_name = r.export_name AND c.run_id = r.run_id AND c.status <> 'done'))")
_NEWEST_RUNS = ("SELECT r.started_at, r.run_id FROM rivet_runs AS r WHERE r.export_name = :e "
                "ORDER BY r.started_at DESC, r.run_id DESC LIMIT 1 OFFSET :n")
_HISTORY_EXPORTS = ("SELECT export_name FROM rivet_runs UNION SELECT export_name FROM rivet_load_ledger")


def parse_before(text: str) -> str:
    """``--before DATE``: an ISO-8601 date or date and time (``2026-01-01``,
    ``2026-01-01T06:00:00Z``, ``2026-01-01T08:00:00+02:00``; without an offset it is UTC), as
    the state writes its times (``2026-01-01T06:00:00.000000Z``), so that the state's text
    compares with it. Raises ``RIVET_CLI_USAGE`` for anything else, and for a time whose
    UTC leaves the years 1 to 9999 (:func:`statetool.moments.parse_time`)."""
    moment = parse_time(text.strip())
    if moment is None:
        raise StateError("RIVET_CLI_USAGE", f"--before {text!r} is no ISO-8601 date or time in the years 1 to 9999 "
                         "(UTC): give 2026-01-01 or 2026-01-01T06:00:00Z (UTC unless an offset is given)")
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class Criteria:
    """What a prune removes: runs that started before ``before`` (the state's time text,
    :func:`parse_before`) and/or lie beyond the ``keep_runs`` newest of their export, and the
    ledger rows loaded before either bound; only of export ``export`` when set; in batches
    of ``batch_size`` rows."""

    before: str | None
    keep_runs: int | None
    export: str | None
    batch_size: int

    def as_dict(self) -> dict[str, object]:
        """``{before, keep_runs, export, batch_size}``."""
        return {"before": self.before, "keep_runs": self.keep_runs, "export": self.export,
                "batch_size": self.batch_size}


@dataclass
class ExportPrune:
    """One export's part of a prune: ``state`` is ``planned`` (a dry run's: ``removed`` is
    what the real run would remove), ``pruned``, ``unchanged`` (nothing reached) or
    ``skipped`` (its run lease was live: ``holder`` says whose). ``removed``, ``kept`` and
    ``protected`` count rows per table (``rivet_runs``, ``rivet_load_ledger``): ``kept``
    what stays, ``protected`` what the options reached but a rule keeps."""

    export: str
    state: str
    removed: dict[str, int]
    kept: dict[str, int]
    protected: dict[str, int]
    batches: int = 0
    holder: str | None = None

    def as_dict(self) -> dict[str, object]:
        """``{export, state, removed, kept, protected, batches, holder}``."""
        return {"export": self.export, "state": self.state, "removed": self.removed, "kept": self.kept,
                "protected": self.protected, "batches": self.batches, "holder": self.holder}


@dataclass
class PruneReport:
    """What ``statetool prune`` did (or, with ``dry_run``, would do): the exports,
    ``archive`` ``{path, rows, bytes}`` (None without ``--archive``; ``bytes`` 0 when nothing
    was written, no file then), ``vacuum`` ``{ran, before_bytes, after_bytes}`` (None
    without ``--vacuum``; sizes null in a dry run), the warnings."""

    location: dict[str, object]
    dry_run: bool
    criteria: Criteria
    exports: list[ExportPrune] = field(default_factory=list)
    archive: dict[str, object] | None = None
    vacuum: dict[str, object] | None = None
    warnings: list[StateWarning] = field(default_factory=list)
    #: The id of a real prune (in its archive lines and audit rows); None in a dry run.
    prune_id: str | None = None

    @property
    def removed(self) -> dict[str, int]:
        """Rows removed (or to remove) per table, over every export."""
        return {t: sum(e.removed[t] for e in self.exports) for t in TABLES}

    def as_dict(self) -> dict[str, object]:
        """``{location, dry_run, prune_id, criteria, exports, removed, batches, archive, vacuum,
        warnings}``."""
        return {"location": self.location, "dry_run": self.dry_run, "prune_id": self.prune_id,
                "criteria": self.criteria.as_dict(),
                "exports": [e.as_dict() for e in self.exports], "removed": self.removed,
                "batches": sum(e.batches for e in self.exports), "archive": self.archive, "vacuum": self.vacuum,
                "warnings": [w.as_dict() for w in self.warnings]}


@dataclass(frozen=True)
class _Bounds:
    """What of one export the criteria reach, as SQL (``AND``-ed conditions with their
    parameters): ``runs`` / ``ledger`` the reach of the options (None: nothing), and what
    keeps a reached row all the same (besides :data:`_RUN_KEPT` and :data:`_NOT_LATEST`): the time since which
    ledger rows belong to a run that resumes, the ledger row kept for progress."""

    export: str
    runs: tuple[str, dict[str, object]] | None
    ledger: tuple[str, dict[str, object]] | None
    resumed_from: str | None
    last_ledger: int | None

    def run_sql(self, protected: bool) -> tuple[str, dict[str, object]]:
        """The ``WHERE`` of the runs reached (and, with ``protected``, not kept by a rule)."""
        assert self.runs is not None
        where, params = f"r.export_name = :e AND {self.runs[0]}", {"e": self.export, **self.runs[1]}
        if protected:
            where += f" AND {_RUN_KEPT} AND {_NOT_LATEST}"
        return where, params

    def ledger_sql(self, protected: bool) -> tuple[str, dict[str, object]]:
        """The ``WHERE`` of the ledger rows reached (and, with ``protected``, not kept)."""
        assert self.ledger is not None
        where, params = f"l.export_name = :e AND {self.ledger[0]}", {"e": self.export, **self.ledger[1]}
        if protected and self.resumed_from is not None:
            where += " AND l.loaded_at < :resumed"
            params["resumed"] = self.resumed_from
        if protected and self.last_ledger is not None:
            where += " AND l.id <> :last"
            params["last"] = self.last_ledger
        return where, params


def _bounds(conn: Reader, tables: frozenset[str], name: str, criteria: Criteria) -> _Bounds:
    """The :class:`_Bounds` of export ``name``, read on ``conn`` (indexed lookups). With
    ``keep_runs`` N above 0, the runs reached are those at or before the (N+1)th newest, and
    the ledger rows those loaded before the Nth newest started; nothing with N runs or fewer."""
    run_parts: list[str] = []
    ledger_parts: list[str] = []
    params: dict[str, object] = {}
    if criteria.before is not None:
        run_parts.append("r.started_at < :before")
        ledger_parts.append("l.loaded_at < :before")
        params["before"] = criteria.before
    if criteria.keep_runs == 0:
        run_parts.append("1 = 1")
        ledger_parts.append("1 = 1")
    elif criteria.keep_runs is not None:
        beyond = conn.one(_NEWEST_RUNS, {"e": name, "n": criteria.keep_runs})
        if beyond is None:
            return _Bounds(name, None, None, None, None)
        oldest_kept = conn.one(_NEWEST_RUNS, {"e": name, "n": criteria.keep_runs - 1})
        assert oldest_kept is not None
        run_parts.append("r.started_at <= :ks AND (r.started_at < :ks OR r.run_id <= :kr)")
        ledger_parts.append("l.loaded_at < :kept")
        params["ks"], params["kr"] = beyond
        params["kept"] = oldest_kept[0]
    ledger = (" AND ".join(ledger_parts), params) if LOAD_LEDGER in tables else None
    point = resume_points(conn, tables, [name])[name]
    last = None
    if ledger is not None and not has_progress(point.cursor, int(point.succeeded), point.chunks_total, 0):
        last = conn.scalar("SELECT max(id) FROM rivet_load_ledger WHERE export_name = :e", {"e": name})
    return _Bounds(name, (" AND ".join(run_parts), params), ledger, conn.scalar(_RESUMED_FROM, {"e": name}),
                   None if last is None else int(last))


def _count(conn: Reader, table: str, alias: str, where: tuple[str, dict[str, object]]) -> int:
    return int(conn.scalar(f"SELECT count(*) FROM {table} AS {alias} WHERE {where[0]}", where[1]) or 0)


def _plan_export(conn: Reader, tables: frozenset[str], name: str, criteria: Criteria, state: str) -> ExportPrune:
    """The counts of export ``name`` (:class:`ExportPrune`), read on ``conn``."""
    bounds = _bounds(conn, tables, name, criteria)
    totals = {RUNS: int(conn.scalar("SELECT count(*) FROM rivet_runs WHERE export_name = :e", {"e": name}) or 0),
              LOAD_LEDGER: int(conn.scalar("SELECT count(*) FROM rivet_load_ledger WHERE export_name = :e",
                                           {"e": name}) or 0) if LOAD_LEDGER in tables else 0}
    reached = {RUNS: 0, LOAD_LEDGER: 0}
    removed = {RUNS: 0, LOAD_LEDGER: 0}
    if bounds.runs is not None:
        reached[RUNS] = _count(conn, RUNS, "r", bounds.run_sql(False))
        removed[RUNS] = _count(conn, RUNS, "r", bounds.run_sql(True))
    if bounds.ledger is not None:
        reached[LOAD_LEDGER] = _count(conn, LOAD_LEDGER, "l", bounds.ledger_sql(False))
        removed[LOAD_LEDGER] = _count(conn, LOAD_LEDGER, "l", bounds.ledger_sql(True))
    return ExportPrune(name, state if any(removed.values()) else "unchanged", removed,
                       {t: totals[t] - removed[t] for t in TABLES}, {t: reached[t] - removed[t] for t in TABLES})


class Archive:
    """The ``--archive`` file: gzipped JSON lines, one ``{"prune", "batch", "table", "row"}``
    object per removed row (the prune's id, the batch's number, 1-based; docs/commands.md,
    "The archive"), one gzip member per batch (``zcat`` and :func:`gzip.open` read the
    members as one stream). Created on the first batch, exclusively and never through a
    link, mode 0600; each member is written and fsynced before its batch's delete commits,
    so the file holds every removed row. A member that cannot be written whole, or whose
    batch then fails to commit, is cut away again (the file truncated to the members before
    it; removed when it was the first), so the file holds whole members of committed
    batches only. A kill mid-member leaves it cut short, and a kill between a member and its
    commit leaves a member whose batch has no audit row: a reader keeps only the lines of
    batches that have one (docs/commands.md, "The archive")."""

    def __init__(self, path: Path, prune_id: str) -> None:
        self.path = path
        self.prune_id = prune_id
        self.rows = 0
        self.bytes = 0
        self.members = 0
        self._fd: int | None = None
        #: ``(rows, bytes)`` of the member the last append wrote, until :meth:`withdraw`.
        self._last: tuple[int, int] | None = None

    def append(self, batch: int, table: str, rows: list[dict[str, Any]]) -> None:
        """Append ``rows`` of ``table``, batch number ``batch``, as one member, fsynced.
        Raises ``RIVET_STATE_TARGET_NOT_EMPTY`` for a file that appeared at the path since
        the plan, ``RIVET_STATE_UNSAFE_FILE`` for a symlink there, and the filesystem's
        faults (``RIVET_STATE_DISK_FULL``, ...), the member cut away again first."""
        text = "".join(json.dumps({"prune": self.prune_id, "batch": batch, "table": table, "row": row},
                                  sort_keys=True, default=str) + "\n" for row in rows)
        member = memoryview(gzip.compress(text.encode(), mtime=0))
        try:
            if self._fd is None:
                try:
                    self._fd = os.open(self.path, CREATE_FLAGS, 0o600)
                except FileExistsError:
                    raise StateError("RIVET_STATE_TARGET_NOT_EMPTY", f"{self.path} appeared since the prune began; "
                                     "the archive is never written over a file", {"path": str(self.path)}) from None
                fsync_dir(self.path.parent)
            try:
                written = 0
                while written < len(member):
                    written += os.write(self._fd, member[written:])
                os.fsync(self._fd)
            except OSError:
                self._truncate()
                raise
        except OSError as err:
            raise fault(self.path, err) or os_fault(err) or err from None
        self._last = (len(rows), len(member))
        self.rows += len(rows)
        self.bytes += len(member)
        self.members += 1

    def withdraw(self) -> None:
        """Cut away the member the last :meth:`append` wrote, whose batch then did not
        commit (the guarded write's abort action)."""
        if self._last is not None:
            rows, size = self._last
            self._last = None
            self.rows, self.bytes, self.members = self.rows - rows, self.bytes - size, self.members - 1
            self._truncate()

    def _truncate(self) -> None:
        """Leave the file holding its whole members (:attr:`bytes`), fsynced, or remove it
        when it holds none. Best effort: where even that fails, a reader still skips what is
        left of a member whose batch never committed (it has no audit row)."""
        assert self._fd is not None
        with contextlib.suppress(OSError):
            if self.members:
                os.ftruncate(self._fd, self.bytes)
                os.fsync(self._fd)
            else:
                self.close()
                os.unlink(self.path)
                fsync_dir(self.path.parent)

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def as_dict(self) -> dict[str, object]:
        """``{path, rows, bytes}``."""
        return {"path": str(self.path), "rows": self.rows, "bytes": self.bytes}


def _check_archive(path: Path, *, dry_run: bool) -> list[StateWarning]:
    """Refuse an ``--archive`` the prune could not create, before anything is written:
    ``RIVET_CLI_USAGE`` when its directory does not exist, ``RIVET_STATE_UNSAFE_FILE`` for a
    symlink or another non-regular file at the path, ``RIVET_STATE_TARGET_NOT_EMPTY`` for a
    file there (never written over), and the faults of its directory
    (``RIVET_STATE_READ_ONLY``, ``RIVET_STATE_PERMISSION_DENIED``: a dry run's warnings;
    ``RIVET_STATE_DISK_FULL``). Returns the dry run's warnings."""
    if not path.parent.is_dir():
        raise StateError("RIVET_CLI_USAGE", f"--archive {path}: {path.parent} is no directory; name a file in a "
                         "directory that exists (prune creates none)", {"path": str(path)})
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise StateError("RIVET_STATE_UNSAFE_FILE", f"--archive {path} is a symlink or not a regular file; the "
                             "archive is never written through one", {"path": str(path)})
        raise StateError("RIVET_STATE_TARGET_NOT_EMPTY", f"--archive {path} exists; the archive is never written "
                         "over a file: name a new one", {"path": str(path)})
    return tolerate_read_only(lambda: refuse_unwritable(path, directories=(path.parent,), need=WRITE_MARGIN,
                                                        room_for="the archive"), dry_run=dry_run, denied_too=True)


class _NothingLeft(Exception):
    """Raised in a batch's transaction that found nothing to remove: it rolls back (no serial
    advanced for nothing)."""


def _pause(backend: Backend, contended: bool) -> None:
    """Before a batch takes the write lock, leave it free long enough for a writer that waits
    for it to take it first (:attr:`~statetool.backends.base.Backend.writer_retry_seconds`),
    when one may be waiting (``contended``, looked at on the batch's read session)."""
    if contended:
        time.sleep(backend.writer_retry_seconds * _PAUSE_FACTOR)


def _skipped(plan: ExportPrune, holder: str, warnings: list[StateWarning]) -> ExportPrune:
    """``plan``'s export skipped, as its run lease is live (``holder``: who holds it):
    nothing removed, every row kept, warning ``RIVET_STATE_PRUNE_SKIPPED`` added to
    ``warnings``; the real run's and the dry run's alike."""
    warnings.append(StateWarning("RIVET_STATE_PRUNE_SKIPPED",
                                 f"export {plan.export} was not pruned: its run lease is held by {holder}"))
    kept = {t: plan.kept[t] + plan.removed[t] for t in TABLES}
    return ExportPrune(plan.export, "skipped", {t: 0 for t in TABLES}, kept, dict(plan.protected), holder=holder)


def _foreseen(ctx: Context, planned: list[ExportPrune], warnings: list[StateWarning]) -> list[ExportPrune]:
    """A dry run's exports as the real run (which takes no lease it must wait for) will
    find them: one whose run lease is live now is skipped (:func:`_skipped`), read from the
    lease table without taking any lock (a fresh user's finding: the dry run counted it)."""
    from statetool.operations.leasing import list_leases

    live = {row["export"]: f"pid {row['holder_pid']} on {row['host']} ({row['command']})"
            for row in list_leases(ctx).live if row["export"] is not None}
    return [_skipped(p, live[p.export], warnings) if p.state == "planned" and p.export in live else p
            for p in planned]


@dataclass
class _Run:
    """One real prune in progress: what every batch needs."""

    ctx: Context
    preflight: Preflight
    criteria: Criteria
    archive: Archive | None
    tables: frozenset[str]
    update: Callable[[int, int], None]
    total: int
    #: The prune's id, in every archive line and audit row of its batches.
    prune_id: str
    batches: int = 0
    done: int = 0
    claimed: bool = False
    warnings: list[StateWarning] = field(default_factory=list)
    #: Rows removed by the committed batches: export -> table -> rows.
    committed: dict[str, dict[str, int]] = field(default_factory=dict)
    #: The number of the batch under way (its guarded write open), None between batches.
    failing: int | None = None

    def batch(self, lease: HeldLease, table: str, bounds: _Bounds, after: tuple[Any, ...] | None,
              name: str) -> tuple[tuple[Any, ...] | None, int]:
        """One batch of export ``name``'s ``table``, after the key ``after`` (None: from the
        oldest). Its rows are found on a read session
        (:meth:`~statetool.backends.base.Backend.scanning`: the scan, which on the ledger may
        pass many rows of other exports, holds no lock), then read again by key and by the rule,
        archived, removed and audited in one guarded write, which so holds the write lock
        only for lookups by key. Returns the last key found (None: nothing was left) and how
        many rows went."""
        number = self.batches + 1
        backend = self.ctx.backend()
        with backend.scanning() as conn:
            last = _candidates(conn, table, bounds, after, self.criteria.batch_size)
            contended = last is not None and backend.contended(conn)
        if last is None:
            return None, 0
        _pause(backend, contended)  # a writer kept waiting by the last batch takes the lock first
        self.failing = number
        try:
            with guarded_write(self.ctx, NO_LEASE, preflight=self.preflight, held=[lease], claim=not self.claimed,
                               copies=0) as session:
                reader = session.reader
                rows = _rows(reader, table, bounds, after, last)
                if not rows:
                    raise _NothingLeft
                if self.archive is not None:
                    self.archive.append(number, table, rows)
                    session.on_abort(lambda n=number: None if self._audited(n) else self.archive.withdraw())
                    self.ctx.on_step(f"archived-{number}")
                _delete(session.conn, table, [row[_KEYS[table]] for row in rows])
                self.ctx.on_step(f"deleted-{number}")
                session.audit("prune", {"prune_id": self.prune_id, "export": name, "batch": number,
                                        "removed": {table: len(rows)},
                                        "criteria": self.criteria.as_dict(),
                                        "archive": None if self.archive is None else str(self.archive.path),
                                        "archive_bytes": None if self.archive is None else self.archive.bytes})
                if not self.claimed:
                    self.warnings += session.warnings
                    self.claimed = True
        except _NothingLeft:
            self.failing = None
            return last, 0
        self.ctx.on_step(f"landed-{number}")  # committed, not yet counted: the window settle() closes
        self.failing = None
        self.batches = number
        counts = self.committed.setdefault(name, {t: 0 for t in TABLES})
        counts[table] += len(rows)
        self.ctx.on_step(f"committed-{number}")
        self.done += len(rows)
        self.update(self.done, self.total)
        return last, len(rows)

    def _audited(self, number: int) -> dict[str, Any] | None:
        """The ``prune`` audit row's detail of this prune's batch ``number``, read from the
        state (None: the batch did not commit). The state's word, not this run's
        bookkeeping: a Ctrl-C or a fault can land after a batch's commit and before the run
        counted it, and then neither its archive member may be cut away nor the batch be
        called rolled back (a re-check's finding). None too when the state cannot be read."""
        try:
            with self.ctx.backend().reading() as conn:
                rows = conn.rows("SELECT detail FROM rivet_audit WHERE action = 'prune' AND detail LIKE :p",
                                 {"p": f"%{self.prune_id}%"})
        except StateError:
            return None
        for (text,) in rows:
            detail = json.loads(text)
            if detail.get("prune_id") == self.prune_id and detail.get("batch") == number:
                return dict(detail)
        return None

    def settle(self) -> None:
        """Count the batch under way (:attr:`failing`) as committed when the state holds its
        audit row (:meth:`_audited`)."""
        if self.failing is None:
            return
        detail = self._audited(self.failing)
        if detail is None:
            return
        counts = self.committed.setdefault(str(detail["export"]), {t: 0 for t in TABLES})
        for table, n in dict(detail["removed"]).items():
            counts[table] += int(n)
        self.batches, self.failing = self.failing, None

    def _done(self) -> tuple[str, str, dict[str, int]]:
        """What was done before a stop: ``(the words, how to finish, rows removed per
        table)``; the words name the batch rolled back, the committed and audited batches
        with their rows per table and export, and the archive's whole members. The batch
        under way is first settled by the state's audit rows (:meth:`settle`)."""
        self.settle()
        removed = {t: sum(c[t] for c in self.committed.values()) for t in TABLES}
        per_export = "; ".join(f"{name}: {_rows_text(c)}" for name, c in self.committed.items())
        stopped = f"batch {self.failing} was rolled back, and " if self.failing is not None else ""
        archived, again = "", "run the same prune again"
        if self.archive is not None:
            archived = (f", and archived in {self.archive.path} ({self.archive.members} whole gzip members, "
                        f"{self.archive.rows} rows: exactly those)")
            again += " with --archive naming a new file (this one is never written over)"
        words = (f"{stopped}the {_plural(self.batches, 'batch', 'batches')} before it were committed and audited: "
                 f"{_rows_text(removed)} removed ({per_export}){archived}")
        return words, again, removed

    def incomplete(self, cause: StateError) -> StateError:
        """``RIVET_STATE_PRUNE_INCOMPLETE`` for ``cause``, a failure after batches committed:
        :meth:`_done`'s words, and that the same prune run again removes the rest
        (docs/commands.md, "When a prune stops half-way")."""
        done, again, removed = self._done()
        cause_text = cause.message.replace("; nothing was written", "")
        return StateError("RIVET_STATE_PRUNE_INCOMPLETE",
                          f"prune {self.prune_id} stopped: {cause_text} ({cause.code}); {done}. Fix that, then "
                          f"{again}: it removes the rest", {
                              "prune_id": self.prune_id, "cause": cause.code, "batches": self.batches,
                              "removed": removed, "exports": self.committed,
                              "archive": None if self.archive is None else str(self.archive.path),
                              "archive_rows": None if self.archive is None else self.archive.rows,
                              "archive_bytes": None if self.archive is None else self.archive.bytes})

    def interrupted(self) -> str:
        """What a Ctrl-C after batches committed logs on its way out (``ctx.log``: the CLI's
        stderr; it then exits 130): :meth:`_done`'s words and how to finish."""
        done, again, _ = self._done()
        return f"prune {self.prune_id} was interrupted: {done}; {again} to remove the rest"

    def export(self, plan: ExportPrune, wait: bool) -> ExportPrune:
        """Prune export ``plan.export`` under its run lease (waited for with ``wait``, else
        taken only when free: a live one skips the export, warning
        ``RIVET_STATE_PRUNE_SKIPPED``), table by table, batch by batch."""
        name = plan.export
        try:
            lease = acquire(self.ctx, run_lease_key(name), deadline=None if wait else time.monotonic())
        except StateError as err:
            if wait or err.code != "RIVET_STATE_RUN_IN_PROGRESS":
                raise
            return _skipped(plan, err.message.partition(" is held by ")[2] or err.message, self.warnings)
        removed = {t: 0 for t in TABLES}
        first = self.batches
        try:
            backend = self.ctx.backend()
            with backend.scanning() as conn:  # under the lease: the export's rows stay as read
                bounds = _bounds(conn, self.tables, name, self.criteria)
            for table in TABLES:
                after: tuple[Any, ...] | None = None
                while True:
                    after, gone = self.batch(lease, table, bounds, after, name)
                    removed[table] += gone
                    if after is None:
                        break
        finally:
            lease.release()
        kept = {t: plan.kept[t] + plan.removed[t] - removed[t] for t in TABLES}
        return ExportPrune(name, "pruned" if any(removed.values()) else "unchanged", removed, kept,
                           dict(plan.protected), self.batches - first)


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _rows_text(counts: dict[str, int]) -> str:
    """``40 runs and 0 ledger rows``."""
    return f"{_plural(counts[RUNS], 'run', 'runs')} and {_plural(counts[LOAD_LEDGER], 'ledger row', 'ledger rows')}"


#: The column that names a row of each table a prune removes from.
_KEYS = {RUNS: "run_id", LOAD_LEDGER: "id"}


def _reach(table: str, bounds: _Bounds) -> tuple[str, dict[str, object]] | None:
    """The ``WHERE`` of the rows of ``table`` the bounds let go, None when none."""
    if table == RUNS:
        return None if bounds.runs is None else bounds.run_sql(True)
    return None if bounds.ledger is None else bounds.ledger_sql(True)


def _after(table: str, where: str, params: dict[str, object], after: tuple[Any, ...] | None,
           upto: tuple[Any, ...] | None = None) -> str:
    """``where`` narrowed to the keys after ``after`` (and up to ``upto``, included), in the
    order the batches go: runs by ``(started_at, run_id)`` (the index by export and start),
    ledger rows by ``id``. Adds the bounds to ``params``."""
    for name, key, op, eq in (("a", after, ">", ">"), ("u", upto, "<", "<=")):
        if key is None:
            continue
        if table == RUNS:  # the first term alone is a range of the index: the second cannot be
            where += (f" AND r.started_at {op}= :{name}s AND (r.started_at {op} :{name}s OR "
                      f"r.run_id {eq} :{name}r)")
            params[f"{name}s"], params[f"{name}r"] = key
        else:
            where += f" AND l.id {eq} :{name}i"
            params[f"{name}i"] = key[0]
    return where


def _candidates(conn: Reader, table: str, bounds: _Bounds, after: tuple[Any, ...] | None,
                limit: int) -> tuple[Any, ...] | None:
    """The key of the last of the next ``limit`` rows of ``table`` the bounds let go after the
    key ``after``, oldest first: ``(started_at, run_id)`` or ``(id,)``; None when none is left."""
    reach = _reach(table, bounds)
    if reach is None:
        return None
    where, params = reach
    where = _after(table, where, params, after)
    sql = (f"SELECT r.started_at, r.run_id FROM rivet_runs AS r WHERE {where} {_RUN_ORDER} LIMIT :n" if table == RUNS
           else f"SELECT l.id FROM rivet_load_ledger AS l WHERE {where} ORDER BY l.id LIMIT :n")
    found = conn.rows(sql, {**params, "n": limit})
    return tuple(found[-1]) if found else None


def _rows(conn: Reader, table: str, bounds: _Bounds, after: tuple[Any, ...] | None,
          upto: tuple[Any, ...]) -> list[dict[str, Any]]:
    """The rows of ``table`` after the key ``after`` up to ``upto`` that the bounds still let
    go, each as ``{column: value}``, oldest first: what a batch archives and removes (a
    range of the index, so the write lock is held for a range read, not a scan)."""
    reach = _reach(table, bounds)
    assert reach is not None
    where, params = reach
    where = _after(table, where, params, after, upto)
    alias = "r" if table == RUNS else "l"
    columns = _RUN_COLUMNS if table == RUNS else _LEDGER_COLUMNS
    order = _RUN_ORDER if table == RUNS else "ORDER BY l.id"
    found = conn.rows(f"SELECT {', '.join(f'{alias}.{c}' for c in columns)} FROM {table} AS {alias} WHERE {where} "
                      f"{order}", params)
    return [dict(zip(columns, row, strict=True)) for row in found]


def _delete(conn: sa.Connection, table: str, keys: list[Any]) -> None:
    """Remove the rows of ``table`` with ``keys`` (run ids, ledger ids: each table's primary
    key, looked up by it) in the write ``conn``."""
    target = schema.runs if table == RUNS else schema.load_ledger
    conn.execute(sa.delete(target).where(target.c[_KEYS[table]].in_(keys)))


def _plan(ctx: Context, criteria: Criteria, state: str) -> tuple[Preflight, frozenset[str], list[ExportPrune]]:
    """The write pre-flight and the counts of every export the prune reaches, read in one
    read-only session. Raises the pre-flight's codes and ``RIVET_EXPORT_UNKNOWN``."""
    pf = run_preflight(ctx, for_write=True)
    snap = require(pf)
    if criteria.export is not None and criteria.export not in snap.exports and \
            ctx.config.export(criteria.export) is None:
        raise StateError("RIVET_EXPORT_UNKNOWN",
                         f"export '{criteria.export}' is in neither {ctx.config.path} nor the state",
                         {"export": criteria.export})
    backend = ctx.backend()
    with backend.reading() as conn:
        tables = frozenset(backend.table_names(conn))
        query = _HISTORY_EXPORTS if LOAD_LEDGER in tables else "SELECT export_name FROM rivet_runs"
        names = sorted({row[0] for row in conn.rows(query)})
        if criteria.export is not None:
            names = [n for n in names if n == criteria.export]
        return pf, tables, [_plan_export(conn, tables, name, criteria, state) for name in names]


def prune_history(ctx: Context, *, before: str | None = None, keep_runs: int | None = None,
                  export: str | None = None, batch_size: int = DEFAULT_BATCH, archive: Path | None = None,
                  vacuum: bool = False, dry_run: bool = False) -> PruneReport:
    """``statetool prune``: remove the runs and load-ledger rows older than ``before`` (ISO
    date or time text, :func:`parse_before`) and/or beyond the ``keep_runs`` newest runs of
    each export (of ``export`` only, when given), ``batch_size`` rows per guarded write,
    never a row the module docstring keeps.

    Each export is pruned under its run lease: with ``export`` named it is waited for up to
    ``--lock-wait`` (then ``RIVET_STATE_LOCK_TIMEOUT``; at once with ``--lock-wait 0``:
    ``RIVET_STATE_RUN_IN_PROGRESS``); otherwise an export whose run lease is live is skipped
    with warning ``RIVET_STATE_PRUNE_SKIPPED`` and the others go on. ``archive`` (a new file)
    receives every removed row before its batch commits (:class:`Archive`). ``vacuum``
    gives the space back afterwards (:meth:`~statetool.backends.base.Backend.reclaim_space`;
    where it keeps writers out, as one write of the whole state holding every run lease,
    waited for up to ``--lock-wait``, then ``RIVET_STATE_RUN_IN_PROGRESS`` naming the rows
    already pruned), with a ``prune.vacuum`` audit row. No backup is taken: the batches are
    small, and the archive is the record of what went (docs/decisions.md, "prune").

    ``dry_run`` makes every check of the real run (the pre-flight, the export, the archive's
    place, the state's writability, the rights to vacuum) and returns the counts; it changes
    no byte and creates no file. Raises ``RIVET_CLI_USAGE`` without ``before`` or
    ``keep_runs``, for a ``keep_runs`` outside 0 to :data:`~statetool.numbers.MAX_KEEP` or
    a ``batch_size`` outside 1 to :data:`MAX_BATCH`, ``RIVET_STATE_PRUNE_INCOMPLETE`` for a
    failure after some batches committed (:meth:`_Run.incomplete`), and the codes named
    above, the pre-flight's and the guarded write's.
    """
    if before is None and keep_runs is None:
        raise StateError("RIVET_CLI_USAGE", "say what to prune: --before DATE and/or --keep-runs N")
    if keep_runs is not None:
        require_within("--keep-runs", keep_runs, 0, MAX_KEEP)
    require_within("--batch-size", batch_size, 1, MAX_BATCH)
    criteria = Criteria(None if before is None else parse_before(before), keep_runs, export, batch_size)
    pf, tables, planned = _plan(ctx, criteria, "planned")
    backend = ctx.backend()
    warnings = require_writable(ctx, copies=_vacuum_copies(backend, vacuum), dry_run=dry_run, denied_too=True,
                                room_for=VACUUM_ROOM)
    if dry_run and not warnings:  # a place the real run may not write: its lease files neither
        keys = [run_lease_key(p.export) for p in planned if p.state == "planned"]
        warnings = tolerate_read_only(lambda: lease_store(ctx).require_takable(keys), dry_run=True, denied_too=True)
    if archive is not None:
        archive = Path(os.path.abspath(archive))
        warnings += _check_archive(archive, dry_run=dry_run)
    if vacuum:
        with backend.reading() as conn:
            backend.check_reclaimable(conn, TABLES)
    report = PruneReport(ctx.location.as_dict(), dry_run, criteria, warnings=warnings)
    if dry_run:
        report.exports = planned if export is not None else _foreseen(ctx, planned, report.warnings)
        planned = report.exports
        report.archive = None if archive is None else {"path": str(archive), "rows": sum(
            sum(p.removed.values()) for p in planned), "bytes": 0}
        report.vacuum = None if not vacuum else {"ran": False, "exclusive": backend.reclaim_blocks_writers,
                                                 "before_bytes": None, "after_bytes": None}
        return report
    report.prune_id = uuid.uuid4().hex
    sink = Archive(archive, report.prune_id) if archive is not None else None
    total = sum(sum(p.removed.values()) for p in planned)
    try:
        with ctx.progress("prune") as update:
            run = _Run(ctx, pf, criteria, sink, tables, update, total, report.prune_id)
            try:
                report.exports = [run.export(p, wait=export is not None) if p.state == "planned" else p
                                  for p in planned]
            except BaseException as exc:
                run.settle()
                if not run.batches:
                    raise  # nothing was committed: the error says so, as it is
                if interrupted(exc):  # Ctrl-C: say what was done, on the way out
                    ctx.log(f"interrupted; {run.interrupted()}")
                    raise
                if not isinstance(exc, Exception):
                    raise
                raise run.incomplete(_state_error(exc)) from exc
    finally:
        if sink is not None:
            sink.close()
    report.warnings += run.warnings
    report.archive = None if sink is None else sink.as_dict()
    if vacuum:
        report.vacuum = _vacuum(ctx, pf, report)
    return report


#: The room a SQLite ``VACUUM`` needs beside the state, in files as large as it: the
#: rebuilt copy, and the WAL the rebuilt pages go through; and those words, for a refusal.
VACUUM_COPIES = 2
VACUUM_ROOM = "for --vacuum: the copy VACUUM rebuilds and the WAL its pages go through"


def _vacuum_copies(backend: Backend, vacuum: bool) -> int:
    """How many files as large as the state a prune needs room for beside it (the
    ``copies`` of :func:`~statetool.operations.writes.require_writable`): :data:`VACUUM_COPIES`
    with ``vacuum`` where the backend's reclaim rebuilds the file (SQLite), else none. The
    one rule, for the prune's first check (and its dry run's) and the vacuum's own write."""
    return VACUUM_COPIES if vacuum and backend.reclaim_blocks_writers else 0


def _state_error(exc: Exception) -> StateError:
    """``exc`` as the registered error the CLI would make of it (SPEC §7)."""
    if isinstance(exc, StateError):
        return exc
    return (os_fault(exc) if isinstance(exc, OSError) else None) or internal_error(exc)


def _vacuum(ctx: Context, pf: Preflight, report: PruneReport) -> dict[str, object]:
    """``--vacuum`` after the batches: the backend's reclaim, under every run lease where it
    keeps writers out, and its ``prune.vacuum`` audit row. A refusal says what was pruned
    already (audited): a re-run with the same options has nothing left to prune and vacuums."""
    backend = ctx.backend()
    sizes: list[tuple[int, int]] = []
    blocks = backend.reclaim_blocks_writers
    try:
        with guarded_write(ctx, WHOLE_STATE if blocks else NO_LEASE, preflight=pf, claim=False,
                           copies=_vacuum_copies(backend, True), room_for=VACUUM_ROOM,
                           prepare=lambda: sizes.append(backend.reclaim_space(TABLES))
                           ) as session:
            session.audit("prune.vacuum", {"tables": list(TABLES), "before_bytes": sizes[0][0],
                                           "after_bytes": sizes[0][1]})
    except StateError as err:
        gone = report.removed
        raise StateError(err.code, f"the prune removed {gone[RUNS]} runs and {gone[LOAD_LEDGER]} ledger rows "
                         f"(audited), but the vacuum did not run: {err.message}; re-run with --vacuum",
                         err.details) from None
    return {"ran": True, "exclusive": blocks, "before_bytes": sizes[0][0], "after_bytes": sizes[0][1]}
