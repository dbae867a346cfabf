"""Lease cost: the goals of the lease issue, each side by side with its peer in one run.

    .venv/bin/python bench/bench_leases.py [-n 20] [--ops 2000] [--pg-ops 400] [--no-pg] [--profile]

Goals (docs: bench/README.md, "Leases"):

1. ``statetool leases run --export bench -- true`` (a child process, on a SQLite state made
   by ``statetool init``) costs at most 30 ms MORE than ``statetool --help`` (a child
   process): the wall time from spawn to exit of both, the difference of the medians and
   the ratio printed. Informational rows: the same command vs ``flock FILE true`` (the
   same job done by flock(1), as a cron line uses it), and ``statetool --help`` vs
   ``python -c pass`` (the interpreter floor under both).
2. ``with store.run("bench", "incremental"): pass`` in-process per operation, on a store
   opened once (``StateStore.open``, lock_wait 0) costs at most 3x its peer:
   SQLite: Python ``fcntl.flock(fd, LOCK_EX)`` + ``flock(fd, LOCK_UN)`` of a file opened
   once; informational peer: open + flock + close per operation.
   PostgreSQL: one bare ``INSERT … ON CONFLICT (key) DO NOTHING`` into ``rivet_leases`` on
   a psycopg connection held open in autocommit, same server, same table; informational
   peer: INSERT + DELETE (the two round trips of the least a row lease can do).
   Informational rows split the statetool side: the lease store's ``try_acquire`` +
   ``release`` alone (store and holder record built once; no look at the state lease);
   on SQLite ``store.run`` once the state lease's sidecar exists (as after any migrate:
   the state-lease look then reads ``/proc/locks``). And the floor of the protocol, timed
   in the same blocks as the goal row: on SQLite its syscalls in bare Python (open folder
   and sidecar, LOCK_EX, token read, record write, state-lease look, released record,
   unlock, close), on PostgreSQL the very statements one ``store.run`` sends (captured with
   SQLAlchemy events, with their parameters) replayed on the bare psycopg connection; the
   floor's own ratio to the goal's peer is printed: a goal below it is out of reach of any
   implementation of the protocol.
3. ``statetool --json leases`` (a child process) lists 10,000 PostgreSQL leases in < 1 s;
   peer for reference: ``psql --csv`` selecting the same rows. The rows are inserted
   directly with every column of revision 0004 (fencing_token; holder_started for the
   holders on this host): a third live on this host, a third live on other hosts, a third
   stale. The output is checked (10,000 leases in the JSON).

Start-up is only meaningful with byte-code: PYTHONDONTWRITEBYTECODE is set here, so the
bench first byte-compiles statetool and its dependencies (``python -m compileall``, see
_harness.compile_packages) and runs the children with it unset; the header says so.

Process rows: one warm-up run of each side not counted, then ``-n`` rounds alternating the
order (A B, B A, ...), medians. In-process rows: 20 warm-up operations of each side not
counted, then ``--ops`` / ``--pg-ops`` operations per side in 10 blocks alternating the
order, medians per operation. Checks make sure the statetool side did the work: the
run lease's fencing token grows by one per ``leases run`` and per ``store.run``.

When a goal is missed (or with ``--profile``), the bench says where statetool's time goes:
for goal 1 the import time per package of both commands (``python -X importtime``) and a
cProfile of the ``leases run`` child; for goal 2 a cProfile of the in-process operation
(calls and microseconds PER OPERATION), and on PostgreSQL the SQL statements (round trips)
and pool checkouts per operation, counted with SQLAlchemy events.

The server: a throwaway cluster started as conftest.py does (``runuser -u postgres`` when
root, Unix socket only), or the database of ``STATETOOL_TEST_PG_URL`` (a schema of its
own, dropped afterwards). ``--no-pg`` runs the SQLite rows only.
"""

from __future__ import annotations

import argparse
import cProfile
import fcntl
import json
import os
import pstats
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (Case, Row, Run, compile_packages, header, measure, measured_env, parse_args,  # noqa: E402
                      as_postgres, pg_bindir, print_table, ratio_row, run_child)

