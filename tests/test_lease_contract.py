"""The lease contract under fire (SPEC §5 "Fencing", §9 "Two processes never hold one lease at
once, and a process that lost its lease writes nothing"), on the rewritten lease/guard layer.

* Contention with a referee: worker processes take ``chunk-run:orders`` through
  ``StateStore.run`` a thousand times (500 on PostgreSQL) while the test SIGKILLs workers (and restarts them),
  ``statetool leases run`` wrappers (the wrapper only) and their commands. Every holder
  appends fixed-size records to one O_APPEND referee file; the test judges the file.
* A stalled PostgreSQL holder (SIGSTOP past its TTL) that is taken over writes nothing when
  it wakes, and ``leases run`` stops its command and exits 2.
* ``leases release`` is atomic with its audit row, refuses bad and unknown keys, and never
  shows a password given in ``--reason``.
* Findings on the same rules: a release the database refuses is classified as a permanent
  fault; a SQLite sidecar removed under a holder never makes a token repeat; a PostgreSQL
  takeover blocked by a row lock still honours ``--lock-wait``.

Real processes, real files, a real PostgreSQL server; no mocks and no timed assertions.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from support import Forked, describe, error_object, fork_code, process_env
from statetool.backends.processes import alive, process_started
from statetool.errors import StateError
from statetool.runtime import StateStore
from test_leases import (  # noqa: F401 - fixtures are used by name
    RUN_KEY,
    LeaseRun,
    State,
    _pg_dsn,
    dead_pid,
    pg_state,
    spawn,
    sqlite_state,
    state,
    wait_for,
)

# -- the referee ------------------------------------------------------------------------

#: Every referee record is exactly this many bytes (space padded, newline last). 4096 is a
#: multiple of it, so no record straddles a page: an append cut short by SIGKILL (the kernel
#: checks for a fatal signal between pages) can never leave half a record.
REC = 128

#: Shared by the library workers and the commands under ``leases run``.
#:
#: A record: ``kind role pid start holder token t prev prevstate cursor``:
#:   kind      enter | exit
#:   role      lib (StateStore.run in this process) | cli (the command of a leases run wrapper)
#:   pid/start the writer (pid and its start time in clock ticks, /proc/PID/stat field 22)
#:   holder    "pid:start" of the process the lease names (lib: the writer; cli: its wrapper)
#:   token     the fencing token of this holding
#:   t         CLOCK_MONOTONIC ns (system wide): enter = right after the lease was taken,
#:             exit = right before the exit record is written (the lease is still held)
#:   prev      enter: "pid:start" of the last record of the file when it is an enter (a
#:             holder that never wrote its exit), "-" otherwise
#:   prevstate enter: that holder judged at this moment: "dead" (gone, a zombie, a reused
#:             pid, in do_exit, or with SIGKILL pending: it never runs user code again) or
#:             "alive"; "-" when prev is "-"
#:   cursor    enter: the export's cursor as committed in the state ("-" for none);
#:             exit: the cursor this holder committed ("-" for a cli holder: it writes none)
COMMON = textwrap.dedent("""\
    import json, os, random, signal, sys, time
    REC = 128
    KILL_BIT = 1 << (signal.SIGKILL - 1)

    def stat_fields(pid):
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                data = fh.read()
        except OSError:
            return None
        return data[data.rfind(b")") + 2:].split()

    def my_start():
        return int(stat_fields(os.getpid())[19])

    def gone(pid, start):
        fields = stat_fields(pid)
        if fields is None or int(fields[19]) != start or fields[0] in (b"Z", b"X"):
            return True
        if int(fields[6]) & 0x4:  # PF_EXITING: in do_exit
            return True
        try:
            with open(f"/proc/{pid}/status") as fh:
                status = fh.read()
        except OSError:
            return True
        for line in status.splitlines():
            if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & KILL_BIT:
                return True
        return False

    def look(rfd):
        size = os.fstat(rfd).st_size
        if size == 0:
            return "-", "-"
        if size % REC:
            return "torn", "-"
        last = os.pread(rfd, REC, size - REC).split()
        if last[0] != b"enter":
            return "-", "-"
        pid, start = int(last[2]), int(last[3])
        return f"{pid}:{start}", ("dead" if gone(pid, start) else "alive")

    def record(wfd, *fields):
        line = " ".join(str(f) for f in fields)
        assert len(line) < REC, line
        os.write(wfd, (line.ljust(REC - 1) + "\\n").encode())

    def cursor_reader(backend, target):
        if backend == "sqlite":
            import sqlite3
            db = sqlite3.connect(f"file:{target}?mode=ro", uri=True, isolation_level=None)
            query = "SELECT cursor_value FROM rivet_exports WHERE export_name = 'orders'"
        else:
            import psycopg
            dsn, schema = json.loads(target)
            db = psycopg.connect(dsn, autocommit=True, options=f"-c search_path={schema}")
            query = "SELECT cursor_value FROM rivet_exports WHERE export_name = 'orders'"
        def read():
            row = db.execute(query).fetchone()
            return "-" if row is None or row[0] is None else row[0]
        return read
    """)

#: A library worker: takes the run lease again and again until STOP exists.
LIB_WORKER = COMMON + textwrap.dedent("""\
    from statetool.runtime import StateStore
    config, referee, stop, backend, target = sys.argv[1:6]
    store = StateStore.open(config, lock_wait=600)
    read_cursor = cursor_reader(backend, target)
    wfd = os.open(referee, os.O_WRONLY | os.O_APPEND)
    rfd = os.open(referee, os.O_RDONLY)
    me, start = os.getpid(), my_start()
    while not os.path.exists(stop):
        with store.run("orders", "incremental") as run:
            t = time.monotonic_ns()
            prev, prevstate = look(rfd)
            record(wfd, "enter", "lib", me, start, f"{me}:{start}", run.token, t, prev, prevstate, read_cursor())
            time.sleep(random.uniform(0, 0.008))
            value = f"c{run.token}"
            run.commit_cursor(value)
            record(wfd, "exit", "lib", me, start, f"{me}:{start}", run.token, time.monotonic_ns(), "-", "-", value)
        time.sleep(random.uniform(0, 0.02))
    """)

#: The command under ``statetool leases run``: reads its wrapper's token from the lease
#: record (the sidecar, or the lease row), holds for HOLD seconds, writes no cursor.
CLI_CHILD = COMMON + textwrap.dedent("""\
    t = time.monotonic_ns()
    referee, backend, target, sidecar, hold = sys.argv[1:6]
    wrapper = os.getppid()
    if backend == "sqlite":
        for _ in range(100):  # the wrapper may be rewriting the record (its child pid) right now
            try:
                with open(sidecar) as fh:
                    doc = json.loads(fh.readline())
                holder, token = doc["pid"], doc["fencing_token"]
                break
            except (ValueError, KeyError):
                time.sleep(0.01)
        else:
            raise SystemExit("no readable lease record in " + sidecar)
    else:
        import psycopg
        dsn, schema = json.loads(target)
        with psycopg.connect(dsn, autocommit=True, options=f"-c search_path={schema}") as conn:
            holder, token = conn.execute("SELECT holder_pid, fencing_token FROM rivet_leases "
                                         "WHERE key = 'chunk-run:orders'").fetchone()
    fields = stat_fields(holder)
    holder = f"{holder}:{int(fields[19]) if fields else 0}"
    read_cursor = cursor_reader(backend, target)
    wfd = os.open(referee, os.O_WRONLY | os.O_APPEND)
    rfd = os.open(referee, os.O_RDONLY)
    me, start = os.getpid(), my_start()
    prev, prevstate = look(rfd)
    record(wfd, "enter", "cli", me, start, holder, token, t, prev, prevstate, read_cursor())
    time.sleep(float(hold))
    record(wfd, "exit", "cli", me, start, holder, token, time.monotonic_ns(), "-", "-", "-")
    """)


@dataclass(frozen=True)
class Rec:
    """One referee record."""

    kind: str
    role: str
    pid: int
    start: int
    holder: str
    token: int
    t: int
    prev: str
    prevstate: str
    cursor: str

    @classmethod
    def parse(cls, raw: bytes) -> Rec:
        kind, role, pid, start, holder, token, t, prev, prevstate, cursor = raw.decode().split()
        return cls(kind, role, int(pid), int(start), holder, int(token), int(t), prev, prevstate, cursor)

    @property
    def who(self) -> str:
        return f"{self.pid}:{self.start}"


def read_records(path: Path) -> list[Rec]:
    data = path.read_bytes()
    assert len(data) % REC == 0, f"the referee file holds a torn record ({len(data)} bytes)"
    records = [data[i:i + REC] for i in range(0, len(data), REC)]
    assert all(len(r.rstrip(b" \n")) < REC - 1 and r.endswith(b"\n") for r in records)
    return [Rec.parse(r) for r in records]


@dataclass
class Verdict:
    """What the referee found: violations, and counts that show the run was not vacuous."""

    problems: list[str] = field(default_factory=list)
    enters: int = 0
    handoffs: int = 0
    killed_inside: dict[str, int] = field(default_factory=lambda: {"lib": 0, "wrapper": 0, "child": 0})
    lib_enters: int = 0
    cli_enters: int = 0
    last_token: int = 0
    last_cursor: str = "-"


def judge(records: list[Rec], kills: dict[tuple[str, str], int], wrappers: set[str]) -> Verdict:
    """Judge the referee file. ``kills`` maps (role, "pid:start") to the monotonic ns at
    which the test sent SIGKILL (role ``worker``, ``wrapper`` or ``child``); ``wrappers``
    are the "pid:start" of every ``leases run`` wrapper."""
    v = Verdict()
    committed = "-"  # the cursor the state must show to the next holder

    def bad(i: int, what: str) -> None:
        context = "\n".join(f"  {j}: {records[j]}" for j in range(max(0, i - 3), min(len(records), i + 2)))
        v.problems.append(f"record {i}: {what}\n{context}")

    def killed_at(rec: Rec) -> tuple[str, int] | None:
        """How the holder that wrote ``rec`` was killed (by the test), or None."""
        if rec.role == "lib":
            at = kills.get(("worker", rec.who))
            return ("lib", at) if at is not None else None
        at = kills.get(("child", rec.who))
        if at is not None:
            return "child", at
        at = kills.get(("wrapper", rec.holder))
        return ("wrapper", at) if at is not None else None

    prev: Rec | None = None
    for i, rec in enumerate(records):
        if rec.kind == "exit":
            if prev is None or prev.kind != "enter" or (prev.who, prev.token) != (rec.who, rec.token):
                bad(i, "an exit that does not close the holding right before it (two holders interleaved)")
            elif rec.t < prev.t:
                bad(i, "an exit stamped before its enter")
            if rec.role == "lib":
                committed = rec.cursor
            prev = rec
            continue
        if rec.kind != "enter":
            bad(i, f"unknown record kind {rec.kind!r}")
            prev = rec
            continue
        v.enters += 1
        v.lib_enters += rec.role == "lib"
        v.cli_enters += rec.role == "cli"
        if rec.token <= v.last_token:
            bad(i, f"fencing token {rec.token} does not exceed the previous holder's {v.last_token}")
        v.last_token = max(v.last_token, rec.token)
        if rec.role == "lib" and rec.holder != rec.who:
            bad(i, f"a library holder whose lease names {rec.holder}")
        if rec.role == "cli" and rec.holder not in wrappers:
            bad(i, f"a command whose lease names {rec.holder}, not one of the wrappers")
        if prev is None or prev.kind == "exit":
            if rec.prev != "-":
                bad(i, f"the holder saw {rec.prev} inside, but the file shows nobody inside: a record was "
                       "appended between its look and its enter")
            if prev is not None and not rec.t > prev.t:
                bad(i, f"holder {rec.who} took the lease (t={rec.t}) before {prev.who} left it (t={prev.t})")
            if rec.cursor != committed:
                bad(i, f"the state's cursor is {rec.cursor!r}, the last holder committed {committed!r}")
            if prev is not None and prev.pid != rec.pid:
                v.handoffs += 1
        else:  # the previous holder never wrote its exit: it must have died, killed by the test
            if rec.prev != prev.who:
                bad(i, f"the holder saw {rec.prev} last, the file shows {prev.who}")
            if rec.prevstate != "dead":
                bad(i, f"holder {rec.who} entered while {prev.who} (inside, no exit) was still ALIVE")
            how = killed_at(prev)
            if how is None:
                bad(i, f"{prev.who} left no exit, but the test never killed it (nor its wrapper)")
            else:
                if not rec.t > how[1]:
                    bad(i, f"holder {rec.who} took the lease before the test even killed {prev.who}")
                v.killed_inside[how[0]] += 1
            allowed = {committed} | ({f"c{prev.token}"} if prev.role == "lib" else set())
            if rec.cursor not in allowed:
                bad(i, f"the state's cursor is {rec.cursor!r}, expected one of {sorted(allowed)} "
                       "(a write landed outside its holding, or a committed one was lost)")
            committed = rec.cursor
            v.handoffs += 1
        prev = rec
    if prev is not None and prev.kind == "enter":
        how = killed_at(prev)
        if how is None:
            bad(len(records) - 1, f"the last holder {prev.who} left no exit but was never killed")
        else:
            v.killed_inside[how[0]] += 1
    v.last_cursor = committed
    return v


# -- the contention run -------------------------------------------------------------------


@dataclass
class Wrapper:
    proc: Forked
    fate: str  # finish | kill-wrapper | kill-child | kill-early
    err: Path
    who: str  # "pid:start"
    kill_at: float | None = None  # monotonic seconds (kill-early), or once inside
    acted: bool = False
    children: set[str] = field(default_factory=set)  # "pid:start" of its commands the test killed


@dataclass
class Plan:
    """How hard one backend is pushed (the run stops when every target is met)."""

    workers: int
    acquisitions: int
    lib_kills_inside: int
    random_kills: int
    wrappers_per_fate: int
    budget: float  # seconds; running out of it fails the test (no target is timed)


PLANS = {
    "sqlite": Plan(workers=4, acquisitions=1000, lib_kills_inside=15, random_kills=15, wrappers_per_fate=3,
                   budget=300),
    "postgres": Plan(workers=4, acquisitions=500, lib_kills_inside=10, random_kills=10, wrappers_per_fate=3,
                     budget=300),
}


def _kill_pidfd(pid: int, start: int) -> bool:
    """SIGKILL process ``pid`` if it is still the one that started at ``start`` (through a
    pidfd, so a reused pid is never hit). True when the signal was sent."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            return False
        if int(stat[stat.rfind(b")") + 2:].split()[19]) != start:
            return False
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True
    finally:
        os.close(pidfd)


