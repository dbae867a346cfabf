"""Leases (SPEC §5, issue #3), end to end on both backends.

Real processes hold real leases: ``statetool leases run`` wrappers around a small Python
command, or the library's ``holding`` in subprocesses (forked from the server that imported
statetool once, :mod:`support.forked`; the commands under ``leases run`` are exec'd as
usual). Holders are killed with SIGKILL,
waiters really wait. "Another host" on PostgreSQL is a row whose ``holder_host`` is
another name. A wait for a condition polls with a deadline; no test asserts speed with a
sleep. Every shared rule runs on SQLite (state beside the config) and PostgreSQL (a
schema of its own on a throwaway server).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
import types
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pytest

from support import (CliRun, Forked, declare_export, describe, error_object, fork_cli, fork_code, process_env, run_cli,
                     run_cli_forked, tree_digest, write_config)
from statetool.backends.base import Holder, LeaseInfo
from statetool.backends.processes import alive, group_alive, host_name, process_started
from statetool.backends.proclocks import lock_holders
from statetool.errors import StateError
from statetool.example import build_legacy_state
from statetool.operations.context import Context
from statetool.operations.inspect import info
from statetool.operations.leases import _exit_watch
from statetool.operations.leasing import acquire, list_leases, this_holder
from statetool.operations.migrate import migrate
from support.backends import StateBackend

RUN_KEY = "chunk-run:orders"
SIDECAR_NAME = "chunk-run%3Aorders"

#: The command a ``leases run`` holder wraps: writes its pid to READY, then waits for GO
#: (or up to 120 s) and exits with CODE. On SIGTERM/SIGINT it writes the signal number to
#: READY.signal and exits with CODE.
HOLD = textwrap.dedent("""\
    import os, pathlib, signal, sys, time
    ready, go, code = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3])
    def stop(signum, _frame):
        pathlib.Path(sys.argv[1] + ".signal").write_text(str(signum))
        sys.exit(code)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    tmp = pathlib.Path(sys.argv[1] + ".tmp")
    tmp.write_text(str(os.getpid()))
    tmp.rename(ready)
    deadline = time.monotonic() + 120
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    sys.exit(code)
    """)

#: A command that records that it ran.
TOUCH = "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text('ran')"


# -- states -----------------------------------------------------------------------------


def _pg_dsn(pg_url: str) -> tuple[str, str]:
    """``(libpq URL without ?schema=, schema)`` of a test state URL."""
    parts = urlsplit(pg_url)
    query = parse_qsl(parts.query)
    schema = dict(query)["schema"]
    rest = urlencode([(k, v) for k, v in query if k != "schema"])
    return urlunsplit(parts._replace(scheme="postgresql", query=rest)), schema


@dataclass
class State:
    """A state (config beside it, and the state URL for PostgreSQL) and how to reach it."""

    backend: str
    config: Path
    env: dict[str, str]
    pg_url: str | None = None
    #: The directory of a SQLite state file (beside the config, or declared); None on PostgreSQL.
    state_dir: Path | None = None

    @property
    def directory(self) -> Path:
        return self.config.parent

    @property
    def leases_dir(self) -> Path:
        return self.directory / ".rivet_state.leases"

    @property
    def sidecar(self) -> Path:
        return self.leases_dir / SIDECAR_NAME

    def cli(self, *args: str, timeout: float = 120) -> CliRun:
        return run_cli("-c", str(self.config), *args, env=self.env, timeout=timeout)

    def cli_process(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``statetool ARGS`` in a process of its own (forked: no interpreter start-up)."""
        return run_cli_forked("-c", str(self.config), *args, env=self.env, timeout=timeout)

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "statetool", "-c", str(self.config), *args]

    def popen(self, *args: str, **kwargs: Any) -> Forked:
        """``statetool ARGS`` started in a forked process, a session of its own (stdout and
        stderr piped unless given)."""
        return fork_cli("-c", str(self.config), *args, env=process_env(self.env), new_session=True, **kwargs)

    def context(self, lock_wait: float = 0.0) -> Context:
        return Context(config_path=self.config, env=process_env(self.env), lock_wait=lock_wait)

    def leases(self) -> dict[str, dict[str, Any]]:
        """``{key: lease doc}`` as the library lists them (no lock taken)."""
        return {row["key"]: row for row in list_leases(self.context()).leases}  # type: ignore[misc]

    def pg(self) -> Any:
        """An autocommit psycopg connection whose search_path is the state's schema."""
        import psycopg

        assert self.pg_url is not None
        dsn, schema = _pg_dsn(self.pg_url)
        return psycopg.connect(dsn, autocommit=True, options=f"-c search_path={schema}")

    def audit_rows(self, action: str) -> list[dict[str, Any]]:
        """The ``rivet_audit`` rows of ``action``, detail parsed, oldest first."""
        query = "SELECT actor, command, action, detail FROM rivet_audit WHERE action = ? ORDER BY id"
        if self.backend == "sqlite":
            assert self.state_dir is not None
            db = sqlite3.connect(f"file:{self.state_dir / '.rivet_state.db'}?mode=ro", uri=True)
            try:
                rows = db.execute(query, (action,)).fetchall()
            finally:
                db.close()
        else:
            with self.pg() as conn:
                rows = conn.execute(query.replace("?", "%s"), (action,)).fetchall()
        return [{"actor": a, "command": c, "action": act, "detail": json.loads(d)} for a, c, act, d in rows]


def _make_state(backend: StateBackend, *, init: bool = True) -> State:
    state = State(backend.kind, write_config(backend.pipeline), backend.env, backend.url, backend.state_dir)
    if init:  # what `statetool init` runs, in-process: a CLI start per test would double the runtime
        from statetool.operations.create import init as create

        create(state.context())
    return state


@pytest.fixture
def state(state_backend: StateBackend) -> State:
    """A fresh state at head on each backend."""
    return _make_state(state_backend)


@pytest.fixture
def sqlite_state(tmp_path: Path) -> State:
    return _make_state(StateBackend.sqlite(tmp_path))


@pytest.fixture
def pg_state(tmp_path: Path, pg_url: str) -> State:
    return _make_state(StateBackend.postgres(tmp_path, pg_url))


# -- holders ----------------------------------------------------------------------------


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """Poll ``condition`` until true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


@dataclass
class LeaseRun:
    """A real ``statetool leases run --export EXPORT -- python HOLD`` process group."""

    state: State
    proc: Forked
    ready: Path
    go: Path

    @property
    def pid(self) -> int:
        """The wrapper's pid: the holder the lease records."""
        return self.proc.pid

    def wait_ready(self) -> int:
        """Wait until the command runs under the lease; returns the command's pid."""
        def ready() -> bool:
            if self.proc.poll() is not None:
                out, err = self.proc.communicate()
                pytest.fail(f"the holder ended before its command ran: exit {self.proc.returncode}\n{out}\n{err}")
            return self.ready.exists()

        wait_for(ready, "the holder's command to start")
        return int(self.ready.read_text())

    def finish(self) -> subprocess.CompletedProcess[str]:
        """Let the command end; returns the wrapper's result."""
        self.go.touch()
        out, err = self.proc.communicate(timeout=60)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)

    def kill_group(self) -> None:
        """SIGKILL the wrapper and its command at once and reap the wrapper."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.communicate(timeout=60)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., LeaseRun]]:
    """Start ``leases run`` holders; every process group still alive is killed afterwards."""
    started: list[LeaseRun] = []

    def start(state: State, *, export: str = "orders", code: int = 0, options: tuple[str, ...] = ()) -> LeaseRun:
        tag = uuid.uuid4().hex[:8]
        ready, go = tmp_path / f"ready-{tag}", tmp_path / f"go-{tag}"
        proc = state.popen(*options, "leases", "run", "--export", export, "--",
                           sys.executable, "-c", HOLD, str(ready), str(go), str(code))
        run = LeaseRun(state, proc, ready, go)
        started.append(run)
        return run

    yield start
    for run in started:
        run.go.touch()
        if run.proc.poll() is None:
            run.kill_group()
        if run.ready.exists():  # the command may outlive its wrapper (SQLite inheritance test)
            pid = int(run.ready.read_text())
            try:  # only if that pid is still our command, not a reused pid
                if str(run.ready).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ValueError):
                pass


def dead_pid() -> int:
    """The pid of a process that has ended and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# -- mutual exclusion -------------------------------------------------------------------