GOAL_RATIO = 3.0
#: Goal 1: ``leases run -- true`` at most this many seconds more than ``--help``.
GOAL_EXTRA_SECONDS = 0.030
GOAL_LIST_SECONDS = 1.0
LIST_ROWS = 10_000
EXPORT = "bench"
KEY = f"chunk-run:{EXPORT}"
CONFIG = """\
source:
  url: postgresql://reader@db.internal:5432/sales
exports:
  - name: bench
    mode: incremental
"""


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", type=int, default=2000,
                        help="in-process SQLite operations per side (default 2000)")
    parser.add_argument("--pg-ops", type=int, default=400,
                        help="in-process PostgreSQL operations per side (default 400)")
    parser.add_argument("--no-pg", action="store_true", help="skip the PostgreSQL rows")
    parser.add_argument("--profile", action="store_true",
                        help="print where statetool's time goes even when the goals are met")


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


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} µs"


def _p90(values: list[float]) -> float:
    return sorted(values)[int(len(values) * 0.9)]


def op_row(name: str, statetool: list[float], peer: list[float], goal: float | None) -> tuple[Row, bool | None]:
    s, p = statistics.median(statetool), statistics.median(peer)
    ratio = s / p
    ok = None if goal is None else ratio <= goal
    return Row(name, _us(s), _us(p), f"{ratio:.2f}", f"ratio <= {goal:g}" if goal else "-",
               "-" if ok is None else ("PASS" if ok else "FAIL")), ok


def extra_row(case: Case, limit: float) -> tuple[Row, bool]:
    """The row of a goal "at most ``limit`` seconds more than the peer": ratio and difference."""
    s, p = case.median("statetool"), case.median("peer")
    ok = s - p <= limit
    return Row(case.name, f"{s * 1000:.1f} ms", f"{p * 1000:.1f} ms", f"{s / p:.2f} ({(s - p) * 1000:+.1f} ms)",
               f"<= +{limit * 1000:g} ms over peer", "PASS" if ok else "FAIL"), ok


def ms_row(case: Case) -> Row:
    """:func:`ratio_row` in milliseconds, with the difference beside the ratio."""
    s, p = case.median("statetool"), case.median("peer")
    return Row(case.name, f"{s * 1000:.1f} ms", f"{p * 1000:.1f} ms", f"{s / p:.2f} ({(s - p) * 1000:+.1f} ms)",
               "-", "-")


# -- where the time goes -----------------------------------------------------------------------


def import_times(cmd: list[str], env: dict[str, str], cwd: Path) -> dict[str, int]:
    """Import self time (µs) of ``cmd`` per top-level package (``-X importtime``), the run
    with the smallest total of 3."""
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
    return best


def import_diff(cmd: list[str], peer: list[str], env: dict[str, str], cwd: Path, top: int = 12) -> str:
    mine, theirs = import_times(cmd, env, cwd), import_times(peer, env, cwd)
    lines = [f"  all imports: {sum(mine.values()) / 1000:.1f} ms (leases run) vs {sum(theirs.values()) / 1000:.1f} ms "
             f"(--help); per package, leases run / --help / extra:"]
    for name in sorted(mine, key=lambda n: -(mine[n] - theirs.get(n, 0)))[:top]:
        lines.append(f"  {name:<22} {mine[name] / 1000:7.1f} ms {theirs.get(name, 0) / 1000:7.1f} ms "
                     f"{(mine[name] - theirs.get(name, 0)) / 1000:+7.1f} ms")
    return "\n".join(lines)


def _where(func: tuple[str, int, str]) -> str:
    path, line, name = func
    if path == "~":
        return name  # a builtin: {built-in method posix.open}
    parts = Path(path).parts
    short = "/".join(parts[parts.index("statetool"):]) if "statetool" in parts else "/".join(parts[-2:])
    return f"{short}:{line}({name})"


#: Frames left out of the cumulative listing: wrappers that only repeat their callee's time.
_PLUMBING = ("contextlib.py", "builtins.next", "bench_leases.py", "<method 'join' of 'str'")


