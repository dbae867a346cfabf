"""The two ways the tests run the CLI.

:func:`run_cli` runs ``statetool.cli.main(argv)`` in this process, under typer's test
isolation (stdin empty, stdout and stderr captured, the environment overridden), at a
fixed width of 200 columns (or the ``columns`` a run asks for, or none, as in a log)
without colour, in ``cwd``; everything a run could leave behind is put back afterwards
(environment, cwd, umask, signal handlers, logging), so runs are as independent as
processes. :func:`run_cli_process` runs the installed package
(``python -m statetool``) as a real process, for the tests where the process is what is
tested: a signal, a crash or SIGKILL, a lease held by another process, stdin or a
terminal, exit by ``os._exit``, or ``leases run -- CMD``, which forks a child.
docs/decisions.md "The test suite: in-process runs, shared states, three workers" has
the rule.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from typer.testing import CliRunner

#: What every run sees on top of the environment: a fixed width, no colour.
FIXED_ENV = {"COLUMNS": "200", "NO_COLOR": "1"}
#: The width of a run that asks for no other.
DEFAULT_COLUMNS = int(FIXED_ENV["COLUMNS"])
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE, signal.SIGALRM, signal.SIGCHLD)


class Output(Protocol):
    """A finished run: ``returncode``, ``stdout``, ``stderr`` (text)."""

    returncode: int
    stdout: str
    stderr: str


@dataclass
class CliRun:
    """One in-process run: ``args`` as given, the exit code and the captured text (the
    attributes of :class:`subprocess.CompletedProcess` the tests read)."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


class CliTimeout(BaseException):
    """An in-process run took longer than its ``timeout`` (a BaseException, so that the
    CLI's own handlers do not turn it into an error object)."""


def exit_code(done: SystemExit) -> int:
    """The status a process ending with ``done`` exits with (None 0, an int itself, else 1)."""
    return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)


def describe(proc: Output) -> str:
    """The output of a CLI run (in-process or a process), for assertion messages."""
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"


def _forks(args: list[str]) -> bool:
    """True for ``leases run`` (before any ``--``)."""
    head = args[:args.index("--")] if "--" in args else args
    return any(a == "leases" and b == "run" for a, b in zip(head, head[1:]))


def _overrides(env: dict[str, str] | None, columns: int | None) -> dict[str, str | None]:
    """The environment of one run: RIVET_STATE_URL removed unless ``env`` gives it, no
    colour, ``COLUMNS`` set to ``columns`` (removed for None: stdout is no terminal, so
    the run has no width at all, as in a log), then ``env``."""
    return {"RIVET_STATE_URL": None, **FIXED_ENV, "COLUMNS": None if columns is None else str(columns), **(env or {})}


@contextmanager
def _deadline(timeout: float) -> Iterator[None]:
    """Raise :class:`CliTimeout` in the body after ``timeout`` seconds (SIGALRM, so only
    while Python code runs: a wait inside C, such as SQLite's busy handler, ends at its own
    timeout first). Armed around the body alone, so a timeout never interrupts the
    restoring of streams and process settings around it."""
    def expire(signum: int, frame: object) -> None:
        raise CliTimeout(f"the run took longer than {timeout} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def _restored(cwd: Path | None) -> Iterator[None]:
    """Run the body in ``cwd`` with no remembered secrets (a new process knows none) and
    put back what a run may change: the environment as a whole, cwd, umask, signal
    handlers, the root logger, the remembered secrets."""
    from statetool import redact

    saved_secrets = set(redact._secrets)
    redact._secrets.clear()
    saved_env = dict(os.environ)
    saved_cwd = os.getcwd()
    saved_umask = os.umask(0o022)
    os.umask(saved_umask)
    saved_signals = {s: signal.getsignal(s) for s in _SIGNALS}
    root = logging.getLogger()
    saved_logging = (root.level, list(root.handlers), logging.root.manager.disable)
    try:
        if cwd is not None:
            os.chdir(cwd)
        yield
    finally:
        os.chdir(saved_cwd)
        os.umask(saved_umask)
        for signum, handler in saved_signals.items():
            signal.signal(signum, handler)
        root.setLevel(saved_logging[0])
        root.handlers[:] = saved_logging[1]
        logging.disable(saved_logging[2])
        os.environ.clear()
        os.environ.update(saved_env)
        redact._secrets.clear()
        redact._secrets.update(saved_secrets)


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
            timeout: float = 120, columns: int | None = DEFAULT_COLUMNS) -> CliRun:
    """Run ``statetool ARGS`` in this process (``statetool.cli.main``) and return its exit
    code, stdout and stderr: stdin empty, ``columns`` wide (200; None: no ``COLUMNS``, as
    in a log, where stdout is no terminal), no colour, no RIVET_STATE_URL unless ``env``
    gives one, in ``cwd``; fails the test after ``timeout`` seconds. Main thread only (the
    isolation swaps the process's stdout; threads use :func:`run_cli_process`)."""
    from statetool.cli import main

    given = [str(arg) for arg in args]
    assert threading.current_thread() is threading.main_thread(), \
        "run_cli swaps this process's stdout and cwd: from a thread use run_cli_process"
    overrides = _overrides(env, columns)
    runner = CliRunner()
    code = 0
    with _restored(cwd), runner.isolation(env=overrides) as (out, err, _):
        try:
            with _deadline(timeout):
                main(given)
        except SystemExit as done:
            code = exit_code(done)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        stdout, stderr = out.getvalue().decode(), err.getvalue().decode("utf-8", "backslashreplace")
    return CliRun(given, code, stdout, stderr)


def process_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a CLI process the tests start: theirs without RIVET_STATE_URL,
    200 columns, no colour, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "RIVET_STATE_URL"}
    env.update(FIXED_ENV)
    env.update(extra or {})
    return env


def run_cli_process(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
                    timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the real CLI (``python -m statetool``) in a subprocess: the environment of the
    tests, no RIVET_STATE_URL unless ``env`` gives one, 200 columns, no colour, ``env``
    on top; raises :class:`subprocess.TimeoutExpired` after ``timeout`` seconds."""
    return subprocess.run([sys.executable, "-m", "statetool", *args], cwd=cwd, env=process_env(env), text=True,
                          capture_output=True, timeout=timeout)


def run_cli_as_needed(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
                      timeout: float = 120) -> Output:
    """For tables of commands that mix both kinds: :func:`run_cli_process` for ``leases
    run`` (it forks the command), :func:`run_cli` for everything else."""
    runner = run_cli_process if _forks([str(arg) for arg in args]) else run_cli
    return runner(*args, cwd=cwd, env=env, timeout=timeout)