def test_no_two_holders_ever_overlap_and_tokens_only_grow_under_sigkill_chaos(
        state: State, tmp_path: Path) -> None:
    plan = PLANS[state.backend]
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    referee, stop = tmp_path / "referee", tmp_path / "stop"
    referee.touch()
    if state.backend == "sqlite":
        target = str(state.directory / ".rivet_state.db")
    else:
        assert state.pg_url is not None
        target = json.dumps(list(_pg_dsn(state.pg_url)))
    env = process_env(state.env)
    logs = tmp_path / "logs"
    logs.mkdir()

    workers: dict[int, tuple[Forked, Path]] = {}
    wrappers: list[Wrapper] = []
    kills: dict[tuple[str, str], int] = {}
    killed_workers: set[int] = set()  # pids of killed workers not reaped yet
    failures: list[str] = []
    counts = {"worker_kills": 0, "random_kills": 0, "targeted_kills": 0, "wrapper_kills": 0, "child_kills": 0,
              "restarts": 0, "late_kills": 0}

    def start_worker() -> None:
        err = logs / f"worker-{len(kills)}-{time.monotonic_ns()}.err"
        with open(err, "wb") as fh:
            proc = fork_code(LIB_WORKER, str(state.config), str(referee), str(stop), state.backend, target, env=env,
                             stdout=fh, stderr=fh)
        workers[proc.pid] = (proc, err)

    def kill_worker(pid: int, why: str) -> None:
        proc, _err = workers[pid]
        if proc.poll() is not None:
            return
        kills[("worker", f"{pid}:{process_started(pid)}")] = time.monotonic_ns()  # not reaped: pid still its own
        killed_workers.add(pid)
        proc.send_signal(signal.SIGKILL)
        counts["worker_kills"] += 1
        counts[why] += 1

    def start_wrapper(fate: str) -> None:
        err = logs / f"wrapper-{len(wrappers)}.err"
        hold = f"{rng.uniform(0.4, 0.7):.3f}"
        with open(err, "wb") as fh:
            proc = state.popen("--json-errors", "--lock-wait", "600", "leases", "run", "--export", "orders", "--",
                               sys.executable, "-c", CLI_CHILD, str(referee), state.backend, target,
                               str(state.sidecar), hold, stdout=subprocess.DEVNULL, stderr=fh)
        kill_at = time.monotonic() + rng.uniform(0.0, 3.0) if fate == "kill-early" else None
        wrappers.append(Wrapper(proc, fate, err, f"{proc.pid}:{process_started(proc.pid)}", kill_at))

    fates = [f for f in ("kill-wrapper", "kill-child", "finish", "kill-early") for _ in range(plan.wrappers_per_fate)]
    rng.shuffle(fates)

    rfd = os.open(referee, os.O_RDONLY)
    offset = 0
    inside: Rec | None = None
    pending_kill: tuple[float, int] | None = None  # (when, worker pid) of a targeted kill
    seen_enter: int = 0
    enters = 0
    lib_inside_kills = 0
    deadline = time.monotonic() + plan.budget
    next_random = time.monotonic() + rng.uniform(0.5, 2.0)
    next_wrapper = time.monotonic() + rng.uniform(0.5, 2.0)
    stopping = False
    try:
        for _ in range(plan.workers):
            start_worker()
        while True:
            now = time.monotonic()
            # Follow the referee file.
            data = os.pread(rfd, 1 << 20, offset)
            whole = len(data) - len(data) % REC
            for i in range(0, whole, REC):
                rec = Rec.parse(data[i:i + REC])
                if rec.kind == "enter":
                    enters += 1
                    inside = rec
                else:
                    inside = None
            offset += whole

            # Reap; restart killed workers.
            for pid, (proc, err) in list(workers.items()):
                code = proc.poll()
                if code is None:
                    continue
                del workers[pid]
                killed = pid in killed_workers
                killed_workers.discard(pid)
                if code == -signal.SIGKILL and killed:
                    if not stopping:
                        start_worker()
                        counts["restarts"] += 1
                elif code != 0 or not stopping:
                    failures.append(f"worker {pid} ended with {code}:\n{err.read_text()[-3000:]}")
            for w in wrappers:
                if w.proc.returncode is None:
                    w.proc.poll()

            # Kill the holder inside: a library worker now and then, or a wrapper's command or
            # wrapper as its fate says.
            if inside is not None and enters != seen_enter:
                seen_enter = enters
                if inside.role == "lib" and inside.pid in workers and not stopping \
                        and lib_inside_kills < plan.lib_kills_inside \
                        and rng.random() < 2 * plan.lib_kills_inside / plan.acquisitions:
                    pending_kill = (now + rng.uniform(0.0, 0.006), inside.pid)
                if inside.role == "cli":
                    w = next((w for w in wrappers if w.who == inside.holder), None)
                    if w is not None and w.fate in ("kill-wrapper", "kill-child") and not w.acted:
                        w.kill_at = now + rng.uniform(0.0, 0.1)
            if pending_kill is not None and now >= pending_kill[0]:
                if pending_kill[1] in workers:
                    kill_worker(pending_kill[1], "targeted_kills")
                    lib_inside_kills += 1
                pending_kill = None
            for w in wrappers:
                if w.acted or w.kill_at is None or now < w.kill_at or w.proc.returncode is not None:
                    continue
                w.acted = True
                if w.fate == "kill-child":
                    at = time.monotonic_ns()  # stamped before the signal
                    if inside is not None and inside.role == "cli" and inside.holder == w.who \
                            and _kill_pidfd(inside.pid, inside.start):
                        kills[("child", inside.who)] = at
                        w.children.add(inside.who)
                        counts["child_kills"] += 1
                else:
                    kills[("wrapper", w.who)] = time.monotonic_ns()
                    w.proc.send_signal(signal.SIGKILL)  # the wrapper only, not its process group
                    counts["wrapper_kills"] += 1
            # Random kills of any worker, wherever it is (waiting, inside, between rounds).
            if not stopping and now >= next_random and workers:
                kill_worker(rng.choice(list(workers)), "random_kills")
                next_random = now + rng.uniform(0.8, 3.0)
            # Wrappers, one or two at a time.
            if not stopping and fates and now >= next_wrapper and \
                    sum(w.proc.returncode is None for w in wrappers) < 2:
                start_wrapper(fates.pop())
                next_wrapper = now + rng.uniform(0.3, 2.0)

            if not stopping and enters >= plan.acquisitions and not fates \
                    and counts["random_kills"] >= plan.random_kills and lib_inside_kills >= plan.lib_kills_inside:
                stopping = True
                stop.touch()
            if stopping and not workers and all(w.proc.poll() is not None for w in wrappers):
                break
            if failures:
                break
            if now > deadline:
                pytest.fail(f"seed {seed}: not done after {plan.budget} s: {enters} acquisitions, {counts}, "
                            f"wrappers left {len(fates)}, live workers {len(workers)}")
            time.sleep(0.003)
    finally:
        os.close(rfd)
        stop.touch()
        for proc, _err in workers.values():
            proc.kill()
            proc.wait()
        for w in wrappers:
            if w.proc.poll() is None:
                os.killpg(w.proc.pid, signal.SIGKILL)
                w.proc.wait()
    # A SIGKILL that reached a wrapper (or its command) already on its way out killed nothing:
    # the wrapper ended 0 after its command released the lease. Such a kill is no kill, and
    # the referee must show that holding closed like any other.
    for w in wrappers:
        if w.proc.returncode == 0:
            for key in [("wrapper", w.who), *(("child", who) for who in w.children)]:
                counts["late_kills"] += kills.pop(key, None) is not None
    verdict = judge(read_records(referee), kills, {w.who for w in wrappers})
    summary = (f"seed {seed}: {verdict.enters} acquisitions ({verdict.lib_enters} library, {verdict.cli_enters} "
               f"commands), {verdict.handoffs} handoffs, killed inside the lease {verdict.killed_inside}, "
               f"kills {counts}")
    print(summary)
    assert not verdict.problems, summary + "\n" + "\n".join(verdict.problems[:10])
    assert not failures, summary + "\n" + "\n".join(failures)

    # What the wrappers returned: their command's code, 137 when the command was killed, or
    # death by SIGKILL themselves. A wrapper never reports a lost lease here: none stalled.
    for w in wrappers:
        code = w.proc.returncode
        expected = {"finish": {0}, "kill-wrapper": {-signal.SIGKILL, 0}, "kill-child": {128 + signal.SIGKILL, 0},
                    "kill-early": {-signal.SIGKILL, 0}}[w.fate]
        if ("wrapper", w.who) in kills:
            expected = {-signal.SIGKILL}
        assert code in expected, f"seed {seed}: wrapper ({w.fate}) exit {code}:\n{w.err.read_text()}"

    # Not vacuous: many acquisitions, many handoffs between processes, and holders really
    # killed inside the lease in every way the test kills.
    assert verdict.enters >= plan.acquisitions, summary
    assert verdict.handoffs >= plan.acquisitions // 20, summary
    assert verdict.killed_inside["lib"] >= plan.lib_kills_inside // 2, summary
    assert verdict.killed_inside["wrapper"] >= 1 and verdict.killed_inside["child"] >= 1, summary
    assert counts["worker_kills"] >= plan.random_kills + plan.lib_kills_inside // 2, summary

    # The state agrees with the referee: the cursor the last holder committed, and a lease
    # nobody holds, whose token is the last one drawn or later.
    leases = state.leases()
    row = leases.get(RUN_KEY, {"state": "free"})
    assert row["state"] in ("free", "stale"), row
    if state.backend == "sqlite":
        doc = json.loads(state.sidecar.read_text().splitlines()[0])
        assert doc["fencing_token"] >= verdict.last_token, doc
    else:
        with state.pg() as conn:
            (token,) = conn.execute("SELECT token FROM rivet_lease_tokens WHERE key = %s", (RUN_KEY,)).fetchone()
        assert token >= verdict.last_token
    assert _cursor(state) == (None if verdict.last_cursor == "-" else verdict.last_cursor), (summary, leases)


