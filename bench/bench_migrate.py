"""Upgrade cost: ``statetool migrate`` of a legacy state with --runs runs (default 1,000,000)
vs the same upgrade as plain SQL in the ``sqlite3`` shell, one transaction (goals, issue 13:
ratio <= 0.7, statetool's result file no larger than the peer's, statetool's peak RSS < 150 MiB).

The legacy state is built once with statetool.example.build_legacy_state (the exports of
examples/rivet.yaml) and copied afresh before every run of either side, so both always
start from byte-identical files (and both files are in the page cache after the copy).
The peer is what revisions 0001 -> 0004 amount to on SQLite (see UPGRADE_SQL below): the
version table, the rebuild of rivet_runs that alembic's batch mode does (CREATE new /
INSERT ... SELECT / DROP / RENAME), the index, the four new tables and the version row (0004 adds nothing on SQLite).
After the runs the two results are compared table by table (columns, types, defaults,
NOT NULL, keys, indexes, row counts, revision) to prove the peer does the same upgrade.

    .venv/bin/python bench/bench_migrate.py [--runs 1000000] [-n 3]
    .venv/bin/python bench/bench_migrate.py --runs 100000 -n 3      # quick run
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (REPO, Case, Row, Run, compile_packages, header, measure, measured_env, parse_args,  # noqa: E402
                      print_table, ratio_row, run_child)

GOAL = 0.7
RSS_GOAL_MIB = 150

#: Revisions 0001 -> 0004 on SQLite (0004 changes only PostgreSQL's lease table), as plain SQL (the DDL alembic emits, same types and
#: defaults), in one transaction. synchronous = FULL as statetool's writer sets it.
UPGRADE_SQL = """\
PRAGMA synchronous = FULL;
BEGIN IMMEDIATE;
CREATE TABLE rivet_state_version (
    version_num VARCHAR(32) NOT NULL,
    CONSTRAINT rivet_state_version_pkc PRIMARY KEY (version_num)
);
-- 0002: rivet_runs rebuilt (rows/files BIGINT, three new columns), as alembic batch mode does
CREATE TABLE _new_rivet_runs (
    run_id TEXT NOT NULL,
    export_name TEXT NOT NULL,
    mode TEXT NOT NULL,
    status TEXT NOT NULL,
    started_at TEXT NOT NULL,
    finished_at TEXT,
    rows BIGINT DEFAULT '0' NOT NULL,
    files BIGINT DEFAULT '0' NOT NULL,
    error TEXT,
    bytes_read BIGINT DEFAULT '0' NOT NULL,
    duration_ms BIGINT,
    error_code TEXT,
    PRIMARY KEY (run_id)
);
INSERT INTO _new_rivet_runs (run_id, export_name, mode, status, started_at, finished_at, rows, files, error)
    SELECT run_id, export_name, mode, status, started_at, finished_at, rows, files, error FROM rivet_runs;
DROP TABLE rivet_runs;
ALTER TABLE _new_rivet_runs RENAME TO rivet_runs;
CREATE INDEX ix_rivet_runs_export_started ON rivet_runs (export_name, started_at);
CREATE TABLE rivet_run_aggregates (
    run_id TEXT NOT NULL, config_path TEXT, started_at TEXT NOT NULL, finished_at TEXT,
    status TEXT NOT NULL, details_json TEXT, PRIMARY KEY (run_id)
);
CREATE TABLE rivet_load_ledger (
    id INTEGER NOT NULL, export_name TEXT NOT NULL, table_name TEXT NOT NULL, part TEXT NOT NULL,
    rows BIGINT DEFAULT '0' NOT NULL, loaded_at TEXT, PRIMARY KEY (id)
);
-- 0003: identity and audit
CREATE TABLE rivet_identity (
    id INTEGER NOT NULL, state_key TEXT NOT NULL, recorded_at TEXT NOT NULL, recorded_by TEXT NOT NULL,
    PRIMARY KEY (id), CONSTRAINT ck_rivet_identity_single_row CHECK (id = 1)
);
CREATE TABLE rivet_audit (
    id INTEGER NOT NULL, at TEXT NOT NULL, actor TEXT NOT NULL, command TEXT NOT NULL,
    action TEXT NOT NULL, detail TEXT NOT NULL, PRIMARY KEY (id)
);
INSERT INTO rivet_state_version (version_num) VALUES ('0004');
COMMIT;
"""

BUILD = """\
import sys
from pathlib import Path
from statetool.config import load_config
from statetool.example import build_legacy_state
config = load_config(sys.argv[1])
print(build_legacy_state(Path(sys.argv[2]), [(e.name, e.mode) for e in config.exports], int(sys.argv[3])))
"""


def shape(path: Path) -> dict[str, object]:
    """What the upgrade is judged by: per table its columns (name, declared type, NOT NULL,
    default, pk position), its indexes (name, columns, unique) and rows; the revision."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                           "AND name NOT LIKE 'sqlite_%' ORDER BY name")]
        out: dict[str, object] = {}
        for t in tables:
            cols = [(r[1], r[2].upper(), r[3], r[4], r[5]) for r in db.execute(f'PRAGMA table_info("{t}")')]
            indexes = sorted((r[1] if not r[1].startswith("sqlite_autoindex") else "(autoindex)", r[2],
                              tuple(c[2] for c in db.execute(f'PRAGMA index_info("{r[1]}")')))
                             for r in db.execute(f'PRAGMA index_list("{t}")'))
            rows = db.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0]
            out[t] = {"columns": cols, "indexes": indexes,
                      "rows": rows if t not in ("rivet_identity", "rivet_audit") else "(written by statetool)"}
        out["revision"] = db.execute("SELECT version_num FROM rivet_state_version").fetchall()
        out["integrity"] = db.execute("PRAGMA quick_check").fetchone()[0]
        return out
    finally:
        db.close()