WORKER = textwrap.dedent("""\
    import os, pathlib, random, sys, time
    from statetool.operations.context import Context
    from statetool.operations.leasing import holding
    config, counter, log, go, rounds = sys.argv[1:6]
    ctx = Context(config_path=pathlib.Path(config), env=dict(os.environ), lock_wait=120)
    counter, go = pathlib.Path(counter), pathlib.Path(go)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    while not go.exists():
        time.sleep(0.005)
    for _ in range(int(rounds)):
        with holding(ctx, "chunk-run:orders", f"counter worker {os.getpid()}"):
            os.write(fd, f"enter {os.getpid()} {time.monotonic_ns()}\\n".encode())
            value = int(counter.read_text())
            time.sleep(0.01)
            counter.write_text(str(value + 1))
            os.write(fd, f"exit {os.getpid()} {time.monotonic_ns()}\\n".encode())
        time.sleep(random.uniform(0, 0.03))
    """)


def test_eight_processes_taking_one_lease_count_exactly_and_never_overlap(state: State, tmp_path: Path) -> None:
    processes, rounds = 8, 8
    counter, log, go = tmp_path / "counter", tmp_path / "holders.log", tmp_path / "go"
    counter.write_text("0")
    workers = [fork_code(WORKER, str(state.config), str(counter), str(log), str(go), str(rounds),
                         env=process_env(state.env), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for _ in range(processes)]
    go.touch()
    for worker in workers:
        out, err = worker.communicate(timeout=240)
        assert worker.returncode == 0, f"worker failed: exit {worker.returncode}\n{out}\n{err}"

    assert int(counter.read_text()) == processes * rounds
    records = [line.split() for line in log.read_text().splitlines()]
    assert len(records) == 2 * processes * rounds
    # In the order they were appended: enter and exit of one holder, then the next holder.
    for i in range(0, len(records), 2):
        (kind_in, pid_in, _), (kind_out, pid_out, _) = records[i], records[i + 1]
        assert (kind_in, kind_out, pid_in) == ("enter", "exit", pid_out), records[max(0, i - 2):i + 4]
    # And by the clock: sorted by entry, every holder entered after the previous one left.
    intervals = sorted((int(records[i][2]), int(records[i + 1][2]), records[i][1]) for i in range(0, len(records), 2))
    for (_, left, first), (entered, _, second) in zip(intervals, intervals[1:]):
        assert entered > left, f"holders {first} and {second} overlapped"
    assert len({pid for _, _, pid in intervals}) == processes


# -- dead holders -----------------------------------------------------------------------


def test_sigkilled_holder_never_blocks_the_next_taker(state: State, spawn: Callable[..., LeaseRun]) -> None:
    holder = spawn(state)
    holder.wait_ready()
    assert state.leases()[RUN_KEY]["state"] == "live"
    holder.kill_group()

    row = state.leases()[RUN_KEY]
    assert (row["state"], row["holder_pid"]) == ("stale", holder.pid)
    # --lock-wait 0 refuses any live holder at once, so success proves no wait was needed.
    proc = state.cli_process("--lock-wait", "0", "leases", "run", "--export", "orders", "--", "true")
    assert proc.returncode == 0, describe(proc)
    assert "waiting" not in proc.stderr, describe(proc)


OTHER_HOST_HOLDER = textwrap.dedent("""\
    import os, pathlib, sys, time
    from statetool.backends.base import Holder, LeaseInfo
    from statetool.operations.context import Context
    from statetool.operations.leasing import this_holder
    config, ready, ttl = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3])
    store = Context(config_path=config, env=dict(os.environ)).backend().leases(ttl)
    me = this_holder("rivet run -e orders")
    lease = store.try_acquire("chunk-run:orders", Holder(me.pid, "worker-7.elsewhere.example", me.user,
                                                          me.command, me.acquired_at))
    assert not isinstance(lease, LeaseInfo), lease
    ready.write_text("held")
    time.sleep(600)
    """)


def test_postgres_holder_on_another_host_is_taken_over_only_after_its_ttl(pg_state: State, tmp_path: Path) -> None:
    ttl = 4
    ready = tmp_path / "ready"
    holder = fork_code(OTHER_HOST_HOLDER, str(pg_state.config), str(ready), str(ttl), env=process_env(pg_state.env),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: ready.exists() or holder.poll() is not None, "the other-host holder")
        assert ready.exists(), holder.communicate()
    finally:
        holder.kill()
        holder.communicate(timeout=30)
    with pg_state.pg() as conn:
        (last_beat,) = conn.execute("SELECT heartbeat_at FROM rivet_leases WHERE key = %s", (RUN_KEY,)).fetchone()

    # Its pid is dead, but the row names another host: only the TTL can free it. The
    # judge is the database clock: no take may be stamped within the TTL of the last beat.
    store = pg_state.context().backend().leases()
    early = store.try_acquire(RUN_KEY, this_holder("early taker"))
    if isinstance(early, LeaseInfo):
        assert (early.state, early.holder.host) == ("live", "worker-7.elsewhere.example"), early  # type: ignore[union-attr]
        lease = acquire(pg_state.context(lock_wait=30), RUN_KEY, "patient taker")
    else:  # this machine took longer than the TTL to get here: still judged by the clock
        lease = early
    try:
        taken_at = lease.acquired  # type: ignore[attr-defined]
        assert taken_at - last_beat > timedelta(seconds=ttl), (taken_at, last_beat)
    finally:
        lease.release()


# -- waiting ----------------------------------------------------------------------------


def test_waiter_behind_a_live_holder_times_out_with_lock_timeout_after_lock_wait(
        state: State, spawn: Callable[..., LeaseRun], tmp_path: Path) -> None:
    holder = spawn(state)
    holder.wait_ready()
    marker = tmp_path / "waiter-ran"
    started = time.monotonic()
    proc = state.cli_process("--json-errors", "leases", "run", "--export", "orders", "--lock-wait", "2", "--",
                             sys.executable, "-c", TOUCH, str(marker))
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, describe(proc)
    err = error_object(proc)
    assert (err["code"], err["retryable"], err["exit_class"], err["class"]) == \
        ("RIVET_STATE_LOCK_TIMEOUT", True, 2, "retryable"), err
    assert f"pid {holder.pid}" in err["message"], err
    assert f"waiting up to 2 s for lease {RUN_KEY}, held by pid {holder.pid}" in proc.stderr, describe(proc)
    assert elapsed >= 2.0
    assert not marker.exists()
    assert holder.finish().returncode == 0


def test_waiter_with_lock_wait_zero_is_refused_run_in_progress_at_once(
        state: State, spawn: Callable[..., LeaseRun], tmp_path: Path) -> None:
    holder = spawn(state)
    holder.wait_ready()
    marker = tmp_path / "waiter-ran"
    proc = state.cli_process("leases", "run", "--export", "orders", "--json-errors", "--lock-wait", "0", "--",
                             sys.executable, "-c", TOUCH, str(marker))
    assert proc.returncode == 2, describe(proc)
    err = error_object(proc)
    assert (err["code"], err["retryable"], err["exit_code"]) == ("RIVET_STATE_RUN_IN_PROGRESS", True, 2), err
    assert f"pid {holder.pid}" in err["message"], err
    assert "waiting" not in proc.stderr, "--lock-wait 0 waited: " + describe(proc)
    assert not marker.exists()
    assert holder.finish().returncode == 0


def test_listing_in_a_tight_loop_never_disturbs_a_waiter_and_takes_no_lock(
        state: State, spawn: Callable[..., LeaseRun], tmp_path: Path) -> None:
    sqlite = state.backend == "sqlite"
    holder = spawn(state)
    holder.wait_ready()
    marker, waiter_log = tmp_path / "waiter-ran", tmp_path / "waiter.err"
    with open(waiter_log, "w") as err_file:
        waiter = state.popen("--lock-wait", "120", "leases", "run", "--export", "orders", "--",
                             sys.executable, "-c", TOUCH, str(marker), stderr=err_file)
    wait_for(lambda: "waiting up to" in waiter_log.read_text(), "the waiter to wait")

    listings: list[subprocess.CompletedProcess[str]] = []
    stop = threading.Event()

    def cli_loop() -> None:
        while not stop.is_set():
            listings.append(state.cli_process("--json", "leases"))

    # Phase 1, held: every listing sees the holder live, the kernel's lock table shows the
    # holder's lock only, and the waiter keeps waiting.
    looper = threading.Thread(target=cli_loop)
    looper.start()
    rounds = 0
    try:
        while len(listings) < 2 or rounds < (200 if sqlite else 100):
            row = state.leases()[RUN_KEY]
            assert (row["state"], row["holder_pid"]) == ("live", holder.pid), row
            if sqlite:
                assert lock_holders(state.sidecar) == {holder.pid}
            assert waiter.poll() is None and not marker.exists(), "the waiter saw a spurious free lease"
            rounds += 1
    finally:
        stop.set()
        looper.join()
    for proc in listings:
        assert proc.returncode == 0, describe(proc)
        row = {r["key"]: r for r in json.loads(proc.stdout)["leases"]}[RUN_KEY]
        assert (row["state"], row["holder_pid"]) == ("live", holder.pid), row

    # The holder ends: the waiter gets the lease.
    assert holder.finish().returncode == 0
    assert waiter.wait(timeout=60) == 0, waiter_log.read_text()
    assert marker.read_text() == "ran"

    # Phase 2, free: listings keep running while takers with --lock-wait 0 take it again
    # and again; a listing that took any lock would make one of them fail.
    listings.clear()
    stop.clear()
    seen: list[str] = []

    def library_loop() -> None:
        while not stop.is_set():
            seen.append(state.leases().get(RUN_KEY, {"state": "free"})["state"])

    loopers = [threading.Thread(target=cli_loop), threading.Thread(target=library_loop)]
    for t in loopers:
        t.start()
    refused: list[str] = []
    takes = 0
    try:
        while len(listings) < 1 or takes < (300 if sqlite else 60):
            try:
                lease = acquire(state.context(lock_wait=0), RUN_KEY, "probe")
            except StateError as err:
                refused.append(err.message)
                continue
            finally:
                takes += 1
            if sqlite:
                assert lock_holders(state.sidecar) == {os.getpid()}
            lease.release()
    finally:
        stop.set()
        for t in loopers:
            t.join()
    assert not refused, f"{len(refused)} of {takes} takes saw a busy lease: {refused[:3]}"
    assert set(seen) <= {"live", "free"}, set(seen)
    assert all(proc.returncode == 0 for proc in listings), [describe(p) for p in listings if p.returncode]


def _strace_works() -> bool:
    if shutil.which("strace") is None:
        return False
    return subprocess.run(["strace", "-o", os.devnull, "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _strace_works(), reason="needs a working strace")
def test_listing_sqlite_leases_makes_no_lock_system_call(sqlite_state: State, spawn: Callable[..., LeaseRun],
                                                         tmp_path: Path) -> None:
    holder = spawn(sqlite_state)
    holder.wait_ready()
    trace = tmp_path / "trace"
    proc = subprocess.run(["strace", "-f", "-qq", "-e", "trace=flock,fcntl", "-o", str(trace),
                           *sqlite_state.argv("--json", "leases")], env=process_env({}), capture_output=True, text=True)
    assert proc.returncode == 0, describe(proc)
    assert json.loads(proc.stdout)["leases"][0]["state"] == "live"
    calls = trace.read_text()
    locking = [line for line in calls.splitlines() if "flock(" in line or re.search(r"F_(OFD_)?SETLKW?", line)]
    assert not locking, locking
    assert holder.finish().returncode == 0


# -- release ----------------------------------------------------------------------------


def test_release_refuses_a_live_holder_and_releases_a_stale_one_with_an_audit_row(
        state: State, spawn: Callable[..., LeaseRun]) -> None:
    holder = spawn(state)
    holder.wait_ready()
    proc = state.cli("--json-errors", "leases", "release", RUN_KEY, "--reason", "looks stuck")
    assert proc.returncode == 2, describe(proc)
    err = error_object(proc)
    assert err["code"] == "RIVET_STATE_RUN_IN_PROGRESS" and f"pid {holder.pid}" in err["message"], err
    assert state.leases()[RUN_KEY]["state"] == "live"
    assert state.audit_rows("leases.release") == []

    holder.kill_group()
    assert state.leases()[RUN_KEY]["state"] == "stale"
    proc = state.cli("leases", "release", RUN_KEY, "--reason", "worker rebooted; its run is gone", "--json")
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    assert (doc["key"], doc["released"]["holder_pid"]) == (RUN_KEY, holder.pid), doc

    assert state.leases().get(RUN_KEY, {"state": "free"})["state"] == "free"
    (row,) = state.audit_rows("leases.release")
    detail = row["detail"]
    assert (detail["key"], detail["reason"]) == (RUN_KEY, "worker rebooted; its run is gone"), row
    assert (detail["removed"]["holder_pid"], detail["removed"]["host"]) == (holder.pid, socket.gethostname()), row
    assert row["actor"].endswith("@" + socket.gethostname()), row


@dataclass
class OrphanedStep:
    """A ``leases run -- sh -c '<step>; …'`` whose wrapper was SIGKILLed alone: the shell
    (the command) died with it, the step it started (``HOLD``) works on in its group."""

    wrapper: Forked
    shell: int
    step: int


@contextmanager
def orphaned_step(state: State, tmp_path: Path, closes_fds: bool) -> Iterator[OrphanedStep]:
    """Start the run, SIGKILL its wrapper alone, and yield once only its step lives (the
    step closes its inherited descriptors first when ``closes_fds``); on the way out the
    step is told to end and waited for."""
    ready, go = tmp_path / "ready", tmp_path / "go"
    hold = ("import os; os.closerange(3, 65536)\n" if closes_fds else "") + HOLD
    wrapper = state.popen("leases", "run", "--export", "orders", "--", "sh", "-c", '"$0" -c "$1" "$2" "$3" 0; true',
                          sys.executable, hold, str(ready), str(go))
    step = 0
    try:
        wait_for(ready.exists, "the shell's step to start")
        step = int(ready.read_text())
        shell = state.leases()[RUN_KEY]["child_pid"]
        assert shell not in (None, step), (shell, step, state.leases()[RUN_KEY])
        os.kill(wrapper.pid, signal.SIGKILL)  # the wrapper alone
        wrapper.wait(timeout=30)  # its output pipes stay open: the step holds them
        wait_for(lambda: not alive(shell, None), f"the shell {shell} to die with its wrapper", timeout=10)
        assert alive(step, None), "the step died too: this test shows nothing"
        yield OrphanedStep(wrapper, shell, step)
    finally:
        go.touch()
        if step:
            wait_for(lambda: not alive(step, None), f"the step {step} to end", timeout=10)


@pytest.mark.parametrize("closes_fds", [False, True], ids=["keeps its descriptors", "closes them"])
def test_release_refuses_a_dead_wrapper_whose_command_group_works_on_naming_that_process(
        state: State, tmp_path: Path, closes_fds: bool) -> None:
    """``leases release`` of a lease whose ``leases run`` wrapper was SIGKILLed while a step
    of its command (``sh -c 'python …; true'``) works on: refused on both backends, as
    ``leases list`` shows it live, naming the process that still works (not only the dead
    wrapper) and changing nothing (no audit row; on SQLite no byte of the lease folder);
    once the step ended, the same release succeeds, audited. On SQLite a step that keeps
    its descriptors keeps the inherited lock; one that closes them (as daemons do) leaves
    only the record, whose command group still lives."""
    with orphaned_step(state, tmp_path, closes_fds) as run:
        assert state.leases()[RUN_KEY]["state"] == "live"
        before = tree_digest(state.leases_dir) if state.backend == "sqlite" else None
        for dry in ((), ("--dry-run",)):
            proc = state.cli_process("--json-errors", "leases", "release", RUN_KEY, *dry, "--reason", "looks stuck")
            assert proc.returncode == 2, describe(proc)
            err = error_object(proc)
            assert err["code"] == "RIVET_STATE_RUN_IN_PROGRESS", err
            assert f"pid {run.step} " in err["message"] and f"kill -TERM -- -{run.shell}" in err["message"], err
        assert state.leases()[RUN_KEY]["state"] == "live"
        assert state.audit_rows("leases.release") == []
        if before is not None:
            assert tree_digest(state.leases_dir) == before
    proc = state.cli_process("--json", "leases", "release", RUN_KEY, "--reason", "the run's step has ended")
    assert proc.returncode == 0, describe(proc)
    assert json.loads(proc.stdout)["released"]["holder_pid"] == run.wrapper.pid
    (row,) = state.audit_rows("leases.release")
    removed = row["detail"]["removed"]
    assert (removed["holder_pid"], removed["child_pid"]) == (run.wrapper.pid, run.shell), row
    assert state.leases().get(RUN_KEY, {"state": "free"})["state"] == "free"


# -- leases without a pipeline config (issue 12 item 7) -----------------------------------


@pytest.fixture(params=["declared", pytest.param("postgres", marks=pytest.mark.postgres)])
def url_state(request: pytest.FixtureRequest, tmp_path: Path) -> State:
    """A state at head that RIVET_STATE_URL names: a declared SQLite directory, or PostgreSQL."""
    if request.param == "postgres":
        return _make_state(StateBackend.postgres(tmp_path, request.getfixturevalue("pg_url")))
    declared = tmp_path / "declared"
    declared.mkdir()
    return _make_state(StateBackend.sqlite(tmp_path, declared))


def test_leases_list_and_release_need_no_pipeline_config_where_the_url_names_the_state(
        url_state: State, spawn: Callable[..., LeaseRun], tmp_path: Path) -> None:
    """A DBA in a directory without rivet.yaml clears a stale lease: listed, a live holder
    refused, the stale one released with its audit row, then taken by ``leases run``;
    nothing created where the DBA is."""
    live = spawn(url_state, export="order_lines")
    live.wait_ready()
    stale = spawn(url_state)
    stale.wait_ready()
    stale.kill_group()
    dba = tmp_path / "dba"
    dba.mkdir()
    for args in (("leases",), ("leases", "list")):
        proc = run_cli("--json", *args, cwd=dba, env=url_state.env)
        assert proc.returncode == 0, describe(proc)
        states = {row["key"]: row["state"] for row in json.loads(proc.stdout)["leases"]}
        assert states == {"chunk-run:order_lines": "live", RUN_KEY: "stale"}, states

    proc = run_cli("--json-errors", "leases", "release", "chunk-run:order_lines", "--reason", "looks stuck",
                   cwd=dba, env=url_state.env)
    err = error_object(proc)
    assert (proc.returncode, err["code"]) == (2, "RIVET_STATE_RUN_IN_PROGRESS"), describe(proc)
    assert f"pid {live.pid}" in err["message"], err
    url = url_state.env["RIVET_STATE_URL"]
    proc = run_cli("--state-url", url, "--json", "leases", "release", RUN_KEY, "--reason", "worker rebooted", cwd=dba)
    assert proc.returncode == 0, describe(proc)
    assert json.loads(proc.stdout)["released"]["holder_pid"] == stale.pid, describe(proc)

    (row,) = url_state.audit_rows("leases.release")
    assert (row["detail"]["key"], row["detail"]["reason"]) == (RUN_KEY, "worker rebooted"), row
    assert row["detail"]["removed"]["holder_pid"] == stale.pid, row
    leases = url_state.leases()
    assert leases.get(RUN_KEY, {"state": "free"})["state"] == "free", leases
    assert leases["chunk-run:order_lines"]["state"] == "live", leases
    proc = run_cli_forked("--lock-wait", "0", "leases", "run", "--export", "orders", "--", "true", cwd=dba,
                          env=url_state.env)
    assert proc.returncode == 0, describe(proc)  # the released lease is free to take, config or not
    assert list(dba.iterdir()) == []
    assert live.finish().returncode == 0


def test_leases_read_a_config_that_is_there_or_named_and_keep_its_guards(tmp_path: Path) -> None:
    """Without a config the identity is not compared; a config that is there is read and
    compared (a declared directory refuses another source's), a broken one refuses, and a
    config named with -c must exist."""
    declared = tmp_path / "declared"
    declared.mkdir()
    state = _make_state(StateBackend.sqlite(tmp_path, declared))
    before = tree_digest(declared)
    other = write_config(tmp_path / "other-source", source_url="postgresql://crm.internal:5432/crm")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "rivet.yaml").write_text("exports: [\n")
    for cwd, args, code in ((other.parent, (), "RIVET_STATE_FOREIGN"),
                            (broken, (), "RIVET_CONFIG_INVALID"),
                            (tmp_path, ("-c", str(tmp_path / "typo.yaml")), "RIVET_CONFIG_NOT_FOUND")):
        proc = run_cli(*args, "--json-errors", "leases", "release", RUN_KEY, cwd=cwd, env=state.env)
        assert error_object(proc)["code"] == code, describe(proc)
    proc = run_cli("-c", str(tmp_path / "typo.yaml"), "--json-errors", "leases", cwd=tmp_path, env=state.env)
    assert error_object(proc)["code"] == "RIVET_CONFIG_NOT_FOUND", describe(proc)
    assert tree_digest(declared) == before
    proc = run_cli("--json", "leases", "list", cwd=other.parent, env=state.env)
    assert proc.returncode == 0, describe(proc)  # a read compares no identity


def test_leases_run_of_an_export_the_config_does_not_declare_is_refused_before_any_lease(
        url_state: State, tmp_path: Path) -> None:
    """A typo in ``--export`` (issue 12 fixB item 2): with a config there, RIVET_EXPORT_UNKNOWN
    (exit 1), the command not run, no lease record; without a config there is nothing to
    check against, and the run goes ahead (docs/decisions.md)."""
    marker = tmp_path / "ran"
    before = url_state.leases()
    proc = url_state.cli_process("--json-errors", "leases", "run", "--export", "nope", "--", "touch", str(marker))
    err = error_object(proc)
    assert (proc.returncode, err["code"]) == (1, "RIVET_EXPORT_UNKNOWN"), describe(proc)
    assert "nope" in err["message"] and str(url_state.config) in err["message"], err
    assert not marker.exists()
    assert url_state.leases() == before
    dba = tmp_path / "dba"
    dba.mkdir()
    proc = run_cli_forked("leases", "run", "--export", "nope", "--", "touch", str(marker), cwd=dba,
                          env=url_state.env)
    assert proc.returncode == 0 and marker.exists(), describe(proc)


@pytest.fixture(params=["declared", pytest.param("postgres", marks=pytest.mark.postgres)])
def no_state(request: pytest.FixtureRequest, tmp_path: Path) -> State:
    """Nothing where RIVET_STATE_URL points: an empty declared directory, or a schema that
    does not exist."""
    if request.param == "postgres":
        return _make_state(StateBackend.postgres(tmp_path, request.getfixturevalue("pg_url")), init=False)
    declared = tmp_path / "declared"
    declared.mkdir()
    return _make_state(StateBackend.sqlite(tmp_path, declared), init=False)


def test_every_leases_command_refuses_a_missing_state_alike_and_creates_nothing(no_state: State) -> None:
    """A list of no state is not "nobody runs here" (issue 12 fixB item 1): ``leases``,
    ``leases list``, ``release`` and ``run`` all refuse RIVET_STATE_MISSING, exit 5."""
    before = tree_digest(no_state.directory.parent)
    for args in (("leases",), ("leases", "list"), ("--json", "leases", "list"),
                 ("leases", "release", RUN_KEY), ("leases", "run", "--export", "orders", "--", "true")):
        proc = no_state.cli("--json-errors", *args)
        err = error_object(proc)
        assert (proc.returncode, err["code"]) == (5, "RIVET_STATE_MISSING"), (args, describe(proc))
        assert "no lease" not in proc.stdout, describe(proc)
    assert tree_digest(no_state.directory.parent) == before
    if no_state.backend == "postgres":
        with no_state.pg() as conn:
            schema = _pg_dsn(no_state.pg_url)[1]
            assert conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)).fetchone() is None


