"""Read commands load no SQLAlchemy, no alembic and no pydantic (issue 13 items 1 and 5;
docs/decisions.md, "Reads without SQLAlchemy"): the real CLI runs in a fresh interpreter
against a real state, on SQLite and on PostgreSQL, and reports what it imported. Start-up
(``--help``) loads typer and the error registry only, and converts to click commands only
what it shows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support import describe, process_env, tree_digest, write_config
from support.backends import StateBackend
from support.states import build_state

#: Packages a read command must not import: the write engine, the migration engine, and
#: what a newer typer would pull in.
FORBIDDEN = ("sqlalchemy", "alembic", "pydantic")

#: What a command whose page is lines only (``doctor``) needs none of: rich lays out
#: tables, OpenSSL hashes copies, threads check pages, temporary directories hold private
#: copies, a socket names the host of an audit row (issue 13: on 2,000 exports their
#: start-up was a third of doctor's time).
UNNEEDED_BY_DOCTOR = ("rich", "_hashlib", "concurrent", "tempfile", "socket")

#: Runs ``python -m statetool ARGS`` in this interpreter, then prints (on fd 3's stand-in:
#: the last line of stderr) the exit code and the modules of the packages named (``%r``)
#: it imported.
_DRIVER = """\
import json, runpy, sys
sys.argv = ["statetool", *sys.argv[1:]]
code = 0
try:
    runpy.run_module("statetool", run_name="__main__", alter_sys=True)
except SystemExit as done:
    code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
sys.stdout.flush()
sys.stderr.write("\\nIMPORTS " + json.dumps({"code": code, "modules": sorted(
    m for m in sys.modules if m.split(".")[0] in %r)}) + "\\n")
"""

#: Every read command of issue 13 item 1, and the exit codes a state built by
#: :func:`build_state` gives them (``check``: 0; ``doctor``: 0, nothing is a first run).
READ_COMMANDS = (("check",), ("--json", "check"), ("info",), ("--json", "info"), ("doctor",), ("checkpoints",),
                 ("revisions",), ("exports", "list"), ("exports", "show", "orders"), ("leases",), ("leases", "list"),
                 ("--json", "leases", "list"), ("metrics",))


def imports_of(*args: str, cwd: Path, env: dict[str, str] | None = None,
               packages: tuple[str, ...] = FORBIDDEN) -> tuple[int, list[str], str]:
    """``(exit code, modules of ``packages`` imported, output)`` of ``statetool ARGS`` run
    in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", _DRIVER % (packages,), *args], cwd=cwd, env=process_env(env),
                          text=True, capture_output=True, timeout=120)
    marker = proc.stderr.rsplit("\nIMPORTS ", 1)
    assert len(marker) == 2, describe(proc)
    doc = json.loads(marker[1])
    return doc["code"], doc["modules"], proc.stdout + marker[0]


@pytest.mark.parametrize("args", READ_COMMANDS, ids=" ".join)
def test_a_read_command_imports_no_sqlalchemy_alembic_or_pydantic(state_backend: StateBackend, args: tuple[str, ...]
                                                                   ) -> None:
    config = write_config(state_backend.pipeline)
    build_state(config, state_backend.url, checkpoint_dir=config.parent, env=state_backend.env)
    before = tree_digest(config.parent)
    code, modules, output = imports_of("-c", str(config), *args, cwd=config.parent, env=state_backend.env)
    assert code == 0, output
    assert modules == [], f"statetool {' '.join(args)} on {state_backend.kind} imported {modules[:8]}"
    assert tree_digest(config.parent) == before, "a read changed or created a file"


@pytest.mark.parametrize("args", [("doctor",), ("--json", "doctor")], ids=" ".join)
def test_doctor_loads_no_rich_openssl_threads_tempfile_or_socket(tmp_path: Path, args: tuple[str, ...]) -> None:
    config = write_config(tmp_path)
    build_state(config, checkpoint_dir=config.parent)
    code, modules, output = imports_of("-c", str(config), *args, cwd=tmp_path, packages=UNNEEDED_BY_DOCTOR)
    assert code == 0, output
    assert "resumes" in output, output
    assert modules == [], f"statetool {' '.join(args)} imported {modules[:8]}"


