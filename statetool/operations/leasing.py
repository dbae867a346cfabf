"""The lease service (SPEC §5): acquire, hold, wait, list and liveness, for every caller.

Below the pre-flight and the write path, above the backends; it imports no other
operation. Every wait for a lease in statetool goes through :func:`wait_for`, the one
loop with backoff that names the holder when it starts waiting, every 30 s, and in the
error when ``--lock-wait`` runs out.

Two kinds of lease exclude each other:

* a **run lease** ``chunk-run:<export>`` (and ``load-table:``, ``staging:``) is held by
  whatever runs or changes one export;
* the **state lease** ``state:exclusive`` is held by a write that changes the whole state
  (migrate, relocate, transfer, identity adopt/rekey). Such a write takes the state lease,
  then the run lease of every export it knows, then waits until no other live lease is
  left. Every run-lease acquirer of this release takes its run lease FIRST and then looks
  at the state lease, and gives its lease back while the state lease is live. Either the
  whole-state write sees the run lease in its final look, or the run sees the state lease:
  the two never overlap (docs/decisions.md, "One state lease").
"""

from __future__ import annotations

import functools
import getpass
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import NamedTuple, TypeVar

from statetool.backends.base import HeldLease, Holder, LeaseInfo, LeaseStore
from statetool.backends.processes import host_name, process_started
from statetool.errors import StateError
from statetool.operations.context import Context, now_iso
from statetool.redact import redact_text

RUN_LEASE_PREFIX = "chunk-run:"
#: The lease of a write that changes the whole state (docs/decisions.md, "One state lease").
STATE_LEASE = "state:exclusive"
#: Every lease key starts with one of these (SPEC §5, plus the state lease).
KEY_PREFIXES = (RUN_LEASE_PREFIX, "load-table:", "staging:")
#: First and longest pause between two tries of a busy lease, in seconds.
FIRST_PAUSE, LONGEST_PAUSE = 0.05, 0.5
#: Seconds between two "waiting for" log lines.
LOG_EVERY = 30.0

T = TypeVar("T")


def run_lease_key(export: str) -> str:
    """The run lease key of an export: ``chunk-run:<export>``. Raises ``RIVET_CLI_USAGE``
    for an empty export name."""
    if not export.strip():
        raise StateError("RIVET_CLI_USAGE", "the export name is empty")
    return f"{RUN_LEASE_PREFIX}{export}"


def valid_key(key: str) -> str:
    """``key`` when it is a well-formed lease key (a known prefix and a non-empty name
    without C0/C1 control characters); raises ``RIVET_STATE_LEASE_KEY_INVALID`` otherwise."""
    name = next((key[len(p):] for p in KEY_PREFIXES if key.startswith(p)), None)
    if key == STATE_LEASE or (name and name.strip() and not any(ord(ch) < 32 or 127 <= ord(ch) < 160 for ch in key)):
        return key
    raise StateError("RIVET_STATE_LEASE_KEY_INVALID",
                     f"{key!r} is not a lease key (chunk-run:<export>, load-table:<table>, staging:<prefix>, "
                     f"{STATE_LEASE})", {"key": key})


