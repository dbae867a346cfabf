"""The API a pipeline runtime uses to keep its progress in a state (the second face).

    store = StateStore.open("rivet.yaml")            # resolve, pre-flight, claim identity
    with store.run("orders", "incremental") as run:  # the run lease chunk-run:orders
        run_id = run.start_run()
        run.commit_cursor("2026-11-30T00:00:00Z")
        run.finish_run(run_id, "succeeded", rows=1200, files=1)

Opening goes through the same resolver and pre-flight as every statetool command:
a foreign state in a declared directory is refused (``RIVET_STATE_FOREIGN``), a state
with pending revisions is refused (``RIVET_STATE_MIGRATION_PENDING``), a state with
progress and no identity is adopted (warning ``RIVET_STATE_IDENTITY_ADOPTED``), and a
missing state is refused (``RIVET_STATE_MISSING``) unless ``create=True`` (SPEC §5a).

Every write goes through the guarded write path
(:func:`statetool.operations.writes.guarded_write`): a run's writes are fenced by its run
lease (``RIVET_STATE_LEASE_LOST`` once another holder took it over), and a write of an
export's progress outside :meth:`StateStore.run` takes that export's run lease for its
transaction, refused at once (``RIVET_STATE_RUN_IN_PROGRESS``) while another process
holds it (SPEC §5).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from statetool import schema
from statetool.backends.base import HeldLease
from statetool.errors import StateError, StateWarning
from statetool.location import resolve_checkpoint
from statetool.operations.checkpoint_file import read_checkpoint
from statetool.operations.checkpoints import checkpoints, shared_checkpoint
from statetool.operations.context import Context, now_iso
from statetool.operations.create import init
from statetool.operations.leasing import acquire, run_lease_key
from statetool.operations.positions import put_position, require_fits, require_shallow
from statetool.operations.preflight import Preflight, require, run_preflight
from statetool.operations.probe import decode_position, position_text
from statetool.operations.writes import NO_LEASE, WHOLE_STATE, WriteSession, guarded_write

#: Run statuses a runtime records.
RUN_STATUSES = ("running", "succeeded", "failed", "skipped")


@dataclass
class Writer:
    """Writes of one transaction. Times default to now (ISO-8601 UTC); counts are rows/files.

    ``guard(export)`` is called before each write of an export's progress: it makes sure
    the write holds that export's run lease (see :meth:`StateStore.transaction`).
    """

    conn: Connection
    guard: Callable[[str], None]

    def start_run(self, export: str, mode: str, *, run_id: str | None = None, started_at: str | None = None) -> str:
        """Record the start of a run (status ``running``); returns its run id."""
        self.guard(export)
        run_id = run_id or uuid.uuid4().hex
        self.conn.execute(sa.insert(schema.runs).values(
            run_id=run_id, export_name=export, mode=mode, status="running", started_at=started_at or now_iso()))
        return run_id

    def finish_run(self, run_id: str, status: str, *, rows: int = 0, files: int = 0, bytes_read: int = 0,
                   error: str | None = None, error_code: str | None = None, finished_at: str | None = None) -> None:
        """Record the end of a run: ``status`` one of :data:`RUN_STATUSES`, counts in rows,
        files and bytes. Raises ``ValueError`` for another status or an unknown run id."""
        if status not in RUN_STATUSES:
            raise ValueError(f"status {status!r} is not one of {RUN_STATUSES}")
        r = schema.runs
        export = self.conn.execute(sa.select(r.c.export_name).where(r.c.run_id == run_id)).scalar()
        if export is None:
            raise ValueError(f"no run {run_id!r} in this state")
        self.guard(export)
        self.conn.execute(sa.update(r).where(r.c.run_id == run_id).values(
            status=status, rows=rows, files=files, bytes_read=bytes_read, error=error, error_code=error_code,
            finished_at=finished_at or now_iso()))

    def commit_cursor(self, export: str, mode: str, value: str, *, at: str | None = None) -> None:
        """Commit export ``export``'s incremental cursor ``value``."""
        self.guard(export)
        at = at or now_iso()
        e = schema.exports
        if not self.conn.execute(sa.update(e).where(e.c.export_name == export).values(
                mode=mode, cursor_value=value, cursor_updated_at=at, updated_at=at)).rowcount:
            self.conn.execute(sa.insert(e).values(export_name=export, mode=mode, cursor_value=value,
                                                  cursor_updated_at=at, updated_at=at))

    def commit_position(self, export: str, engine: str, value: object, *, run_id: str | None = None,
                        token: int | None = None) -> None:
        """Commit CDC export ``export``'s position ``value`` (any JSON value, as its engine's
        checkpoint file holds it) into the state (revision 0006, SPEC §6), with the run that
        committed it and the fencing token of the lease it was committed under. Raises
        ``ValueError`` for a value that is not JSON (one that contains itself, ``NaN``), or
        is None: JSON null is no position, and a row holding it would be read back as none
        (issue 15, finding 5); ``RIVET_STATE_POSITION_TOO_DEEP`` for one that nests deeper
        than 64 levels of lists and dicts (counted before it is serialized: ``MAX_POSITION_DEPTH``)
        and ``RIVET_STATE_POSITION_TOO_LARGE`` for one larger than a checkpoint file may be
        (1 MiB of JSON: it could never go back to its file). All before the export's lease
        is taken and before anything is written."""
        if value is None:
            raise ValueError(f"None is no position of {export}: commit the position its engine gave; a stream with "
                             "no position yet commits nothing")
        require_shallow(export, value)
        text = json.dumps(value, sort_keys=True, allow_nan=False)
        require_fits(export, text)
        self.guard(export)
        put_position(self.conn, export, engine, text, run_id=run_id, token=token)

    def record_chunk(self, export: str, run_id: str, index: int, lower: str | None, upper: str | None,
                     status: str, *, rows: int = 0) -> None:
        """Record (or update) chunk ``index`` of a checkpointed run: bounds, status, rows."""
        self.guard(export)
        c = schema.chunks
        key = (c.c.export_name == export) & (c.c.run_id == run_id) & (c.c.chunk_index == index)
        values = {"lower_bound": lower, "upper_bound": upper, "status": status, "rows": rows, "updated_at": now_iso()}
        if not self.conn.execute(sa.update(c).where(key).values(**values)).rowcount:
            self.conn.execute(sa.insert(c).values(export_name=export, run_id=run_id, chunk_index=index, **values))


