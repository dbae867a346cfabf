"""States with run history to prune (tests/test_prune.py), on either backend: the rows a
pipeline's runs leave, what each table holds (to compare before and after), the archive
``prune --archive`` writes read back, and a live run that commits its cursor in a loop
and measures how long each commit took (:func:`live_writer`, run in a process of its own).
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from statetool import schema
from statetool.operations.context import Context
from statetool.runtime import StateStore

#: Every table ``prune`` must leave as it was, whatever it removes.
UNTOUCHED = ("rivet_exports", "rivet_chunks", "rivet_cdc_positions", "rivet_run_aggregates")
#: The tables ``prune`` removes from, with the column that tells their rows apart.
PRUNED = {"rivet_runs": "run_id", "rivet_load_ledger": "id"}


def stamp(day: int, second: int = 0) -> str:
    """The state's time text of day ``day`` of 2025 (1-based, up to 365) at ``second``."""
    return time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime(1735689600 + (day - 1) * 86400 + second))


def store_of(config: Path, env: dict[str, str]) -> StateStore:
    """The state of ``config`` opened through the runtime API (created where none is)."""
    return StateStore.open(config, env=env, create=True)


def bulk_history(config: Path, env: dict[str, str], export: str, runs: int, ledger: int, *, first_day: int = 1,
                 mode: str = "incremental", prefix: str | None = None) -> None:
    """Insert ``runs`` finished runs (two in three succeeded, the rest failed) and ``ledger``
    load-ledger rows of ``export``, from the start of day ``first_day`` on: a run starting
    every hour (finished half an hour later), a ledger row loaded each hour at half past; in
    one transaction on the state's own writer (many rows at once, as a long history is).
    Run ids are ``<prefix>-<n>`` (``prefix`` default ``export``: another call for one export
    names another prefix)."""
    ctx = Context(config, None, env)
    with ctx.backend().writing("RIVET_STATE_LOCK_TIMEOUT") as conn:
        if runs:
            conn.execute(sa.insert(schema.runs), [
                {"run_id": f"{prefix or export}-{i:07d}", "export_name": export, "mode": mode,
                 "status": "failed" if i % 3 == 2 else "succeeded", "started_at": stamp(first_day, i * 3600),
                 "finished_at": stamp(first_day, i * 3600 + 1800), "rows": i, "files": 1, "error": None,
                 "bytes_read": i * 10, "duration_ms": 30_000, "error_code": None} for i in range(runs)])
        if ledger:
            conn.execute(sa.insert(schema.load_ledger), [
                {"export_name": export, "table_name": f"{export}_t", "part": f"part-{i:07d}", "rows": i,
                 "loaded_at": stamp(first_day, i * 3600 + 1800)} for i in range(ledger)])


def table_rows(config: Path, env: dict[str, str]) -> dict[str, dict[Any, dict[str, Any]]]:
    """``{table: {key: row as {column: value}}}`` of the pruned tables (keyed by
    :data:`PRUNED`) and of :data:`UNTOUCHED` (keyed by the row's position, sorted), read
    read-only through the state's own reader."""
    backend = Context(config, None, env).backend()
    out: dict[str, dict[Any, dict[str, Any]]] = {}
    with backend.reading() as conn:
        for table in (*PRUNED, *UNTOUCHED):
            columns = list(schema.metadata.tables[table].columns.keys())
            rows = [dict(zip(columns, row, strict=True)) for row in conn.rows(
                f"SELECT {', '.join(columns)} FROM {table} ORDER BY {', '.join(columns[:3])}")]
            key = PRUNED.get(table)
            out[table] = {row[key] if key else i: row for i, row in enumerate(rows)}
    return out


def committed_batches(config: Path, env: dict[str, str]) -> set[tuple[str, int]]:
    """``{(prune id, batch number)}`` of every batch a prune committed: its ``prune`` audit
    row (written in the batch's own transaction), read read-only."""
    backend = Context(config, None, env).backend()
    with backend.reading() as conn:
        details = [json.loads(r[0]) for r in conn.rows("SELECT detail FROM rivet_audit WHERE action = 'prune'")]
    return {(d["prune_id"], d["batch"]) for d in details}


def read_archive(path: Path, committed: set[tuple[str, int]], *,
                 cut_short: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """``[(table, row)]`` of an archive, member by member, keeping only the lines of a batch
    in ``committed`` (:func:`committed_batches`: a batch archived whose commit never came, a
    kill between the two, removed nothing); with ``cut_short``, a last member a kill cut
    short (its batch never committed) is read up to where it ends, as ``zcat`` does, and
    what it holds is left out."""
    data = path.read_bytes()
    found: list[tuple[str, dict[str, Any]]] = []
    while data:
        inflate = zlib.decompressobj(zlib.MAX_WBITS | 16)
        try:
            text = inflate.decompress(data)
        except zlib.error:
            assert cut_short, f"{path}: a damaged member"
            break
        if not inflate.eof:
            assert cut_short, f"{path}: a member cut short"
            break
        found += [(obj["table"], obj["row"]) for obj in map(json.loads, text.decode().splitlines())
                  if (obj["prune"], obj["batch"]) in committed]
        data = inflate.unused_data
    if not cut_short:
        with gzip.open(path, "rt") as fh:  # what an operator reads it with says the same
            assert [(o["table"], o["row"]) for o in map(json.loads, fh) if (o["prune"], o["batch"]) in committed] \
                == found
    return found


def live_writer(argv: list[str]) -> int:
    """``CONFIG OUT STOP``: a live run of export orders (its run lease held for the whole
    run, through the runtime API) that commits its cursor in a loop until the file ``STOP``
    exists, then writes to ``OUT`` the JSON ``{"latencies": [seconds per commit], "last":
    last cursor}``. Writes ``OUT.ready`` once the lease is held."""
    config, out, stop = argv
    export = "orders"
    store = StateStore.open(config, env=dict(os.environ))
    latencies: list[float] = []
    with store.run(export, "incremental") as run:
        Path(f"{out}.ready").write_text("1")
        i = 0
        while not os.path.exists(stop):
            i += 1
            began = time.monotonic()
            run.commit_cursor(f"{i:09d}")
            latencies.append(time.monotonic() - began)
            time.sleep(0.005)
    Path(out).write_text(json.dumps({"latencies": latencies, "last": f"{i:09d}"}))
    return 0


if __name__ == "__main__":
    sys.exit(live_writer(sys.argv[1:]))
