"""Leases (SPEC §5): acquire with a bounded wait, list, release a stale one, run a command
under an export's run lease.

One lease per export, key ``chunk-run:<export>`` (the historical name, kept so old and
new releases exclude each other), plus ``load-table:<table>`` and ``staging:<prefix>``.
The mechanism (flock sidecar or heartbeat row) lives in the backend; the waiting, the
messages and the audit live here, once for both.
"""

from __future__ import annotations

import getpass
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

from statetool.backends import open_leases
from statetool.backends.base import HeldLease, Holder, LeaseInfo, LeaseStore
from statetool.errors import StateError
from statetool.operations.context import Context, now_iso
from statetool.redact import redact_text

RUN_LEASE_PREFIX = "chunk-run:"
#: Seconds between two tries of a busy lease.
POLL_SECONDS = 0.2
#: Seconds between two "waiting for" log lines.
LOG_EVERY = 30.0


def run_lease_key(export: str) -> str:
    """The run lease key of an export: ``chunk-run:<export>``. Raises ``RIVET_CLI_USAGE``
    for an empty export name."""
    if not export.strip():
        raise StateError("RIVET_CLI_USAGE", "the export name is empty")
    return f"{RUN_LEASE_PREFIX}{export}"


def this_holder(command: str) -> Holder:
    """The holder record of this process (command redacted and cut to 1,000 characters)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return Holder(os.getpid(), socket.gethostname(), user, redact_text(command)[:1000], now_iso())


def _store(ctx: Context) -> LeaseStore:
    """The lease store, after the config was read (a wrong ``-c`` must not read as "no
    lease") and, for SQLite, after the state directory was found: an unmounted volume is
    ``RIVET_STATE_DIR_MISSING``, never a lease folder created somewhere else."""
    _ = ctx.config
    location = ctx.location
    if location.directory is not None and not location.directory.is_dir():
        raise StateError("RIVET_STATE_DIR_MISSING", f"state directory {location.directory} does not exist "
                         "(is the volume mounted?)")
    return open_leases(location, ctx.lock_wait)


@contextmanager
def _unreachable_as_state_error(ctx: Context) -> Iterator[None]:
    if ctx.location.backend == "sqlite":  # an flock: no driver, nothing to translate
        yield
        return
    import sqlalchemy as sa

    try:
        yield
    except sa.exc.DBAPIError as err:
        raise StateError("RIVET_STATE_UNREACHABLE",
                         f"the state at {ctx.location.display} failed while reading leases: "
                         f"{str(err.orig).strip().splitlines()[0] if str(err.orig).strip() else err}") from None


def _holder_text(info: LeaseInfo) -> str:
    return info.holder.describe() if info.holder else "a holder that has not written its record yet"


def acquire(ctx: Context, key: str, command: str) -> HeldLease:
    """Take lease ``key``, waiting up to ``ctx.lock_wait`` seconds while a live holder has it.

    Logs (``ctx.log``) a line naming the holder when it starts waiting and every 30 s.
    Raises ``RIVET_STATE_RUN_IN_PROGRESS`` at once with ``lock_wait`` 0, and
    ``RIVET_STATE_LOCK_TIMEOUT`` when the wait runs out (both exit 2, retryable).
    A stale holder (dead, or past its TTL) never blocks: it is taken over.
    """
    store = _store(ctx)
    holder = this_holder(command)
    deadline = time.monotonic() + ctx.lock_wait
    last_log: float | None = None
    with _unreachable_as_state_error(ctx):
        while True:
            got = store.try_acquire(key, holder)
            if not isinstance(got, LeaseInfo):
                return got
            now = time.monotonic()
            if ctx.lock_wait <= 0:
                raise StateError("RIVET_STATE_RUN_IN_PROGRESS", f"lease {key} is held by {_holder_text(got)}",
                                 {"key": key})
            if now >= deadline:
                raise StateError("RIVET_STATE_LOCK_TIMEOUT",
                                 f"lease {key} stayed held for {ctx.lock_wait:g} s (--lock-wait) by {_holder_text(got)}",
                                 {"key": key})
            if last_log is None or now - last_log >= LOG_EVERY:
                ctx.log(f"waiting up to {deadline - now:.0f} s for lease {key}, held by {_holder_text(got)}")
                last_log = now
            time.sleep(min(POLL_SECONDS, max(deadline - now, 0.0)))


@contextmanager
def holding(ctx: Context, key: str, command: str) -> Iterator[HeldLease]:
    """Hold lease ``key`` for the body (see :func:`acquire`); released on every exit."""
    lease = acquire(ctx, key, command)
    try:
        yield lease
    finally:
        lease.release()


def hold_run_leases(ctx: Context, stack: ExitStack, exports: Sequence[str]) -> None:
    """Take the run lease of every export in ``exports`` (released when ``stack`` closes):
    a move of the whole state holds off every run. A wait past ``--lock-wait`` is
    ``RIVET_STATE_RUN_IN_PROGRESS``: the state is in use, as SPEC §4 check 6 names it."""
    for export in exports:
        try:
            stack.enter_context(holding(ctx, run_lease_key(export), ctx.command))
        except StateError as err:
            if err.code != "RIVET_STATE_LOCK_TIMEOUT":
                raise
            raise StateError("RIVET_STATE_RUN_IN_PROGRESS", err.message, err.details) from None


def _lease_doc(info: LeaseInfo) -> dict[str, object]:
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
    }


@dataclass
class LeasesResult:
    """Every lease of the state (``{"leases": [...]}``)."""

    leases: list[dict[str, object]] = field(default_factory=list)

    @property
    def live(self) -> list[dict[str, object]]:
        """The live leases only."""
        return [lease for lease in self.leases if lease["state"] == "live"]

    def as_dict(self) -> dict[str, object]:
        """``{"leases": [{key, export, state, holder_pid, host, user, command, acquired_at,
        heartbeat_age, ttl_left}]}``; ages and TTLs in seconds (PostgreSQL only)."""
        return {"leases": self.leases}


def list_leases(ctx: Context) -> LeasesResult:
    """Every lease with its state, read without taking any lock (Linux: ``/proc/locks``)."""
    with _unreachable_as_state_error(ctx):
        return LeasesResult([_lease_doc(info) for info in _store(ctx).list()])


def live_holders(ctx: Context) -> list[str]:
    """One line per live lease (key and holder), for pre-flight messages."""
    return [f"{row['key']} (pid {row['holder_pid']} on {row['host']}: {row['command']})"
            for row in list_leases(ctx).live]


def release(ctx: Context, key: str, reason: str) -> dict[str, object]:
    """Release a STALE lease: remove its holder record and write an audit row, in that
    order, after the whole pre-flight passed (a refused release removes nothing).

    Raises ``RIVET_STATE_RUN_IN_PROGRESS`` (exit 2) for a live holder, naming it, and
    every pre-flight code. Returns ``{"key", "released": {holder doc} | None, "reason"}``.
    """
    from statetool.operations.writes import audit, head_write

    with head_write(ctx, backup_label=None, claim=False) as session:
        with _unreachable_as_state_error(ctx):
            removed = _store(ctx).clear_stale(key)
        doc = _lease_doc(removed) if removed.holder else None
        audit(session.conn, ctx, "leases.release", {"key": key, "removed": doc, "reason": reason or None})
    return {"key": key, "released": doc, "reason": reason or None}


def wait_until_no_live_lease(ctx: Context) -> None:
    """Wait up to ``ctx.lock_wait`` seconds for every live lease to end (a migration must not
    run beside a live run). Raises ``RIVET_STATE_UPGRADE_BESIDE_LIVE_RUN`` naming each holder."""
    deadline = time.monotonic() + ctx.lock_wait
    last_log: float | None = None
    while True:
        holders = live_holders(ctx)
        if not holders:
            return
        now = time.monotonic()
        if now >= deadline:
            raise StateError("RIVET_STATE_UPGRADE_BESIDE_LIVE_RUN",
                             f"live runs hold leases on this state: {'; '.join(holders)}")
        if last_log is None or now - last_log >= LOG_EVERY:
            ctx.log(f"waiting up to {deadline - now:.0f} s for live runs to finish: {'; '.join(holders)}")
            last_log = now
        time.sleep(min(POLL_SECONDS, max(deadline - now, 0.0)))


def run_under_lease(ctx: Context, export: str, argv: Sequence[str]) -> int:
    """Run ``argv`` while holding export's run lease (like ``flock(1)`` for rivet state).

    Waits as :func:`acquire` does; forwards SIGINT and SIGTERM to the command; releases
    the lease when it ends; returns its exit code (128 + N when killed by signal N). On
    SQLite the command inherits the lock, so the lease outlives a killed wrapper for as
    long as the command runs. Raises ``RIVET_CLI_USAGE`` when the command cannot start.
    """
    if not argv:
        raise StateError("RIVET_CLI_USAGE", "give the command to run after --")
    command = " ".join(argv)
    with holding(ctx, run_lease_key(export), command) as lease:
        try:
            child = subprocess.Popen(list(argv), pass_fds=lease.inheritable_fds())
        except OSError as err:
            raise StateError("RIVET_CLI_USAGE", f"cannot start {argv[0]}: {err.strerror}") from None

        def forward(signum: int, _frame: object) -> None:
            child.send_signal(signum)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = child.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    return 128 - code if code < 0 else code