#: What ``leases run`` needs none of (bench_leases.py goal 1: at most 30 ms over ``--help``;
#: docs/decisions.md, "leases run: what start-up does not pay for"): the write and migration
#: engines, rich, ``dataclasses`` (a frozen dataclass costs about a millisecond to build),
#: ``socket`` (the holder's host is uname's node name) and ``random`` (only a wait jitters).
UNNEEDED_BY_LEASES_RUN = (*FORBIDDEN, "rich", "dataclasses", "socket", "random")

#: Runs ``python -m statetool ARGS`` and prints on the last line of stderr how many objects
#: the collector had frozen when the command under the lease started.
_FROZEN_AT_START = """\
import gc, json, runpy, subprocess, sys
frozen = []
start = subprocess.Popen._execute_child
def counted(*args, **kwargs):
    frozen.append(gc.get_freeze_count())
    return start(*args, **kwargs)
subprocess.Popen._execute_child = counted
sys.argv = ["statetool", *sys.argv[1:]]
try:
    runpy.run_module("statetool", run_name="__main__", alter_sys=True)
except SystemExit:
    pass
sys.stderr.write("\\nFROZEN " + json.dumps(frozen) + "\\n")
"""


def test_leases_run_loads_no_dataclasses_socket_random_or_engine(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    build_state(config, checkpoint_dir=config.parent)
    code, modules, output = imports_of("-c", str(config), "leases", "run", "--export", "orders", "--", "true",
                                       cwd=tmp_path, packages=UNNEEDED_BY_LEASES_RUN)
    assert code == 0, output
    assert modules == [], f"statetool leases run imported {modules[:8]}"


def test_leases_run_freezes_what_start_up_built_before_its_command_starts(tmp_path: Path) -> None:
    """The wrapper's start-up objects (typer's tree, the modules: about 18,000) live until
    it exits; frozen before the command starts, neither the collections while it runs nor
    the full ones at interpreter exit traverse them."""
    config = write_config(tmp_path)
    build_state(config, checkpoint_dir=config.parent)
    proc = subprocess.run([sys.executable, "-c", _FROZEN_AT_START, "-c", str(config), "leases", "run", "--export",
                           "orders", "--", "true"], cwd=tmp_path, env=process_env(), text=True, capture_output=True,
                          timeout=120)
    marker = proc.stderr.rsplit("\nFROZEN ", 1)
    assert proc.returncode == 0 and len(marker) == 2, describe(proc)
    frozen = json.loads(marker[1])
    assert len(frozen) == 1 and frozen[0] > 5000, frozen


def test_a_read_of_a_legacy_state_imports_no_sqlalchemy_either(tmp_path: Path) -> None:
    """A state waiting for its migration (no version table) is read the same way: ``check``
    reports the pending migration (exit 3) without loading the migration engine."""
    from statetool.example import build_legacy_state
    from statetool.location import STATE_FILE

    config = write_config(tmp_path)
    build_legacy_state(config.parent / STATE_FILE, [("orders", "incremental"), ("order_lines", "chunked")], runs=50)
    code, modules, output = imports_of("-c", str(config), "check", cwd=tmp_path)
    assert code == 3, output
    assert "RIVET_STATE_MIGRATION_PENDING" in output, output
    assert modules == [], modules


#: What ``statetool ARGS`` loads of statetool (and of the packages start-up must not load):
#: the CLI, its help and the registry; below the root, the root's callback runs before the
#: help, and it loads :mod:`statetool.redact` (to mask the command line it records).
START_UP = ["statetool", "statetool.cli", "statetool.cli_help", "statetool.errors"]
HELP_IMPORTS = {("--help",): START_UP, ("exports", "--help"): [*START_UP, "statetool.redact"],
                ("migrate", "--help"): [*START_UP, "statetool.redact"],
                ("exports", "set-cursor", "--help"): [*START_UP, "statetool.redact"],
                ("leases", "run", "--help"): [*START_UP, "statetool.redact"]}


@pytest.mark.parametrize("args", list(HELP_IMPORTS), ids=" ".join)
def test_help_imports_only_typer_and_the_registry(tmp_path: Path, args: tuple[str, ...]) -> None:
    """``statetool --help`` (issue 13 item 5): of statetool, only the CLI, its help and the
    error registry load; no YAML, no rich, no ``dataclasses``, no database driver. A
    command's help loads no more than the masking of the command line."""
    code = (f"import runpy, sys; sys.argv = ['statetool', *{list(args)!r}]\n"
            "try:\n    runpy.run_module('statetool', run_name='__main__', alter_sys=True)\n"
            "except SystemExit:\n    pass\n"
            "print('\\nMODULES', sorted(m for m in sys.modules if m.split('.')[0] in "
            "('statetool', 'sqlalchemy', 'alembic', 'pydantic', 'yaml', 'psycopg', 'sqlite3', 'rich', 'dataclasses')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=process_env(), text=True,
                          capture_output=True, timeout=120)
    assert proc.returncode == 0 and "Usage: statetool" in proc.stdout, describe(proc)
    loaded = proc.stdout.rsplit("\nMODULES ", 1)[1].strip()
    assert loaded == str(HELP_IMPORTS[args]), loaded


#: Runs ``python -m statetool ARGS`` with typer's two converters (a command's function to
#: its click command, a typer app to its click group) counted, and prints on the last line
#: of stderr the names of what was converted (the root group is ``""``), in order.
_CONVERSIONS = """\
import json, runpy, sys
import typer.main
built = []
def counted(convert):
    def wrapper(*args, **kwargs):
        command = convert(*args, **kwargs)
        built.append(command.name)
        return command
    return wrapper
typer.main.get_command_from_info = counted(typer.main.get_command_from_info)
typer.main.get_group_from_info = counted(typer.main.get_group_from_info)
sys.argv = ["statetool", *sys.argv[1:]]
try:
    runpy.run_module("statetool", run_name="__main__", alter_sys=True)
except SystemExit:
    pass
sys.stdout.flush()
sys.stderr.write("\\nBUILT " + json.dumps(built) + "\\n")
"""


#: ``statetool ARGS`` -> what it converts (:data:`_CONVERSIONS`), and a line of what it prints.
CONVERTED = {("--help",): ([""], "Commands:\n  info "),
             ("exports", "--help"): (["", "exports"], "Commands:\n  list "),
             ("exports", "show", "--help"): (["", "exports", "show"], "Usage: statetool exports show [OPTIONS] NAME"),
             ("info", "--help"): (["", "info"], "Usage: statetool info [OPTIONS]"),
             ("--version",): ([""], "statetool "),
             ("infoo",): ([""], "No such command 'infoo'. Did you mean 'info'?")}


@pytest.mark.parametrize("args", list(CONVERTED), ids=" ".join)
def test_the_cli_converts_only_the_commands_it_runs_or_shows(tmp_path: Path, args: tuple[str, ...]) -> None:
    """Issue 13 item 5: the click tree is lazy (``cli_help.lazy_command_tree``). Help
    lists a group's commands from their registrations, an unknown command is judged (and a
    close one suggested) by name, and only the command that runs or shows its help is
    converted from its function, the groups on its way too."""
    built, shown = CONVERTED[args]
    proc = subprocess.run([sys.executable, "-c", _CONVERSIONS, *args], cwd=tmp_path, env=process_env(), text=True,
                          capture_output=True, timeout=120)
    marker = proc.stderr.rsplit("\nBUILT ", 1)
    assert len(marker) == 2, describe(proc)
    assert shown in proc.stdout + marker[0], describe(proc)
    assert json.loads(marker[1]) == built, describe(proc)
