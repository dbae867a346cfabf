"""Real processes that skip the import: forked from a server that imported statetool once.

A CLI process costs about 0.8 s of CPU before it does anything (the interpreter, typer,
rich, SQLAlchemy, psycopg); the crash sweeps and the lease chaos start hundreds. Here the
standard library's fork server (:mod:`multiprocessing`, start method ``forkserver``)
imports every statetool module once, in a single-threaded process of its own, and each
run is a ``fork()`` of it: a real process with its own pid, its own descriptors, locks
and leases, that a signal reaches and SIGKILL kills, whose exit status the test reads.
What it does not have is the interpreter's start-up: the tests where that is what is
tested (the installed entry point, stdin, another user, the interpreter's encoding,
resource limits) keep :func:`support.cli.run_cli_process`.

The child gets exactly the environment, working directory, umask and session it is
given, its stdin is ``/dev/null``, and its stdout and stderr are the descriptors given
(inherited through the server), so what it sees is what a ``python -m statetool``
process started with them sees. docs/decisions.md "The test suite" has the rule.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
import pkgutil
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from multiprocessing import reduction
from pathlib import Path
from typing import IO, Any

import statetool
from support.cli import process_env

#: What the server imports before it forks anything: every statetool module and the
#: drivers a run loads lazily.
DRIVERS = ("sqlalchemy.dialects.sqlite.pysqlite", "sqlalchemy.dialects.postgresql.psycopg", "psycopg",
           "alembic.command", "alembic.runtime.migration", "alembic.script", "alembic.operations", "yaml",
           "typer.main", "rich._emoji_codes", "support.crash_driver", "support.forked")
_CONTEXT = multiprocessing.get_context("forkserver")
#: multiprocessing's bookkeeping of children is not made for threads starting them at once.
_STARTING = threading.RLock()
_server_started = False
#: The children not yet seen to end: any still running at exit is killed (:func:`_kill_leftovers`).
_RUNNING: set[Forked] = set()
_TESTS = Path(__file__).resolve().parents[1]
PACKAGE_ROOT = Path(statetool.__file__).resolve().parents[1]

#: Where a child's stdout or stderr goes: ``None`` (``/dev/null``), ``subprocess.PIPE``
#: (captured, read by :meth:`Forked.communicate`), or an open file.
Sink = int | IO[Any] | None


def preload() -> list[str]:
    """The modules a fork server imports before it forks anything (also the zygote's)."""
    names = [m.name for m in pkgutil.walk_packages(statetool.__path__, "statetool.")]
    return ["statetool", *(n for n in names if n != "statetool.__main__"), *DRIVERS]


@contextmanager
def _server_environment() -> Iterator[None]:
    """While the server starts: the package and ``tests`` first on its PYTHONPATH (it
    imports ``support.forked``, whose function every child runs)."""
    saved_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), str(_TESTS), *filter(None, [saved_path])])
    try:
        yield
    finally:
        if saved_path is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved_path


def start_server() -> None:
    """Start the fork server of this test process unless it runs (it imports everything
    once, about a second; it ends with this process). Only the first call changes this
    process's PYTHONPATH, for a moment, under :data:`_STARTING`."""
    global _server_started
    with _STARTING:
        if _server_started:
            return
        _CONTEXT.set_forkserver_preload(preload())
        with _server_environment():
            multiprocessing.forkserver.ensure_running()
        atexit.register(_kill_leftovers)
        _server_started = True


def _kill_leftovers() -> None:
    """At exit, SIGKILL every child still running: multiprocessing would otherwise wait
    for it (a holder a failed test left behind would hang the test process)."""
    for child in list(_RUNNING):
        child.kill()


def _running(pid: int) -> bool:
    """True while ``pid`` runs: it is in /proc and neither a zombie nor dead."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] not in (b"Z", b"X")


def _umask() -> int:
    """This process's umask, read without setting it (``/proc/self/status``; setting and
    restoring it would change it for every thread meanwhile)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    raise AssertionError("no Umask line in /proc/self/status")