class Run:
    """One run of one export, under its run lease (from :meth:`StateStore.run`). Each
    method is one fenced transaction; :meth:`transaction` groups several."""

    def __init__(self, store: StateStore, export: str, mode: str, lease: HeldLease) -> None:
        self.store, self.export, self.mode, self.lease = store, export, mode, lease
        #: The id of the run this object last recorded the start of (:meth:`start_run`),
        #: which a position committed after it names; None before.
        self.run_id: str | None = None

    @property
    def token(self) -> int | None:
        """The fencing token of this run's lease (SPEC §5)."""
        return self.lease.token

    @contextmanager
    def transaction(self) -> Iterator[Writer]:
        """One writing transaction fenced by this run's lease: raises
        ``RIVET_STATE_LEASE_LOST`` (and writes nothing) once the lease was taken over."""

        def only_mine(export: str) -> None:
            if export != self.export:
                raise StateError("RIVET_CLI_USAGE", f"this run holds the lease of {self.export}, not of {export}")

        with self.store.guarded(held=[self.lease]) as session:
            yield Writer(session.conn, only_mine)

    def start_run(self, *, run_id: str | None = None, started_at: str | None = None) -> str:
        """Record the start of this run; returns its run id (also kept as :attr:`run_id`)."""
        with self.transaction() as tx:
            self.run_id = tx.start_run(self.export, self.mode, run_id=run_id, started_at=started_at)
        return self.run_id

    def finish_run(self, run_id: str, status: str, **counts: object) -> None:
        """Record the end of this run (see :meth:`Writer.finish_run`)."""
        with self.transaction() as tx:
            tx.finish_run(run_id, status, **counts)  # type: ignore[arg-type]

    def commit_cursor(self, value: str, *, at: str | None = None) -> None:
        """Commit this export's cursor ``value``."""
        with self.transaction() as tx:
            tx.commit_cursor(self.export, self.mode, value, at=at)

    def record_chunk(self, run_id: str, index: int, lower: str | None, upper: str | None, status: str, *,
                     rows: int = 0) -> None:
        """Record (or update) chunk ``index`` of this run."""
        with self.transaction() as tx:
            tx.record_chunk(self.export, run_id, index, lower, upper, status, rows=rows)

    def read_position(self) -> object | None:
        """This CDC export's position: the state's (revision 0006) where it holds a row, and
        then the checkpoint file is never read again; else the checkpoint file's JSON where
        the config names one and a file is there (read by
        :func:`~statetool.operations.checkpoint_file.read_checkpoint`, as every command
        reads it); else None, the one answer that starts the stream from no position (SPEC
        §5a). Reads the state read-only. Raises ``RIVET_STATE_POSITION_INVALID`` (the row
        holds no position), the reader's ``RIVET_STATE_CHECKPOINT_NOT_A_FILE``,
        ``RIVET_STATE_PERMISSION_DENIED`` and ``RIVET_STATE_CHECKPOINT_UNREADABLE``, and
        ``RIVET_CLI_USAGE`` for an export that is not CDC."""
        self._engine()
        stored = self.store.stored_position(self.export)
        if stored is not None:
            return stored
        path = self.store.checkpoint_path(self.export)
        return None if path is None else read_checkpoint(path).position

    def commit_position(self, value: object, *, run_id: str | None = None) -> None:
        """Commit this CDC export's position ``value`` into the state, fenced by this run's
        lease (``RIVET_STATE_LEASE_LOST`` once another holder took it over: nothing is
        written) and recorded with its fencing token and the run that committed it
        (``run_id``, default the one :meth:`start_run` recorded; issue 15 item 1). Raises
        ``RIVET_CLI_USAGE`` for an export that is not CDC, ``ValueError`` for a value that
        is not JSON, ``RIVET_STATE_POSITION_TOO_DEEP`` for one nested deeper than 64 levels,
        ``RIVET_STATE_POSITION_TOO_LARGE`` for one over 1 MiB of JSON (nothing written:
        :meth:`Writer.commit_position`)."""
        engine = self._engine()
        with self.transaction() as tx:
            tx.commit_position(self.export, engine, value, run_id=run_id or self.run_id, token=self.token)

    def _engine(self) -> str:
        spec = self.store.ctx.config.export(self.export)
        if spec is None or spec.cdc is None:
            raise StateError("RIVET_CLI_USAGE", f"{self.export} is not a CDC export of {self.store.ctx.config.path}: "
                             "it has no position", {"export": self.export})
        return spec.cdc.engine


