"""Lease cost: acquire+release of an uncontended lease on SQLite and PostgreSQL, and listing
10,000 leases on PostgreSQL (issue #3: ratio <= 3 against each peer; listing < 1 s).

    .venv/bin/python bench/bench_leases.py [-n 20] [--ops 2000] [--pg-ops 400]

What is timed, side by side in the same run (sides alternated every round, one warm-up of
each not counted):

SQLite, goal row: ``statetool leases run --export bench -- true`` vs ``flock FILE true``,
both as child processes, wall time from spawn to exit. Each takes a lock, runs ``true``
under it and releases it: the same job, the way a cron line uses it. Informational rows
split the statetool side: the library's ``acquire(ctx, key, cmd)`` + ``release()``
in-process per operation (no interpreter start), the interpreter floor
(``python -c pass``) and ``statetool --version``; and, when the goal is missed, the
import-time profile of the command (``python -X importtime``).

PostgreSQL, goal row: the library's ``acquire(ctx, key, cmd)`` + ``release()`` in-process
per operation vs one bare ``INSERT … ON CONFLICT (key) DO NOTHING`` round trip on an open
psycopg connection (autocommit), same server, same table. Informational rows: the
library's ``RowLeases.try_acquire`` + ``release`` on a store built once (no engine per
call), and a peer that connects per operation (``psycopg.connect`` + INSERT … ON CONFLICT
+ DELETE + close), the floor of a client without a pool. When the goal is missed, a
cProfile of the library side is printed.

Listing, goal row: ``statetool --json leases`` as a child process with 10,000 rows in
``rivet_leases`` (inserted directly: a third live on this host, a third live on other
hosts, a third stale), goal < 1 s; peer for reference: ``psql --csv`` selecting the same
rows. The output is checked (10,000 leases in the JSON).

The server: a throwaway cluster started as conftest.py does (``runuser -u postgres`` when
root, Unix socket only), or the database of ``STATETOOL_TEST_PG_URL`` (a schema of its
own, dropped afterwards). ``--no-pg`` runs the SQLite rows only.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (Case, Row, compile_packages, header, measure, measured_env, parse_args,  # noqa: E402
                      as_postgres, pg_bindir, print_table, ratio_row, run_child)

GOAL_RATIO = 3.0
GOAL_LIST_SECONDS = 1.0
LIST_ROWS = 10_000
CONFIG = """\
source:
  url: postgresql://reader@db.internal:5432/sales
exports:
  - name: bench
    mode: incremental
"""


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", type=int, default=2000,
                        help="in-process SQLite acquire+release operations per side (default 2000)")
    parser.add_argument("--pg-ops", type=int, default=400,
                        help="in-process PostgreSQL operations per side (default 400)")
    parser.add_argument("--no-pg", action="store_true", help="skip the PostgreSQL rows")


# -- the PostgreSQL server ---------------------------------------------------------------------






@contextmanager
def pg_server() -> Iterator[str]:
    """A superuser URL: STATETOOL_TEST_PG_URL, or a throwaway cluster on a Unix socket."""
    given = os.environ.get("STATETOOL_TEST_PG_URL")
    if given:
        yield given
        return
    bindir = pg_bindir()
    root = Path(tempfile.mkdtemp(prefix="statetool-bench-pg-"))
    root.chmod(0o755)
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    data = root / "data"
    subprocess.run(as_postgres([str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres",
                                 "--no-sync"]), check=True, capture_output=True)
    subprocess.run(as_postgres([str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "server.log"), "-w",
                                 "-o", f"-k {root} -c listen_addresses='' -c fsync=off -c max_connections=50",
                                 "start"]), check=True, capture_output=True)
    try:
        yield f"postgresql://postgres@/postgres?host={root}"
    finally:
        subprocess.run(as_postgres([str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
                       capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


# -- timing in-process operations ---------------------------------------------------------------


def per_op(sides: dict[str, Callable[[], None]], ops: int, rounds: int = 10) -> dict[str, list[float]]:
    """Seconds per operation of each side: ``ops`` operations per side, in ``rounds`` blocks
    alternating the order of the sides (A B, B A, ...), after 20 unmeasured operations each."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for op in sides.values():
        for _ in range(20):
            op()
    block = max(1, ops // rounds)
    names = list(sides)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            op = sides[name]
            for _ in range(block):
                start = time.perf_counter()
                op()
                times[name].append(time.perf_counter() - start)
    return times


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f} ms"