def test_the_empty_list_says_what_is_true_after_leases_were_taken_and_released(state: State) -> None:
    """On PostgreSQL a finished run leaves no row, on SQLite a free sidecar: either way the
    list must not claim that no lease was ever taken (issue 12 fixB item 1)."""
    proc = state.cli_process("--lock-wait", "0", "leases", "run", "--export", "orders", "--", "true")
    assert proc.returncode == 0, describe(proc)
    proc = state.cli("leases")
    assert proc.returncode == 0, describe(proc)
    assert "ever" not in proc.stdout, describe(proc)
    if not state.leases():
        assert "no lease is held or recorded" in proc.stdout, describe(proc)


# -- PostgreSQL takeover race ------------------------------------------------------------


def test_two_postgres_takers_racing_for_one_stale_row_exactly_one_wins(pg_state: State) -> None:
    stores = [pg_state.context().backend().leases() for _ in range(2)]
    barrier = threading.Barrier(2)
    me = this_holder("racer")
    gone = dead_pid()
    with pg_state.pg() as conn:
        for round_no in range(80):
            # Even rounds: TTL expired on another host; odd rounds: dead pid on this host.
            host, pid, age = (("worker-9.elsewhere.example", 4242, "1 hour") if round_no % 2 == 0
                              else (socket.gethostname(), gone, "0 seconds"))
            conn.execute("INSERT INTO rivet_leases (key, holder_pid, holder_host, holder_user, command, acquired_at, "
                         "heartbeat_at, ttl_seconds) VALUES (%s, %s, %s, 'old', 'old run', now() - interval '2 hours', "
                         f"now() - interval '{age}', 30)", (RUN_KEY, pid, host))
            results: list[Any] = [None, None]

            def take(i: int) -> None:
                barrier.wait()
                results[i] = stores[i].try_acquire(
                    RUN_KEY, Holder(me.pid, me.host, me.user, f"taker {i}", me.acquired_at))

            threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            winners = [r for r in results if not isinstance(r, LeaseInfo)]
            assert len(winners) == 1, f"round {round_no}: {results}"
            loser = next(r for r in results if isinstance(r, LeaseInfo))
            assert loser.state == "live" and loser.holder.command == winners[0].holder.command, (round_no, loser)
            (command,) = conn.execute("SELECT command FROM rivet_leases WHERE key = %s", (RUN_KEY,)).fetchone()
            assert command == winners[0].holder.command
            winners[0].release()