def _cursor(state: State) -> str | None:
    query = "SELECT cursor_value FROM rivet_exports WHERE export_name = 'orders'"
    if state.backend == "sqlite":
        db = sqlite3.connect(f"file:{state.directory / '.rivet_state.db'}?mode=ro", uri=True)
        try:
            row = db.execute(query).fetchone()
        finally:
            db.close()
    else:
        with state.pg() as conn:
            row = conn.execute(query).fetchone()
    return None if row is None else row[0]


def test_the_referee_itself_flags_overlaps_unkilled_silences_and_shrinking_tokens() -> None:
    """The judge of the contention test is not vacuous: fed violating files, it objects."""

    def rec(kind: str, pid: int, token: int, t: int, prev: str = "-", prevstate: str = "-", cursor: str = "-",
            role: str = "lib") -> Rec:
        return Rec(kind, role, pid, 1000 + pid, f"{pid}:{1000 + pid}", token, t, prev, prevstate, cursor)

    good = [rec("enter", 1, 1, 10), rec("exit", 1, 1, 20, cursor="c1"),
            rec("enter", 2, 2, 30, cursor="c1"), rec("exit", 2, 2, 40, cursor="c2"),
            rec("enter", 3, 3, 50, cursor="c2"),  # killed inside at t=55
            rec("enter", 1, 4, 60, prev="3:1003", prevstate="dead", cursor="c3"), rec("exit", 1, 4, 70, cursor="c4")]
    kills = {("worker", "3:1003"): 55}
    assert judge(good, kills, set()).problems == []
    assert judge(good, kills, set()).killed_inside["lib"] == 1

    def flagged(records: list[Rec], kills: dict[tuple[str, str], int] = kills) -> bool:
        return bool(judge(records, kills, set()).problems)

    assert flagged(good[:5] + [rec("enter", 1, 4, 60, prev="3:1003", prevstate="alive", cursor="c3")] + good[6:])
    assert flagged(good, {})  # a holder fell silent, but nobody killed it
    assert flagged(good, {("worker", "3:1003"): 65})  # the next holder entered before the kill
    assert flagged(good, {("worker", "3:999"): 55})  # another process with that pid was killed
    assert flagged(good[:2] + [rec("enter", 2, 1, 30, cursor="c1")] + good[3:])  # a token went back
    assert flagged(good[:2] + [rec("enter", 2, 2, 15, cursor="c1")] + good[3:])  # entered before the exit
    assert flagged([good[0], good[2], good[1], good[3]])  # interleaved
    assert flagged(good[:2] + [rec("enter", 2, 2, 30, cursor="c0")] + good[3:])  # a committed cursor lost


