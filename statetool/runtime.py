"""The API a pipeline runtime uses to keep its progress in a state (the second face).

    store = StateStore.open("rivet.yaml")            # resolve, pre-flight, claim identity
    with store.transaction() as tx:
        run_id = tx.start_run("orders", "incremental")
        tx.commit_cursor("orders", "incremental", "2026-11-30T00:00:00Z")
        tx.finish_run(run_id, "succeeded", rows=1200, files=1)

Opening goes through the same resolver and pre-flight as every statetool command:
a foreign state in a declared directory is refused (``RIVET_STATE_FOREIGN``), a state
with pending revisions is refused (``RIVET_STATE_MIGRATION_PENDING``), a state with
progress and no identity is adopted (warning ``RIVET_STATE_IDENTITY_ADOPTED``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from statetool import schema
from statetool.errors import StateError, StateWarning
from statetool.location import resolve_checkpoint
from statetool.operations.context import Context
from statetool.operations.create import init
from statetool.operations.writes import head_write, now_iso

#: Run statuses a runtime records.
RUN_STATUSES = ("running", "succeeded", "failed", "skipped")


@dataclass
class Writer:
    """Writes of one transaction. Times default to now (ISO-8601 UTC); counts are rows/files."""

    conn: Connection

    def start_run(self, export: str, mode: str, *, run_id: str | None = None, started_at: str | None = None) -> str:
        """Record the start of a run (status ``running``); returns its run id."""
        run_id = run_id or uuid.uuid4().hex
        self.conn.execute(sa.insert(schema.runs).values(
            run_id=run_id, export_name=export, mode=mode, status="running", started_at=started_at or now_iso()))
        return run_id

    def finish_run(self, run_id: str, status: str, *, rows: int = 0, files: int = 0, bytes_read: int = 0,
                   error: str | None = None, error_code: str | None = None, finished_at: str | None = None) -> None:
        """Record the end of a run: ``status`` one of :data:`RUN_STATUSES`, counts in rows,
        files and bytes."""
        if status not in RUN_STATUSES:
            raise ValueError(f"status {status!r} is not one of {RUN_STATUSES}")
        self.conn.execute(sa.update(schema.runs).where(schema.runs.c.run_id == run_id).values(
            status=status, rows=rows, files=files, bytes_read=bytes_read, error=error, error_code=error_code,
            finished_at=finished_at or now_iso()))

    def commit_cursor(self, export: str, mode: str, value: str, *, at: str | None = None) -> None:
        """Commit export ``export``'s incremental cursor ``value``."""
        at = at or now_iso()
        e = schema.exports
        if not self.conn.execute(sa.update(e).where(e.c.export_name == export).values(
                mode=mode, cursor_value=value, cursor_updated_at=at, updated_at=at)).rowcount:
            self.conn.execute(sa.insert(e).values(export_name=export, mode=mode, cursor_value=value,
                                                  cursor_updated_at=at, updated_at=at))

    def record_chunk(self, export: str, run_id: str, index: int, lower: str | None, upper: str | None,
                     status: str, *, rows: int = 0) -> None:
        """Record (or update) chunk ``index`` of a checkpointed run: bounds, status, rows."""
        c = schema.chunks
        key = (c.c.export_name == export) & (c.c.run_id == run_id) & (c.c.chunk_index == index)
        values = {"lower_bound": lower, "upper_bound": upper, "status": status, "rows": rows, "updated_at": now_iso()}
        if not self.conn.execute(sa.update(c).where(key).values(**values)).rowcount:
            self.conn.execute(sa.insert(c).values(export_name=export, run_id=run_id, chunk_index=index, **values))


class StateStore:
    """A state opened by a pipeline. Build with :meth:`open`."""

    def __init__(self, ctx: Context, warnings: list[StateWarning]) -> None:
        self.ctx = ctx
        self.warnings = warnings

    @classmethod
    def open(cls, config_path: str | os.PathLike[str], *, state_url: str | None = None,
             env: Mapping[str, str] | None = None, create: bool = True, lock_wait: float = 600.0) -> StateStore:
        """Resolve and open the state of the config at ``config_path``.

        ``state_url`` overrides ``RIVET_STATE_URL`` from ``env`` (default: the process
        environment). With ``create``, a missing state is created at head, stamped (what
        a pipeline's first run does); without it, ``RIVET_STATE_MISSING``. Raises every
        pre-flight code; warnings (identity claims, and the CDC checkpoint warnings of SPEC
        §6, once per export) are kept in :attr:`warnings`.
        """
        ctx = Context(Path(config_path), state_url, dict(os.environ if env is None else env), lock_wait,
                      command="runtime")
        if create and not ctx.backend().present():
            try:
                init(ctx)
            except StateError as err:
                # Another task of this pipeline created it meanwhile (first runs started
                # together): open that one; the pre-flight below judges it like any state.
                if err.code != "RIVET_STATE_TARGET_NOT_EMPTY":
                    raise
        from statetool.operations.checkpoints import checkpoints

        with head_write(ctx, backup_label=None) as session:
            warnings = session.warnings
        # SPEC §6: once per CDC export at run start (RIVET_STATE_CHECKPOINT_RELATIVE, ...).
        return cls(ctx, warnings + checkpoints(ctx).warnings)

    def checkpoint_path(self, export: str) -> Path | None:
        """Where export ``export``'s CDC checkpoint file lives (SPEC §6), through the same
        resolver as ``statetool checkpoints`` and ``doctor``; None when the engine keeps its
        position server-side (postgres) or the export is not a CDC export."""
        spec = self.ctx.config.export(export)
        if spec is None or spec.cdc is None:
            return None
        return resolve_checkpoint(spec.cdc.checkpoint, spec.cdc.engine, self.ctx.location,
                                  self.ctx.config.directory).path

    @contextmanager
    def transaction(self) -> Iterator[Writer]:
        """One writing transaction, committed on a clean exit (waits up to ``lock_wait``,
        then ``RIVET_STATE_LOCK_TIMEOUT``)."""
        with self.ctx.backend().writing("RIVET_STATE_LOCK_TIMEOUT") as conn:
            yield Writer(conn)