# -- key encoding -----------------------------------------------------------------------

ODD_KEYS = [
    "chunk-run:../../../../escaped",
    "load-table:/tmp/absolute",
    "staging:..",
    "..",
    ".",
    ".hidden",
    "chunk-run:\"double\" and 'single' quotes",
    "chunk-run:ünïcødé/日本語/表",
    "staging:a\\b\\..\\c",
    "chunk-run:%2E%2E%2Fpre-encoded",
    "chunk-run:../%2e%2e/x",
    "load-table:tab\tand\nnewline",
]


def test_lease_key_with_slashes_dots_quotes_and_non_ascii_stays_inside_the_sidecar_folder(
        state: State, tmp_path: Path) -> None:
    # Where each key would land if it were used as a path (the sidecar folder itself excepted).
    naive = ({(state.leases_dir / key).resolve() for key in ODD_KEYS} |
             {(state.leases_dir / key.split(":", 1)[-1]).resolve() for key in ODD_KEYS}) - {state.leases_dir}
    existed = {p for p in naive if os.path.lexists(p)}
    def outside() -> set[Path]:
        return {p for p in tmp_path.rglob("*") if p != state.leases_dir and state.leases_dir not in p.parents}

    before = outside()

    held = [acquire(state.context(), key, f"odd key {i}") for i, key in enumerate(ODD_KEYS)]
    try:
        listed = state.leases()
        assert {k for k, row in listed.items() if row["state"] == "live"} == set(ODD_KEYS)
    finally:
        for lease in held:
            lease.release()
    declare_export(state.config, "../../outside")
    proc = state.cli_process("leases", "run", "--export", "../../outside", "--", "true")
    assert proc.returncode == 0, describe(proc)
    proc = state.cli("--json", "leases")
    assert proc.returncode == 0, describe(proc)
    keys = set(ODD_KEYS) | {"chunk-run:../../outside"}
    assert {row["key"] for row in json.loads(proc.stdout)["leases"]} == (keys if state.backend == "sqlite" else set())

    assert outside() == before
    assert {p for p in naive if os.path.lexists(p)} == existed
    if state.backend == "sqlite":
        names = [p.name for p in state.leases_dir.iterdir()]
        assert len(names) == len(keys), names
        for path in state.leases_dir.iterdir():
            assert path.is_file() and not path.is_symlink(), path
            assert re.fullmatch(r"[A-Za-z0-9_%-]+", path.name), path.name
    else:
        assert not state.leases_dir.exists()


