"""History retention: ``statetool prune --keep-runs 100`` of a state with 1,000,000 runs (and
250,000 load-ledger rows) over 4 exports vs the same rows removed by a plain ``DELETE`` in
the ``sqlite3`` shell, one transaction (goals: ratio <= GOAL, peak RSS < 150 MiB), and the
longest wait of a live run beside a prune (goal: < 1 s, issue 16's bound).

The state: created at head by the runtime API (``StateStore.open``, WAL mode, identity
stamped), then filled in bulk inside SQLite (recursive CTEs): runs an hour apart per
export, two in three succeeded, a ledger row per run of a quarter of them. Built once; each
measured run starts from a fresh copy (untimed). statetool removes in batches of 1000 rows,
each its own transaction with an audit row, under each export's run lease, and keeps the
latest succeeded run of each export; the peer's two ``DELETE``s remove the runs beyond the
100 newest of each export and the ledger rows loaded before the oldest of those started,
the same rows but for that one run.

The live run: a process holding export ``live``'s run lease commits its cursor in a loop
through the runtime API while one more statetool prune (not timed in the table) runs; the
longest of its commits is printed. Beside the live run the prune leaves the write lock free
between its batches (docs/decisions.md, "prune"), so it takes longer than alone.

    .venv/bin/python bench/bench_prune.py [-n 3] [--runs 1000000]
    .venv/bin/python bench/bench_prune.py --runs 200000 -n 3     # quick run, ~1 min idle
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (Case, Row, compile_packages, header, measure, measured_env, parse_args, print_table,  # noqa: E402
                      ratio_row, run_child)

GOAL = 10.0
KEEP = 100
EXPORTS = ("orders", "order_lines", "customers", "live")
STATE = ".rivet_state.db"
CONFIG = "exports:\n" + "".join(f"  - name: {name}\n    mode: incremental\n" for name in EXPORTS)

#: argv: config, runs. The runtime API creates the state; SQLite fills it.
BUILD = r'''
import sqlite3, sys
from statetool.runtime import StateStore
config, runs = sys.argv[1], int(sys.argv[2])
StateStore.open(config, env={}, create=True)
db = sqlite3.connect(config.rsplit("/", 1)[0] + "/.rivet_state.db")
exports = ["orders", "order_lines", "customers", "live"]
per = runs // len(exports)
with db:
    for e in exports:
        db.execute("""WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i + 1 < ?)
            INSERT INTO rivet_runs (run_id, export_name, mode, status, started_at, finished_at, rows, files)
            SELECT printf('%s-%08d', ?, i), ?, 'incremental', CASE WHEN i % 3 = 2 THEN 'failed' ELSE 'succeeded' END,
                   strftime('%Y-%m-%dT%H:%M:%S.000000Z', 1600000000 + i * 3600, 'unixepoch'),
                   strftime('%Y-%m-%dT%H:%M:%S.000000Z', 1600000000 + i * 3600 + 1800, 'unixepoch'), i, 1
            FROM n""", (per, e, e))
        db.execute("""WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 4 FROM n WHERE i + 4 < ?)
            INSERT INTO rivet_load_ledger (export_name, table_name, part, rows, loaded_at)
            SELECT ?, ? || '_t', printf('part-%08d', i), i,
                   strftime('%Y-%m-%dT%H:%M:%S.000000Z', 1600000000 + i * 3600 + 1700, 'unixepoch') FROM n""",
                   (per, e, e))
db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
db.close()
'''

#: The peer: the same removal as plain SQL, one transaction.
PEER_SQL = f"""
BEGIN;
CREATE TEMP TABLE kept AS SELECT export_name, min(started_at) AS oldest FROM (
  SELECT export_name, started_at, row_number() OVER (PARTITION BY export_name
                                                     ORDER BY started_at DESC, run_id DESC) AS n
  FROM rivet_runs) WHERE n <= {KEEP} GROUP BY export_name;