# -- a stalled PostgreSQL holder ------------------------------------------------------------

#: Holds chunk-run:orders through StateStore.run with a TTL of 2 s, writes once, reports
#: READY (token, run id), waits for GO, then tries every kind of write and reports each
#: outcome to RESULT.
STALLED = textwrap.dedent("""\
    import json, os, pathlib, sys, time
    from statetool.errors import StateError
    from statetool.runtime import StateStore
    config, ready, go, result = sys.argv[1:5]
    store = StateStore.open(config, lock_wait=10, ttl=2)
    out = {}
    with store.run("orders", "incremental") as run:
        run_id = run.start_run()
        run.commit_cursor("before-the-stall")
        out.update(token=run.token, run_id=run_id, pid=os.getpid())
        pathlib.Path(ready + ".tmp").write_text(json.dumps(out))
        os.rename(ready + ".tmp", ready)
        while not os.path.exists(go):
            time.sleep(0.01)

        def in_one_transaction():
            with run.transaction() as tx:
                tx.commit_cursor("orders", "incremental", "grouped-after-the-stall")

        attempts = {}
        for name, write in [("commit_cursor", lambda: run.commit_cursor("after-the-stall")),
                            ("start_run", lambda: run.start_run()),
                            ("record_chunk", lambda: run.record_chunk(run_id, 0, "a", "m", "done", rows=5)),
                            ("finish_run", lambda: run.finish_run(run_id, "succeeded", rows=5)),
                            ("transaction", in_one_transaction)]:
            try:
                write()
                attempts[name] = "WRITTEN"
            except StateError as err:
                attempts[name] = err.code
        out.update(attempts=attempts, lost=run.lease.lost)
    pathlib.Path(result).write_text(json.dumps(out))
    """)


