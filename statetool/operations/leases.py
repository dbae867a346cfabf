"""``statetool leases [list] | release KEY | run --export E -- CMD`` (SPEC §5, §8).

The lease mechanics (acquire, wait, liveness, the state lease) live in
:mod:`statetool.operations.leasing`; this module holds the three commands. A release is
a guarded write (its audit row and the removal commit together); ``run`` holds an
export's run lease for the whole life of a command, and stops the command when the lease
is lost.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence

from statetool.backends.processes import process_started
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

__all__ = ["LeasesResult", "list_leases", "release", "run_under_lease", "show_leases"]

#: Seconds a command whose lease was lost gets between SIGTERM and SIGKILL.
GRACE_SECONDS = 10.0
#: Seconds between two looks at a running command's lease.
WATCH_SECONDS = 0.2
_PR_SET_PDEATHSIG = 1


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


def release(ctx: Context, key: str, reason: str) -> dict[str, object]:
    """Release a STALE lease: remove its holder record and write its audit row as one
    change (if the audit row cannot be written, the lease stays as it was), after the
    whole write pre-flight passed.

    Raises ``RIVET_STATE_LEASE_KEY_INVALID`` (not a lease key), ``RIVET_STATE_LEASE_UNKNOWN``
    (no such lease), ``RIVET_STATE_RUN_IN_PROGRESS`` (a live holder, named) and every
    pre-flight code. Returns ``{"key", "released": lease doc | None, "reason"}``; a lease
    that is already free is left alone, with no audit row (``released`` None).

    A state named by ``RIVET_STATE_URL`` needs no pipeline config here when none is there
    (issue 12 item 7: a DBA clearing a stale row has none); a config that is there is read
    and its identity compared, as for every write.
    """
    # Loaded here, not at the top: `leases run` and `leases list` must not pay for SQLAlchemy
    # (the write path's import), which only a release needs. No cycle: writes imports no command.
    from statetool.operations.preflight import run_preflight
    from statetool.operations.writes import NO_LEASE, guarded_write

    key = valid_key(key)
    reason = redact_text(reason) or None
    preflight = run_preflight(ctx, for_write=True, config_optional=True)
    with guarded_write(ctx, NO_LEASE, claim=False, preflight=preflight) as session:
        claim = lease_store(ctx).claim_stale(key, session.conn)
        session.on_abort(claim.abandon)
        if claim.info.holder is None:
            session.after_commit(claim.abandon)
            return {"key": key, "released": None, "reason": reason}
        doc = lease_doc(claim.info)
        session.audit("leases.release", {"key": key, "removed": doc, "reason": reason})
        session.after_commit(claim.commit)
    return {"key": key, "released": doc, "reason": reason}


def _die_with_parent() -> Callable[[], None] | None:
    """What the child runs before exec: ask Linux for SIGKILL when the wrapper dies
    (prctl(2) ``PR_SET_PDEATHSIG``), and die at once if the wrapper died already. Resolved
    here, in the parent, so the forked child calls one C function and loads nothing.
    None where there is no ``prctl`` (not Linux: the limit docs/decisions.md names)."""
    if sys.platform != "linux":
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def in_child() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return in_child


def _stop(child: subprocess.Popen[bytes], grace: float) -> None:
    child.terminate()
    try:
        child.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def run_under_lease(ctx: Context, export: str, argv: Sequence[str], *, grace: float = GRACE_SECONDS) -> int:
    """Run ``argv`` while holding export's run lease (like ``flock(1)`` for rivet state).

    The state must exist where it is resolved (``RIVET_STATE_MISSING``, and
    ``RIVET_STATE_RELOCATED`` at an old place: a lease there would guard nothing). Waits
    for the lease as every acquirer does; the command cannot outlive the wrapper (Linux
    ``PR_SET_PDEATHSIG``), and its pid and start time are recorded with the lease, so on
    PostgreSQL a wrapper that died while its command lives still holds the lease on this
    host; on SQLite the command inherits the lock. Forwards SIGINT and SIGTERM. When the
    lease is lost (taken over, or unconfirmed for a TTL), the command gets SIGTERM, SIGKILL after ``grace`` seconds,
    and ``RIVET_STATE_LEASE_LOST`` is raised (exit 2), never a success. Returns the
    command's exit code (128 + N when killed by signal N). Raises ``RIVET_CLI_USAGE`` when
    the command cannot start, and ``RIVET_EXPORT_UNKNOWN`` before any lease is taken when
    a pipeline config is there and does not declare ``export`` (issue 12 fixB item 2;
    without a config any export name is accepted).
    """
    if not argv:
        raise StateError("RIVET_CLI_USAGE", "give the command to run after --")
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

        def forward(signum: int, _frame: object) -> None:
            if started:
                started[0].send_signal(signum)
            else:
                held.append(signum)

        # Forwarding starts before the command does: a SIGTERM between the start and the
        # handler would kill the wrapper alone (its command then dies of PR_SET_PDEATHSIG).
        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                child = subprocess.Popen(list(argv), pass_fds=lease.inheritable_fds(),
                                         preexec_fn=_die_with_parent())
            except OSError as err:
                raise StateError("RIVET_CLI_USAGE", f"cannot start {argv[0]}: {err.strerror}") from None
            started.append(child)
            for signum in held:
                child.send_signal(signum)
            lease.set_child(child.pid, process_started(child.pid))
            while True:
                try:
                    code = child.wait(timeout=WATCH_SECONDS)
                    break
                except subprocess.TimeoutExpired:
                    if lease.lost:
                        _stop(child, grace)
                        break
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        if lease.lost:
            raise StateError("RIVET_STATE_LEASE_LOST",
                             f"lease {key} was lost while `{command}` ran (taken over by another holder, its "
                             "record replaced, or its heartbeat unconfirmed by the server for a whole TTL); the "
                             "command was stopped", {"key": key})
    return 128 - code if code < 0 else code