@functools.cache
def _this_process() -> tuple[int, str, str, int | None]:
    """(pid, host, user, start time) of this process, read once."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    pid = os.getpid()
    return pid, host_name(), user, process_started(pid)


def this_holder(command: str) -> Holder:
    """The holder record of this process (command redacted and cut to 1,000 characters),
    with its process start time."""
    pid, host, user, started = _this_process()
    if pid != os.getpid():  # a forked child: it is another holder
        _this_process.cache_clear()
        pid, host, user, started = _this_process()
    return Holder(pid, host, user, redact_text(command)[:1000], now_iso(), started=started)


def lease_store(ctx: Context) -> LeaseStore:
    """The lease store, after the config was read (a wrong ``-c`` must not read as "no
    lease") and, for SQLite, after the state directory was found: an unmounted volume is
    ``RIVET_STATE_DIR_MISSING``, never a lease folder created somewhere else.

    Leases need no config where ``RIVET_STATE_URL`` names the state and none is there or
    named (:meth:`Context.config_or_none`, issue 12 item 7): a DBA clearing a stale row
    has no pipeline config. Beside the config, the config decides the place, so it must
    exist."""
    ctx.config_or_none()
    location = ctx.location
    problem = location.directory_problem()
    if problem is not None:
        raise problem
    return ctx.lease_store


def holder_text(info: LeaseInfo) -> str:
    """Who holds ``info``'s lease, for messages."""
    return info.holder.describe() if info.holder else "a holder that has not written its record yet"


def wait_for(ctx: Context, attempt: Callable[[], T | str], *, what: str, busy_code: str, timeout_code: str,
             deadline: float | None = None) -> T:
    """Call ``attempt`` until it returns a result rather than a text naming who is in the
    way, pausing with backoff (0.05 s growing to 0.5 s, jittered) up to ``ctx.lock_wait``
    seconds (or until the monotonic ``deadline``).

    Logs (``ctx.log``) a line naming the holder when the wait starts and every 30 s.
    Raises ``busy_code`` at once with ``lock_wait`` 0 (or a ``deadline`` already past), and ``timeout_code`` when the wait
    runs out, both naming the holder.
    """
    start = time.monotonic()
    deadline = start + ctx.lock_wait if deadline is None else deadline
    pause = FIRST_PAUSE
    last_log: float | None = None
    while True:
        got = attempt()
        if not isinstance(got, str):
            return got
        now = time.monotonic()
        if ctx.lock_wait <= 0 or deadline <= start:
            raise StateError(busy_code, f"{what} is held by {got}", {"what": what})
        if now >= deadline:
            raise StateError(timeout_code, f"{what} stayed held for {ctx.lock_wait:g} s (--lock-wait) by {got}",
                             {"what": what})
        if last_log is None or now - last_log >= LOG_EVERY:
            ctx.log(f"waiting up to {deadline - now:.0f} s for {what}, held by {got}")
            last_log = now
        import random  # only a wait pauses: an acquisition that gets its lease at once does not load it

        time.sleep(min(pause * random.uniform(0.75, 1.25), max(deadline - now, 0.0)))
        pause = min(pause * 1.5, LONGEST_PAUSE)


def acquire(ctx: Context, key: str, command: str | None = None, *, under_state_lease: bool = False,
            busy_code: str = "RIVET_STATE_RUN_IN_PROGRESS", timeout_code: str = "RIVET_STATE_LOCK_TIMEOUT",
            deadline: float | None = None) -> HeldLease:
    """Take lease ``key`` (see :func:`wait_for` for the wait and its errors).

    A lease this user could not take is refused first (``RIVET_STATE_PERMISSION_DENIED``,
    :meth:`~statetool.backends.base.LeaseStore.require_takable`). A stale holder (dead, or
    past its TTL) never blocks: it is taken over. A run lease is
    given back and waited for again while a whole-state write holds the state lease,
    unless this process holds that state lease itself (``under_state_lease``).
    """
    store = lease_store(ctx)
    store.require_takable([key])  # a lease this user cannot take is refused before any wait
    holder = this_holder(ctx.command if command is None else command)

    respects_state = key != STATE_LEASE and not under_state_lease

    def attempt() -> HeldLease | str:
        if respects_state:  # a first look, read-only: a run refused here creates no lease file
            whole = store.info(STATE_LEASE)
            if whole.state == "live":
                return f"a write of the whole state ({holder_text(whole)})"
        got = store.try_acquire(key, holder)
        if isinstance(got, LeaseInfo):
            return holder_text(got)
        if respects_state:  # the look that counts: after this lease is visible to the whole-state writer
            whole = store.info(STATE_LEASE)
            if whole.state == "live":
                got.release()
                return f"a write of the whole state ({holder_text(whole)})"
        return got

    return wait_for(ctx, attempt, what=f"lease {key}", busy_code=busy_code, timeout_code=timeout_code,
                    deadline=deadline)


@contextmanager
def holding(ctx: Context, key: str, command: str | None = None) -> Iterator[HeldLease]:
    """Hold lease ``key`` for the body (see :func:`acquire`); released on every exit."""
    lease = acquire(ctx, key, command)
    try:
        yield lease
    finally:
        lease.release()


def refuse_untakable(ctx: Context, exports: Iterable[str]) -> None:
    """Refuse, before any lease is taken, a write of the whole state that could not take
    every lease it needs (the state lease and the run lease of each of ``exports``): one
    it could not take (another user's lease file) would refuse it half way, with the lease
    files of those it took before created (SPEC §9: a refusal creates no file). Raises
    ``RIVET_STATE_PERMISSION_DENIED`` / ``RIVET_STATE_READ_ONLY``
    (:meth:`~statetool.backends.base.LeaseStore.require_takable`); reads only.
    :func:`hold_whole_state` calls it; a move calls it before its first file too."""
    lease_store(ctx).require_takable([STATE_LEASE, *(run_lease_key(export) for export in sorted(set(exports)))])


def hold_whole_state(ctx: Context, stack: ExitStack, exports: Iterable[str], busy_code: str) -> list[HeldLease]:
    """Hold off every run for a write of the whole state: the state lease, then the run
    lease of every export in ``exports``, then a wait until no other live lease is left;
    all released when ``stack`` closes. One ``--lock-wait`` bounds the whole wait; past it
    (or at once with ``--lock-wait 0``) ``busy_code`` names the holders. A lease this user
    could not take (another user's lease file) is refused before any is taken
    (:meth:`~statetool.backends.base.LeaseStore.require_takable`:
    ``RIVET_STATE_PERMISSION_DENIED``).

    A PostgreSQL state without a lease table (below revision 0002) has no lease to take:
    no run can hold one there either. Returns the leases held.
    """
    deadline = time.monotonic() + ctx.lock_wait
    held: list[HeldLease] = []
    store = lease_store(ctx)
    refuse_untakable(ctx, exports)

    def quiet() -> bool | str:
        try:
            live = [info for info in store.list() if info.state == "live"]
        except StateError as err:
            if err.code != "RIVET_STATE_MIGRATION_LOCKED":
                raise
            return err.message  # another migration alters the lease table: wait for it
        return True if not live else "; ".join(f"{i.key} ({holder_text(i)})" for i in live)

    # looked at first, read-only: a write refused here creates no lease file
    wait_for(ctx, quiet, what="the state (live runs)", busy_code=busy_code, timeout_code=busy_code, deadline=deadline)
    try:
        state = acquire(ctx, STATE_LEASE, busy_code=busy_code, timeout_code=busy_code, deadline=deadline)
    except StateError as err:
        if err.code != "RIVET_STATE_MIGRATION_PENDING":
            raise
        return held
    stack.callback(state.release)
    held.append(state)
    for export in sorted(set(exports)):
        lease = acquire(ctx, run_lease_key(export), under_state_lease=True, busy_code=busy_code,
                        timeout_code=busy_code, deadline=deadline)
        stack.callback(lease.release)
        held.append(lease)
    mine = {lease.key for lease in held}

    def nobody_else() -> bool | str:
        others = [info for info in store.list() if info.state == "live" and info.key not in mine]
        return True if not others else "; ".join(f"{i.key} ({holder_text(i)})" for i in others)

    wait_for(ctx, nobody_else, what="the state (live runs)", busy_code=busy_code, timeout_code=busy_code,
             deadline=deadline)
    return held


def lease_doc(info: LeaseInfo) -> dict[str, object]:
    """One lease as JSON: ``{key, export, state, holder_pid, host, user, command,
    acquired_at, heartbeat_age, ttl_left, fencing_token, child_pid}`` (ages in seconds)."""
    h = info.holder
    return {
        "key": info.key,
        "export": info.key[len(RUN_LEASE_PREFIX):] if info.key.startswith(RUN_LEASE_PREFIX) else None,
        "state": info.state,
        "holder_pid": h.pid if h else None,
        "host": h.host if h else None,
        "user": h.user if h else None,
        "command": h.command if h else None,
        "acquired_at": h.acquired_at if h else None,
        "heartbeat_age": round(info.heartbeat_age, 3) if info.heartbeat_age is not None else None,
        "ttl_left": round(info.ttl_left, 3) if info.ttl_left is not None else None,
        "fencing_token": h.token if h else None,
        "child_pid": h.child_pid if h else None,
    }


class LeasesResult(NamedTuple):
    """Every lease of the state (``{"leases": [...]}``)."""

    leases: list[dict[str, object]]

    @property
    def live(self) -> list[dict[str, object]]:
        """The live leases only."""
        return [lease for lease in self.leases if lease["state"] == "live"]

    def as_dict(self) -> dict[str, object]:
        """``{"leases": [lease_doc, ...]}``."""
        return {"leases": self.leases}


def list_leases(ctx: Context) -> LeasesResult:
    """Every lease with its state, read without taking any lock (Linux: ``/proc/locks``)."""
    return LeasesResult([lease_doc(info) for info in lease_store(ctx).list()])


def live_holders(ctx: Context) -> list[str]:
    """One line per live lease (key and holder), for pre-flight messages."""
    return [f"{row['key']} (pid {row['holder_pid']} on {row['host']}: {row['command']})"
            for row in list_leases(ctx).live]