def _table(state: State, sql: str) -> list[tuple[Any, ...]]:
    with state.pg() as conn:
        return [tuple(row) for row in conn.execute(sql).fetchall()]


def test_a_stalled_postgres_holder_taken_over_writes_nothing_and_gets_lease_lost(
        pg_state: State, tmp_path: Path) -> None:
    ready, go, result = tmp_path / "ready", tmp_path / "go", tmp_path / "result"
    err_log = tmp_path / "stalled.err"
    with open(err_log, "wb") as fh:
        stalled = fork_code(STALLED, str(pg_state.config), str(ready), str(go), str(result),
                            env=process_env(pg_state.env), stdout=fh, stderr=fh)
    try:
        wait_for(lambda: ready.exists() or stalled.poll() is not None, "the holder to take the lease")
        assert ready.exists(), err_log.read_text()
        first = json.loads(ready.read_text())
        os.kill(stalled.pid, signal.SIGSTOP)  # stalls: no heartbeat, no write
        try:
            # Another process (this one) waits for the TTL to run out and takes the lease over.
            store = StateStore.open(pg_state.config, env=process_env(pg_state.env), lock_wait=60)
            with store.run("orders", "incremental") as run:
                assert run.token is not None and run.token > first["token"], (run.token, first)
                assert alive(stalled.pid, None), "the stalled holder must still exist for this test"
                (row,) = _table(pg_state, "SELECT holder_pid, fencing_token FROM rivet_leases")
                assert row == (os.getpid(), run.token), row
                mine = run.start_run()
                run.commit_cursor("new-holder")

                go.touch()
                os.kill(stalled.pid, signal.SIGCONT)
                stalled.wait(timeout=60)
                assert stalled.returncode == 0, err_log.read_text()
                out = json.loads(result.read_text())
                assert out["attempts"] == dict.fromkeys(
                    ("commit_cursor", "start_run", "record_chunk", "finish_run", "transaction"),
                    "RIVET_STATE_LEASE_LOST"), (out, err_log.read_text())
                assert out["lost"] is True, out

                # Nothing of the stalled holder landed after the takeover, and its release
                # left the new holder's lease alone.
                assert _table(pg_state, "SELECT cursor_value FROM rivet_exports WHERE export_name = 'orders'") \
                    == [("new-holder",)]
                runs = dict(_table(pg_state, "SELECT run_id, status FROM rivet_runs"))
                assert runs == {first["run_id"]: "running", mine: "running"}, runs
                assert _table(pg_state, "SELECT count(*) FROM rivet_chunks") == [(0,)]
                (row,) = _table(pg_state, "SELECT holder_pid, fencing_token FROM rivet_leases")
                assert row == (os.getpid(), run.token), row
                run.commit_cursor("new-holder-still-writes")
                run.finish_run(mine, "succeeded", rows=1)
            assert _table(pg_state, "SELECT cursor_value FROM rivet_exports") == [("new-holder-still-writes",)]
            assert _table(pg_state, "SELECT count(*) FROM rivet_leases") == [(0,)]
        finally:
            if stalled.poll() is None:
                os.kill(stalled.pid, signal.SIGCONT)
    finally:
        if stalled.poll() is None:
            stalled.kill()
            stalled.wait()


