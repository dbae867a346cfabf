"""``statetool leases [list] | release KEY | run --export E -- CMD`` (SPEC §5, §8).

The lease mechanics (acquire, wait, liveness, the state lease) live in
:mod:`statetool.operations.leasing`; this module holds the three commands. A release is
a guarded write (its audit row and the removal commit together); ``run`` holds an
export's run lease for the whole life of a command, and stops the command when the lease
is lost.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence

from statetool.backends.base import HeldLease, LeaseInfo
from statetool.backends.processes import group_alive, group_member, process_started
from statetool.errors import StateError
from statetool.operations.context import Context
from statetool.operations.leasing import (
    LeasesResult,
    lease_doc,
    lease_store,
    list_leases,
    holding,
    run_lease_key,
    valid_key,
)
from statetool.redact import command_line, redact_text
from statetool.numbers import require_within

__all__ = ["LeasesResult", "list_leases", "release", "run_under_lease", "show_leases"]

#: Seconds the command's process group gets between SIGTERM and SIGKILL (``--kill-after``):
#: after the wrapper got SIGTERM, after its lease was lost, or, once the command ended,
#: what is left of its group (docs/decisions.md, "Stopping the command").
KILL_AFTER_SECONDS, MAX_KILL_AFTER = 10.0, 86400.0
#: Seconds between two SIGKILLs of a group that is still alive, and between two lines
#: naming a process that outlives them.
KILL_AGAIN_SECONDS, KILL_LOG_SECONDS = 1.0, 30.0
#: Seconds between two looks at a running command's lease.
WATCH_SECONDS = 0.2
_PR_SET_PDEATHSIG = 1
#: The action of a release's audit row.
_RELEASE_AUDIT = "leases.release"


def show_leases(ctx: Context) -> LeasesResult:
    """``statetool leases [list]``: every lease of the state with its state (live, stale,
    free) and holder, read without taking any lock and creating no file.

    A state that is not where it resolves is refused as ``leases release`` and ``leases
    run`` refuse it (issue 12 fixB item 1): ``RIVET_STATE_MISSING`` (no file, an empty
    schema, no such schema), ``RIVET_STATE_RELOCATED``, ``RIVET_STATE_NOT_A_STATE``; an
    empty list of a missing state would read as "nobody runs here". A state without a
    lease table yet (before revision 0002) lists nothing.
    """
    lease_store(ctx).require_state(to_hold=False)
    return list_leases(ctx)


def release(ctx: Context, key: str, reason: str, *, dry_run: bool = False) -> dict[str, object]:
    """Release a STALE lease: remove its holder record and write its audit row as one
    change (if the audit row cannot be written, the lease stays as it was), after the
    whole write pre-flight passed.

    Raises ``RIVET_STATE_LEASE_KEY_INVALID`` (not a lease key), ``RIVET_STATE_LEASE_UNKNOWN``
    (no such lease), ``RIVET_STATE_RUN_IN_PROGRESS`` (a live holder, named) and every
    pre-flight code. Returns ``{"key", "released": lease doc | None, "reason", "dry_run",
    "plan", "warnings"}``; a lease that is already free is left alone, with no audit row
    (``released`` None). ``dry_run`` makes the same checks (the lease read as the release
    would find it, :meth:`~statetool.backends.base.LeaseStore.releasable`) and returns
    the plan, with ``released`` the holder it would remove; it writes nothing and creates
    no file.

    A state named by ``RIVET_STATE_URL`` needs no pipeline config here when none is there
    (issue 12 item 7: a DBA clearing a stale row has none); a config that is there is read
    and its identity compared, as for every write.
    """
    # Loaded here, not at the top: `leases run` and `leases list` must not pay for SQLAlchemy
    # (the write path's import), which only a release needs. No cycle: writes imports no command.
    from statetool.operations.preflight import run_preflight
    from statetool.operations.writes import NO_LEASE, plan_write, write_planned

    key = valid_key(key)
    reason = redact_text(reason) or None
    plan = plan_write(ctx, NO_LEASE, claim=False, preflight=run_preflight(ctx, for_write=True, config_optional=True),
                      dry_run=dry_run)

    def result(found: LeaseInfo) -> dict[str, object]:
        if found.holder is not None:
            plan.change(f"lease {key}", found.state, "free")
            plan.audit.append(_RELEASE_AUDIT)
        return {"key": key, "released": lease_doc(found) if found.holder is not None else None, "reason": reason,
                "dry_run": dry_run, "plan": plan.as_dict(), "warnings": [w.as_dict() for w in plan.warnings]}

    if dry_run:  # the lease as the release would find it, unlocked; the real run finds it locked, in its session
        return result(lease_store(ctx).releasable(key))
    with write_planned(ctx, plan) as session:
        claim = lease_store(ctx).claim_stale(key, session.conn)
        session.on_abort(claim.abandon)
        if claim.info.holder is None:
            session.after_commit(claim.abandon)
            return result(claim.info)
        session.audit(_RELEASE_AUDIT, {"key": key, "removed": lease_doc(claim.info), "reason": reason})
        session.after_commit(claim.commit)
    return result(claim.info)


def _terminal() -> int | None:
    """The wrapper's terminal (stdin) when the wrapper runs in its foreground, else None:
    the command's process group then takes the foreground, as a shell's job does, so that
    it can read the terminal and Ctrl-C reaches all of it."""
    try:
        return 0 if os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp() else None
    except OSError:
        return None


def _set_foreground(terminal: int, group: int) -> None:
    """Give ``terminal`` to process ``group`` (SIGTTOU ignored meanwhile: a process not in
    the foreground group may then still change it; tcsetpgrp(3))."""
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(terminal, group)
    finally:
        signal.signal(signal.SIGTTOU, previous)


def _child_setup(terminal: int | None) -> Callable[[], None]:
    """What the child runs before exec: lead a process group of its own (every process the
    command starts belongs to it, so the wrapper signals and ends all of them, never the
    command alone), take the terminal's foreground when the wrapper had it, and ask Linux
    for SIGKILL when the wrapper dies (prctl(2) ``PR_SET_PDEATHSIG``), dying at once if the
    wrapper died already. ``prctl`` is resolved here, in the parent, so the forked child
    loads nothing; where there is none (not Linux: the limit docs/decisions.md names) the
    command can outlive a killed wrapper."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
    parent = os.getpid()

    def in_child() -> None:
        os.setpgid(0, 0)
        if terminal is not None:
            _set_foreground(terminal, os.getpgrp())
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)

    return in_child