def test_sqlite_lease_key_too_long_for_a_file_name_is_refused_as_usage(tmp_path: Path) -> None:
    """A config refuses such a name itself; without one (a declared directory) the lease
    store refuses it."""
    declared = tmp_path / "declared"
    declared.mkdir()
    _make_state(StateBackend.sqlite(tmp_path, declared))
    proc = run_cli_forked("--json-errors", "leases", "run", "--export", "x" * 300, "--", "true", cwd=declared,
                          env={"RIVET_STATE_URL": f"sqlite:{declared}"})
    assert proc.returncode == 1, describe(proc)
    assert error_object(proc)["code"] == "RIVET_CLI_USAGE"
    leases_dir = declared / ".rivet_state.leases"
    assert not any(leases_dir.iterdir()) if leases_dir.exists() else True


# -- leases run -------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_leases_run_forwards_the_signal_exits_with_the_command_code_and_releases(
        state: State, spawn: Callable[..., LeaseRun], signum: int) -> None:
    holder = spawn(state, code=7)
    holder.wait_ready()
    os.kill(holder.pid, signum)
    out, err = holder.proc.communicate(timeout=60)
    assert holder.proc.returncode == 7, f"{out}\n{err}"
    assert Path(str(holder.ready) + ".signal").read_text() == str(int(signum))
    assert state.leases().get(RUN_KEY, {"state": "free"})["state"] == "free"
    proc = state.cli_process("--lock-wait", "0", "leases", "run", "--export", "orders", "--", "true")
    assert proc.returncode == 0, describe(proc)