def profile_table(profile: cProfile.Profile, ops: int, top: int = 16, unit: float = 1e6) -> str:
    """Two listings of a cProfile, per operation: by cumulative time (what each call takes,
    statetool's own functions, the threading module, SQLAlchemy's ``execute`` and the
    builtins), and by own time (where the clock actually runs: syscalls, SQL, JSON, ...)."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    rows = [(nc / ops, tt / ops, ct / ops, _where(func)) for func, (_cc, nc, tt, ct, _callers) in stats.items()]
    label = "µs" if unit == 1e6 else "ms"
    out = [f"  {'calls/op':>8} {f'own {label}/op':>10} {f'cum {label}/op':>10}  function"]
    cumulative = [r for r in rows if not any(p in r[3] for p in _PLUMBING)
                  and (r[3].startswith(("statetool/", "{", "threading.py")) or "(execute)" in r[3])]
    for title, listing, key in (("by cumulative time", cumulative, lambda r: -r[2]),
                                ("by own time", rows, lambda r: -r[1])):
        out.append(f"  -- {title}")
        for calls, own, cum, where in sorted(listing, key=key)[:top]:
            out.append(f"  {calls:8.2f} {own * unit:10.1f} {cum * unit:10.1f}  {where}")
    return "\n".join(out)


def cprofile_ops(op: Callable[[], None], ops: int, top: int = 16, unit: float = 1e6) -> str:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(ops):
        op()
    profile.disable()
    return (f"  ({ops} operation{'s' if ops > 1 else ''} under cProfile, which inflates small calls)\n"
            + profile_table(profile, ops, top, unit))


def breakdown(parts: dict[str, Callable[[], None]], ops: int) -> str:
    """Median µs of each part of an operation, timed alone without a profiler (parts
    alternated in blocks as :func:`per_op` does)."""
    times = per_op(parts, ops)
    return ", ".join(f"{name} {_us(statistics.median(t))}" for name, t in times.items())


def cprofile_child(python: str, argv: list[str], env: dict[str, str], cwd: Path, top: int = 16) -> str:
    """A cProfile of one ``statetool ARGV`` child (``python -m cProfile``), cumulative."""
    with tempfile.NamedTemporaryFile(suffix=".prof", delete=False) as fh:
        out = fh.name
    try:
        run = subprocess.run([python, "-m", "cProfile", "-o", out, "-m", "statetool", *argv], env=env, cwd=cwd,
                             capture_output=True, text=True)
        if run.returncode:
            return f"  (cProfile run failed: {run.stderr.strip()[-500:]})"
        stats = pstats.Stats(out).stats  # type: ignore[attr-defined]
        rows = [(nc, tt, ct, _where(func)) for func, (_cc, nc, tt, ct, _callers) in stats.items()]
        lines = [f"  {'calls':>6} {'own ms':>8} {'cum ms':>8}  function (one run of statetool {' '.join(argv)})"]
        interesting = [r for r in rows if "statetool/" in r[3] or r[3].startswith("{")]
        for calls, own, cum, where in sorted(interesting, key=lambda r: -r[2])[:top]:
            lines.append(f"  {calls:6d} {own * 1000:8.2f} {cum * 1000:8.2f}  {where}")
        return "\n".join(lines)
    finally:
        os.unlink(out)


def lease_token(lease_dir: Path) -> int:
    doc = json.loads((lease_dir / "chunk-run%3Abench").read_text().splitlines()[0])
    return int(doc["fencing_token"])


# -- the bench ----------------------------------------------------------------------------------


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], repeat=20, extra=_extra)
    compiled = compile_packages(args.python)
    header("bench_leases: `leases run -- true` vs `--help` (+30 ms), StateStore.run vs flock / "
           "INSERT … ON CONFLICT (ratio <= 3), listing 10,000 PostgreSQL leases (< 1 s)", args, compiled)
    if shutil.which("flock") is None:
        raise SystemExit("flock(1) not found (util-linux)")
    from statetool.runtime import StateStore
    from statetool.backends.processes import process_started
    from statetool.operations.leasing import STATE_LEASE, holding, lease_store, this_holder

    env = measured_env()
    plain_env = {k: v for k, v in os.environ.items() if k != "RIVET_STATE_URL"}
    statetool = str(args.bin / "statetool")
    failed = False
    tmp = Path(tempfile.mkdtemp(prefix="statetool-bench-leases-"))
    try:
        # ---- goal 1: processes, SQLite ------------------------------------------------------
        pipe = tmp / "pipeline"
        pipe.mkdir()
        config = pipe / "rivet.yaml"
        config.write_text(CONFIG)
        init = run_child([statetool, "-c", str(config), "init"], env=env)
        if init.returncode:
            raise SystemExit(f"statetool init failed:\n{init.stderr}")
        lease_dir = pipe / ".rivet_state.leases"
        lockfile = tmp / "flock-peer.lock"
        run_argv = ["-c", str(config), "leases", "run", "--export", EXPORT, "--", "true"]

        def leases_run() -> Run:
            return run_child([statetool, *run_argv], env=env, cwd=pipe)

        def help_run() -> Run:
            return run_child([statetool, "--help"], env=env, cwd=pipe)

        def flock_run() -> Run:
            return run_child(["flock", str(lockfile), "true"], env=env)

        run_case = Case("SQLite: `statetool leases run --export bench -- true` vs `statetool --help`",
                        leases_run, help_run, None)
        flock_case = Case("  info: `statetool leases run --export bench -- true` vs `flock FILE true`",
                          leases_run, flock_run, None)
        floor_case = Case("  info: `statetool --help` vs `python -c pass` (interpreter floor)",
                          help_run, lambda: run_child([args.python, "-c", "pass"], env=env), None)
        print("\nGoal 1, processes (SQLite state made by `statetool init`):")
        leases_run()  # the sidecar's first token is the clock in microseconds; from there it counts
        first = lease_token(lease_dir)
        measure([run_case, flock_case, floor_case], args.repeat)
        runs = 2 * (1 + args.repeat)  # run_case and flock_case, warm-up included
        if lease_token(lease_dir) != first + runs:
            raise SystemExit(f"the run lease's fencing token is {lease_token(lease_dir)} after {runs} `leases run` "
                             f"from {first}: not every run took the lease")
        row1, ok1 = extra_row(run_case, GOAL_EXTRA_SECONDS)
        failed |= not ok1
        print_table([row1, ms_row(flock_case), ms_row(floor_case)],
                    "Goal 1: `leases run -- true` at most 30 ms more than `--help` (medians of child processes; "
                    "ratio = statetool / peer, then the difference)")
        print(f"checked: the run lease's fencing token grew by one per `leases run` ({runs})")
        if not ok1 or args.profile:
            print("\nWhere `leases run -- true` spends its time beyond `--help`: import time per package "
                  "(python -X importtime, best of 3), largest extra first:")
            print(import_diff([args.python, "-m", "statetool", *run_argv], [args.python, "-m", "statetool", "--help"],
                              env, pipe))
            print("\ncProfile of one `leases run -- true` child (statetool functions and builtins, cumulative):")
            print(cprofile_child(args.python, run_argv, env, pipe))

        # ---- goal 2: in-process, SQLite -------------------------------------------------------
        store = StateStore.open(config, env=plain_env, lock_wait=0)
        raw = lease_store(store.ctx)
        holder = this_holder("bench")

        def store_run() -> None:
            with store.run(EXPORT, "incremental"):
                pass

        def raw_lease() -> None:
            raw.try_acquire(KEY, holder).release()  # type: ignore[union-attr]

        peer_fd = os.open(lockfile, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)

        def flock_unflock() -> None:
            fcntl.flock(peer_fd, fcntl.LOCK_EX)
            fcntl.flock(peer_fd, fcntl.LOCK_UN)

        def open_flock_close() -> None:
            fd = os.open(lockfile, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

        floor_dir = tmp / "floor-leases"
        floor_dir.mkdir()
        holder_doc = {"pid": holder.pid, "host": holder.host, "user": holder.user, "command": holder.command,
                      "key": KEY, "pid_started": holder.started, "child_pid": None, "child_started": None}

        def sqlite_floor() -> None:
            """What the flock lease protocol needs, in bare Python: open the folder and the
            sidecar, LOCK_EX, read the last token, write the holder record with the next one,
            look at the state lease's sidecar (absent here), write the released record, unlock,
            close (sqlite_leases.py's docstring)."""
            dfd = os.open(floor_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            fd = os.open("chunk-run%3Abench", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            token = json.loads(os.pread(fd, 65536, 0).split(b"\n", 1)[0] or b"{}").get("fencing_token", 0) + 1
            data = json.dumps({**holder_doc, "acquired_at": time.time(), "fencing_token": token}).encode() + b"\n"
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
            try:
                os.close(os.open("state%3Aexclusive", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd))
            except FileNotFoundError:
                pass
            os.close(dfd)
            data = json.dumps({"key": KEY, "fencing_token": token, "released_at": time.time()}).encode() + b"\n"
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

        before = lease_token(lease_dir)
        print(f"\nGoal 2, in-process, SQLite: {args.ops} operations per side ...")
        goal = per_op({"statetool": store_run, "peer": flock_unflock, "floor": sqlite_floor}, args.ops)
        info_open = per_op({"statetool": store_run, "peer": open_flock_close}, args.ops // 2)
        info_raw = per_op({"statetool": raw_lease, "peer": flock_unflock}, args.ops // 2)
        done = lease_token(lease_dir) - before
        expected = 3 * 20 + args.ops // 10 * 10 + 2 * (args.ops // 2 // 10 * 10)
        if done != expected:
            raise SystemExit(f"the run lease's fencing token grew by {done}, not {expected}: not every op took it")
        # A state whose state lease was ever taken (any migrate, relocate, transfer, identity
        # write) keeps its sidecar: every run's look at the state lease then reads /proc/locks.
        with holding(store.ctx, STATE_LEASE, "bench"):
            pass
        info_state = per_op({"statetool": store_run, "peer": flock_unflock}, args.ops // 2)
        row2, ok2 = op_row("SQLite: `with store.run(...)` vs fcntl.flock EX+UN of an open file",
                           goal["statetool"], goal["peer"], GOAL_RATIO)
        failed |= ok2 is False
        floor_row = op_row("  info: `with store.run(...)` vs its protocol's syscalls in bare Python",
                           goal["statetool"], goal["floor"], None)[0]
        print_table([row2,
                     op_row("  info: `with store.run(...)` vs open + flock EX+UN + close per op",
                            info_open["statetool"], info_open["peer"], None)[0],
                     floor_row,
                     op_row("  info: FlockLeases.try_acquire+release (holder built once) vs flock EX+UN",
                            info_raw["statetool"], info_raw["peer"], None)[0],
                     op_row("  info: `with store.run(...)`, state-lease sidecar present, vs flock EX+UN",
                            info_state["statetool"], info_state["peer"], None)[0]],
                    "Goal 2, SQLite: acquire+release per operation, in-process (medians per operation)")
        floor_ratio = statistics.median(goal["floor"]) / statistics.median(goal["peer"])
        print(f"store.run p90 {_us(_p90(goal['statetool']))}, flock EX+UN p90 {_us(_p90(goal['peer']))}; "
              f"checked: the fencing token grew by one per operation ({done})")
        print(f"the protocol's syscalls alone (open folder+sidecar, flock, token read, record write, state-lease "
              f"look, released record, unlock, close) take {_us(statistics.median(goal['floor']))}: "
              f"{floor_ratio:.1f}x flock EX+UN, the floor of any implementation against the goal's peer")
        if not ok2 or args.profile:
            print("\nWhere `with store.run(...)` spends its time on SQLite. Parts timed alone (medians, no profiler):")
            print("  " + breakdown({"store.run": store_run, "this_holder()": lambda: this_holder("bench"),
                                    "of it process_started (/proc/PID/stat)": lambda: process_started(os.getpid()),
                                    "try_acquire+release": raw_lease,
                                    "state-lease look info(), sidecar present (/proc/locks)": lambda: raw.info(
                                        STATE_LEASE)}, min(args.ops, 500)))
            print("cProfile, per operation (state-lease sidecar present):")
            print(cprofile_ops(store_run, min(args.ops, 500)))
        os.close(peer_fd)

        # ---- PostgreSQL ------------------------------------------------------------------------
        if args.no_pg:
            print("\nall SQLite goals met (--no-pg)" if not failed else "\nat least one goal missed")
            return 1 if failed else 0
        import psycopg
        import sqlalchemy as sa

        with pg_server() as base:
            schema = f"bench_{uuid.uuid4().hex[:10]}"
            state_url = f"{base}{'&' if '?' in base else '?'}schema={schema}"
            pg_env = {**env, "RIVET_STATE_URL": state_url}
            init = run_child([statetool, "-c", str(config), "init"], env=pg_env)
            if init.returncode:
                raise SystemExit(f"statetool init (PostgreSQL) failed:\n{init.stderr}")
            conn = psycopg.connect(base, autocommit=True, options=f"-c search_path={schema}")
            try:
                revision = conn.execute("SELECT * FROM rivet_state_version").fetchone()
                columns = {r[0] for r in conn.execute(
                    "SELECT column_name FROM information_schema.columns WHERE table_schema = %s "
                    "AND table_name = 'rivet_leases'", (schema,))}
                missing = {"fencing_token", "holder_started", "child_pid", "child_started"} - columns
                if missing:
                    raise SystemExit(f"the lease table made by statetool init lacks {sorted(missing)}")
                print(f"\nPostgreSQL state made by `statetool init`: version row {revision}, rivet_leases with "
                      "fencing_token, holder_started, child_pid, child_started")

                pg_store = StateStore.open(config, state_url=state_url, env=plain_env, lock_wait=0)
                pg_raw = lease_store(pg_store.ctx)
                engine = pg_raw.engine  # type: ignore[attr-defined]
                host = socket.gethostname()
                insert = ("INSERT INTO rivet_leases (key, holder_pid, holder_host, holder_user, command, acquired_at, "
                          "heartbeat_at, ttl_seconds) VALUES (%s, %s, %s, 'bench', 'bench', now(), now(), 30) "
                          "ON CONFLICT (key) DO NOTHING")

                def pg_store_run() -> None:
                    with pg_store.run(EXPORT, "incremental"):
                        pass

                def pg_raw_lease() -> None:
                    pg_raw.try_acquire(KEY, holder).release()  # type: ignore[union-attr]

                def thread_start_join() -> None:
                    stop = threading.Event()
                    thread = threading.Thread(target=stop.wait, args=(10.0,), daemon=True)
                    thread.start()
                    stop.set()
                    thread.join()

                def bare_upsert() -> None:
                    conn.execute(insert, ("peer:bench", os.getpid(), host))

                def insert_delete() -> None:
                    conn.execute(insert, ("peer:pair", os.getpid(), host))
                    conn.execute("DELETE FROM rivet_leases WHERE key = 'peer:pair'")

                # What one `with store.run(...)` sends: every statement and its parameters as
                # SQLAlchemy hands them to psycopg, and the pool checkouts (counted over 50 ops,
                # before the timing, with the listeners removed again).
                sent: list[tuple[str, object]] = []
                checkouts = [0]

                def on_execute(_conn: object, _cursor: object, statement: str, parameters: object,
                               *_rest: object) -> None:
                    sent.append((statement, parameters))

                def on_checkout(*_args: object) -> None:
                    checkouts[0] += 1

                pg_store_run()  # the store's one-time look at the lease table's layout is not per operation
                sa.event.listen(engine, "before_cursor_execute", on_execute)
                sa.event.listen(engine.pool, "checkout", on_checkout)
                counted = 50
                for _ in range(counted):
                    pg_store_run()
                sa.event.remove(engine, "before_cursor_execute", on_execute)
                sa.event.remove(engine.pool, "checkout", on_checkout)
                one_op = sent[:len(sent) // counted]
                if len(sent) % counted or not one_op[-1][0].startswith("DELETE"):
                    raise SystemExit(f"{len(sent)} statements in {counted} operations, the last of the first "
                                     f"{one_op[-1][0][:40]!r}: not one sequence ending in the release per operation")
                kinds: dict[str, int] = {}
                for statement, _params in sent:
                    kind = statement.split()[0] + (" (rivet_lease_tokens CTE)" if "rivet_lease_tokens" in statement
                                                   else "")
                    kinds[kind] = kinds.get(kind, 0) + 1
                floor_key = f"{KEY}-floor"

                def pg_floor() -> None:
                    """The statements of one `store.run` replayed on the bare psycopg connection
                    (its own key; the DELETE names the acquired_at this INSERT returned)."""
                    acquired = None
                    for statement, params in one_op:
                        values = dict(params) if isinstance(params, dict) else {}
                        if values.get("key") == KEY:
                            values["key"] = floor_key
                        if acquired is not None and "acquired" in values:
                            values["acquired"] = acquired
                        returns = " RETURNING " in statement or statement.lstrip().startswith(("SELECT", "WITH"))
                        got = conn.execute(statement, values).fetchone() if returns else conn.execute(statement, values)
                        if got is not None and "rivet_lease_tokens" in statement:  # the acquire: its acquired_at
                            acquired = got[0]  # type: ignore[index]

                token_sql = "SELECT token FROM rivet_lease_tokens WHERE key = %s"
                before_n = conn.execute(token_sql, (KEY,)).fetchone()[0]  # type: ignore[index]
                print(f"Goal 2, in-process, PostgreSQL: {args.pg_ops} operations per side ...")
                goal = per_op({"statetool": pg_store_run, "peer": bare_upsert, "floor": pg_floor}, args.pg_ops)
                info_pair = per_op({"statetool": pg_store_run, "peer": insert_delete}, args.pg_ops // 2)
                info_raw = per_op({"statetool": pg_raw_lease, "peer": bare_upsert}, args.pg_ops // 2)
                done = conn.execute(token_sql, (KEY,)).fetchone()[0] - before_n  # type: ignore[index]
                expected = 3 * 20 + args.pg_ops // 10 * 10 + 2 * (args.pg_ops // 2 // 10 * 10)
                if done != expected:
                    raise SystemExit(f"rivet_lease_tokens grew by {done}, not {expected}: not every op took the lease")
                left = conn.execute("SELECT count(*) FROM rivet_leases WHERE key = %s", (floor_key,)).fetchone()
                if left != (0,):
                    raise SystemExit("the replayed statements left their lease row behind: the replay is wrong")

                row3, ok3 = op_row("PostgreSQL: `with store.run(...)` vs bare INSERT … ON CONFLICT DO NOTHING",
                                   goal["statetool"], goal["peer"], GOAL_RATIO)
                failed |= ok3 is False
                print_table([row3,
                             op_row("  info: `with store.run(...)` vs INSERT … ON CONFLICT + DELETE (2 round trips)",
                                    info_pair["statetool"], info_pair["peer"], None)[0],
                             op_row(f"  info: `with store.run(...)` vs its {len(one_op)} statements on bare psycopg",
                                    goal["statetool"], goal["floor"], None)[0],
                             op_row("  info: RowLeases.try_acquire+release (holder built once) vs bare INSERT",
                                    info_raw["statetool"], info_raw["peer"], None)[0]],
                            "Goal 2, PostgreSQL: acquire+release per operation, in-process, same server "
                            "(medians per operation)")
                floor_ratio = statistics.median(goal["floor"]) / statistics.median(goal["peer"])
                print(f"store.run p90 {_us(_p90(goal['statetool']))}, INSERT p90 {_us(_p90(goal['peer']))}; "
                      f"checked: rivet_lease_tokens grew by one per operation ({done})")
                print(f"per `with store.run(...)`: {len(sent) / counted:g} SQL statements (round trips), "
                      f"{checkouts[0] / counted:g} pool checkouts; statements: "
                      + ", ".join(f"{k} x{v / counted:g}" for k, v in sorted(kinds.items())))
                floor_us = _us(statistics.median(goal["floor"]))
                print(f"those {len(one_op)} statements alone on bare psycopg take {floor_us}: {floor_ratio:.1f}x the bare INSERT, the floor of this protocol against the goal's peer")
                if not ok3 or args.profile:
                    print("\nWhere `with store.run(...)` spends its time on PostgreSQL. Parts timed alone "
                          "(medians, no profiler):")
                    print("  " + breakdown({"store.run": pg_store_run, "this_holder()": lambda: this_holder("bench"),
                                            "try_acquire+release": pg_raw_lease,
                                            "state-lease look info()": lambda: pg_raw.info(STATE_LEASE),
                                            "a thread start+join (as the heartbeat's)": thread_start_join,
                                            "the statements on bare psycopg": pg_floor,
                                            "bare INSERT": bare_upsert}, min(args.pg_ops, 200)))
                    print("cProfile, per operation:")
                    print(cprofile_ops(pg_store_run, min(args.pg_ops, 200)))

                # ---- goal 3: listing 10,000 leases --------------------------------------------
                conn.execute("DELETE FROM rivet_leases")
                started = this_holder("bench").started
                conn.execute(
                    "INSERT INTO rivet_leases (key, holder_pid, holder_host, holder_user, command, acquired_at, "
                    "heartbeat_at, ttl_seconds, fencing_token, holder_started, child_pid, child_started) "
                    "SELECT 'chunk-run:export-' || lpad(i::text, 5, '0'), "
                    "       CASE WHEN mod(i, 3) = 0 THEN %s ELSE 10000 + i END, "
                    "       CASE WHEN mod(i, 3) = 0 THEN %s ELSE 'worker-' || (mod(i, 40)) || '.elsewhere.example' END, "
                    "       'rivet', 'rivet run -e export-' || i, now() - interval '5 minutes', "
                    "       CASE WHEN mod(i, 3) = 2 THEN now() - interval '1 hour' ELSE now() END, 30, "
                    "       i, CASE WHEN mod(i, 3) = 0 THEN %s END, NULL, NULL "
                    "FROM generate_series(1, %s) AS i", (os.getpid(), host, started, LIST_ROWS))

                def check_listing(side: str, run: Run) -> None:
                    if side == "statetool":
                        doc = json.loads(run.stdout)
                        if len(doc["leases"]) != LIST_ROWS:
                            raise SystemExit(f"statetool listed {len(doc['leases'])} leases, not {LIST_ROWS}")

                psql = shutil.which("psql") or str(pg_bindir() / "psql")
                list_case = Case(
                    f"PostgreSQL: `statetool --json leases`, {LIST_ROWS:,} rows (peer: psql --csv SELECT)",
                    lambda: run_child([statetool, "-c", str(config), "--json", "leases"], env=pg_env),
                    lambda: run_child([psql, "--csv", "-X", "-d", base, "-c",
                                       f"SELECT * FROM {schema}.rivet_leases ORDER BY key"], env=env),
                    None, goal_text=f"statetool < {GOAL_LIST_SECONDS:g} s", check=check_listing)
                print("\nGoal 3, listing:")
                measure([list_case], max(5, args.repeat // 2))
                row = ratio_row(list_case)
                listed_ok = list_case.median("statetool") < GOAL_LIST_SECONDS
                row.result = "PASS" if listed_ok else "FAIL"
                failed |= not listed_ok
                from statetool.operations.leasing import list_leases

                t0 = time.perf_counter()
                listed = list_leases(pg_store.ctx).leases
                in_process_s = time.perf_counter() - t0
                states: dict[str, int] = {}
                for lease in listed:
                    states[str(lease["state"])] = states.get(str(lease["state"]), 0) + 1
                print_table([row], f"Goal 3: listing {LIST_ROWS:,} leases on PostgreSQL (medians)")
                print(f"library list_leases in-process (after imports): {len(listed)} leases in {in_process_s:.3f} s "
                      f"({', '.join(f'{v} {k}' for k, v in sorted(states.items()))})")
                if not listed_ok or args.profile:
                    print("\nWhere `statetool --json leases` spends its time:")
                    print(cprofile_child(args.python, ["-c", str(config), "--json", "leases"], pg_env, pipe))
                    doc = list_leases(pg_store.ctx).as_dict()
                    select = f"{pg_raw._select()} ORDER BY key"  # noqa: SLF001 - the store's own query

                    def timed(op: Callable[[], object]) -> str:
                        seconds = []
                        for _ in range(3):
                            t0 = time.perf_counter()
                            op()
                            seconds.append(time.perf_counter() - t0)
                        return f"{min(seconds) * 1000:.0f} ms"

                    print("Parts timed alone in-process (best of 3, no profiler): "
                          f"list_leases {timed(lambda: list_leases(pg_store.ctx))}, "
                          f"of it the store's SELECT on psycopg {timed(lambda: conn.execute(select).fetchall())}; "
                          f"json.dumps(indent=2) as --json prints it {timed(lambda: json.dumps(doc, indent=2))} "
                          f"(without indent: {timed(lambda: json.dumps(doc))})")
                    print("cProfile of list_leases in-process (one call, ms):")
                    print(cprofile_ops(lambda: list_leases(pg_store.ctx), 1, unit=1e3))
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
    print("\nall goals met" if not failed else "\nat least one goal missed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