def _signal_group(group: int, signum: int) -> None:
    """Send ``signum`` to every process of ``group`` (none left: nothing to do)."""
    try:
        os.killpg(group, signum)
    except ProcessLookupError:
        pass


def _end_group(group: int, kill_at: float | None, kill_after: float, log: Callable[[str], None]) -> None:
    """End what is left of the command's process group once the command has ended (a
    process it started in the background, or one that ignored the signal that ended the
    command), so that no process of the run outlives its lease: SIGTERM (unless the group
    got one already: ``kill_at`` is then the monotonic time its grace ends), SIGKILL once
    ``kill_after`` seconds have passed (:func:`_kill_until_gone`). Returns only when no
    live process of the group is left (a zombie does no work: :func:`group_alive`)."""
    if not group_alive(group):
        return
    if kill_at is None:
        _signal_group(group, signal.SIGTERM)
        kill_at = time.monotonic() + kill_after
    if not _gone_within(group, kill_at - time.monotonic()):
        _kill_until_gone(group, log, f"process {group_member(group)} of the command's group outlived it and did "
                         f"not end within {kill_after:g} s (--kill-after) of SIGTERM")


def _kill_until_gone(group: int, log: Callable[[str], None], why: str) -> None:
    """SIGKILL process ``group``, again every second, until it has no live process: the lease
    is released only then. Logs ``why`` (who did not end in time) first. A process SIGKILL cannot
    end at once (in uninterruptible sleep on a hung mount) is waited for, with a line every
    30 s naming it, never left behind."""
    log(f"{why}: SIGKILL sent to process group {group}")
    since = last_log = time.monotonic()
    while True:
        _signal_group(group, signal.SIGKILL)
        if _gone_within(group, KILL_AGAIN_SECONDS):
            return
        now = time.monotonic()
        if now - last_log >= KILL_LOG_SECONDS:
            last_log = now
            log(f"process group {group} still has a live process (pid {group_member(group)}) {now - since:.0f} s "
                "after SIGKILL; the lease is held until it ends")