def op_row(name: str, statetool: list[float], peer: list[float], goal: float | None) -> tuple[Row, bool | None]:
    s, p = statistics.median(statetool), statistics.median(peer)
    ratio = s / p
    ok = None if goal is None else ratio <= goal
    return Row(name, _ms(s), _ms(p), f"{ratio:.2f}", f"ratio <= {goal:g}" if goal else "-",
               "-" if ok is None else ("PASS" if ok else "FAIL")), ok


def import_profile(cmd: list[str], env: dict[str, str], cwd: Path, top: int = 10) -> str:
    """Import time of ``cmd`` per package (``-X importtime`` self times summed by top-level
    package name; the run with the smallest total of 3)."""
    best: dict[str, int] | None = None
    for _ in range(3):
        run = subprocess.run(cmd, env={**env, "PYTHONPROFILEIMPORTTIME": "1"}, cwd=cwd, capture_output=True,
                             text=True)
        by_package: dict[str, int] = {}
        for line in run.stderr.splitlines():
            m = re.match(r"import time:\s+(\d+) \|\s+\d+ \|\s+(\S+)", line)
            if m:
                name = m.group(2).split(".")[0]
                by_package[name] = by_package.get(name, 0) + int(m.group(1))
        if best is None or sum(by_package.values()) < sum(best.values()):
            best = by_package
    assert best is not None
    total = sum(best.values())
    lines = [f"  {name:<20} {us / 1000:8.1f} ms" for name, us in sorted(best.items(), key=lambda kv: -kv[1])[:top]]
    return f"  all imports: {total / 1000:.1f} ms\n" + "\n".join(lines)


def cprofile(op: Callable[[], None], ops: int, top: int = 14) -> str:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(ops):
        op()
    profile.disable()
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("cumulative").print_stats(top)
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    return "\n".join("  " + line for line in lines[start:start + top + 1])