def test_leases_run_stalled_past_its_ttl_and_taken_over_stops_its_command_and_exits_lease_lost(
        pg_state: State, tmp_path: Path) -> None:
    wrapper = pg_state.popen("--json-errors", "leases", "run", "--export", "orders", "--lease-ttl", "2", "--",
                             "sleep", "60")
    try:
        def command_runs() -> bool:
            if wrapper.poll() is not None:
                out, err = wrapper.communicate()
                pytest.fail(f"the wrapper ended early: exit {wrapper.returncode}\n{out}\n{err}")
            row = pg_state.leases().get(RUN_KEY)
            return row is not None and row["child_pid"] is not None

        wait_for(command_runs, "the command to run under the lease")
        row = pg_state.leases()[RUN_KEY]
        assert (row["state"], row["holder_pid"]) == ("live", wrapper.pid), row
        command, old_token = row["child_pid"], row["fencing_token"]
        command_started = process_started(command)
        assert alive(command, command_started)

        os.kill(wrapper.pid, signal.SIGSTOP)  # the wrapper only: its command keeps running
        try:
            store = StateStore.open(pg_state.config, env=process_env(pg_state.env), lock_wait=60)
            with store.run("orders", "incremental") as run:
                assert run.token is not None and run.token > old_token, (run.token, old_token)
                os.kill(wrapper.pid, signal.SIGCONT)
                out, err = wrapper.communicate(timeout=60)
                proc = subprocess.CompletedProcess(wrapper.args, wrapper.returncode, out, err)
                assert proc.returncode == 2, describe(proc)
                error = error_object(proc)
                assert (error["code"], error["exit_code"], error["retryable"]) == \
                    ("RIVET_STATE_LEASE_LOST", 2, True), describe(proc)
                wait_for(lambda: not alive(command, command_started), f"command {command} to be stopped",
                         timeout=30)
                # The wrapper's exit left the new holder's lease in place, and its writes land.
                row = pg_state.leases()[RUN_KEY]
                assert (row["state"], row["holder_pid"], row["fencing_token"]) == \
                    ("live", os.getpid(), run.token), row
                run.commit_cursor("after-the-takeover")
            assert _table(pg_state, "SELECT cursor_value FROM rivet_exports") == [("after-the-takeover",)]
        finally:
            if wrapper.poll() is None:
                os.kill(wrapper.pid, signal.SIGCONT)
    finally:
        if wrapper.poll() is None:
            os.killpg(wrapper.pid, signal.SIGKILL)
            wrapper.communicate()