def _gone_within(group: int, seconds: float) -> bool:
    """Wait up to ``seconds`` for process ``group`` to have no live process; True if it has none."""
    deadline = time.monotonic() + seconds
    while group_alive(group):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _on_path(name: str) -> bool:
    """Whether ``name`` names an existing file: itself when it holds a ``/``, else in a
    directory of ``PATH`` (:func:`os.get_exec_path`, the search ``subprocess`` makes)."""
    if "/" in name:
        return os.path.exists(name)
    return any(os.path.exists(os.path.join(directory, name)) for directory in os.get_exec_path())


def _unstartable(name: str, err: OSError, key: str) -> StateError:
    """The error of a command ``name`` that the exec of ``leases run`` refused with ``err``,
    as a shell tells them apart: ``RIVET_COMMAND_NOT_FOUND`` (exit 127) when no such file
    is there (ENOENT), ``RIVET_COMMAND_NOT_EXECUTABLE`` (exit 126) for one that is there
    but cannot be executed (no execute right, a directory, not a program, or a ``#!``
    interpreter that is missing: ENOENT too, for a file that exists). ``key`` is the lease
    that was given back."""
    shown = redact_text(name)
    after = f"nothing ran, and lease {key} was given back"
    if err.errno == errno.ENOENT and not _on_path(name):
        where = "there is no such file" if "/" in name else "no such command on PATH"
        return StateError("RIVET_COMMAND_NOT_FOUND", f"cannot run {shown}: {where}; {after}", {"command": shown})
    why = "its #! interpreter was not found" if err.errno == errno.ENOENT else err.strerror
    return StateError("RIVET_COMMAND_NOT_EXECUTABLE", f"cannot run {shown}: {why}; {after}", {"command": shown})


def _watch(child: subprocess.Popen[bytes], lease: HeldLease, kill_at: list[float], terminate: Callable[[], None],
           log: Callable[[str], None], kill_after: float) -> int:
    """Wait for ``child``, the command, to end; returns its exit status (``-N`` when signal
    N ended it). A lost ``lease`` sends its group SIGTERM (and starts the grace,
    ``terminate``); once the grace of a SIGTERM runs out (``kill_at[0]``, monotonic) the
    group gets SIGKILL until none of it is left (:func:`_kill_until_gone`), and the wait
    goes on until the command has ended."""
    killed = False
    with _exit_watch(child) as ended:
        while (code := ended(WATCH_SECONDS)) is None:
            if lease.lost and not kill_at:
                terminate()
                _signal_group(child.pid, signal.SIGTERM)
            if kill_at and not killed and time.monotonic() >= kill_at[0]:
                killed = True
                _kill_until_gone(child.pid, log, f"the command (pid {child.pid}) did not end within {kill_after:g} s "
                                 "(--kill-after) of SIGTERM")
    return code


@contextlib.contextmanager
def _exit_watch(child: subprocess.Popen[bytes]) -> Iterator[Callable[[float], int | None]]:
    """Yield ``ended(seconds)``: the command's exit status once it has ended, waited for up
    to ``seconds``, else None. On Linux (5.3 and later) the wait is a poll(2) of the
    command's pidfd (pidfd_open(2)), which wakes the moment the command ends; elsewhere
    :meth:`subprocess.Popen.wait`, which looks after 1, 2, 4, ... ms (up to 50 ms) and so
    adds up to that much to a short command's time."""
    try:
        pidfd: int | None = os.pidfd_open(child.pid)
    except (AttributeError, OSError):  # not Linux, or a kernel without pidfd_open
        pidfd = None
    ending = select.poll()
    if pidfd is not None:
        ending.register(pidfd, select.POLLIN)

    def ended(seconds: float) -> int | None:
        if pidfd is not None and not ending.poll(seconds * 1000):
            return None
        try:
            return child.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return None

    try:
        yield ended
    finally:
        if pidfd is not None:
            os.close(pidfd)


def run_under_lease(ctx: Context, export: str, argv: Sequence[str], *,
                    kill_after: float = KILL_AFTER_SECONDS) -> int:
    """Run ``argv`` while holding export's run lease (like ``flock(1)`` for rivet state).

    The state must exist where it is resolved (``RIVET_STATE_MISSING``, and
    ``RIVET_STATE_RELOCATED`` at an old place: a lease there would guard nothing). Waits
    for the lease as every acquirer does; the command cannot outlive the wrapper (Linux
    ``PR_SET_PDEATHSIG``), and its pid and start time are recorded with the lease, so on
    PostgreSQL a wrapper that died while its command lives still holds the lease on this
    host; on SQLite the command inherits the lock. The command leads a process group of
    its own: SIGINT and SIGTERM are forwarded to the whole group; ``kill_after`` seconds
    after a SIGTERM the wrapper got, a group that has not ended gets SIGKILL (SIGINT is not
    escalated: an interactive command may catch Ctrl-C and go on). Once the command has
    ended, what is left of its group gets SIGTERM, then SIGKILL after ``kill_after``
    seconds, and the lease is released only when no live process of the group is left (a
    process the command started cannot run on beside the next holder; one that leaves the
    group, setsid(2), is its own). When the lease is lost (taken over, or unconfirmed for a
    TTL), the group gets SIGTERM, SIGKILL after ``kill_after`` seconds, and
    ``RIVET_STATE_LEASE_LOST`` is raised (exit 2), never a success. Returns the
    command's exit code (128 + N when killed by signal N). Raises ``RIVET_CLI_USAGE`` without
    a command, ``RIVET_COMMAND_NOT_FOUND`` (exit 127) / ``RIVET_COMMAND_NOT_EXECUTABLE``
    (exit 126) when it cannot start (the lease given back, :func:`_unstartable`), ``RIVET_CLI_USAGE`` for a
    ``kill_after`` outside 0 to 86400 seconds, and ``RIVET_EXPORT_UNKNOWN`` before any lease is taken when
    a pipeline config is there and does not declare ``export`` (issue 12 fixB item 2;
    without a config any export name is accepted).
    """
    if not argv:
        raise StateError("RIVET_CLI_USAGE", "give the command to run after --")
    require_within("--kill-after", kill_after, 0, MAX_KILL_AFTER, "seconds")
    command = command_line(argv)  # shell-quoted, each argument redacted: the holder record is readable by all
    key = valid_key(run_lease_key(export))  # the name is the operator's input: no control characters
    store = lease_store(ctx)
    config = ctx.config_or_none()
    # A typo would hold a lease no run ever takes, and leave its record behind for good.
    # Without a config there is nothing to check against: the state knows only the exports
    # that ran before, and a new export's first run must be wrappable (docs/decisions.md).
    if config is not None and config.export(export) is None:
        raise StateError("RIVET_EXPORT_UNKNOWN", f"export '{export}' is not in {config.path}; nothing was run "
                         "and no lease was taken", {"export": export})
    store.require_state()
    with holding(ctx, key, command) as lease:
        started: list[subprocess.Popen[bytes]] = []
        held: list[int] = []  # signals that came before the command started: it gets them first thing
        kill_at: list[float] = []  # when the group gets SIGKILL: kill_after seconds after the first SIGTERM

        def terminate() -> None:
            if not kill_at:
                kill_at.append(time.monotonic() + kill_after)

        def forward(signum: int, _frame: object) -> None:
            if signum == signal.SIGTERM:
                terminate()  # a scheduler stopping the task: it gets its grace, then SIGKILL
            if started:
                _signal_group(started[0].pid, signum)
            else:
                held.append(signum)

        # Forwarding starts before the command does: a SIGTERM between the start and the
        # handler would kill the wrapper alone (its command then dies of PR_SET_PDEATHSIG).
        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        terminal = _terminal()
        try:
            try:
                child = subprocess.Popen(list(argv), pass_fds=lease.inheritable_fds(),
                                         preexec_fn=_child_setup(terminal))
            except OSError as err:
                raise _unstartable(argv[0], err, key) from None
            started.append(child)
            try:
                for signum in held:
                    _signal_group(child.pid, signum)
                lease.set_child(child.pid, process_started(child.pid))
                code = _watch(child, lease, kill_at, terminate, ctx.log, kill_after)
            finally:
                # before the lease goes, on every way out: no process of the run outlives it
                _end_group(child.pid, kill_at[0] if kill_at else None, kill_after, ctx.log)
        finally:
            if terminal is not None:
                _set_foreground(terminal, os.getpgrp())
            for s, handler in previous.items():
                signal.signal(s, handler)
        if lease.lost:
            raise StateError("RIVET_STATE_LEASE_LOST",
                             f"lease {key} was lost while `{command}` ran (taken over by another holder, its "
                             "record replaced, or its heartbeat unconfirmed by the server for a whole TTL); the "
                             "command was stopped", {"key": key})
    return 128 - code if code < 0 else code
