"""``statetool doctor`` on a large state: 2,000 exports, 5,000,000 runs, >= 1 GiB, vs the same
queries in Python's ``sqlite3`` (goal: ratio <= 4, peak RSS <= 150 MiB), and how ``check``,
``info`` and ``doctor`` grow with the state (5 k, 500 k, 5 M runs).

What ``doctor`` must read to judge every export is small even on a large state: the
cursors (``rivet_exports``, one row per export), the chunk checkpoints (``rivet_chunks``,
counted per export), and the last succeeded run of each export (``rivet_runs``, through
the index ``ix_rivet_runs_export_started``: a short backward scan per export, never the
whole history). The floor runs exactly those queries, once in the ``sqlite3`` shell and
once in a bare ``python -c`` with the stdlib sqlite3 module (the interpreter's own
start-up included), on the same file, alternated with doctor.

The state: ``statetool init`` on a config with 2,000 exports (1,000 incremental, 600
chunked, 200 full, 200 CDC mysql with a checkpoint file each), then 5,000,000 runs
inserted with ``executemany`` in one transaction (every 17th run failed, with a
traceback as its error text, which brings the file past 1 GiB), a cursor for every
incremental export and ten chunk checkpoints for every chunked one (every third with a
chunk pending). The index is dropped for the bulk load and rebuilt, the file is put back
in WAL mode as ``init`` made it, and it is cached for the whole run (``--cache DIR``
keeps it across runs). Every measured ``doctor`` must find all 2,000 exports resuming.

The scaling table (``--scaling``, on by default) builds the same 2,000 exports with 5,000
and 500,000 runs too (beside the large state: ``DIR-runs-N`` with ``--cache DIR``) and
times ``check``, ``info`` and ``doctor`` (``--json``) on each: they should stay flat, apart
from ``check``'s ``quick_check``, which reads every page (O(file size)).

    .venv/bin/python bench/bench_doctor.py [-n 5] [--cache /var/tmp/statetool-bench-doctor]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (Case, Row, Run, compile_packages, header, measure, measured_env, parse_args,  # noqa: E402
                      print_table, run_child)

#: doctor (human) / the same queries in a bare ``python -c`` with sqlite3 (issue 13).
GOAL_RATIO = 4.0
GOAL_RSS_MIB = 150.0
#: The smaller states of the scaling table (the large one is the main state).
SCALES = (5_000, 500_000)
GIB = 1 << 30
BASE = datetime(2025, 1, 1, tzinfo=UTC)
TRACEBACK = ("Traceback (most recent call last):\n" + "".join(
    f'  File "/usr/lib/python3/dist-packages/rivet/runner/step_{k}.py", line {100 + k}, in run_chunk\n'
    f"    rows = self.source.fetch(query, bounds=({k * 1000}, {(k + 1) * 1000}), timeout=self.timeout)\n"
    for k in range(12)) + "psycopg.OperationalError: connection reset by peer (server closed the connection)\n")

#: What doctor needs, as plain SQL (the floor). One statement each, on one read connection.
FLOOR_SQL = [
    "SELECT export_name, cursor_value, cursor_updated_at FROM rivet_exports",
    "SELECT export_name, count(*), sum(CASE WHEN status != 'done' THEN 1 ELSE 0 END) FROM rivet_chunks "
    "GROUP BY export_name",
    "SELECT e.export_name, (SELECT r.finished_at FROM rivet_runs AS r WHERE r.export_name = e.export_name "
    "AND r.status = 'succeeded' ORDER BY r.started_at DESC LIMIT 1) FROM rivet_exports AS e",
]


#: CPU seconds (user + sys) of each measured child, by (case, side): on a shared machine the
#: wall time carries other people's load, the CPU time much less.
CPU: dict[tuple[str, str], list[float]] = {}


def timed(case: str, side: str, cmd: list[str], cwd: Path, env: dict[str, str], stdin: str | None = None) -> Run:
    """:func:`_harness.run_child` plus the child's CPU time (its rusage from ``os.wait4``)."""
    stdin_file = None
    if stdin is not None:
        stdin_file = tempfile.TemporaryFile("w+")
        stdin_file.write(stdin)
        stdin_file.seek(0)
    with tempfile.TemporaryFile("w+") as so, tempfile.TemporaryFile("w+") as se:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=stdin_file or subprocess.DEVNULL, stdout=so, stderr=se)
        _pid, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        so.seek(0)
        se.seek(0)
        run = Run(seconds, usage.ru_maxrss, os.waitstatus_to_exitcode(status), so.read(), se.read())
    if stdin_file is not None:
        stdin_file.close()
    CPU.setdefault((case, side), []).append(usage.ru_utime + usage.ru_stime)
    return run


def iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


MODES = ("incremental",) * 5 + ("chunked",) * 3 + ("full", "cdc")


def mode_of(i: int) -> str:
    """Export i's mode: of every ten, five incremental, three chunked, one full, one CDC."""
    return MODES[i % 10]


def write_config(directory: Path, exports: int) -> Path:
    lines = ["source:", "  url: postgresql://reader@db.internal:5432/warehouse", "exports:"]
    for i in range(exports):
        lines += [f"  - name: export_{i:04d}", f"    mode: {mode_of(i)}"]
        if mode_of(i) == "cdc":
            lines += ["    cdc:", "      engine: mysql", f"      checkpoint: checkpoints/export_{i:04d}.json"]
    config = directory / "rivet.yaml"
    config.write_text("\n".join(lines) + "\n")
    return config


def build(statetool: str, directory: Path, exports: int, runs: int, min_bytes: int, env: dict[str, str]) -> Path:
    """Build (or reuse) the state in ``directory``; returns the config path."""
    marker = directory / "built.json"
    params = {"exports": exports, "runs": runs, "min_bytes": min_bytes, "format": 1}
    if marker.is_file() and json.loads(marker.read_text()) == params:
        print(f"reusing the cached state in {directory}")
        return directory / "rivet.yaml"
    directory.mkdir(parents=True, exist_ok=True)
    for leftover in directory.glob(".rivet_state.db*"):
        leftover.unlink()
    marker.unlink(missing_ok=True)
    started = time.perf_counter()
    config = write_config(directory, exports)
    subprocess.run([statetool, "-c", str(config), "init"], check=True, env=env, capture_output=True)
    state = directory / ".rivet_state.db"
    names = [f"export_{i:04d}" for i in range(exports)]
    db = sqlite3.connect(state, isolation_level=None)
    db.execute("PRAGMA journal_mode=DELETE")  # bulk load without doubling it through the WAL
    db.execute("PRAGMA synchronous=OFF")
    db.execute("PRAGMA cache_size=-200000")
    index_sql = db.execute("SELECT sql FROM sqlite_master WHERE name = 'ix_rivet_runs_export_started'").fetchone()[0]
    db.execute("BEGIN")
    db.execute("DROP INDEX ix_rivet_runs_export_started")
    last_ok: dict[str, datetime] = {}

    def run_rows():  # type: ignore[no-untyped-def]
        for i in range(runs):
            name = names[i % exports]
            start = BASE + timedelta(seconds=6 * i)
            failed = i % 17 == 16
            if not failed:
                last_ok[name] = start
            yield (f"r{i:010d}", name, mode_of(i % exports), "failed" if failed else "succeeded", iso(start),
                   iso(start + timedelta(seconds=5)), 0 if failed else 1000 + i % 5000, 0 if failed else 1,
                   TRACEBACK if failed else None, 0 if failed else 65536, 5000,
                   "RIVET_SOURCE_UNREACHABLE" if failed else None)

    db.executemany("INSERT INTO rivet_runs (run_id, export_name, mode, status, started_at, finished_at, rows, files, "
                   "error, bytes_read, duration_ms, error_code) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", run_rows())
    db.execute(index_sql)
    export_rows, chunk_rows = [], []
    for i, name in enumerate(names):
        mode, at = mode_of(i), iso(last_ok[name] + timedelta(seconds=5))
        cursor = iso(last_ok[name]) if mode == "incremental" else None
        export_rows.append((name, mode, cursor, at if cursor else None, at))
        if mode == "chunked":
            pending = i % 3 == 0
            chunk_rows += [(name, f"last-{name}", k, str(k * 100_000), str((k + 1) * 100_000),
                            "pending" if pending and k == 9 else "done", 100_000, at) for k in range(10)]
    db.executemany("INSERT INTO rivet_exports (export_name, mode, cursor_value, cursor_updated_at, updated_at) "
                   "VALUES (?,?,?,?,?)", export_rows)
    db.executemany("INSERT INTO rivet_chunks (export_name, run_id, chunk_index, lower_bound, upper_bound, status, "
                   "rows, updated_at) VALUES (?,?,?,?,?,?,?,?)", chunk_rows)
    db.execute("COMMIT")
    size = state.stat().st_size
    if size < min_bytes:  # not expected with the traceback above; keeps the size goal honest anyway
        db.execute("CREATE TABLE bench_padding (filler BLOB)")
        db.executemany("INSERT INTO bench_padding VALUES (?)",
                       ((os.urandom(1 << 20),) for _ in range((min_bytes - size) // (1 << 20) + 1)))
    db.execute("ANALYZE")
    db.execute("PRAGMA journal_mode=WAL")  # as statetool init made it
    db.close()
    for i, name in enumerate(names):
        if mode_of(i) == "cdc":
            path = directory / "checkpoints" / f"{name}.json"
            path.parent.mkdir(exist_ok=True)
            path.write_text(json.dumps({"file": "mysql-bin.000417", "pos": 4 + i}))
    marker.write_text(json.dumps(params))
    print(f"built {state} ({state.stat().st_size / GIB:.2f} GiB) in {time.perf_counter() - started:.0f} s")
    return config


def main() -> int:
    def extra(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--runs", type=int, default=5_000_000, help="runs in the state (default 5,000,000)")
        parser.add_argument("--exports", type=int, default=2000, help="exports in the config and state (default 2,000)")
        parser.add_argument("--min-gib", type=float, default=1.0, help="minimum state size in GiB (default 1)")
        parser.add_argument("--cache", type=Path, help="build the state here and keep it for later runs")
        parser.add_argument("--build-only", action="store_true", help="only build the state into --cache")
        parser.add_argument("--no-scaling", dest="scaling", action="store_false",
                            help="skip the table of check/info/doctor at 5 k, 500 k and the full runs")

    args = parse_args(__doc__.splitlines()[0], repeat=5, extra=extra)
    if args.build_only:
        build(str(args.bin / "statetool"), args.cache.absolute(), args.exports, args.runs, int(args.min_gib * GIB),
              measured_env())
        return 0
    compiled = compile_packages(args.python)
    header(f"bench_doctor: statetool doctor on {args.exports} exports, {args.runs:,} runs, >= {args.min_gib:g} GiB",
           args, compiled)
    env = measured_env()
    statetool = str(args.bin / "statetool")
    tmp_obj = None
    if args.cache:
        directory = args.cache.absolute()
    else:
        tmp_obj = tempfile.TemporaryDirectory(prefix="statetool-bench-doctor-")
        directory = Path(tmp_obj.name) / "state"
    scales = {runs: directory.with_name(f"{directory.name}-runs-{runs}") for runs in SCALES if runs < args.runs}

    def build_in_child(place: Path, runs: int, min_gib: float) -> None:
        # Built in a child process: a measured child's peak RSS starts from this process's
        # (vfork/exec keeps the parent's high-water mark), so this process must stay small.
        subprocess.run([args.python, __file__, "--build-only", "--runs", str(runs), "--exports", str(args.exports),
                        "--min-gib", str(min_gib), "--cache", str(place), "--python", args.python],
                       check=True, env=env)

    try:
        build_in_child(directory, args.runs, args.min_gib)
        config = directory / "rivet.yaml"
        state = directory / ".rivet_state.db"
        size = state.stat().st_size
        runs_in_state = sqlite3.connect(f"file:{state}?immutable=1", uri=True).execute(
            "SELECT max(rowid) FROM rivet_runs").fetchone()[0]

        def all_resume(side: str, run: Run) -> None:
            if side != "statetool":
                return
            doc = json.loads(run.stdout)
            verdicts = [e["verdict"] for e in doc["exports"]]
            if len(verdicts) != args.exports or set(verdicts) != {"resumes"}:
                raise SystemExit(f"doctor should find {args.exports} exports resuming: {run.stdout[:2000]}")

        def floor_rows(side: str, run: Run) -> None:
            if side == "peer" and len(run.stdout.splitlines()) < 2 * args.exports:
                raise SystemExit(f"the floor queries returned too little:\n{run.stdout[:500]}\n{run.stderr}")

        def both(side: str, run: Run) -> None:
            all_resume(side, run)
            floor_rows(side, run)

        uri = f"file:{state}?immutable=1"
        shell_sql = ".bail on\n" + ";\n".join(FLOOR_SQL) + ";\n"
        python_floor = ("import sqlite3, sys\n"
                        f"c = sqlite3.connect({uri!r}, uri=True)\n"
                        "c.execute('BEGIN')\n"
                        f"for q in {FLOOR_SQL!r}:\n"
                        "    for row in c.execute(q): print(*row)\n")
        json_case, human_case = "doctor --json vs sqlite3 shell", "doctor (human) vs python sqlite3"
        cases = [
            Case(json_case,
                 lambda: timed(json_case, "statetool", [statetool, "-c", str(config), "--json", "doctor"],
                               directory, env),
                 lambda: timed(json_case, "peer", ["sqlite3", "-readonly", uri], directory, env, stdin=shell_sql),
                 None, check=both),
            Case(human_case,
                 lambda: timed(human_case, "statetool", [statetool, "-c", str(config), "doctor"], directory, env),
                 lambda: timed(human_case, "peer", [args.python, "-c", python_floor], directory, env),
                 None, check=floor_rows),
        ]
        before = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir()}
        measure(cases, args.repeat)
        unchanged = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir()} == before
        scaling: list[Row] = []
        if args.scaling:
            for runs, place in scales.items():
                build_in_child(place, runs, 0)
            scaling = scaling_rows({**{runs: place for runs, place in scales.items()}, runs_in_state: directory},
                                   statetool, env, args.repeat)
    finally:
        if tmp_obj is not None:
            if args.keep:
                print(f"kept {directory}")
            else:
                tmp_obj.cleanup()

    rows, passed = [], True
    for case in cases:
        rss = max(case.rss["statetool"]) / 1024
        goal = GOAL_RATIO if case.name == human_case else None
        ok = None if goal is None else case.ratio <= goal and rss <= GOAL_RSS_MIB
        passed &= ok is not False
        rows.append(Row(case.name, f"{case.median('statetool'):.3f} s", f"{case.median('peer'):.3f} s",
                        f"{case.ratio:.2f}", f"ratio <= {goal:g}, RSS <= {GOAL_RSS_MIB:g} MiB" if goal else "-",
                        "-" if ok is None else "PASS" if ok else "FAIL", f"{rss:.0f} MiB"))
    for case in cases:
        # The warm-up run is recorded too: drop it, as the wall times do.
        cpu, peer_cpu = (statistics.median(CPU[(case.name, side)][1:]) for side in ("statetool", "peer"))
        rows.append(Row(f"CPU (user+sys): {case.name}", f"{cpu:.3f} s", f"{peer_cpu:.3f} s", f"{cpu / peer_cpu:.2f}",
                        "(wall on an idle machine)", "-"))
    for case in cases:
        rss, peer_rss = max(case.rss["statetool"]) / 1024, max(case.rss["peer"]) / 1024
        ok = rss < GOAL_RSS_MIB
        passed &= ok
        rows.append(Row(f"peak RSS: {case.name}", f"{rss:.0f} MiB", f"{peer_rss:.0f} MiB", f"{rss / peer_rss:.2f}",
                        f"< {GOAL_RSS_MIB:g} MiB", "PASS" if ok else "FAIL"))
    print_table(rows, f"doctor on {state.name}: {size / GIB:.2f} GiB, {args.exports} exports, "
                      f"{runs_in_state:,} runs (medians of {args.repeat}; peer = the same queries, the floor)")
    print(f"state directory unchanged by every doctor run (sizes, mtimes): {'yes' if unchanged else 'NO'}")
    if scaling:
        print()
        print(f"How the cost grows ({args.exports} exports; medians of {args.repeat}; statetool --json COMMAND)")
        widths = [max(len(c) for c in col) for col in zip(*(r.cells for r in scaling))]
        for i, r in enumerate(scaling):
            print("  ".join(c.ljust(w) for c, w in zip(r.cells, widths)).rstrip())
            if i == 0:
                print("  ".join("-" * w for w in widths))
        passed &= all(r.rss_ok for r in scaling)
    return 0 if passed and unchanged else 1


@dataclass
class ScaleRow:
    """One line of the scaling table: a state and the medians of each command on it."""

    cells: tuple[str, ...]
    rss_ok: bool = True


#: The read commands whose growth the scaling table shows.
SCALED = ("check", "info", "doctor")


def scaling_rows(states: dict[int, Path], statetool: str, env: dict[str, str], repeat: int) -> list[ScaleRow]:
    """``check``, ``info`` and ``doctor`` (``--json``) timed ``repeat`` times on each state
    (runs -> directory), after one unmeasured run each; one row per state."""
    rows = [ScaleRow(("runs", "file", *(f"{c} median" for c in SCALED), "peak RSS (max)"))]
    for runs, place in sorted(states.items()):
        config = place / "rivet.yaml"
        medians, peak = [], 0
        for command in SCALED:
            cmd = [statetool, "-c", str(config), "--json", command]
            run_child(cmd, cwd=place, env=env)
            times = []
            for _ in range(repeat):
                run = run_child(cmd, cwd=place, env=env)
                if run.returncode not in (0, 3):  # check: 3 would be a pending migration; none expected
                    raise SystemExit(f"{command} on {runs} runs failed ({run.returncode}): {run.stderr[-1000:]}")
                times.append(run.seconds)
                peak = max(peak, run.max_rss_kib)
            medians.append(f"{statistics.median(times):.3f} s")
        size = (place / ".rivet_state.db").stat().st_size
        rows.append(ScaleRow((f"{runs:,}", f"{size / (1 << 20):,.0f} MiB", *medians, f"{peak / 1024:.0f} MiB"),
                             peak / 1024 <= GOAL_RSS_MIB))
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
