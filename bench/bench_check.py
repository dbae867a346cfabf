"""Pre-flight cost: ``statetool check`` vs ``alembic current`` on the bundled example state
(goal: ratio <= 0.4, peak RSS <= 150 MiB).

``alembic current`` is what a DBA runs to read a state's revision without statetool
(alembic.ini at the repository root): one interpreter, SQLAlchemy, alembic, one
connection, one query. ``statetool check`` answers more (location, config, integrity,
identity), but a CI pre-flight that costs more than the plain tool is a reason not to
run it. Since issue 13 a read loads neither SQLAlchemy nor alembic (the standard library's
``sqlite3`` reads the state), so the goal is well below the peer's. The state:
examples/rivet.yaml copied into a temporary directory, built with
``python -m statetool.example --runs 5000`` and migrated to head with ``statetool migrate``.
alembic is pointed at it with a temporary alembic.ini (script_location = the repository's
alembic/, sqlalchemy.url = sqlite:///<state>); its env.py reads the version table
rivet_state_version.

    .venv/bin/python bench/bench_check.py [-n 10]
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (REPO, RSS_GOAL_MIB, Case, Run, compile_packages, header, measure, measured_env,  # noqa: E402
                      parse_args, print_table, ratio_row, run_child)

GOAL = 0.4
RUNS = 5000


def digest(directory: Path) -> dict[str, str]:
    """Every file of the state directory and its SHA-256 (check must change no byte, create no file)."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != "alembic.ini"}


def build(python: str, statetool: str, tmp: Path, env: dict[str, str]) -> tuple[Path, Path]:
    config = tmp / "rivet.yaml"
    shutil.copyfile(REPO / "examples" / "rivet.yaml", config)
    subprocess.run([python, "-m", "statetool.example", "--config", str(config), "--runs", str(RUNS)],
                   check=True, env=env, cwd=tmp, capture_output=True)
    subprocess.run([statetool, "-c", str(config), "--json", "migrate"], check=True, env=env, cwd=tmp,
                   capture_output=True)
    for backup in tmp.glob(".rivet_state.db.backup-*"):
        backup.unlink()  # not part of the state; keeps the directory as an operator would have it
    state = tmp / ".rivet_state.db"
    ini = tmp / "alembic.ini"
    ini.write_text("[alembic]\n"
                   f"script_location = {REPO / 'alembic'}\n"
                   f"sqlalchemy.url = sqlite:///{state}\n")
    return config, ini


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], repeat=10)
    compiled = compile_packages(args.python)
    header(f"bench_check: statetool check vs alembic current (example state, {RUNS} runs, at head)", args, compiled)
    env = measured_env()
    statetool, alembic = str(args.bin / "statetool"), str(args.bin / "alembic")
    tmp_obj = tempfile.TemporaryDirectory(prefix="statetool-bench-check-")
    tmp = Path(tmp_obj.name)
    try:
        config, ini = build(args.python, statetool, tmp, env)
        before = digest(tmp)

        def check_output(side: str, run: Run) -> None:
            if side == "peer" and "(head)" not in run.stdout:
                raise SystemExit(f"alembic current did not report the head revision:\n{run.stdout}\n{run.stderr}")

        peer = lambda: run_child([alembic, "-c", str(ini), "current"], cwd=tmp, env=env)  # noqa: E731
        cases = [
            Case("check", lambda: run_child([statetool, "-c", str(config), "check"], cwd=tmp, env=env), peer,
                 GOAL, check=check_output),
            Case("check --json (info)", lambda: run_child([statetool, "-c", str(config), "--json", "check"],
                                                          cwd=tmp, env=env), peer, None, check=check_output),
        ]
        measure(cases, args.repeat)
        unchanged = digest(tmp) == before
        rss = {side: max(cases[0].rss[side]) / 1024 for side in ("statetool", "peer")}
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            tmp_obj.cleanup()
    print_table([ratio_row(c) for c in cases], "check (medians; peer = alembic -c <tmp>/alembic.ini current)")
    print(f"peak RSS: statetool check {rss['statetool']:.0f} MiB, alembic current {rss['peer']:.0f} MiB "
          f"(goal: statetool <= {RSS_GOAL_MIB:g} MiB)")
    print(f"state directory byte-identical after every check run (read-only): {'yes' if unchanged else 'NO'}")
    return 0 if unchanged and all(c.passed is not False for c in cases) else 1


if __name__ == "__main__":
    raise SystemExit(main())
