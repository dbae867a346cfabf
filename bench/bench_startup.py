"""Start-up cost: ``statetool --help`` vs ``python -c 'import typer'`` (goal: ratio <= 1.1,
peak RSS <= 150 MiB).

cli.py promises that start-up costs about what ``import typer`` does: only typer and the
error registry load before a command runs (issue 13 item 5; tests/test_read_imports.py
checks the module list). Both sides use the venv's interpreter.

    .venv/bin/python bench/bench_startup.py [-n 20]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import Case, compile_packages, header, measure, measured_env, parse_args, print_table, ratio_row, run_child  # noqa: E402

GOAL = 1.1


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], repeat=20)
    compiled = compile_packages(args.python)
    header("bench_startup: statetool --help vs python -c 'import typer'", args, compiled)
    env = measured_env()
    statetool = str(args.bin / "statetool")
    with tempfile.TemporaryDirectory(prefix="statetool-bench-startup-") as tmp:
        cwd = Path(tmp)  # no rivet.yaml, no state: --help must not need one

        def check(side: str, run: object) -> None:
            if side == "statetool" and "Usage" not in run.stdout:  # type: ignore[attr-defined]
                raise SystemExit("statetool --help printed no usage")

        cases = [
            Case("statetool --help", lambda: run_child([statetool, "--help"], cwd=cwd, env=env),
                 lambda: run_child([args.python, "-c", "import typer"], cwd=cwd, env=env),
                 GOAL, check=check),
            Case("statetool --version (info)", lambda: run_child([statetool, "--version"], cwd=cwd, env=env),
                 lambda: run_child([args.python, "-c", "import typer"], cwd=cwd, env=env), None),
        ]
        floor = [run_child([args.python, "-c", "pass"], cwd=cwd, env=env).seconds for _ in range(args.repeat)]
        measure(cases, args.repeat)
        floor += [run_child([args.python, "-c", "pass"], cwd=cwd, env=env).seconds for _ in range(args.repeat)]
    print_table([ratio_row(c) for c in cases], "Start-up (medians; peer = python -c 'import typer')")
    print(f"interpreter floor (python -c pass), median: {statistics.median(floor):.3f} s")
    return 0 if all(c.passed is not False for c in cases) else 1


if __name__ == "__main__":
    raise SystemExit(main())