DELETE FROM rivet_runs WHERE run_id IN (SELECT run_id FROM (SELECT run_id, row_number() OVER (
  PARTITION BY export_name ORDER BY started_at DESC, run_id DESC) AS n FROM rivet_runs) WHERE n > {KEEP});
DELETE FROM rivet_load_ledger WHERE loaded_at < (SELECT oldest FROM kept WHERE kept.export_name =
  rivet_load_ledger.export_name);
COMMIT;
"""

#: argv: config, out, stop. A live run of export ``live``, committing its cursor in a loop.
LIVE = r'''
import json, os, sys, time
from statetool.runtime import StateStore
config, out, stop = sys.argv[1:]
store = StateStore.open(config, env={})
waits = []
with store.run("live", "incremental") as run:
    open(out + ".ready", "w").close()
    i = 0
    while not os.path.exists(stop):
        i += 1
        began = time.monotonic()
        run.commit_cursor(str(i))
        waits.append(time.monotonic() - began)
        time.sleep(0.005)
json.dump({"commits": len(waits), "longest": max(waits)}, open(out, "w"))
'''


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], 3, lambda p: p.add_argument("--runs", type=int, default=1_000_000))
    if shutil.which("sqlite3") is None:
        raise SystemExit("the sqlite3 shell is needed for the peer (apt-get install sqlite3)")
    compiled = compile_packages(args.python)
    header(f"bench_prune: prune --keep-runs {KEEP} of {args.runs:,} runs vs a plain DELETE in sqlite3", args,
           compiled)
    root = Path(tempfile.mkdtemp(prefix="bench-prune-"))
    try:
        template, work = root / "template", root / "work"
        template.mkdir()
        (template / "rivet.yaml").write_text(CONFIG)
        built = run_child([args.python, "-c", BUILD, str(template / "rivet.yaml"), str(args.runs)], env=measured_env())
        if built.returncode:
            raise SystemExit(built.stderr)
        size = (template / STATE).stat().st_size
        print(f"state: {size / 2**20:.0f} MiB, {args.runs:,} runs, {args.runs // 4:,} ledger rows, {len(EXPORTS)} "
              "exports")

        def fresh() -> None:
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(template, work)

        statetool = str(args.bin / "statetool")
        env = measured_env()
        case = Case(f"prune --keep-runs {KEEP}",
                    lambda: run_child([statetool, "-c", str(work / "rivet.yaml"), "--json", "prune", "--keep-runs",
                                       str(KEEP)], env=env),
                    lambda: run_child(["sqlite3", str(work / STATE)], stdin=PEER_SQL, env=env),
                    GOAL, prepare_statetool=fresh, prepare_peer=fresh)
        measure([case], args.repeat)
        rows: list[Row] = [ratio_row(case)]
        fresh()
        out, stop = root / "live.json", root / "stop"
        live = subprocess.Popen([args.python, "-c", LIVE, str(work / "rivet.yaml"), str(out), str(stop)], env=env)
        while not Path(f"{out}.ready").exists():
            time.sleep(0.02)
        beside = run_child([statetool, "-c", str(work / "rivet.yaml"), "--json", "prune", "--keep-runs", str(KEEP)],
                           env=env)
        stop.write_text("1")
        live.wait(60)
        waits = json.loads(out.read_text())
        if beside.returncode:
            raise SystemExit(f"prune beside the live run failed ({beside.returncode}): {beside.stderr}")
        pruned = json.loads(beside.stdout)
        ok = beside.returncode == 0 and waits["longest"] < 1.0
        rows.append(Row("live run beside a prune", f"{beside.seconds:.3f} s", "-", "-",
                        "longest commit < 1 s", "PASS" if ok else "FAIL", f"{beside.max_rss_kib / 1024:.0f} MiB"))
        print_table(rows, f"prune ({case.median('statetool'):.1f} s alone; beside the live run "
                          f"{beside.seconds:.1f} s, {pruned['batches']} batches, {waits['commits']} commits of the "
                          f"live run, the longest {waits['longest'] * 1000:.0f} ms)")
        return 0 if all(r.result == "PASS" for r in rows) else 1
    finally:
        if args.keep:
            print(f"kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