#: Commands ``leases run`` cannot start: (how it is made in tmp_path, exit code, error code).
UNSTARTABLE = {
    "not on PATH": (None, 127, "RIVET_COMMAND_NOT_FOUND"),
    "no such file": ("missing", 127, "RIVET_COMMAND_NOT_FOUND"),
    "its #! interpreter is missing": ("#!/nonexistent/python3\n", 126, "RIVET_COMMAND_NOT_EXECUTABLE"),
    "no execute bit": ("plain", 126, "RIVET_COMMAND_NOT_EXECUTABLE"),
    "a directory": ("dir", 126, "RIVET_COMMAND_NOT_EXECUTABLE"),
    "not a program": ("\x00\x01binary", 126, "RIVET_COMMAND_NOT_EXECUTABLE"),
}


@pytest.mark.parametrize("case", list(UNSTARTABLE))
def test_leases_run_of_a_command_that_cannot_start_exits_as_a_shell_does_and_frees_the_lease(
        state: State, tmp_path: Path, case: str) -> None:
    """A command that is not found exits 127, one that is found but cannot be executed 126
    (a shell's convention, which schedulers read), with the registered code and a message
    naming the command on stderr; the lease it took is given back: no record claims a
    holder, and the next run takes it at once."""
    how, exit_code, code = UNSTARTABLE[case]
    target = tmp_path / "cmd"
    if how is None:
        command = f"no-such-command-{uuid.uuid4().hex[:8]}"
    else:
        command = str(target)
        if how == "dir":
            target.mkdir()
        elif how == "plain":
            target.write_text("echo hi\n")
        elif how != "missing":
            target.write_text(how)
            target.chmod(0o755)
    proc = state.cli_process("--json-errors", "leases", "run", "--export", "orders", "--", command, "arg")
    assert proc.returncode == exit_code, describe(proc)
    err = error_object(proc)
    assert (err["code"], err["exit_code"]) == (code, exit_code), err
    assert command in err["message"] and "nothing ran" in err["message"], err
    lease = state.leases().get(RUN_KEY, {"state": "free", "holder_pid": None})
    assert (lease["state"], lease["holder_pid"]) == ("free", None), lease
    if state.backend == "sqlite":
        assert "pid" not in json.loads(state.sidecar.read_text()), state.sidecar.read_text()
    proc = state.cli_process("--lock-wait", "0", "leases", "run", "--export", "orders", "--", "true")
    assert proc.returncode == 0, describe(proc)


#: A command that forks one process and writes "LEADER CHILD" to READY once both are set
#: up, then both wait up to 120 s. IGNORES ("child" or "both") says which ignore SIGTERM.
STUBBORN = textwrap.dedent("""\
    import os, pathlib, signal, sys, time
    ready, ignores = pathlib.Path(sys.argv[1]), sys.argv[2]
    set_up, told = os.pipe()
    child = os.fork()
    if child == 0:
        if ignores in ("child", "both"):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.write(told, b"x")  # READY only once the child ignores what it should
        time.sleep(120)
        os._exit(0)
    os.read(set_up, 1)
    if ignores == "both":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tmp = pathlib.Path(sys.argv[1] + ".tmp")
    tmp.write_text(f"{os.getpid()} {child}")
    tmp.rename(ready)
    time.sleep(120)
    """)