# -- leases release ---------------------------------------------------------------------


def _stale_lease(state: State, spawn: Callable[..., LeaseRun]) -> LeaseRun:
    """A lease whose holder (a ``leases run`` wrapper and its command) was SIGKILLed."""
    holder = spawn(state)
    holder.wait_ready()
    holder.kill_group()
    row = state.leases()[RUN_KEY]
    assert (row["state"], row["holder_pid"]) == ("stale", holder.pid), row
    return holder


def _lease_record(state: State) -> Any:
    """The lease as stored: the sidecar's bytes, or the lease row."""
    if state.backend == "sqlite":
        return state.sidecar.read_bytes()
    with state.pg() as conn:
        return conn.execute("SELECT * FROM rivet_leases WHERE key = %s", (RUN_KEY,)).fetchall()


def _all_audit(state: State) -> list[tuple[Any, ...]]:
    query = "SELECT * FROM rivet_audit ORDER BY id"
    if state.backend == "sqlite":
        db = sqlite3.connect(f"file:{state.directory / '.rivet_state.db'}?mode=ro", uri=True)
        try:
            return [tuple(r) for r in db.execute(query).fetchall()]
        finally:
            db.close()
    with state.pg() as conn:
        return [tuple(r) for r in conn.execute(query).fetchall()]


def _audit_trigger(state: State, present: bool) -> None:
    """Make every insert into rivet_audit fail (or stop doing so)."""
    if state.backend == "sqlite":
        db = sqlite3.connect(state.directory / ".rivet_state.db")
        try:
            if present:
                db.execute("CREATE TRIGGER no_audit BEFORE INSERT ON rivet_audit "
                           "BEGIN SELECT RAISE(ABORT, 'no audit'); END")
            else:
                db.execute("DROP TRIGGER no_audit")
            db.commit()
        finally:
            db.close()
        return
    with state.pg() as conn:
        if present:
            conn.execute("CREATE FUNCTION no_audit() RETURNS trigger LANGUAGE plpgsql AS "
                         "$$ BEGIN RAISE EXCEPTION 'no audit'; END $$")
            conn.execute("CREATE TRIGGER no_audit BEFORE INSERT ON rivet_audit "
                         "FOR EACH ROW EXECUTE FUNCTION no_audit()")
        else:
            conn.execute("DROP TRIGGER no_audit ON rivet_audit")
            conn.execute("DROP FUNCTION no_audit()")


def test_a_release_whose_audit_row_cannot_be_written_leaves_the_stale_lease_exactly_in_place(
        state: State, spawn: Callable[..., LeaseRun]) -> None:
    holder = _stale_lease(state, spawn)
    record = _lease_record(state)
    audit = _all_audit(state)
    _audit_trigger(state, present=True)

    proc = state.cli("--json-errors", "leases", "release", RUN_KEY, "--reason", "worker rebooted")
    assert proc.returncode != 0, describe(proc)
    err = error_object(proc)
    assert err["code"] and err["code"].startswith("RIVET_"), describe(proc)
    assert "Traceback" not in proc.stderr, describe(proc)
    row = state.leases()[RUN_KEY]
    assert (row["state"], row["holder_pid"]) == ("stale", holder.pid), (row, describe(proc))
    assert _lease_record(state) == record, describe(proc)
    assert _all_audit(state) == audit, describe(proc)

    _audit_trigger(state, present=False)
    proc = state.cli("--json", "leases", "release", RUN_KEY, "--reason", "worker rebooted")
    assert proc.returncode == 0, describe(proc)
    assert json.loads(proc.stdout)["released"]["holder_pid"] == holder.pid, describe(proc)
    assert state.leases().get(RUN_KEY, {"state": "free"})["state"] == "free"
    (released,) = state.audit_rows("leases.release")
    assert (released["detail"]["key"], released["detail"]["removed"]["holder_pid"],
            released["detail"]["reason"]) == (RUN_KEY, holder.pid, "worker rebooted"), released
    assert len(_all_audit(state)) == len(audit) + 1


def test_release_of_a_malformed_key_is_key_invalid_and_of_a_key_that_never_existed_is_unknown(
        state: State, spawn: Callable[..., LeaseRun]) -> None:
    _stale_lease(state, spawn)  # a real lease exists beside: neither error may touch it
    record, audit = _lease_record(state), _all_audit(state)
    for key, code in [("foo bar/../x", "RIVET_STATE_LEASE_KEY_INVALID"), ("chunk-run:nope", "RIVET_STATE_LEASE_UNKNOWN")]:
        files = sorted(p.name for p in state.directory.rglob("*"))
        proc = state.cli("--json-errors", "leases", "release", key, "--reason", "cleanup")
        assert proc.returncode == 1, describe(proc)
        err = error_object(proc)
        assert (err["code"], err["exit_code"], err["retryable"]) == (code, 1, False), describe(proc)
        assert _all_audit(state) == audit, describe(proc)
        assert _lease_record(state) == record, describe(proc)
        assert sorted(p.name for p in state.directory.rglob("*")) == files, describe(proc)
        assert not (state.leases_dir / "nope").exists() and not (state.leases_dir / "chunk-run%3Anope").exists()
    assert set(state.leases()) == {RUN_KEY}