class _Descriptor:
    """A descriptor of this process, pickled as a duplicate the child inherits through the
    server (multiprocessing's ``DupFd``)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _inherited, (reduction.DupFd(self.fd),)


def _inherited(duplicate: Any) -> int:
    return duplicate.detach()


def _child(kind: str, target: str, argv: list[str], env: dict[str, str], cwd: str, umask: int,
           out: int, err: int, new_session: bool) -> None:
    """The child's whole life: its descriptors, session, environment, umask and cwd, then
    the run. ``kind`` ``cli`` runs ``statetool.cli.main(argv)``; ``code`` runs ``target``
    as ``python -c`` does (``sys.argv`` ``["-c", *argv]``); ``call`` runs the function
    ``module:name`` of ``target`` with ``argv`` and exits with what it returns."""
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    if new_session:
        os.setsid()
    os.environ.clear()
    os.environ.update(env)
    os.umask(umask)
    os.chdir(cwd)
    if kind == "cli":
        from statetool.cli import main

        sys.argv = [str(Path(statetool.__file__).with_name("__main__.py")), *argv]
        main(argv)
    elif kind == "code":
        sys.argv = ["-c", *argv]
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})  # noqa: S102
    else:
        module, name = target.split(":")
        sys.argv = [module, *argv]
        raise SystemExit(getattr(__import__(module, fromlist=[name]), name)(argv))


class Forked:
    """A process forked from the server: the part of :class:`subprocess.Popen` the tests
    use (``pid``, ``returncode``, ``stdout``/``stderr`` as text streams when captured,
    ``poll``, ``wait``, ``send_signal``, ``kill``, ``terminate``, ``communicate``).
    ``returncode`` is the exit code, or minus the signal that killed it, as Popen's."""

    def __init__(self, kind: str, target: str, argv: Sequence[str], *, env: dict[str, str], cwd: Path | str | None,
                 stdout: Sink, stderr: Sink, new_session: bool) -> None:
        start_server()
        self.args = [kind, target, *argv]
        self.stdout: IO[str] | None = None
        self.stderr: IO[str] | None = None
        ends = [self._end(name, sink) for name, sink in (("stdout", stdout), ("stderr", stderr))]
        umask = _umask()
        self._process = _CONTEXT.Process(target=_child, daemon=False, args=(
            kind, target, list(argv), dict(env), str(cwd or os.getcwd()), umask,
            _Descriptor(ends[0][0]), _Descriptor(ends[1][0]), new_session))
        try:
            with _STARTING:
                self._process.start()
        finally:
            for fd, owned in ends:
                if owned:
                    os.close(fd)
        assert self._process.pid is not None
        self.pid: int = self._process.pid
        _RUNNING.add(self)

    def _end(self, name: str, sink: Sink) -> tuple[int, bool]:
        """The descriptor the child writes ``name`` to, and whether it is this object's to
        close once the child has it (a pipe's write end, ``/dev/null``)."""
        if sink is None or sink == subprocess.DEVNULL:
            return os.open(os.devnull, os.O_WRONLY), True
        if sink == subprocess.PIPE:
            read, write = os.pipe()
            setattr(self, name, open(read, encoding="utf-8", errors="backslashreplace"))  # noqa: SIM115
            return write, True
        assert not isinstance(sink, int), f"{name}: None, subprocess.PIPE, DEVNULL or an open file"
        return sink.fileno(), False

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        """The exit code once the process has ended, else None. The fork server reaps the
        child and sends its status a moment later; a child already dead (a zombie, or
        gone from /proc) is waited for, so that, as with Popen, a signal is never sent to
        a process that has ended."""
        code = self._process.exitcode
        if code is None and not _running(self.pid):
            code = self.wait()
        if code is not None:
            _RUNNING.discard(self)
        return code

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        _RUNNING.discard(self)
        return code

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` unless the process has ended (its pid may be another's by then)."""
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Read the captured streams to their end and wait for the exit
        (:class:`subprocess.TimeoutExpired` after ``timeout`` seconds); returns stdout and
        stderr as text ("" for one not captured)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        streams = {s.fileno(): s for s in (self.stdout, self.stderr) if s is not None}
        chunks: dict[int, list[bytes]] = {fd: [] for fd in streams}
        with selectors.DefaultSelector() as selector:
            for fd in streams:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
                for key, _events in selector.select(left):
                    data = os.read(key.fd, 1 << 16)
                    if data:
                        chunks[key.fd].append(data)
                    else:
                        selector.unregister(key.fd)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        texts = [b"".join(chunks[s.fileno()]).decode("utf-8", "backslashreplace") if s is not None else ""
                 for s in (self.stdout, self.stderr)]
        for stream in streams.values():
            stream.close()
        return texts[0], texts[1]


def fork_cli(*args: str, env: dict[str, str], cwd: Path | str | None = None, stdout: Sink = subprocess.PIPE,
             stderr: Sink = subprocess.PIPE, new_session: bool = False) -> Forked:
    """Start ``statetool ARGS`` in a forked process with exactly the environment ``env``
    (see :func:`support.cli.process_env`)."""
    return Forked("cli", "", [str(a) for a in args], env=env, cwd=cwd, stdout=stdout, stderr=stderr,
                  new_session=new_session)


def fork_code(code: str, *args: str, env: dict[str, str], cwd: Path | str | None = None, stdout: Sink = None,
              stderr: Sink = None, new_session: bool = False) -> Forked:
    """Start ``python -c CODE ARGS`` in a forked process (its imports of statetool are done)."""
    return Forked("code", code, [str(a) for a in args], env=env, cwd=cwd, stdout=stdout, stderr=stderr,
                  new_session=new_session)


def fork_call(function: str, *args: str, env: dict[str, str], cwd: Path | str | None = None,
              stdout: Sink = subprocess.PIPE, stderr: Sink = subprocess.PIPE) -> Forked:
    """Start ``module:function(args)`` in a forked process; its return value is the exit code."""
    return Forked("call", function, [str(a) for a in args], env=env, cwd=cwd, stdout=stdout, stderr=stderr,
                  new_session=False)


def run_cli_forked(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
                   timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """:func:`support.cli.run_cli_process` in a forked process: the same environment
    (:func:`support.cli.process_env` with ``env`` on top), output and exit code, without the
    interpreter's start-up; :class:`subprocess.TimeoutExpired` after ``timeout`` seconds
    (the process is killed first)."""
    proc = fork_cli(*args, env=process_env(env), cwd=cwd)
    try:
        stdout, stderr = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(proc.args, proc.wait(), stdout, stderr)