@pytest.mark.parametrize("ignores", ["both", "child"], ids=["the command ignores it", "what it started ignores it"])
def test_sigterm_to_leases_run_escalates_to_sigkill_after_kill_after_and_only_then_frees_the_lease(
        state: State, tmp_path: Path, ignores: str) -> None:
    """A scheduler stops the task: SIGTERM to ``leases run``, whose command (or a process the
    command started) ignores it. After ``--kill-after`` seconds the command's whole process
    group gets SIGKILL, a line on stderr says so, and the wrapper ends (137 when SIGKILL
    ended the command, 143 when SIGTERM did). At no moment is the lease free while a
    process of the group is alive."""
    ready = tmp_path / "ready"
    log = tmp_path / "wrapper.err"
    with open(log, "w") as err:  # not a pipe: a process of the group would hold it open
        wrapper = state.popen("leases", "run", "--kill-after", "1.5", "--export", "orders", "--",
                              sys.executable, "-c", STUBBORN, str(ready), ignores, stdout=subprocess.DEVNULL, stderr=err)
    wait_for(ready.exists, "the command to start")
    leader, child = (int(pid) for pid in ready.read_text().split())
    try:
        sent = time.monotonic()
        os.kill(wrapper.pid, signal.SIGTERM)
        deadline = sent + 30
        while wrapper.poll() is None:
            assert time.monotonic() < deadline, f"leases run did not end 30 s after SIGTERM:\n{log.read_text()}"
            if state.leases().get(RUN_KEY, {"state": "free"})["state"] != "live":  # the lease first, then who lives
                living = [pid for pid in (leader, child) if alive(pid, None)]
                assert not living, f"the lease was free while {living} of the command's group lived"
            time.sleep(0.05)
        waited = time.monotonic() - sent
    finally:
        try:
            os.killpg(leader, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert wrapper.returncode == 128 + (signal.SIGKILL if ignores == "both" else signal.SIGTERM), log.read_text()
    assert waited >= 1.5, f"SIGKILL came {waited:.2f} s after SIGTERM, before --kill-after"
    assert "(--kill-after) of SIGTERM: SIGKILL sent to process group" in log.read_text(), log.read_text()
    assert not alive(leader, None) and not alive(child, None)
    assert state.leases().get(RUN_KEY, {"state": "free"})["state"] == "free"
    proc = state.cli_process("--lock-wait", "0", "leases", "run", "--export", "orders", "--", "true")
    assert proc.returncode == 0, describe(proc)


def test_leases_run_exits_with_the_command_exit_code(state: State) -> None:
    proc = state.cli_process("leases", "run", "--export", "orders", "--", sys.executable, "-c", "raise SystemExit(9)")
    assert proc.returncode == 9, describe(proc)
    proc = state.cli_process("leases", "run", "--export", "orders", "--", "sh", "-c", "kill -TERM $$")
    assert proc.returncode == 128 + signal.SIGTERM, describe(proc)
    assert state.leases().get(RUN_KEY, {"state": "free"})["state"] == "free"


@pytest.mark.parametrize("ends", ["the wrapper gets SIGTERM", "the command exits"])
def test_no_process_the_command_started_outlives_its_lease(state: State, tmp_path: Path, ends: str) -> None:
    """A command that starts a process of its own (a script's background job): SIGTERM to
    the wrapper reaches that process too, and a command that exits leaving it behind has it
    ended before the lease is released, so no process of the run works beside the next
    holder (the tester's ``-- sh -c 'sleep 25; echo x'``, issue 12 review)."""
    pid_file = tmp_path / "job.pid"
    script = f"sleep 60 & echo $! > {pid_file}; " + ("wait" if ends == "the wrapper gets SIGTERM" else "exit 0")
    log = tmp_path / "wrapper.err"
    with open(log, "w") as err:  # not a pipe: the job would hold it open, and a reader wait for the job
        wrapper = state.popen("leases", "run", "--export", "orders", "--", "sh", "-c", script,
                              stdout=subprocess.DEVNULL, stderr=err)
    wait_for(lambda: pid_file.exists() and pid_file.read_text().strip().isdigit(), "the background job to start")
    job = int(pid_file.read_text())
    if ends == "the wrapper gets SIGTERM":
        os.kill(wrapper.pid, signal.SIGTERM)
    code = wrapper.wait(timeout=30)
    job_alive = alive(job, None)
    if job_alive:
        os.kill(job, signal.SIGKILL)
    assert code == (128 + signal.SIGTERM if ends == "the wrapper gets SIGTERM" else 0), log.read_text()
    assert not job_alive, f"the background job {job} outlived its wrapper ({ends})"
    proc = state.cli_process("--lock-wait", "0", "leases", "run", "--export", "orders", "--", "true")
    assert proc.returncode == 0, describe(proc)


def test_a_sigkilled_wrapper_takes_its_command_with_it_and_only_then_frees_the_lease(
        state: State, spawn: Callable[..., LeaseRun]) -> None:
    holder = spawn(state)
    command_pid = holder.wait_ready()
    assert state.leases()[RUN_KEY]["child_pid"] == command_pid
    os.kill(holder.pid, signal.SIGKILL)  # the wrapper only, not its process group
    holder.proc.wait(timeout=30)
    # PR_SET_PDEATHSIG: the kernel kills the command with its wrapper, so no command runs on
    # without the lease (on PostgreSQL the lease row's heartbeat belongs to the wrapper).
    wait_for(lambda: not alive(command_pid, None), f"command {command_pid} to die with its wrapper", timeout=10)
    assert state.leases()[RUN_KEY]["state"] == "stale"
    proc = state.cli_process("--lock-wait", "0", "leases", "run", "--export", "orders", "--", "true")
    assert proc.returncode == 0, describe(proc)


@pytest.mark.parametrize("closes_fds", [False, True], ids=["keeps its descriptors", "closes them"])
def test_what_the_command_started_keeps_the_lease_live_after_its_wrapper_and_command_are_killed(
        state: State, tmp_path: Path, closes_fds: bool) -> None:
    """A command that is a shell running a step (``sh -c 'python …; true'``): SIGKILL the
    wrapper, PR_SET_PDEATHSIG ends the shell, and the step it started works on, adopted by
    pid 1. The lease stays live while it does, so no second run of the export starts beside
    it; once it ends, the lease is stale and the next run takes it. Found by a fresh user: on
    PostgreSQL the lease read stale at once (holder and command dead) and a second run started
    beside the first one's work. On SQLite a step that keeps its descriptors keeps the
    inherited lock; one that closes them (as daemons do) must not free the lease either."""
    with orphaned_step(state, tmp_path, closes_fds):
        assert state.leases()[RUN_KEY]["state"] == "live"
        proc = state.cli_process("--json-errors", "--lock-wait", "0", "leases", "run", "--export", "orders", "--",
                                 "true")
        assert proc.returncode == 2 and error_object(proc)["code"] == "RIVET_STATE_RUN_IN_PROGRESS", describe(proc)
    assert state.leases()[RUN_KEY]["state"] in {"stale", "free"}
    proc = state.cli_process("--lock-wait", "0", "leases", "run", "--export", "orders", "--", "true")
    assert proc.returncode == 0, describe(proc)


def test_an_ended_group_is_judged_by_one_signal_probe_a_zombie_one_by_proc(monkeypatch: pytest.MonkeyPatch) -> None:
    """What is left of a command's group once it ended (``group_alive``): a group with no
    process at all (its leader reaped) is answered by killpg(2) alone, without reading every
    process's ``stat``; a group whose process is a zombie still answers that probe, so it is
    read from ``/proc``, where a zombie is dead; a live one is alive."""
    listed: list[str] = []
    listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda path: listed.append(path) or listdir(path))
    live = subprocess.Popen(["sleep", "60"], process_group=0)
    try:
        assert group_alive(live.pid)
    finally:
        live.kill()
        live.wait()
    ended = subprocess.Popen(["true"], process_group=0)
    os.waitid(os.P_PID, ended.pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped: a zombie
    listed.clear()
    assert not group_alive(ended.pid)
    assert listed == ["/proc"]
    ended.wait()
    listed.clear()
    assert not group_alive(ended.pid)
    assert listed == []


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfd_open(2) is Linux's")
def test_leases_run_sees_its_command_end_at_once_instead_of_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrapper waits on the command's pidfd: the end of a short command is seen when it
    happens, not at the next of ``Popen.wait``'s growing pauses (1, 2, 4 ... ms)."""
    command = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    polled = types.SimpleNamespace(sleep=lambda seconds: pytest.fail(f"Popen.wait slept {seconds} s: it polled"))
    monkeypatch.setattr(subprocess, "time", polled)
    with _exit_watch(command) as ended:
        assert ended(60.0) == 3


def test_the_host_a_holder_records_is_the_name_gethostname_gives() -> None:
    """Records written with either name compare equal (a PostgreSQL lease on this host)."""
    assert host_name() == socket.gethostname()


def _insert_row(state: State, *, pid: int, started: int | None, child: int | None, child_started: int | None,
                heartbeat_age: str) -> None:
    with state.pg() as conn:
        conn.execute("INSERT INTO rivet_leases (key, holder_pid, holder_host, holder_user, command, acquired_at, "
                     "heartbeat_at, ttl_seconds, fencing_token, holder_started, child_pid, child_started) VALUES "
                     "(%s, %s, %s, 'ops', 'rivet run', now() - interval '2 hours', now() - %s::interval, 30, 7, "
                     "%s, %s, %s)", (RUN_KEY, pid, socket.gethostname(), heartbeat_age, started, child,
                                     child_started))


def test_postgres_row_of_a_dead_wrapper_whose_command_lives_on_this_host_stays_live(pg_state: State) -> None:
    command = subprocess.Popen(["sleep", "60"])
    try:
        _insert_row(pg_state, pid=dead_pid(), started=None, child=command.pid,
                    child_started=process_started(command.pid), heartbeat_age="1 hour")
        assert pg_state.leases()[RUN_KEY]["state"] == "live"  # no heartbeat for an hour, but the work runs
        proc = pg_state.cli_process("--json-errors", "--lock-wait", "0", "leases", "run", "--export", "orders", "--",
                                    "true")
        assert proc.returncode == 2 and error_object(proc)["code"] == "RIVET_STATE_RUN_IN_PROGRESS", describe(proc)
    finally:
        command.kill()
        command.wait()
    assert pg_state.leases()[RUN_KEY]["state"] == "stale"
    proc = pg_state.cli_process("--lock-wait", "0", "leases", "run", "--export", "orders", "--", "true")
    assert proc.returncode == 0, describe(proc)


def test_postgres_holder_whose_pid_was_reused_reads_as_stale_at_once(pg_state: State) -> None:
    # pid of a live process (this test), but another start time: the recorded holder is gone
    me = os.getpid()
    _insert_row(pg_state, pid=me, started=(process_started(me) or 0) + 1, child=None, child_started=None,
                heartbeat_age="0 seconds")
    assert pg_state.leases()[RUN_KEY]["state"] == "stale"
    proc = pg_state.cli_process("--lock-wait", "0", "leases", "run", "--export", "orders", "--", "true")
    assert proc.returncode == 0, describe(proc)


# -- other commands beside a live lease -----------------------------------------------------


@pytest.fixture
def older_state(state_backend: StateBackend) -> State:
    """A state below head: a legacy SQLite file (leases dir beside it), or PostgreSQL moved down to 0002."""
    if state_backend.kind == "sqlite":
        state = _make_state(state_backend, init=False)
        build_legacy_state(state.directory / ".rivet_state.db",
                           [("orders", "incremental"), ("order_lines", "chunked")], runs=60)
        return state
    state = _make_state(state_backend)
    migrate(state.context(), to="0002", allow_data_loss=True)
    return state


def _revision(state: State) -> Any:
    return info(state.context()).as_dict()["revision"]


def test_migrate_beside_a_live_lease_waits_then_fails_upgrade_beside_live_run(
        older_state: State, spawn: Callable[..., LeaseRun]) -> None:
    revision = _revision(older_state)
    holder = spawn(older_state)
    holder.wait_ready()
    files = tree_digest(older_state.directory)
    started = time.monotonic()
    proc = older_state.cli("migrate", "--lock-wait", "2", "--json-errors")
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, describe(proc)
    err = error_object(proc)
    assert err["code"] == "RIVET_STATE_UPGRADE_BESIDE_LIVE_RUN" and err["retryable"] is True, err
    assert RUN_KEY in err["message"] and f"pid {holder.pid}" in err["message"], err
    assert "waiting up to 2 s for the state (live runs), held by chunk-run:orders" in proc.stderr, describe(proc)
    assert elapsed >= 2.0
    assert tree_digest(older_state.directory) == files  # no backup, no byte changed
    assert _revision(older_state) == revision

    assert holder.finish().returncode == 0
    proc = older_state.cli("migrate", "--lock-wait", "0")
    assert proc.returncode == 0, describe(proc)
    assert _revision(older_state)["status"] == "head"


def test_exports_reset_takes_the_run_lease_of_its_export(state: State, spawn: Callable[..., LeaseRun]) -> None:
    holder = spawn(state)
    holder.wait_ready()
    proc = state.cli("--json-errors", "--lock-wait", "0", "exports", "reset", "orders")
    assert proc.returncode == 2, describe(proc)
    err = error_object(proc)
    assert err["code"] == "RIVET_STATE_RUN_IN_PROGRESS" and f"pid {holder.pid}" in err["message"], err
    assert holder.finish().returncode == 0
    proc = state.cli("--lock-wait", "0", "exports", "reset", "orders")
    assert proc.returncode == 0, describe(proc)


def test_a_command_that_takes_the_same_lease_itself_is_refused_under_leases_run(state: State) -> None:
    """The guide's "Which runs to wrap": the wrapper's own lease is busy for its command."""
    proc = state.cli_process("leases", "run", "--export", "orders", "--",
                             *state.argv("--json-errors", "--lock-wait", "0", "exports", "reset", "orders"))
    assert proc.returncode == 2, describe(proc)
    assert error_object(proc)["code"] == "RIVET_STATE_RUN_IN_PROGRESS", describe(proc)
    proc = state.cli("--lock-wait", "0", "exports", "reset", "orders")  # unwrapped, it runs
    assert proc.returncode == 0, describe(proc)


def test_info_and_check_show_the_live_holder(state: State, spawn: Callable[..., LeaseRun]) -> None:
    holder = spawn(state)
    holder.wait_ready()
    proc = state.cli("info", "--json")
    assert proc.returncode == 0, describe(proc)
    (row,) = [r for r in json.loads(proc.stdout)["leases"] if r["key"] == RUN_KEY]
    assert (row["state"], row["holder_pid"], row["export"]) == ("live", holder.pid, "orders"), row
    proc = state.cli("check", "--json")
    assert proc.returncode == 0, describe(proc)
    (leases_check,) = [c for c in json.loads(proc.stdout)["checks"] if c["id"] == "leases"]
    assert f"pid {holder.pid}" in leases_check["message"], leases_check
    assert holder.finish().returncode == 0


def test_a_process_that_is_exiting_is_not_working_a_running_one_is() -> None:
    """``/proc/PID/stat``'s flags (field 9) with PF_EXITING: a SIGKILLed command that has
    closed its files but is not a zombie yet does no more work, so a lease its group kept
    reads stale at once (found in CI: a next taker read "live" right after the kill). This
    process itself is running."""
    from statetool.backends.processes import _stat_fields, _working

    mine = _stat_fields(os.getpid())
    assert mine is not None and _working(mine)
    exiting = [*mine[:6], str(int(mine[6]) | 0x4).encode(), *mine[7:]]
    assert not _working(exiting)
    assert not _working([b"Z", *mine[1:]])


def test_a_symlinked_state_and_its_real_directory_share_one_lease(
        tmp_path: Path, spawn: Callable[..., LeaseRun]) -> None:
    """A fresh user's finding: the lease folder was made beside the symlink, so a run through
    the link and a run through the real directory both held "the" run lease of one state, and
    a cursor was changed under a live run. The folder belongs beside the real file."""
    (tmp_path / "real").mkdir()
    real = _make_state(StateBackend.sqlite(tmp_path, declared=tmp_path / "real"))
    assert real.state_dir is not None
    linked_dir = tmp_path / "linked"
    linked_dir.mkdir()
    (linked_dir / ".rivet_state.db").symlink_to(real.state_dir / ".rivet_state.db")
    linked = State("sqlite", real.config, {"RIVET_STATE_URL": f"sqlite:{linked_dir}"}, None, linked_dir)
    for holding, other in ((linked, real), (real, linked)):
        holder = spawn(holding)
        holder.wait_ready()
        proc = other.cli("--json-errors", "--lock-wait", "0", "leases", "run", "--export", "orders", "--", "true")
        assert proc.returncode == 2, describe(proc)
        assert error_object(proc)["code"] == "RIVET_STATE_RUN_IN_PROGRESS", describe(proc)
        proc = other.cli("--json-errors", "--lock-wait", "0", "exports", "set-cursor", "orders", "9")
        assert proc.returncode == 2, describe(proc)
        assert f"pid {holder.pid}" in error_object(proc)["message"], describe(proc)
        assert other.leases()[RUN_KEY]["state"] == "live"
        assert holder.finish().returncode == 0
    assert sorted(p.name for p in linked_dir.iterdir()) == [".rivet_state.db"]
    assert (real.state_dir / ".rivet_state.leases").is_dir()
