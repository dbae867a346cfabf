"""The one guarded write path (SPEC §4, §5, §9; ARCHITECTURE "The guard of a write").

Every write of statetool and of the runtime API passes through :func:`guarded_write`:

1. the write pre-flight (SPEC §4 checks 1-5) on a read-only open; nothing is written, and
   no file is created, before it passes;
2. the leases the write needs (check 6): a write of the whole state holds the state lease
   and every run lease (:func:`statetool.operations.leasing.hold_whole_state`), a write of
   one export holds that export's run lease, waited on up to ``--lock-wait``;
3. one writing transaction, in which every held lease is fenced (its token still current)
   first and again right before the commit;
4. a verified backup first (SQLite, when the write names one), the identity claim, the
   serial's increment (SPEC §9: the backup keeps the serial before it) and the audit row,
   all in that same transaction: this module is the only writer of ``rivet_audit``,
   ``rivet_identity`` and ``rivet_lineage``;
5. the commit, then the leases are released.

``init`` creates a state instead of changing one: :func:`create_state` builds it with
its identity and audit row through the same writers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from statetool import migrations, schema
from statetool.backends.base import HeldLease, Reader
from statetool.errors import StateError, StateWarning
from statetool.identity import Verdict, identity_warning
from statetool.operations.context import Context, now_iso
from statetool.operations.leasing import (STATE_LEASE, acquire, hold_whole_state, holder_text, lease_store,
                                          run_lease_key)
from statetool.operations.preflight import Preflight, require, run_preflight
from statetool.operations.probe import Snapshot
from statetool.redact import redact_text, redact_values
from statetool.tables import LINEAGE


@dataclass(frozen=True)
class Scope:
    """Which leases a write holds for its whole duration (SPEC §5): every run (the whole
    state), one export's run, or none (a lease release, which fences nothing)."""

    whole_state: bool = False
    export: str | None = None


WHOLE_STATE = Scope(whole_state=True)
NO_LEASE = Scope()


def one_export(name: str) -> Scope:
    """The scope of a write of export ``name``'s progress: its run lease."""
    return Scope(export=name)


def _audit_values(ctx: Context, action: str, detail: dict[str, object]) -> dict[str, str]:
    # The command line and the detail are redacted: a --state-url or --new given with a
    # password must not land in the audit trail (SPEC §7).
    return {"at": now_iso(), "actor": ctx.actor, "command": redact_text(ctx.command), "action": action,
            "detail": json.dumps(redact_values(detail), sort_keys=True, default=lambda v: redact_text(str(v)))}


def _write_audit(into: Connection, ctx: Context, action: str, detail: dict[str, object]) -> None:
    """The one writer of a ``rivet_audit`` row, redacted (:func:`_audit_values`)."""
    into.execute(sa.insert(schema.audit).values(**_audit_values(ctx, action, detail)))


def advance_serial(conn: Connection, past: int = 0) -> tuple[str, int]:
    """Increment the state's serial in the writing transaction ``conn`` (with a new
    ``write_id``: this write's own, revision 0005), to one more than
    the greater of it and ``past`` (a restore's: the replaced state's serial, so the state
    restored is ahead of every copy), and return ``(lineage id, new serial)`` (SPEC §9,
    revision 0005). A state whose lineage row is gone (removed by hand) gets a new lineage
    at serial 1: it can no longer be told from another state, and copies taken before read
    as of another lineage."""
    import uuid

    at, write_id = now_iso(), str(uuid.uuid4())
    serial = schema.lineage.c.serial
    greater = sa.case((serial > past, serial), else_=sa.literal(past, sa.BigInteger))
    if conn.execute(sa.update(schema.lineage).where(schema.lineage.c.id == 1)
                    .values(serial=greater + 1, write_id=write_id, updated_at=at)).rowcount == 0:
        conn.execute(sa.insert(schema.lineage).values(id=1, lineage=str(uuid.uuid4()), serial=1, write_id=write_id,
                                                      updated_at=at))
    row = conn.execute(sa.select(schema.lineage.c.lineage, schema.lineage.c.serial)).one()
    return str(row[0]), int(row[1])


def _write_identity(conn: Connection, ctx: Context, key: str, action: str, old: str | None, reason: str) -> None:
    conn.execute(sa.delete(schema.identity))
    conn.execute(sa.insert(schema.identity).values(id=1, state_key=key, recorded_at=now_iso(), recorded_by=ctx.actor))
    _write_audit(conn, ctx, f"identity.{action}", {"old": old, "new": key, "reason": reason or None})


def _claim(ctx: Context, pf: Preflight) -> tuple[Verdict | None, list[StateWarning]]:
    """What the identity claim of a write does with ``pf``'s verdict (SPEC §3): the verdict
    when it records the computed key (stamp or adopt), else None, and the warnings it gives
    (``RIVET_STATE_IDENTITY_ADOPTED``, ``RIVET_STATE_FOREIGN_BESIDE_CONFIG``). One rule for
    :meth:`WriteSession.claim` and :func:`plan_write`."""
    verdict = pf.verdict
    if verdict is None:
        return None, []
    warning = identity_warning(verdict, str(ctx.location.directory or ctx.location.display), for_write=True)
    return (verdict if verdict.writes else None), ([] if warning is None else [warning])


@dataclass
class WriteSession:
    """An open writing transaction that passed the write pre-flight, with its leases."""

    ctx: Context
    conn: Connection
    preflight: Preflight
    leases: list[HeldLease]
    backup: Path | None = None
    warnings: list[StateWarning] = field(default_factory=list)
    #: ``(lineage id, serial)`` after this write's increment; None for a state below revision
    #: 0005 (a migration's own write: the revision gives the state its lineage).
    lineage: tuple[str, int] | None = None
    _after_commit: list[Callable[[], None]] = field(default_factory=list)
    _on_abort: list[Callable[[], None]] = field(default_factory=list)

    @property
    def reader(self) -> Reader:
        """The read queries (:mod:`statetool.operations.probe`) in this transaction."""
        return self.ctx.backend().reader(self.conn)

    @property
    def snapshot(self) -> Snapshot:
        """The state as the pre-flight read it."""
        assert self.preflight.snapshot is not None
        return self.preflight.snapshot

    def audit(self, action: str, detail: dict[str, object], into: Connection | None = None) -> None:
        """Append one row to ``rivet_audit`` (who, when, which command, what), redacted, in
        this transaction (or in ``into``: a writing transaction on the database a move
        writes, which becomes the state)."""
        _write_audit(self.conn if into is None else into, self.ctx, action, detail)

    def record_identity(self, key: str, action: str, old: str | None = None, reason: str = "",
                        into: Connection | None = None) -> None:
        """Record ``key`` as the state's identity (the one row) and audit it (SPEC §3), in
        this transaction (or in ``into``, as :meth:`audit`)."""
        _write_identity(self.conn if into is None else into, self.ctx, key, action, old, reason)

    def claim(self, into: Connection | None = None) -> list[StateWarning]:
        """Apply the pre-flight's identity verdict (SPEC §3): stamp or adopt the computed
        key, in this transaction (or in ``into``: a migration's copy, which becomes the
        state). Returns the warnings it gives (``RIVET_STATE_IDENTITY_ADOPTED``,
        ``RIVET_STATE_FOREIGN_BESIDE_CONFIG``); a refusal never reaches here."""
        verdict, warnings = _claim(self.ctx, self.preflight)
        if verdict is not None:
            self.record_identity(verdict.computed, verdict.action, into=into)
        return warnings

    def advance(self, into: Connection | None = None, past: int = 0) -> None:
        """Increment the state's serial (:func:`advance_serial`, past ``past``) in this
        transaction, or in ``into`` (a migration's or a restore's copy, which becomes the
        state), and keep the result in :attr:`lineage`."""
        self.lineage = advance_serial(self.conn if into is None else into, past)

    def fence(self, *, final: bool = False) -> None:
        """Raise ``RIVET_STATE_LEASE_LOST`` unless every lease of this write is still held."""
        for lease in self.leases:
            lease.fence(self.conn, final=final)

    def after_commit(self, action: Callable[[], None]) -> None:
        """Run ``action`` once the transaction has committed (a lease record to remove)."""
        self._after_commit.append(action)

    def on_abort(self, action: Callable[[], None]) -> None:
        """Run ``action`` when the transaction rolls back."""
        self._on_abort.append(action)


def _scope_exports(ctx: Context, snap: Snapshot, exports: Iterable[str] | None) -> set[str]:
    names = set(exports) if exports is not None else set(snap.exports)
    try:
        names |= {e.name for e in ctx.config.exports}
    except StateError:
        pass  # an unreadable config was a pre-flight row already; the state's own exports remain
    return names


#: What a dry run that tolerates a refusal of its real run says the real run needs, by code.
_UNTIL = {"RIVET_STATE_READ_ONLY": "it is mounted read-write",
          "RIVET_STATE_PERMISSION_DENIED": "it runs as a user that may write there, or this user is let write there"}


def tolerate_read_only(check: Callable[[], object], *, dry_run: bool,
                       denied_too: bool = False) -> list[StateWarning]:
    """Run ``check`` (a refusal of a write that cannot complete here); return no warning
    when it passes. With ``dry_run``, a state on a filesystem mounted read-only is no
    refusal: a dry run changes nothing, so it still gives its plan there, and this returns
    warning ``RIVET_STATE_READ_ONLY_DRY_RUN`` saying that the real run will be refused
    (``RIVET_STATE_READ_ONLY``) until the filesystem is writable (docs/decisions.md, "Dry
    runs on a read-only mount"); with ``denied_too`` (``prune``, whose dry run is a count:
    docs/decisions.md, "prune --dry-run where it may not write"), so is a place this user may
    not write (``RIVET_STATE_PERMISSION_DENIED``, the same warning naming that code). Every
    other refusal is raised, in a dry run too."""
    try:
        check()
    except StateError as err:
        if not dry_run or err.code not in _UNTIL or (err.code != "RIVET_STATE_READ_ONLY" and not denied_too):
            raise
        return [StateWarning("RIVET_STATE_READ_ONLY_DRY_RUN",
                             f"{err.message.replace('; nothing was written', '')}: the real run will be refused "
                             f"({err.code}) until {_UNTIL[err.code]}; a dry run writes nothing, so this plan is "
                             "given all the same")]
    return []


def require_writable(ctx: Context, *, copies: int = 0, replaced_by: str | None = None,
                     dry_run: bool = False, denied_too: bool = False, room_for: str | None = None
                     ) -> list[StateWarning]:
    """A write's first refusal, before it opens anything or takes any lease: the backend
    refuses a write it cannot complete where the state is
    (:meth:`~statetool.backends.base.Backend.check_writable`: ``RIVET_STATE_READ_ONLY``,
    ``RIVET_STATE_PERMISSION_DENIED``, ``RIVET_STATE_DISK_FULL``,
    ``RIVET_STATE_UNSAFE_FILE``), with room for ``copies`` files as large as the state and,
    with ``replaced_by`` (the write's name), the state's owner given to the new file that
    replaces it (``room_for``: what the copies are for, the refusal's words).
    :func:`guarded_write` calls it, and every ``--dry-run`` of a write calls it with the
    same arguments and ``dry_run``, so a dry run refuses what its real run would
    (SPEC §8a), except a read-only filesystem (:func:`tolerate_read_only`; with
    ``denied_too`` a place this user may not write as well). Returns the warnings (empty
    when the write can run)."""
    return tolerate_read_only(lambda: ctx.backend().check_writable(copies=copies, replaced_by=replaced_by,
                                                                   room_for=room_for),
                              dry_run=dry_run, denied_too=denied_too)


def _copies(copies: int | None, backup_label: str | None) -> int:
    """The room a write needs beside the state (:func:`require_writable`): ``copies`` when
    given, else 2 with a backup (the backup and its journal), else none."""
    return copies if copies is not None else 2 if backup_label else 0


def _first_checks(ctx: Context, preflight: Preflight | None, allow: frozenset[str],
                  check: Callable[[Snapshot], object] | None, copies: int, replaced_by: str | None,
                  dry_run: bool = False, room_for: str | None = None) -> tuple[Preflight, list[StateWarning]]:
    """The checks of a write before it opens anything for writing or takes any lease, in
    their order: the write pre-flight (``preflight``, or run now) with the codes in
    ``allow`` passed, the request against its snapshot (``check``), and
    :func:`require_writable`. :func:`guarded_write` and :func:`plan_write` (every dry run)
    both run them here, so a dry run refuses what its real run would. Returns the
    pre-flight and the warnings (a dry run's ``RIVET_STATE_READ_ONLY_DRY_RUN``)."""
    pf = preflight if preflight is not None else run_preflight(ctx, for_write=True)
    snap = require(pf, allow=allow)
    if check is not None:
        check(snap)
    return pf, require_writable(ctx, copies=copies, replaced_by=replaced_by, dry_run=dry_run, room_for=room_for)


@dataclass
class WritePlan:
    """What a guarded write would change, found by the checks it makes before its first
    byte (:func:`plan_write`). Every ``--dry-run`` of a change prints it as its ``plan``,
    and its real run writes what it says (SPEC §8a, §9; docs/decisions.md, "Dry runs of
    the changes").

    ``changes`` are ``{"what", "before", "after"}`` rows (a value the write keeps has
    ``before == after``); ``backup`` the path the write's backup would get
    (:meth:`~statetool.backends.base.Backend.planned_backup`: SQLite, its time written
    ``YYYYmmddTHHMMSSZ``), None without one; ``leases`` each lease the write would hold,
    ``{"key", "state", "holder"}`` as it is now (a ``live`` one is waited for up to
    ``--lock-wait``); ``audit`` the actions of the audit rows it would write (the command's
    own first, then the identity claim's); ``warnings`` those the real run would give, and
    ``RIVET_STATE_READ_ONLY_DRY_RUN`` in a dry run on a read-only mount. ``guard`` holds the :func:`guarded_write` arguments it was planned
    with (:func:`write_planned`)."""

    preflight: Preflight
    changes: list[dict[str, object]] = field(default_factory=list)
    backup: str | None = None
    leases: list[dict[str, object]] = field(default_factory=list)
    audit: list[str] = field(default_factory=list)
    warnings: list[StateWarning] = field(default_factory=list)
    guard: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def snapshot(self) -> Snapshot:
        """The state as the plan's pre-flight read it."""
        assert self.preflight.snapshot is not None
        return self.preflight.snapshot

    def change(self, what: str, before: object, after: object) -> None:
        """Add the row ``what: before -> after`` (``before == after``: a value the write keeps)."""
        self.changes.append({"what": what, "before": before, "after": after})

    def as_dict(self) -> dict[str, object]:
        """``{changes, backup, leases, audit, warnings}``: the ``plan`` of a command's JSON."""
        return {"changes": self.changes, "backup": self.backup, "leases": self.leases, "audit": self.audit,
                "warnings": [w.as_dict() for w in self.warnings]}


def _planned_leases(ctx: Context, scope: Scope, snap: Snapshot, exports: Iterable[str] | None,
                    dry_run: bool) -> tuple[list[dict[str, object]], list[StateWarning]]:
    """The leases a write of ``scope`` would hold (a whole-state write: the state lease and
    every export's run lease, :func:`_scope_exports`), each as it is now, read without any
    lock; a dry run refuses as the real run would one this user could not take
    (:meth:`~statetool.backends.base.LeaseStore.require_takable`, a read-only mount
    tolerated)."""
    if scope.whole_state:
        keys = [STATE_LEASE, *(run_lease_key(e) for e in sorted(_scope_exports(ctx, snap, exports)))]
    else:
        keys = [] if scope.export is None else [run_lease_key(scope.export)]
    if not keys:
        return [], []
    store = lease_store(ctx)
    warnings = tolerate_read_only(lambda: store.require_takable(keys), dry_run=dry_run) if dry_run else []
    now = {info.key: info for info in store.list()}
    return [{"key": key, "state": now[key].state if key in now else "free",
             "holder": holder_text(now[key]) if key in now and now[key].holder else None} for key in keys], warnings


def plan_write(ctx: Context, scope: Scope, audit: str | None = None, *, backup_label: str | None = None,
               claim: bool = True, allow: frozenset[str] = frozenset(),
               check: Callable[[Snapshot], object] | None = None, exports: Iterable[str] | None = None,
               preflight: Preflight | None = None, copies: int | None = None, replaced_by: str | None = None,
               dry_run: bool = False) -> WritePlan:
    """Plan a guarded write, reading only and creating no file: every check
    :func:`guarded_write` makes with the same arguments before its first byte
    (:func:`_first_checks`: the write pre-flight, ``check``, :func:`require_writable`), in
    a dry run with ``dry_run`` (a read-only mount is warning
    ``RIVET_STATE_READ_ONLY_DRY_RUN``, and a lease this user could not take is refused as
    the real run would: ``RIVET_STATE_PERMISSION_DENIED``). Raises what those raise.

    The plan holds the backup the write would take (``backup_label``), the leases of
    ``scope`` with their state now, the identity claim (with ``claim``: the
    ``state_key`` change row and ``identity.<stamp|adopt>`` audit row, with its warning)
    and ``audit``, the action of the command's own audit row. The command adds its own
    change rows (:meth:`WritePlan.change`); its real run then writes through
    :func:`write_planned`, its dry run returns the plan. The arguments are
    :func:`guarded_write`'s."""
    pf, warnings = _first_checks(ctx, preflight, allow, check, _copies(copies, backup_label), replaced_by, dry_run)
    assert pf.snapshot is not None
    leases, untakable = _planned_leases(ctx, scope, pf.snapshot, exports, dry_run)
    plan = WritePlan(pf, backup=ctx.backend().planned_backup(backup_label) if backup_label else None,
                     leases=leases, audit=[audit] if audit else [], warnings=warnings or untakable,
                     guard={"scope": scope, "backup_label": backup_label, "claim": claim, "allow": allow,
                            "check": check, "exports": exports, "copies": copies, "replaced_by": replaced_by})
    if claim:
        verdict, claimed = _claim(ctx, pf)
        if verdict is not None:
            plan.change("state_key", verdict.recorded, verdict.computed)
            plan.audit.append(f"identity.{verdict.action}")
        plan.warnings += claimed
    return plan


def write_planned(ctx: Context, plan: WritePlan) -> AbstractContextManager[WriteSession]:
    """The guarded write ``plan`` describes: :func:`guarded_write` with the plan's pre-flight
    and the arguments it was planned with (its checks run again, on the same pre-flight)."""
    return guarded_write(ctx, preflight=plan.preflight, **plan.guard)


@contextmanager
def guarded_write(ctx: Context, scope: Scope, *, backup_label: str | None = None, claim: bool = True,
                  allow: frozenset[str] = frozenset(), check: Callable[[Snapshot], object] | None = None,
                  at_head: bool = True, exports: Iterable[str] | None = None, preflight: Preflight | None = None,
                  prepare: Callable[[], None] | None = None, held: list[HeldLease] | None = None,
                  busy_code: str = "RIVET_STATE_RUN_IN_PROGRESS",
                  lock_code: str = "RIVET_STATE_LOCK_TIMEOUT", copies: int | None = None,
                  replaced_by: str | None = None, advance: bool = True, room_for: str | None = None
                  ) -> Iterator[WriteSession]:
    """Pre-flight, leases, one fenced writing transaction with its audit row, release.

    ``scope`` says which leases are held (:class:`Scope`); a whole-state write also holds
    the run lease of every export in ``exports`` (default: the config's and the state's),
    and waits past them up to ``--lock-wait``, then raises ``busy_code``. A per-export
    write waits for its run lease, then raises ``RIVET_STATE_LOCK_TIMEOUT`` (at once with
    ``--lock-wait 0``: ``RIVET_STATE_RUN_IN_PROGRESS``).

    ``preflight`` is a write pre-flight the caller ran already (to plan); ``allow`` lists
    pre-flight codes this write may pass (rekey passes ``RIVET_STATE_FOREIGN``); ``check``
    validates the request against the snapshot (an unknown export) before any lease or
    file; ``prepare`` runs with the leases held, before the transaction (a WAL checkpoint).
    ``held`` lists leases the caller holds already (a runtime run): they are fenced like
    the write's own, including any the caller appends to that list during the body.
    With ``at_head`` the revision is read again in the transaction
    (``RIVET_STATE_MIGRATION_PENDING`` when it moved). With ``backup_label`` a SQLite
    state is backed up (verified) in the transaction before the change; with ``claim``
    the identity verdict is applied. With ``advance`` the state's serial is incremented in
    the transaction (SPEC §9), where the state has a lineage: a write that builds the
    state elsewhere (a migration's copy, a move's target) passes False, and a migration
    advances its copy itself (:meth:`WriteSession.advance`). The transaction waits ``--lock-wait`` for the
    backend's write lock, then raises ``lock_code``. Every held lease is fenced at the
    start and right before the commit (``RIVET_STATE_LEASE_LOST``). Before anything is
    opened for writing, the backend refuses a write it cannot complete there
    (:meth:`~statetool.backends.base.Backend.check_writable`), with room for ``copies``
    files as large as the state (default: 2 with a backup, the backup and its journal) and,
    with ``replaced_by``, the state's owner to give to the file that replaces it
    (:func:`require_writable`; ``room_for`` what the copies are for): refused then, nothing
    of the write exists yet, no lease file
    either.
    """
    pf = _first_checks(ctx, preflight, allow, check, _copies(copies, backup_label), replaced_by,
                       room_for=room_for)[0]
    snap = pf.snapshot
    assert snap is not None
    if scope.whole_state or scope.export is not None:
        # Wait for the state's write lock once before any lease is taken, holding nothing:
        # a write refused because another writer keeps the state busy leaves no lease file.
        with ctx.backend().writing(lock_code):
            pass
    with ExitStack() as stack:
        leases: list[HeldLease] = held if held is not None else []
        if scope.whole_state:
            leases += hold_whole_state(ctx, stack, _scope_exports(ctx, snap, exports), busy_code)
        elif scope.export is not None:
            lease = acquire(ctx, run_lease_key(scope.export))
            stack.callback(lease.release)
            leases.append(lease)
        if prepare is not None:
            prepare()
        session: WriteSession | None = None
        try:
            with ctx.backend().writing(lock_code) as conn:
                session = WriteSession(ctx, conn, pf, leases)
                session.fence()
                if at_head:
                    current = conn.execute(sa.text(f"SELECT version_num FROM {schema.VERSION_TABLE}")).scalar()
                    if current != migrations.head():
                        raise StateError("RIVET_STATE_MIGRATION_PENDING",
                                         f"the state changed to revision {current} while waiting; re-run")
                if backup_label:
                    with ctx.progress("backup") as update:
                        session.backup = ctx.backend().backup(conn, backup_label, update)
                if claim:
                    session.warnings = session.claim()
                if advance and LINEAGE in snap.tables:
                    session.advance()
                yield session
                session.fence(final=True)
        except BaseException:
            for action in session._on_abort if session is not None else ():  # noqa: SLF001 - own session
                action()
            raise
        for action in session._after_commit:  # noqa: SLF001 - own session
            action()


def create_state(ctx: Context, build: Callable[[Connection], None], key: str, *, action: str = "init",
                 detail: dict[str, object] | None = None) -> None:
    """Create a new state at head through the backend's atomic create: ``build`` (the
    schema, and for ``import`` the rows) runs first, then the identity ``key`` is recorded
    (when set) and the ``action`` audit row written (``init``; ``import`` with its
    ``detail``), all in one transaction. Refuses nothing itself (``init`` and ``import`` do)."""

    def whole(conn: Connection) -> None:
        build(conn)
        if key:
            _write_identity(conn, ctx, key, "stamp", None, "")
        _write_audit(conn, ctx, action, {"revision": migrations.head(), "state_key": key or None, **(detail or {})})

    backend = ctx.backend()
    require_writable(ctx)
    backend.create(whole)


def create_from_copy(ctx: Context, source: Path, detail: dict[str, object]) -> int | None:
    """Create the state where none is from the copy ``source`` (``restore``), through the
    backend's atomic create started from its bytes: its serial advanced (the restore is a
    write) and a ``restore`` audit row with ``detail``, where its revision has those tables,
    in the one transaction. Returns the new serial (None for a copy without a lineage).
    Refuses nothing itself (``restore`` does); raises the create's codes."""
    from statetool.tables import AUDIT

    backend = ctx.backend()
    serial: int | None = None

    def whole(conn: Connection) -> None:
        nonlocal serial
        tables = set(backend.table_names(backend.reader(conn)))
        if LINEAGE in tables:
            serial = advance_serial(conn)[1]
        if AUDIT in tables:
            _write_audit(conn, ctx, "restore", {**detail, "serial": serial})

    require_writable(ctx)
    backend.create(whole, start_from=source, on_step=ctx.on_step)
    return serial
