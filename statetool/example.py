"""Build a state the way an old rivet release left it: the *legacy* shape (revision 0001's
tables, no version table), rollback-journal mode, with run history, cursors and chunk
checkpoints. Used by the bundled example, the tests and the benchmarks.

    python -m statetool.example --config examples/rivet.yaml --runs 5000
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from statetool import migrations, schema
from statetool.config import load_config
from statetool.location import STATE_FILE

_BASE = datetime(2026, 1, 1, tzinfo=UTC)


def _iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def create_legacy_schema(path: Path) -> None:
    """Create revision 0001's tables in a new SQLite file at ``path`` and no version table."""
    if path.exists():
        raise FileExistsError(path)
    engine = sa.create_engine("sqlite://", creator=lambda: sqlite3.connect(path), poolclass=NullPool)
    with engine.begin() as conn:
        migrations.apply(conn, migrations.revisions()[0].id, None, "up")
        conn.exec_driver_sql(f"DROP TABLE {schema.VERSION_TABLE}")
    engine.dispose()


def build_legacy_state(path: Path, exports: list[tuple[str, str]], runs: int, seed: int = 7) -> dict[str, int]:
    """Write a legacy state with ``runs`` runs spread over ``exports`` (``(name, mode)`` pairs).

    Every 17th run failed; incremental exports get a cursor, chunked exports the ten
    chunk checkpoints of their last run. Returns ``{table: rows}`` written.
    """
    create_legacy_schema(path)
    rng = random.Random(seed)
    run_rows: list[tuple[object, ...]] = []
    last: dict[str, tuple[str, datetime]] = {}
    for i in range(runs):
        name, mode = exports[i % len(exports)]
        started = _BASE + timedelta(minutes=i)
        failed = i % 17 == 16
        run_id = f"r{i:09d}"
        run_rows.append((run_id, name, mode, "failed" if failed else "succeeded", _iso(started),
                         _iso(started + timedelta(seconds=30)), 0 if failed else rng.randint(1, 50_000),
                         0 if failed else 1, "connection reset by peer" if failed else None))
        if not failed:
            last[name] = (run_id, started)
    export_rows, chunk_rows = [], []
    for name, mode in exports:
        run_id, started = last.get(name, (None, _BASE))
        cursor = _iso(started) if mode == "incremental" and run_id else None
        export_rows.append((name, mode, cursor, _iso(started) if cursor else None, _iso(started)))
        if mode == "chunked" and run_id:
            chunk_rows += [(name, run_id, k, str(k * 100_000), str((k + 1) * 100_000), "done", 100_000, _iso(started))
                           for k in range(10)]
    db = sqlite3.connect(path)
    with db:
        db.executemany("INSERT INTO rivet_runs VALUES (?,?,?,?,?,?,?,?,?)", run_rows)
        db.executemany("INSERT INTO rivet_exports VALUES (?,?,?,?,?)", export_rows)
        db.executemany("INSERT INTO rivet_chunks VALUES (?,?,?,?,?,?,?,?)", chunk_rows)
    db.close()
    return {"rivet_runs": len(run_rows), "rivet_exports": len(export_rows), "rivet_chunks": len(chunk_rows)}


def main(argv: list[str] | None = None) -> None:
    """Build the legacy state beside ``--config`` (or at ``--path``) and its CDC checkpoints."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="rivet.yaml")
    parser.add_argument("--runs", type=int, default=5000)
    parser.add_argument("--path", help=f"the state file (default: {STATE_FILE} beside the config)")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    path = Path(args.path) if args.path else config.directory / STATE_FILE
    written = build_legacy_state(path, [(e.name, e.mode) for e in config.exports], args.runs)
    for export in config.exports:
        if export.cdc and export.cdc.checkpoint and not Path(export.cdc.checkpoint).is_absolute():
            checkpoint = config.directory / export.cdc.checkpoint
            checkpoint.parent.mkdir(parents=True, exist_ok=True)
            checkpoint.write_text(json.dumps({"file": "mysql-bin.000042", "pos": 91_234}) + "\n")
    print(f"built a legacy state at {path}: " + ", ".join(f"{n} {t}" for t, n in written.items()))


if __name__ == "__main__":
    main()
