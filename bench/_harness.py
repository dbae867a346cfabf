"""Shared plumbing of the benchmarks in bench/: byte-compiling, timing child processes,
alternating the two sides, and printing the result table.

Every bench compares statetool with a *peer* (a program that does the same job, or the
floor below which statetool cannot go) run side by side in the same process, alternating
A B B A ..., and judges the ratio of the medians: on a shared, noisy machine absolute
times drift, ratios measured in the same run much less so.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: Packages whose byte-code must exist before a start-up time means anything.
COMPILED_PACKAGES = ("statetool", "typer", "sqlalchemy", "alembic", "rich", "psycopg",
                     # what those import on the way
                     "yaml", "pygments",
                     "mako", "markdown_it", "mdurl", "shellingham", "annotated_doc", "markupsafe",
                     "typing_extensions")


def parse_args(description: str, repeat: int, extra: Callable[[argparse.ArgumentParser], None] | None = None
               ) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter of the venv where statetool is installed (default: this one); "
                             "its bin/ must hold the statetool and alembic scripts")
    parser.add_argument("-n", "--repeat", type=int, default=repeat, help=f"measured runs per side (default {repeat})")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (printed)")
    if extra:
        extra(parser)
    args = parser.parse_args()
    args.python = str(Path(args.python).absolute())
    args.bin = Path(args.python).parent
    return args


def measured_env(**extra: str) -> dict[str, str]:
    """The environment of measured commands: PYTHONDONTWRITEBYTECODE unset (so the byte-code
    compiled by :func:`compile_packages` is used as in a normal installation), no state URL
    leaking in from the caller, colours off."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "RIVET_STATE_URL")}
    env.update({"NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "100"}, **extra)
    return env


def compile_packages(python: str) -> list[str]:
    """Byte-compile statetool, its dependencies and the alembic revisions, as an installation
    would have them (PYTHONDONTWRITEBYTECODE is set in this environment, so nothing else
    writes .pyc files). Returns the directories compiled."""
    probe = ("import importlib.util, sys\n"
             "for name in sys.argv[1:]:\n"
             "    spec = importlib.util.find_spec(name)\n"
             "    if spec and spec.submodule_search_locations:\n"
             "        print(list(spec.submodule_search_locations)[0])\n"
             "    elif spec and spec.origin:\n"
             "        print(spec.origin)\n")
    found = subprocess.run([python, "-c", probe, *COMPILED_PACKAGES], check=True, capture_output=True,
                           text=True, env=measured_env()).stdout.split()
    targets = found + [str(REPO / "alembic")]
    subprocess.run([python, "-m", "compileall", "-q", *targets], check=True, env=measured_env())
    return targets


@dataclass
class Run:
    seconds: float
    max_rss_kib: int
    returncode: int
    stdout: str
    stderr: str
    #: The child's own CPU time, user + system (seconds): on a loaded machine, where wall
    #: times stretch with the load, what a command costs in CPU moves much less.
    cpu_seconds: float = 0.0


def run_child(cmd: Sequence[str], *, cwd: Path | None = None, env: dict[str, str] | None = None,
              stdin: str | None = None) -> Run:
    """Run ``cmd`` once; wall time and the child's own peak RSS (``os.wait4``: the rusage of
    exactly this child, not the maximum over every child ever waited for)."""
    stdin_file = None
    if stdin is not None:
        stdin_file = tempfile.TemporaryFile("w+")
        stdin_file.write(stdin)
        stdin_file.seek(0)
    with tempfile.TemporaryFile("w+") as so, tempfile.TemporaryFile("w+") as se:
        start = time.perf_counter()
        proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdin=stdin_file or subprocess.DEVNULL,
                                stdout=so, stderr=se)
        _pid, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        so.seek(0)
        se.seek(0)
        result = Run(seconds, usage.ru_maxrss, proc.returncode, so.read(), se.read(),
                     usage.ru_utime + usage.ru_stime)
    if stdin_file is not None:
        stdin_file.close()
    return result


@dataclass
class Case:
    """One row of the table: a statetool command and its peer, each a callable doing one run
    (``prepare`` callables run before each measured run, untimed)."""

    name: str
    statetool: Callable[[], Run]
    peer: Callable[[], Run]
    goal_ratio: float | None
    goal_text: str = ""
    prepare_statetool: Callable[[], None] | None = None
    prepare_peer: Callable[[], None] | None = None
    check: Callable[[str, Run], None] | None = None
    times: dict[str, list[float]] = field(default_factory=lambda: {"statetool": [], "peer": []})
    rss: dict[str, list[int]] = field(default_factory=lambda: {"statetool": [], "peer": []})

    def once(self, side: str, record: bool) -> Run:
        prepare = self.prepare_statetool if side == "statetool" else self.prepare_peer
        if prepare is not None:
            prepare()
        run = (self.statetool if side == "statetool" else self.peer)()
        if run.returncode != 0:
            raise SystemExit(f"[{self.name}] {side} failed with exit code {run.returncode}:\n"
                             f"{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
        if self.check is not None:
            self.check(side, run)
        if record:
            self.times[side].append(run.seconds)
            self.rss[side].append(run.max_rss_kib)
        return run

    def median(self, side: str) -> float:
        return statistics.median(self.times[side])

    @property
    def ratio(self) -> float:
        return self.median("statetool") / self.median("peer")

    @property
    def passed(self) -> bool | None:
        return None if self.goal_ratio is None else self.ratio <= self.goal_ratio


def measure(cases: Sequence[Case], repeat: int, warmup: int = 1, log: Callable[[str], None] = print) -> None:
    """Warm up, then ``repeat`` rounds per case alternating the order (A B, then B A, ...)
    so that drift of the machine hits both sides alike."""
    for case in cases:
        for _ in range(warmup):
            case.once("statetool", record=False)
            case.once("peer", record=False)
        for i in range(repeat):
            order = ("statetool", "peer") if i % 2 == 0 else ("peer", "statetool")
            for side in order:
                case.once(side, record=True)
            log(f"  {case.name}: round {i + 1}/{repeat}: statetool {case.times['statetool'][-1]:.3f} s, "
                f"peer {case.times['peer'][-1]:.3f} s")


@dataclass
class Row:
    case: str
    statetool: str
    peer: str
    ratio: str
    goal: str
    result: str
    #: statetool's peak RSS over the measured runs (the goal of every command: <= 150 MiB).
    rss: str = ""


def print_table(rows: Sequence[Row], title: str) -> None:
    headers = Row("case", "statetool median", "peer median", "ratio", "goal", "pass/fail", "peak RSS")
    cells_of = [(r.case, r.statetool, r.peer, r.ratio, r.goal, r.result, r.rss) for r in [headers, *rows]]
    widths = [max(len(c) for c in col) for col in zip(*cells_of)]
    print()
    print(title)
    line = "  ".join("-" * w for w in widths)
    for i, cells in enumerate(cells_of):
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
        if i == 0:
            print(line)


#: Peak RSS every statetool command must stay under (issue 13), MiB.
RSS_GOAL_MIB = 150.0


def peak_rss_mib(case: Case) -> float:
    """statetool's highest peak RSS over the measured runs of ``case``, in MiB."""
    return max(case.rss["statetool"]) / 1024


def ratio_row(case: Case) -> Row:
    """The table row of ``case``: medians, ratio, goal, pass/fail (the ratio's and the peak
    RSS's, :data:`RSS_GOAL_MIB`), and statetool's peak RSS."""
    ok = case.passed
    rss = peak_rss_mib(case)
    if rss > RSS_GOAL_MIB:
        ok = False
    return Row(case.name, f"{case.median('statetool'):.3f} s", f"{case.median('peer'):.3f} s", f"{case.ratio:.2f}",
               case.goal_text or (f"ratio <= {case.goal_ratio:g}" if case.goal_ratio is not None else "-"),
               "-" if ok is None else ("PASS" if ok else "FAIL"), f"{rss:.0f} MiB")


def header(title: str, args: argparse.Namespace, compiled: list[str]) -> None:
    print(title)
    print(f"python: {args.python} ({sys.version.split()[0]} running the bench); repeat={args.repeat}, "
          "sides alternated, warm-up run of each side not counted")
    print(f"byte-compiled first (python -m compileall -q) {len(compiled)} package dirs incl. "
          f"{', '.join(Path(c).name for c in compiled[:6])} ...; measured commands run with "
          "PYTHONDONTWRITEBYTECODE unset")


def pg_bindir() -> Path:
    """The PostgreSQL server binaries: ``STATETOOL_PG_BIN``, else the newest
    ``/usr/lib/postgresql/*/bin``; exits with a clear message when there are none."""
    explicit = os.environ.get("STATETOOL_PG_BIN")
    if explicit:
        return Path(explicit)
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if not found:
        raise SystemExit("PostgreSQL server binaries not found (apt-get install postgresql), "
                         "and STATETOOL_TEST_PG_URL is not set")
    return Path(found[-1]).parent


def as_postgres(cmd: list[str]) -> list[str]:
    """``cmd`` run as the ``postgres`` user when this process is root (the server refuses root)."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd
