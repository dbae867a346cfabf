"""Pre-flight: the ordered checks of SPEC §1-§4, read-only: one list for ``check``, the read
commands and every write path.

``check`` reports every row and the read commands describe the state with them; every
write path (``migrate``, ``identity``, ``exports``, ``leases release``, ``relocate``,
``transfer`` and the runtime's ``StateStore``, through :mod:`~statetool.operations.writes`)
runs the same list and stops at the first failure, so a guard is written once. ``init``
does not run it: it refuses anything already at the location
(``RIVET_STATE_TARGET_NOT_EMPTY``) and builds a new state. Nothing is written here: the
state is read on a connection that creates no file (SQLite) or a read-only transaction
(PostgreSQL).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from statetool.backends.base import Backend
from statetool.backends.faults import os_fault
from statetool.errors import REGISTRY, WARNINGS, StateError, StateWarning
from statetool.identity import Verdict, identity_message, identity_verdict, identity_warning
from statetool.location import ENV_VAR
from statetool.operations.context import Context
from statetool.operations.leasing import live_holders
from statetool.operations.probe import Snapshot, read_snapshot

#: The checks in the order they run (SPEC §4): each id appears in ``check --json``.
CHECK_IDS = ("location", "config", "state", "format", "integrity", "revision", "relocated", "identity", "leases",
             "leftovers")

#: The row a failure to read the state belongs to (anything else: ``integrity``).
_READ_FAILURE_ROW = {"RIVET_STATE_NOT_A_STATE": "format", "RIVET_STATE_MISSING": "format",
                     "RIVET_STATE_UNSAFE_FILE": "format", "RIVET_STATE_RELOCATED": "relocated",
                     "RIVET_STATE_PERMISSION_DENIED": "state", "RIVET_STATE_MOVE_IN_FLIGHT": "relocated"}


@dataclass
class Check:
    """One pre-flight row: ``status`` is ``ok``, ``warn``, ``fail`` or ``skip``."""

    id: str
    status: str
    message: str
    code: str | None = None
    error: StateError | None = field(default=None, repr=False)

    @property
    def action(self) -> str | None:
        """The registered action of the row's code, if any."""
        if self.code is None:
            return None
        return REGISTRY[self.code].action if self.code in REGISTRY else WARNINGS[self.code]

    def as_dict(self) -> dict[str, object]:
        """``{id, status, code, message, action}``."""
        return {"id": self.id, "status": self.status, "code": self.code, "message": self.message,
                "action": self.action}


@dataclass
class Preflight:
    """The rows of one pre-flight, and what was learnt on the way."""

    checks: list[Check] = field(default_factory=list)
    snapshot: Snapshot | None = None
    verdict: Verdict | None = None

    def add(self, check_id: str, status: str, message: str, code: str | None = None) -> None:
        self.checks.append(Check(check_id, status, message, code))

    @property
    def failures(self) -> list[Check]:
        """The ``fail`` rows, in check order."""
        return [c for c in self.checks if c.status == "fail"]

    def skip_rest(self, reason: str) -> None:
        done = {c.id for c in self.checks}
        for check_id in CHECK_IDS:
            if check_id not in done:
                self.add(check_id, "skip", reason)
        self.checks.sort(key=lambda c: CHECK_IDS.index(c.id))

    @property
    def warnings(self) -> list[StateWarning]:
        """The warning rows as registered warnings."""
        return [StateWarning(c.code, c.message) for c in self.checks if c.status == "warn" and c.code]

    def fail(self, err: StateError, check_id: str) -> None:
        """Add the ``fail`` row of ``err``, in place of an ``ok`` row of the same check that
        a later finding overturned (the state found, then unreadable: one ``state`` row)."""
        self.checks = [c for c in self.checks if not (c.id == check_id and c.status == "ok")]
        self.checks.append(Check(check_id, "fail", err.message, err.code, err))


def run_preflight(ctx: Context, *, for_write: bool = False, progress: bool = True, integrity: bool = True,
                  config_optional: bool = False, positions: bool = False) -> Preflight:
    """Run every check in order on a read-only open. Never raises a :class:`StateError`:
    failures become ``fail`` rows carrying their error.

    ``for_write`` changes wording (what happens vs what a write would do), and leaves the
    lease check to the write path, which takes the leases (see :func:`_check_leases`).
    ``progress=False`` reads only whether any progress exists, not each export's (a
    migration needs no more, and on a large legacy state the full read costs seconds).
    ``integrity=False`` skips ``quick_check`` (relocate proves it on its copy instead).
    ``config_optional=True`` (``leases release``, issue 12 item 7) lets a state named by
    ``RIVET_STATE_URL`` go without a pipeline config when there is none
    (:meth:`Context.config_or_none`): the ``config`` and ``identity`` rows are skipped; a
    config that is there is read and compared as always. ``positions=True`` reads the CDC
    positions' texts in the same read (:attr:`~statetool.operations.probe.Snapshot.positions`).
    A SQLite state with the hot journal of a killed writer is read as it was before that
    write (the backend rolls it back in a private copy): the ``integrity`` row warns
    ``RIVET_STATE_HOT_JOURNAL``, and nothing beside the state changes, for a write too; only
    a write whose pre-flight passed opens the state itself, which rolls the journal back.
    """
    pf = Preflight()
    try:
        location = ctx.location
    except StateError as err:
        pf.fail(err, "location")
        pf.skip_rest("no state location")
        return pf
    pf.add("location", "ok", f"{location.display} ({location.scope}, from {location.origin})")
    try:
        config = ctx.config_or_none() if config_optional else ctx.config
        if config is None:
            pf.add("config", "skip", f"no pipeline config at {ctx.config_path}, and none needed: the state is "
                                     f"named by {ENV_VAR} or --state-url")
        else:
            _ = ctx.computed_key  # an ambiguous source URL is a config fault: RIVET_SOURCE_URL_INVALID
            pf.add("config", "ok", f"{config.path}: {len(config.exports)} exports")
    except StateError as err:
        pf.fail(err, "config")
    backend = ctx.backend()
    try:
        present = backend.present()
    except StateError as err:
        pf.fail(err, "state")
        pf.skip_rest("state not reachable")
        return pf
    if not present:
        pf.fail(StateError("RIVET_STATE_MISSING",
                           f"no state at {location.display}: every export would start as a FIRST RUN"), "state")
        pf.skip_rest("no state")
        return pf
    pf.add("state", "ok", f"found at {location.display}")
    try:
        snap = _read_named(backend, progress, integrity, positions)
    except StateError as err:
        pf.fail(err, _READ_FAILURE_ROW.get(err.code, "integrity"))
        pf.skip_rest("the state cannot be read")
        return pf
    pf.snapshot = snap
    pf.add("format", "ok", "legacy rivet state (no version table)" if snap.legacy else "rivet state")
    if snap.interrupted_write:
        pf.add("integrity", "warn", snap.interrupted_write, "RIVET_STATE_HOT_JOURNAL")
    else:
        pf.add("integrity", "ok", "server-managed" if not backend.checks_integrity
               else "quick_check ok" if integrity else "not checked here (proven on the copy)")
    _check_revision(pf, snap)
    # Only what the open proved: no tombstone here, so the state was not moved away. How it
    # came here is the audit's to tell (statetool info), not a query of every pre-flight:
    # a damaged audit table must not fail every read.
    pf.add("relocated", "ok", "in use at this place (not moved away)")
    if snap.known:
        _check_identity(pf, ctx, snap, for_write)
        _check_leases(pf, ctx, for_write)
        _check_leftovers(pf, backend)
    else:
        pf.skip_rest("revision unknown to this release")
    return pf


def _check_leftovers(pf: Preflight, backend: Backend) -> None:
    """What a killed (SIGKILLed) migration or backup left beside the state
    (:meth:`~statetool.backends.base.Backend.leftovers`): warning ``RIVET_STATE_LEFTOVER_TEMP``
    naming each, with what to do; the state itself is whole (SPEC §9). Found by name, read
    only: nothing is removed here."""
    found = backend.leftovers()
    if not found:
        pf.add("leftovers", "ok", "no temporary file of a killed migration or backup")
        return
    pf.add("leftovers", "warn",
           f"{len(found)} left by a killed migration or backup: {', '.join(map(str, found))}; the state itself is "
           "whole. A migration that still has a revision to cross, and a write that takes a backup, remove them "
           "first; with no statetool write running they are safe to delete (none is the state's only copy, nor "
           "a backup)", "RIVET_STATE_LEFTOVER_TEMP")


def _read_named(backend: Backend, progress: bool, integrity: bool, positions: bool) -> Snapshot:
    """The snapshot of one read-only open, with an environment fault met on the way (a
    state file this user may not open, say) raised as its registered error, so it becomes
    a ``fail`` row."""
    try:
        with backend.reading() as conn:
            return read_snapshot(backend, conn, progress=progress, integrity=integrity, positions=positions)
    except OSError as exc:
        raise os_fault(exc) or exc from None


def _check_leases(pf: Preflight, ctx: Context, for_write: bool) -> None:
    """SPEC §4 check 6. For a write, the guarded write path takes the leases the write
    needs right after this pre-flight (waiting up to ``--lock-wait``), and that is where
    this check fails (``RIVET_STATE_RUN_IN_PROGRESS``, ``RIVET_STATE_UPGRADE_BESIDE_LIVE_RUN``):
    a lease looked at here could be taken a moment later. A read reports each live lease
    as warning ``RIVET_STATE_LEASE_LIVE``: a run is on, and a whole-state write would wait."""
    if for_write:
        pf.add("leases", "ok", "taken by the write itself, right after this pre-flight")
        return
    try:
        holders = live_holders(ctx)
    except StateError as err:
        if err.code == "RIVET_STATE_UNSAFE_FILE":  # every lease, and so every run and write, will refuse
            pf.fail(err, "leases")
        else:
            pf.add("leases", "skip", f"leases not readable: {err.message}")
        return
    if holders:
        pf.add("leases", "warn", f"{len(holders)} live: {'; '.join(holders)} (a migration or another write of the "
               "whole state would wait for them; a write of one of these exports too)", "RIVET_STATE_LEASE_LIVE")
    else:
        pf.add("leases", "ok", "no live lease")


def _check_revision(pf: Preflight, snap: Snapshot) -> None:
    from statetool import migrations

    unknown = snap.unknown_revision()
    if unknown is not None:
        pf.fail(unknown, "revision")
    elif snap.pending:
        at = "legacy (0001 shape)" if snap.legacy else snap.revision
        pf.fail(StateError("RIVET_STATE_MIGRATION_PENDING",
                           f"the state is at {at}; head is {migrations.head()}; pending: {', '.join(snap.pending)}"),
                "revision")
    else:
        pf.add("revision", "ok", f"at head ({snap.revision})")


def _check_identity(pf: Preflight, ctx: Context, snap: Snapshot, for_write: bool) -> None:
    try:
        computed = ctx.computed_key
    except StateError:
        pf.add("identity", "skip", "no pipeline config read: no identity compared")
        return
    verdict = identity_verdict(snap.recorded_key, computed, ctx.location.scope, snap.has_progress)
    pf.verdict = verdict
    where = str(ctx.location.directory or ctx.location.display)
    message = identity_message(verdict, where, for_write)
    warning = identity_warning(verdict, where, for_write)
    if verdict.action == "refuse":
        pf.fail(StateError("RIVET_STATE_FOREIGN", message, {"directory": where, "recorded": verdict.recorded,
                                                            "computed": computed}), "identity")
    elif warning is not None:
        pf.add("identity", "warn", warning.message, warning.code)
    elif verdict.action == "skip":
        pf.add("identity", "skip", message)
    else:
        pf.add("identity", "ok", message)


#: Failures a read command reports instead of refusing: the state can still be described.
DESCRIBABLE = frozenset({"RIVET_STATE_MISSING", "RIVET_STATE_MIGRATION_PENDING", "RIVET_STATE_SCHEMA_NEWER",
                         "RIVET_STATE_SCHEMA_UNEXPECTED", "RIVET_STATE_FOREIGN"})


def raise_failures(pf: Preflight, *, allow: frozenset[str] = frozenset()) -> None:
    """Raise the error of the first ``fail`` row whose code is not in ``allow``."""
    for check in pf.failures:
        if check.code not in allow and check.error is not None:
            raise check.error


def require(pf: Preflight, *, allow: frozenset[str] = frozenset()) -> Snapshot:
    """Raise the first failure of ``pf`` whose code is not in ``allow``; return the snapshot.

    Used by every write path: nothing is written before this returns.
    """
    raise_failures(pf, allow=allow)
    assert pf.snapshot is not None
    return pf.snapshot