# -- the bench ----------------------------------------------------------------------------------


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], repeat=20, extra=_extra)
    compiled = compile_packages(args.python)
    header("bench_leases: lease acquire+release (SQLite vs flock(1), PostgreSQL vs INSERT … ON CONFLICT), "
           "listing 10,000 leases", args, compiled)
    if shutil.which("flock") is None:
        raise SystemExit("flock(1) not found (util-linux)")
    from statetool.operations.context import Context
    from statetool.operations.leases import acquire

    env = measured_env()
    statetool = str(args.bin / "statetool")
    failed = False
    tmp = Path(tempfile.mkdtemp(prefix="statetool-bench-leases-"))
    try:
        # ---- SQLite ------------------------------------------------------------------------
        pipe = tmp / "pipeline"
        pipe.mkdir()
        config = pipe / "rivet.yaml"
        config.write_text(CONFIG)
        init = run_child([statetool, "-c", str(config), "init"], env=env)
        if init.returncode:
            raise SystemExit(f"statetool init failed:\n{init.stderr}")
        lockfile = tmp / "flock-peer.lock"
        key = "chunk-run:bench"

        process_case = Case(
            "SQLite: `statetool leases run --export bench -- true` vs `flock FILE true` (processes)",
            lambda: run_child([statetool, "-c", str(config), "leases", "run", "--export", "bench", "--", "true"],
                              env=env),
            lambda: run_child(["flock", str(lockfile), "true"], env=env), GOAL_RATIO)
        floor_case = Case(
            "  info: `python -c pass` (interpreter floor) vs `flock FILE true`",
            lambda: run_child([args.python, "-c", "pass"], env=env),
            lambda: run_child(["flock", str(lockfile), "true"], env=env), None)
        version_case = Case(
            "  info: `statetool --version` vs `flock FILE true`",
            lambda: run_child([statetool, "--version"], env=env),
            lambda: run_child(["flock", str(lockfile), "true"], env=env), None)
        print("\nSQLite, processes:")
        measure([process_case, floor_case, version_case], args.repeat)

        ctx = Context(config_path=config, env={k: v for k, v in os.environ.items() if k != "RIVET_STATE_URL"},
                      lock_wait=0)

        def library_sqlite() -> None:
            acquire(ctx, key, "bench").release()

        def flock_process() -> None:
            run_child(["flock", str(lockfile), "true"], env=env)

        print(f"SQLite, in-process library: {args.ops} operations per side ...")
        lib = per_op({"statetool": library_sqlite, "peer": flock_process}, min(args.ops, 400))
        sqlite_rows = [ratio_row(process_case)]
        row, _ = op_row("  info: library acquire+release in-process vs `flock FILE true` (process)",
                        lib["statetool"], lib["peer"], None)
        lib_only = per_op({"statetool": library_sqlite}, args.ops)["statetool"]
        sqlite_rows += [row, ratio_row(floor_case), ratio_row(version_case)]
        failed |= process_case.passed is False
        print_table(sqlite_rows, "SQLite lease acquire+release (medians; ratio = statetool / peer)")
        print(f"library acquire+release alone, {len(lib_only)} operations: median {_ms(statistics.median(lib_only))}, "
              f"p90 {_ms(sorted(lib_only)[int(len(lib_only) * 0.9)])}")
        if process_case.passed is False:
            print("\nWhere `statetool leases run -- true` spends its time: import profile "
                  "(python -X importtime, best of 3):")
            print(import_profile([args.python, "-m", "statetool", "-c", str(config), "leases", "run", "--export",
                                  "bench", "--", "true"], env, pipe))

        # ---- PostgreSQL ------------------------------------------------------------------------
        if args.no_pg:
            return 1 if failed else 0
        import psycopg

        with pg_server() as base:
            schema = f"bench_{uuid.uuid4().hex[:10]}"
            state_url = f"{base}{'&' if '?' in base else '?'}schema={schema}"
            pg_env = {**env, "RIVET_STATE_URL": state_url}
            init = run_child([statetool, "-c", str(config), "init"], env=pg_env)
            if init.returncode:
                raise SystemExit(f"statetool init (PostgreSQL) failed:\n{init.stderr}")
            conn = psycopg.connect(base, autocommit=True, options=f"-c search_path={schema}")
            try:
                pg_ctx = Context(config_path=config, env={**ctx.env, "RIVET_STATE_URL": state_url}, lock_wait=0)
                store = pg_ctx.backend().leases()
                host = socket.gethostname()
                insert = ("INSERT INTO rivet_leases (key, holder_pid, holder_host, holder_user, command, acquired_at, "
                          "heartbeat_at, ttl_seconds) VALUES (%s, %s, %s, 'bench', 'bench', now(), now(), 30) "
                          "ON CONFLICT (key) DO NOTHING")

                def library_pg() -> None:
                    acquire(pg_ctx, key, "bench").release()

                from statetool.operations.leases import this_holder

                def library_store() -> None:
                    lease = store.try_acquire(key, this_holder("bench"))
                    lease.release()  # type: ignore[union-attr]

                def bare_upsert() -> None:
                    conn.execute(insert, ("peer:bench", os.getpid(), host))

                def connect_per_op() -> None:
                    with psycopg.connect(base, autocommit=True, options=f"-c search_path={schema}") as c:
                        c.execute(insert, ("peer:connect", os.getpid(), host))
                        c.execute("DELETE FROM rivet_leases WHERE key = 'peer:connect'")

                print(f"\nPostgreSQL, in-process: {args.pg_ops} operations per side ...")
                goal = per_op({"statetool": library_pg, "peer": bare_upsert}, args.pg_ops)
                reused = per_op({"statetool": library_store, "peer": bare_upsert}, args.pg_ops // 2)
                conn_peer = per_op({"statetool": library_pg, "peer": connect_per_op}, args.pg_ops // 2)
                pg_rows = []
                row, ok = op_row("PostgreSQL: library acquire+release vs bare INSERT … ON CONFLICT round trip",
                                 goal["statetool"], goal["peer"], GOAL_RATIO)
                pg_rows.append(row)
                failed |= ok is False
                pg_rows.append(op_row("  info: RowLeases.try_acquire+release (store built once) vs the same peer",
                                      reused["statetool"], reused["peer"], None)[0])
                pg_rows.append(op_row("  info: library acquire+release vs connect + INSERT … ON CONFLICT + DELETE",
                                      conn_peer["statetool"], conn_peer["peer"], None)[0])
                print_table(pg_rows, "PostgreSQL lease acquire+release (medians per operation; same server)")
                if ok is False:
                    print("\nWhere the library's acquire+release spends its time (cProfile, cumulative, "
                          f"{min(args.pg_ops, 200)} operations):")
                    print(cprofile(library_pg, min(args.pg_ops, 200)))

                # ---- listing 10,000 leases ----------------------------------------------------
                conn.execute("DELETE FROM rivet_leases")
                conn.execute(
                    "INSERT INTO rivet_leases (key, holder_pid, holder_host, holder_user, command, acquired_at, "
                    "heartbeat_at, ttl_seconds) "
                    "SELECT 'chunk-run:export-' || lpad(i::text, 5, '0'), "
                    "       CASE WHEN mod(i, 3) = 0 THEN %s ELSE 10000 + i END, "
                    "       CASE WHEN mod(i, 3) = 0 THEN %s ELSE 'worker-' || (mod(i, 40)) || '.elsewhere.example' END, "
                    "       'rivet', 'rivet run -e export-' || i, now() - interval '5 minutes', "
                    "       CASE WHEN mod(i, 3) = 2 THEN now() - interval '1 hour' ELSE now() END, 30 "
                    "FROM generate_series(1, %s) AS i", (os.getpid(), host, LIST_ROWS))

                def check_listing(side: str, run: object) -> None:
                    if side == "statetool":
                        import json

                        doc = json.loads(run.stdout)  # type: ignore[attr-defined]
                        if len(doc["leases"]) != LIST_ROWS:
                            raise SystemExit(f"statetool listed {len(doc['leases'])} leases, not {LIST_ROWS}")

                psql = shutil.which("psql") or str(pg_bindir() / "psql")
                list_case = Case(
                    f"PostgreSQL: `statetool --json leases`, {LIST_ROWS:,} rows (peer: psql --csv SELECT)",
                    lambda: run_child([statetool, "-c", str(config), "--json", "leases"], env=pg_env),
                    lambda: run_child([psql, "--csv", "-X", "-d", base, "-c",
                                       f"SELECT * FROM {schema}.rivet_leases ORDER BY key"], env=env),
                    None, goal_text=f"statetool < {GOAL_LIST_SECONDS:g} s", check=check_listing)
                print("\nListing:")
                measure([list_case], max(5, args.repeat // 2))
                row = ratio_row(list_case)
                listed_ok = list_case.median("statetool") < GOAL_LIST_SECONDS
                row.result = "PASS" if listed_ok else "FAIL"
                failed |= not listed_ok
                t0 = time.perf_counter()
                from statetool.operations.leases import list_leases

                in_process = len(list_leases(pg_ctx).leases)
                in_process_s = time.perf_counter() - t0
                print_table([row], f"Listing {LIST_ROWS:,} leases on PostgreSQL (medians)")
                print(f"library list_leases in-process (after imports): {in_process} leases in {in_process_s:.3f} s")
            finally:
                conn.close()
                if os.environ.get("STATETOOL_TEST_PG_URL"):
                    with psycopg.connect(base, autocommit=True) as c:
                        c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