def test_a_password_given_as_the_release_reason_never_shows_anywhere(
        state: State, spawn: Callable[..., LeaseRun]) -> None:
    reason = "postgresql://u:hunter2@h/db"
    seen: list[str] = []
    for key in ("foo bar/../x", "chunk-run:nope"):  # the failures first
        proc = state.cli("--json-errors", "leases", "release", key, "--reason", reason)
        assert proc.returncode == 1, describe(proc)
        seen.append(proc.stdout + proc.stderr)
    holder = _stale_lease(state, spawn)
    for options in (("--json",), ()):  # the JSON document, then the table for people
        proc = state.cli(*options, "leases", "release", RUN_KEY, "--reason", reason)
        assert proc.returncode == 0, describe(proc)
        seen.append(proc.stdout + proc.stderr)
        if options:
            doc = json.loads(proc.stdout)
            assert doc["released"]["holder_pid"] == holder.pid, describe(proc)
            assert "u" in (doc["reason"] or "") and "h/db" in (doc["reason"] or ""), describe(proc)
        holder = _stale_lease(state, spawn)
    proc = state.cli("--json", "leases")
    seen.append(proc.stdout + proc.stderr)
    for text in seen:
        assert "hunter2" not in text, text
    rows = _all_audit(state)
    assert len(state.audit_rows("leases.release")) == 2
    assert not [row for row in rows if "hunter2" in repr(row)], rows


# -- more findings on the same rules ----------------------------------------------------------


def test_a_release_the_database_refuses_is_a_permanent_error_not_a_statetool_bug_nor_retryable(
        state: State, spawn: Callable[..., LeaseRun]) -> None:
    """SPEC §7/§8a: a fault of the environment has a registered code and the right class; a
    permanent one is never retryable, and internal (exit 6) means a bug in statetool. A
    trigger that rejects every audit row fails every re-run the same way."""
    _stale_lease(state, spawn)
    _audit_trigger(state, present=True)
    proc = state.cli("--json-errors", "leases", "release", RUN_KEY, "--reason", "worker rebooted")
    assert proc.returncode != 0, describe(proc)
    err = error_object(proc)
    assert err["code"] != "RIVET_INTERNAL" and err["exit_code"] != 6, describe(proc)
    assert err["code"] != "RIVET_STATE_UNREACHABLE", describe(proc)  # the server answered
    assert err["retryable"] is False, describe(proc)
    assert "no audit" in err["message"], describe(proc)


def test_sqlite_a_lease_taken_after_its_sidecar_was_removed_never_reuses_a_token(sqlite_state: State) -> None:
    """SPEC §5: every acquisition's token is monotonic per key. An operator who deletes a
    "stale lock file" under .rivet_state.leases/ must not make the next holder draw a token
    an earlier (here: still running) holder already has."""
    first = StateStore.open(sqlite_state.config, env=process_env({}), lock_wait=0)
    second = StateStore.open(sqlite_state.config, env=process_env({}), lock_wait=0)
    tokens = []
    for _ in range(3):
        with first.run("orders", "incremental") as run:
            tokens.append(run.token)
    with first.run("orders", "incremental") as old:
        assert tokens == sorted(set(tokens)) and old.token == tokens[-1] + 1, (tokens, old.token)
        sqlite_state.sidecar.unlink()
        with second.run("orders", "incremental") as new:
            with pytest.raises(StateError) as lost:
                old.commit_cursor("old holder")
            assert lost.value.code == "RIVET_STATE_LEASE_LOST"  # the fence itself holds
            new.commit_cursor("new holder")
            assert new.token is not None and new.token > old.token, (new.token, old.token)


def test_postgres_takeover_blocked_by_a_row_lock_still_honours_lock_wait(pg_state: State) -> None:
    """SPEC §5: a busy lease is waited on up to --lock-wait (0: refused at once). A holder
    that stalls (SIGSTOP, a frozen VM, a lost network) right after its final fence
    (``SELECT ... FOR SHARE``) and before its COMMIT leaves its lease row locked; here an
    open transaction holds that same lock on a stale row. The taker must give up within
    its --lock-wait (exit 2), not hang on the row lock for as long as the stall lasts."""
    with pg_state.pg() as conn:
        conn.execute("INSERT INTO rivet_leases (key, holder_pid, holder_host, holder_user, command, acquired_at, "
                     "heartbeat_at, ttl_seconds, fencing_token) VALUES (%s, %s, %s, 'ops', 'rivet run', now(), "
                     "now() - interval '1 hour', 30, 3)", (RUN_KEY, dead_pid(), socket.gethostname()))
    locker = pg_state.pg()
    try:
        locker.autocommit = False
        locker.execute("SELECT 1 FROM rivet_leases WHERE key = %s FOR SHARE", (RUN_KEY,))
        try:
            # 15 s is a hang detector for a command told to refuse at once, not a speed limit.
            proc = pg_state.cli_process("--json-errors", "--lock-wait", "0", "leases", "run", "--export", "orders",
                                        "--", "true", timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail("statetool --lock-wait 0 leases run was still blocked after 15 s on the lease row's lock")
        assert proc.returncode == 2, describe(proc)
        assert error_object(proc)["code"] in ("RIVET_STATE_RUN_IN_PROGRESS", "RIVET_STATE_LOCK_TIMEOUT"), \
            describe(proc)
    finally:
        locker.rollback()
        locker.close()
