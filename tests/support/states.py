"""States built the way a pipeline leaves them, for the tests of ``doctor`` and of the
setup guides: progress recorded through the runtime API, a legacy file an old release
left, the ``-wal``/``-shm`` of another copy beside a state.

Run as a module, it records that progress for the pipeline a shell is in, as the
pipeline's runs would (a guide's test calls it where the guide says the pipeline ran):
``python -m support.states CONFIG`` (the state that ``RIVET_STATE_URL`` names, or the
one beside ``CONFIG``; the CDC checkpoint written beside ``CONFIG``).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

from statetool.example import build_legacy_state
from statetool.location import STATE_FILE
from statetool.runtime import StateStore

#: The CDC position a built state's checkpoint file holds.
POSITION = {"file": "mysql-bin.000042", "pos": 91234}
#: The cursor of export ``orders`` in a built state.
CURSOR = "2026-10-31T23:59:59Z"
#: When the built state's runs finished: an hour ago, so every age doctor reports is positive.
FINISHED = (datetime.now(UTC) - timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
STARTED = (datetime.now(UTC) - timedelta(hours=2)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def build_state(config: Path, state_url: str | None = None, *, checkpoint_dir: Path | None = None,
                only: tuple[str, ...] = ("orders", "order_lines", "order_events"),
                env: dict[str, str] | None = None) -> None:
    """Create the state (like a pipeline's first run) and record progress through the runtime
    API: orders a cursor, order_lines a chunked run interrupted after chunk 0, order_events a
    CDC run with its checkpoint file written into ``checkpoint_dir`` (None: no file)."""
    store = StateStore.open(config, state_url=state_url, env=env or {}, create=True)
    with store.transaction() as tx:
        if "orders" in only:
            run = tx.start_run("orders", "incremental", started_at=STARTED)
            tx.commit_cursor("orders", "incremental", CURSOR, at=FINISHED)
            tx.finish_run(run, "succeeded", rows=120, files=1, finished_at=FINISHED)
        if "order_lines" in only:
            run = tx.start_run("order_lines", "chunked", started_at=STARTED)
            tx.record_chunk("order_lines", run, 0, "0", "100000", "done", rows=100000)
            tx.record_chunk("order_lines", run, 1, "100000", "200000", "pending")
        if "order_events" in only:
            run = tx.start_run("order_events", "cdc", started_at=STARTED)
            tx.finish_run(run, "succeeded", rows=7, finished_at=FINISHED)
    if checkpoint_dir is not None:
        write_checkpoint(checkpoint_dir / "checkpoints" / "order_events.json", json.dumps(POSITION))


def add_runs(path: Path, rows: int) -> None:
    """Insert ``rows`` finished runs of export ``orders`` into the SQLite state at ``path``
    (directly: a state big enough that copying or moving it takes a while), then fold its
    WAL into the file."""
    db = sqlite3.connect(path)
    with db:
        db.executemany("INSERT INTO rivet_runs (run_id, export_name, mode, status, started_at, finished_at, rows) "
                       "VALUES (?, 'orders', 'incremental', 'succeeded', ?, ?, ?)",
                       ((f"r{i:07d}", f"2026-01-01T00:00:{i % 60:02d}Z", "2026-01-01T01:00:00Z", i)
                        for i in range(rows)))
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()


def write_checkpoint(path: Path, body: str) -> Path:
    """Write ``body`` at ``path`` (its directories created); returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    return path


def rollback_journal_state(config: Path) -> Path:
    """A state in rollback-journal mode beside ``config``: the legacy file an old release
    left (60 runs), with its CDC checkpoint; returns the state's path."""
    path = config.parent / STATE_FILE
    build_legacy_state(path, [("orders", "incremental"), ("order_lines", "chunked"), ("order_events", "cdc")], 60)
    write_checkpoint(config.parent / "checkpoints" / "order_events.json", json.dumps(POSITION))
    return path


def orphan_wal_beside(path: Path, scratch: Path) -> None:
    """Copy the -wal/-shm of another WAL-mode database (with committed frames) beside ``path``,
    as a restore that copies the wrong files does."""
    other = scratch / STATE_FILE
    scratch.mkdir(parents=True, exist_ok=True)
    writer = sqlite3.connect(other)
    try:
        writer.execute("PRAGMA journal_mode=wal")
        writer.execute("PRAGMA wal_autocheckpoint=0")
        writer.execute("CREATE TABLE rivet_exports (export_name TEXT PRIMARY KEY, mode TEXT)")
        writer.execute("INSERT INTO rivet_exports VALUES ('orders', 'full')")
        writer.commit()
        shutil.copyfile(f"{other}-wal", f"{path}-wal")
        shutil.copyfile(f"{other}-shm", f"{path}-shm")
    finally:
        writer.close()


if __name__ == "__main__":
    _config = Path(sys.argv[1]).resolve()
    build_state(_config, os.environ.get("RIVET_STATE_URL") or None, checkpoint_dir=_config.parent)