def mib(kib: float) -> str:
    return f"{kib / 1024:.0f} MiB"


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], repeat=3, extra=lambda p: p.add_argument(
        "--runs", type=int, default=1_000_000, help="runs in the legacy state (default 1,000,000)"))
    compiled = compile_packages(args.python)
    header(f"bench_migrate: statetool migrate vs plain SQL in sqlite3, legacy state with {args.runs:,} runs",
           args, compiled)
    sqlite_shell = shutil.which("sqlite3")
    if sqlite_shell is None:
        raise SystemExit("the sqlite3 shell is not installed (apt-get install sqlite3)")
    version = subprocess.run([sqlite_shell, "--version"], capture_output=True, text=True).stdout.split()[0]
    lib = subprocess.run([args.python, "-c", "import sqlite3; print(sqlite3.sqlite_version)"], capture_output=True,
                         text=True).stdout.strip()
    print(f"SQLite: shell {version}, python's sqlite3 module {lib}")
    env = measured_env()
    statetool = str(args.bin / "statetool")
    tmp_obj = tempfile.TemporaryDirectory(prefix="statetool-bench-migrate-")
    tmp = Path(tmp_obj.name)
    try:
        legacy = tmp / "legacy.db"
        started = time.perf_counter()
        subprocess.run([args.python, "-c", BUILD, str(REPO / "examples" / "rivet.yaml"), str(legacy), str(args.runs)],
                       check=True, env=env, capture_output=True)
        print(f"built the legacy state in {time.perf_counter() - started:.1f} s (not measured): "
              f"{legacy.stat().st_size / 2**20:.1f} MiB")
        st_dir, peer_dir = tmp / "statetool", tmp / "peer"
        st_dir.mkdir()
        peer_dir.mkdir()
        shutil.copyfile(REPO / "examples" / "rivet.yaml", st_dir / "rivet.yaml")
        st_state, peer_state = st_dir / ".rivet_state.db", peer_dir / "state.db"

        def fresh_statetool() -> None:
            for p in st_dir.glob(".rivet_state.*"):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            shutil.copyfile(legacy, st_state)

        def fresh_peer() -> None:
            for p in peer_dir.iterdir():
                p.unlink()
            shutil.copyfile(legacy, peer_state)

        def check(side: str, run: Run) -> None:
            if side == "statetool":
                doc = json.loads(run.stdout)
                if not doc.get("applied"):
                    raise SystemExit(f"statetool migrate did not apply: {doc.get('message')}")

        case = Case("migrate", lambda: run_child([statetool, "-c", str(st_dir / "rivet.yaml"), "--json", "migrate"],
                                                 cwd=st_dir, env=env),
                    lambda: run_child([sqlite_shell, "-bail", str(peer_state)], cwd=peer_dir, env=env,
                                      stdin=UPGRADE_SQL),
                    GOAL, prepare_statetool=fresh_statetool, prepare_peer=fresh_peer, check=check)
        measure([case], args.repeat, warmup=0)
        # The last run of each side is still on disk: prove they did the same upgrade.
        st_shape, peer_shape = shape(st_state), shape(peer_state)
        same = st_shape == peer_shape
        sizes = {"legacy": legacy.stat().st_size, "statetool": st_state.stat().st_size,
                 "peer": peer_state.stat().st_size,
                 "backup": sum(p.stat().st_size for p in st_dir.glob(".rivet_state.db.backup-*"))}
        if not same:
            for key in sorted(set(st_shape) | set(peer_shape)):
                if st_shape.get(key) != peer_shape.get(key):
                    print(f"  differs: {key}: statetool {st_shape.get(key)} / peer {peer_shape.get(key)}")
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            tmp_obj.cleanup()
    rss_st, rss_peer = max(case.rss["statetool"]), max(case.rss["peer"])
    rss_ok = rss_st < RSS_GOAL_MIB * 1024
    size_ok = sizes["statetool"] <= sizes["peer"]
    rows = [ratio_row(case),
            Row("peak RSS (max of runs)", mib(rss_st), mib(rss_peer), "-", f"statetool < {RSS_GOAL_MIB} MiB",
                "PASS" if rss_ok else "FAIL"),
            Row("result file size", mib(sizes["statetool"] / 1024), mib(sizes["peer"] / 1024),
                f"{sizes['statetool'] / sizes['peer']:.2f}", "not larger than the peer's",
                "PASS" if size_ok else "FAIL")]
    print_table(rows, f"migrate legacy -> head, {args.runs:,} runs (medians of {args.repeat}; "
                      "peer = sqlite3 shell, plain SQL, one transaction)")
    print(f"statetool peak RSS per run: {', '.join(mib(k) for k in case.rss['statetool'])} "
          f"(median {mib(statistics.median(case.rss['statetool']))})")
    print(f"state file: legacy {sizes['legacy'] / 2**20:.1f} MiB; after statetool {sizes['statetool'] / 2**20:.1f} MiB "
          f"(+ backup {sizes['backup'] / 2**20:.1f} MiB); after plain SQL {sizes['peer'] / 2**20:.1f} MiB")
    print(f"results equivalent (tables, columns, types, defaults, keys, indexes, rows, revision): "
          f"{'yes' if same else 'NO'}; quick_check: statetool {st_shape['integrity']}, peer {peer_shape['integrity']}")
    return 0 if same and rss_ok and size_ok and case.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