class StateStore:
    """A state opened by a pipeline. Build with :meth:`open`."""

    def __init__(self, ctx: Context, preflight: Preflight, warnings: list[StateWarning]) -> None:
        self.ctx = ctx
        self.preflight = preflight
        self.warnings = warnings

    @classmethod
    def open(cls, config_path: str | os.PathLike[str], *, state_url: str | None = None,
             env: Mapping[str, str] | None = None, create: bool = False, lock_wait: float = 600.0,
             ttl: int = 30) -> StateStore:
        """Resolve and open the state of the config at ``config_path``.

        ``state_url`` overrides ``RIVET_STATE_URL`` from ``env`` (default: the process
        environment); ``lock_wait`` (seconds) bounds every wait for a lease or lock;
        ``ttl`` (seconds) is the TTL of the PostgreSQL leases this store takes. A missing
        state is ``RIVET_STATE_MISSING`` (SPEC §5a). With ``create`` it is created at
        head, stamped, with warning ``RIVET_STATE_CREATED``, unless the place shows a
        state lived there before (``RIVET_STATE_VANISHED``). Raises every pre-flight
        code; warnings (identity claims, and the CDC checkpoint warnings of SPEC §6, once
        per export) are kept in :attr:`warnings`.
        """
        ctx = Context(Path(config_path), state_url, dict(os.environ if env is None else env), lock_wait,
                      command="runtime", lease_ttl=ttl)
        warnings: list[StateWarning] = []
        backend = ctx.backend()
        if not backend.present():
            warnings += cls._create(ctx, create)
        pf = run_preflight(ctx, for_write=True)
        require(pf)
        if pf.verdict is not None and pf.verdict.writes:  # stamp or adopt: a write of the whole state
            with guarded_write(ctx, WHOLE_STATE, preflight=pf) as session:
                warnings += session.warnings
        elif pf.verdict is not None and pf.verdict.code is not None:
            warnings += [w for w in pf.warnings if w.code == pf.verdict.code]
        return cls(ctx, pf, warnings + checkpoints(ctx).warnings)

    @staticmethod
    def _create(ctx: Context, create: bool) -> list[StateWarning]:
        location = ctx.location
        if not create:
            raise StateError("RIVET_STATE_MISSING",
                             f"no state at {location.display} ({location.scope}): a missing state is never created "
                             "as a side effect; for a new pipeline run statetool init (or open with create=True)",
                             {"path": str(location.path) if location.path else None})
        evidence = ctx.backend().vanished_evidence()
        if evidence:
            raise StateError("RIVET_STATE_VANISHED",
                             f"no state at {location.display}, but a state lived here before: {'; '.join(evidence)}; "
                             "a new empty state here would be a silent first run", {"evidence": evidence})
        try:
            init(ctx)
        except StateError as err:
            # Another task of this pipeline created it meanwhile (first runs started
            # together): open that one; the pre-flight judges it like any state.
            if err.code != "RIVET_STATE_TARGET_NOT_EMPTY":
                raise
            return []
        return [StateWarning("RIVET_STATE_CREATED", f"created a new, empty state at {location.display} "
                             f"({location.scope}): every export starts as a first run")]

    def checkpoint_path(self, export: str) -> Path | None:
        """Where export ``export``'s CDC checkpoint file lives (SPEC §6), through the same
        resolver as ``statetool checkpoints`` and ``doctor``; None when the engine keeps its
        position server-side (postgres) or the export is not a CDC export."""
        spec = self.ctx.config.export(export)
        if spec is None or spec.cdc is None:
            return None
        return resolve_checkpoint(spec.cdc.checkpoint, spec.cdc.engine, self.ctx.location,
                                  self.ctx.config.directory).path

    def stored_position(self, export: str) -> object | None:
        """The position the state holds for CDC export ``export`` (its JSON value), or None
        where it holds no row (or its revision has no position table): never None for a
        row, since a row holding null is ``RIVET_STATE_POSITION_INVALID``
        (:func:`~statetool.operations.probe.decode_position`). Read-only."""
        backend = self.ctx.backend()
        with backend.reading() as conn:
            text = position_text(conn, frozenset(backend.table_names(conn)), export)
        return None if text is None else decode_position(export, text)

    def require_own_checkpoint(self, export: str) -> None:
        """``RIVET_STATE_CHECKPOINT_SHARED`` when CDC export ``export``'s checkpoint file is
        also another CDC export's (the one rule,
        :func:`~statetool.operations.checkpoints.shared_checkpoint`: by device and inode,
        by real path where no file is there), naming both: that file holds the position of
        whichever wrote it last, so reading it would resume one stream from the other's
        position, and a first commit into the state would anchor it there (SPEC §5a, §6).
        Nothing is read or written before it; another export runs on."""
        err = shared_checkpoint(self.ctx, export)
        if err is not None:
            raise err

    @contextmanager
    def guarded(self, held: list[HeldLease]) -> Iterator[WriteSession]:
        """One guarded writing transaction on the opened state (its pre-flight reused),
        fencing ``held`` (the caller's leases) at the start and before the commit."""
        with guarded_write(self.ctx, NO_LEASE, preflight=self.preflight, claim=False, held=held) as session:
            yield session

    @contextmanager
    def run(self, export: str, mode: str) -> Iterator[Run]:
        """Hold export ``export``'s run lease ``chunk-run:<export>`` for the body (waiting up
        to ``lock_wait`` and logging the holder; heartbeats on PostgreSQL), and give the
        run's writes, each fenced by the lease's token. Raises ``RIVET_STATE_LOCK_TIMEOUT``
        (``RIVET_STATE_RUN_IN_PROGRESS`` with ``lock_wait`` 0); released on every exit.
        Refuses a CDC export whose checkpoint file another export shares
        (``RIVET_STATE_CHECKPOINT_SHARED``, :meth:`require_own_checkpoint`) before the lease."""
        self.require_own_checkpoint(export)
        lease = acquire(self.ctx, run_lease_key(export))
        try:
            yield Run(self, export, mode, lease)
        finally:
            lease.release()

    @contextmanager
    def transaction(self) -> Iterator[Writer]:
        """One writing transaction, committed on a clean exit (waits up to ``lock_wait``
        for the write lock, then ``RIVET_STATE_LOCK_TIMEOUT``). Each export it writes is
        guarded by that export's run lease, taken for this transaction and refused at once
        (``RIVET_STATE_RUN_IN_PROGRESS``) while another process holds it, and refused
        ``RIVET_STATE_CHECKPOINT_SHARED`` for a CDC export sharing its checkpoint file
        (:meth:`require_own_checkpoint`)."""
        with ExitStack() as stack:
            held: list[HeldLease] = []
            taken: set[str] = set()

            def guard(export: str) -> None:
                if export in taken:
                    return
                self.require_own_checkpoint(export)
                lease = acquire(self.ctx, run_lease_key(export), busy_code="RIVET_STATE_RUN_IN_PROGRESS",
                                timeout_code="RIVET_STATE_RUN_IN_PROGRESS", deadline=time.monotonic())
                stack.callback(lease.release)
                held.append(lease)
                taken.add(export)

            with self.guarded(held) as session:
                yield Writer(session.conn, guard)
