"""``statetool migrate``: pre-flight, upgrade (or downgrade) where the backend builds it, verify, switch.

SPEC §4, §8 and §9. Order: every read-only check passes -> every run lease and the state
lease are held -> no other process has the state open and its WAL is checkpointed
(SQLite) -> the write lock is taken (SQLite ``BEGIN IMMEDIATE``; PostgreSQL a
transaction-scoped advisory lock, waited on up to ``--lock-wait``, then
``RIVET_STATE_MIGRATION_LOCKED``) -> the revision is read again (another migrate may have
finished meanwhile) -> the backend's :class:`~statetool.backends.base.Migration`: SQLite
copies the frozen file, PostgreSQL uses THE transaction -> alembic runs every step there
-> the identity claim and the audit row are written there -> ``quick_check``, per-table
row counts and the revision are checked -> commit -> SQLite: the original is kept under
the backup name and the copy renamed into its place (decisions.md, "Revisions and
migrations"). Any failure before the switch leaves the state exactly as before.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from statetool import migrations
from statetool.errors import StateError, StateWarning
from statetool.operations.context import Context
from statetool.operations.preflight import Preflight, require, run_preflight
from statetool.operations.probe import position_texts, row_counts
from statetool.tables import AUDIT, CDC_POSITIONS, IDENTITY, LEASE_TABLES, LINEAGE, VERSION_TABLE

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from statetool.backends.base import Backend, Reader

#: Files as large as the state a migration may add beside it (SQLite): the copy it builds
#: the new revision in, and the tables it rebuilds in that copy (written before the old
#: ones are dropped). The original adds nothing: renamed aside, it is the backup.
MIGRATION_COPIES = 2
#: A SQLite migration's name where it puts the new revision's file in the state's place
#: (:meth:`~statetool.backends.base.Backend.check_writable`: the owner it must keep).
_REPLACED_BY = "a migration"

#: The steps a SQLite migration announces to :attr:`Context.on_step`, in the order it
#: passes them (the crash tests kill it at each): the write lock held, the state copied,
#: the alembic steps run on the copy, the copy verified (with its identity and audit rows),
#: the copy committed and fsynced, the state's transaction closed, the original kept as the
#: backup, the copy renamed into place, the end. A PostgreSQL migration passes ``locked``,
#: ``migrated``, ``verified`` and ``finished``.
CRASH_POINTS = ("locked", "copied", "migrated", "verified", "built", "closed", "kept", "swapped", "finished")

#: Tables left out of the before/after row-count comparison: those a migration writes to
#: itself, and the lease tables, which runs and heartbeats change while it runs (their own
#: guard is the fence of the migration's leases, checked before the commit).
_WRITTEN_BY_MIGRATE = {IDENTITY, AUDIT, LINEAGE, VERSION_TABLE, *LEASE_TABLES}


@dataclass
class StepPlan:
    """One revision crossed: ``rebuilds`` and ``loses`` as ``{table: rows}``."""

    id: str
    description: str
    direction: str
    rebuilds: dict[str, int] = field(default_factory=dict)
    loses: dict[str, int] = field(default_factory=dict)


@dataclass
class MigrateResult:
    """What a migration planned and did. ``from_revision`` is ``"legacy"`` for a legacy state."""

    location: dict[str, object]
    from_revision: str | None
    to_revision: str
    direction: str
    steps: list[StepPlan]
    applied: bool = False
    dry_run: bool = False
    backup: str | None = None
    verified_rows: dict[str, int] = field(default_factory=dict)
    sql: str | None = None
    message: str = ""
    warnings: list[StateWarning] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        """JSON shape of the plan and its outcome."""
        doc = asdict(self)
        doc["warnings"] = [w.as_dict() for w in self.warnings]
        return doc


def _plan(backend: Backend, conn: Reader, tables: set[str], direction: str,
          steps: list[migrations.Revision]) -> list[StepPlan]:
    plans = []
    for rev in steps:
        plan = StepPlan(rev.id, rev.description, direction)
        if direction == "up":
            plan.rebuilds = row_counts(conn, {t for t in backend.rebuilt_tables(conn, rev) if t in tables})
        else:
            plan.rebuilds = row_counts(conn, {t for t in rev.down_rebuilds if t in tables})
            for table, predicate in rev.loses.items():
                if table in tables:
                    where = f" WHERE {predicate}" if predicate else ""
                    plan.loses[table] = int(conn.scalar(f'SELECT count(*) FROM "{table}"{where}') or 0)
        plans.append(plan)
    return plans


def _refuse_dropped_positions(target: str, steps: list[StepPlan], stored: dict[str, str]) -> None:
    """``RIVET_STATE_POSITIONS_IN_STATE`` when a downgrade to ``target`` whose ``steps``
    (:func:`_plan`'s) drop the CDC position table (revision 0006) while the state holds positions
    (``stored``, ``{export: text}``), whatever ``--allow-data-loss`` says: a run of a release
    below 0006 would find no position and re-anchor each stream, losing the changes in
    between without an error (SPEC §5a, §9; issue 15, the fresh user's finding 7). The way
    down without a loss is ``statetool checkpoints export`` first, which the message names
    first."""
    if not stored or not any(CDC_POSITIONS in step.loses for step in steps):
        return
    names = ", ".join(sorted(stored))
    raise StateError("RIVET_STATE_POSITIONS_IN_STATE",
                     f"run statetool checkpoints export first: downgrading to {target} drops the table of CDC "
                     f"positions (revision 0006), and the state holds the positions of {names}. A release before "
                     "0006 reads a position only from its checkpoint file: without it, each stream re-anchors and "
                     "the changes in between are lost without an error. checkpoints export writes each position back "
                     "to its file (an export with no cdc.checkpoint needs one in the config first); then run this "
                     "downgrade again. Nothing was changed", {"target": target, "exports": sorted(stored)})


def migrate(ctx: Context, *, to: str | None = None, dry_run: bool = False, sql: bool = False,
            allow_data_loss: bool = False) -> MigrateResult:
    """Move the state to revision ``to`` (default head), up or down.

    Raises every pre-flight code (a missing state is ``RIVET_STATE_MISSING``: migrate
    never creates one, ``statetool init`` does), ``RIVET_STATE_REVISION_UNKNOWN``,
    ``RIVET_STATE_DATA_LOSS`` (a downgrade that drops rows, without
    ``allow_data_loss``), ``RIVET_STATE_POSITIONS_IN_STATE`` (a downgrade below revision
    0006 while the state holds CDC positions, even with ``allow_data_loss``:
    :func:`_refuse_dropped_positions`), ``RIVET_STATE_SQL_UNSUPPORTED`` (``sql`` on SQLite),
    ``RIVET_STATE_UPGRADE_BESIDE_LIVE_RUN`` (a live lease past ``--lock-wait``; while it
    runs the migration holds the state lease and every run lease, so no run starts),
    ``RIVET_STATE_MIGRATION_LOCKED`` (another writer past ``--lock-wait``),
    ``RIVET_STATE_VERIFY_FAILED`` (the state not changed), and on SQLite
    ``RIVET_STATE_RUN_IN_PROGRESS`` (another process holds the state open past
    ``--lock-wait``, or wrote it without a lease while it was migrated),
    ``RIVET_STATE_PERMISSION_DENIED`` (the new file cannot be given the state's owner:
    refused before any lease or file, in a dry run too) and the faults of its directory
    (``RIVET_STATE_DISK_FULL``, ...). ``dry_run`` and ``sql`` write nothing; a dry run on a
    filesystem mounted read-only gives its plan with warning ``RIVET_STATE_READ_ONLY_DRY_RUN``
    (:func:`~statetool.operations.writes.require_writable`). The result's ``backup`` names
    the original kept beside the state (SQLite).
    """
    if sql and not ctx.backend().supports_offline_sql:  # whatever the state holds: the answer is the same
        raise StateError("RIVET_STATE_SQL_UNSUPPORTED", "--sql prints PostgreSQL DDL; this state is SQLite")
    with migrations.alembic_loading_behind(not (sql or dry_run)):  # while the pre-flight reads the state
        return _migrate(ctx, to, dry_run, sql, allow_data_loss)


def _migrate(ctx: Context, to: str | None, dry_run: bool, sql: bool, allow_data_loss: bool) -> MigrateResult:
    """:func:`migrate` once its thread loading alembic is started."""
    pf = run_preflight(ctx, for_write=True, progress=False)
    missing = next((c for c in pf.failures if c.code == "RIVET_STATE_MISSING"), None)
    if missing is not None and missing.id == "state":
        raise StateError("RIVET_STATE_MISSING", f"{missing.message}; migrate never creates a state "
                         "(an empty state made by accident is how first-run resets start): "
                         "run statetool init to create a new one on purpose")
    snap = require(pf, allow=frozenset({"RIVET_STATE_MIGRATION_PENDING"}))
    target = migrations.resolve_target(to)
    current = snap.effective_revision
    direction, steps = migrations.steps(current, target)
    backend = ctx.backend()
    with backend.reading() as conn:
        plans = _plan(backend, conn, set(snap.tables), direction, steps)
        _refuse_dropped_positions(target, plans, position_texts(conn, snap.tables))
    result = MigrateResult(ctx.location.as_dict(), "legacy" if snap.legacy else current, target, direction, plans,
                           dry_run=dry_run)
    lost = {f"{p.id}:{t}": n for p in plans for t, n in p.loses.items() if n}
    if lost and not allow_data_loss:  # a dry run refuses what the real run refuses
        raise StateError("RIVET_STATE_DATA_LOSS", "downgrading to " + target + " drops data: " +
                         ", ".join(f"{n} rows of {k.split(':')[1]} (undoing {k.split(':')[0]})" for k, n in lost.items()))
    if direction == "none" and not snap.legacy:
        result.message = f"already at {target}; nothing to do"
        return result
    if sql:
        result.sql = backend.offline_sql(current, target, direction, stamp=current if snap.legacy else None)
        result.message = "SQL printed; nothing was changed"
        return result
    if dry_run:
        from statetool.operations.writes import require_writable

        result.warnings = require_writable(ctx, copies=MIGRATION_COPIES, replaced_by=_REPLACED_BY, dry_run=True)
        result.message = "dry run: nothing was changed" + (
            "; this downgrade drops the rows in the 'drops' column" if lost else "")
        return result
    _execute(ctx, result, pf, snap.legacy)
    return result


def _execute(ctx: Context, result: MigrateResult, pf: Preflight, legacy: bool) -> None:
    # Imported here, once the pre-flight has read the state: the write path loads
    # SQLAlchemy, which the thread of migrations.alembic_loading_behind imports meanwhile.
    from statetool.operations.writes import WHOLE_STATE, guarded_write

    backend = ctx.backend()
    target = result.to_revision
    with guarded_write(ctx, WHOLE_STATE, preflight=pf, allow=frozenset({"RIVET_STATE_MIGRATION_PENDING"}),
                       claim=False, advance=False, at_head=False, busy_code="RIVET_STATE_UPGRADE_BESIDE_LIVE_RUN",
                       lock_code="RIVET_STATE_MIGRATION_LOCKED", copies=MIGRATION_COPIES, replaced_by=_REPLACED_BY,
                       prepare=backend.hold_off_writers) as session:
        backend.require_frozen()
        ctx.on_step("locked")
        conn = session.conn
        reader = backend.reader(conn)
        tables = backend.table_names(reader)
        now = _revision(conn) if VERSION_TABLE in tables else None
        if now is not None and now != (None if legacy else result.from_revision):
            if now == target:
                result.message = f"another migration brought the state to {target} meanwhile; nothing to do"
                return
            raise StateError("RIVET_STATE_MIGRATION_PENDING",
                             f"the state moved to revision {now} while waiting; re-run to plan again")
        # Under every run lease and the write lock: a run may have committed a position
        # after the plan was read.
        _refuse_dropped_positions(target, result.steps, position_texts(reader, frozenset(tables)))
        before = row_counts(reader, tables - _WRITTEN_BY_MIGRATE)
        with ctx.progress("copying") as update:
            migration = backend.migration(conn, result.from_revision or "legacy", update, ctx.on_step)
        session.on_abort(migration.discard)
        session.after_commit(migration.switch)
        result.backup = str(migration.backup) if migration.backup else None
        with migration.connection() as new:
            new_reader = backend.reader(new)
            _upgrade(ctx, new, result, legacy)
            ctx.on_step("migrated")
            after_tables = backend.table_names(new_reader)
            if IDENTITY in after_tables:
                result.warnings = session.claim(into=new)
            if LINEAGE in after_tables:
                session.advance(into=new)
            if AUDIT in after_tables:
                session.audit("migrate", {"from": result.from_revision, "to": target, "backup": result.backup},
                              into=new)
            problems = backend.integrity_problems(new_reader)
            after = row_counts(new_reader, set(before) & after_tables)
            revision = _revision(new)
            changed = {t: (before[t], after[t]) for t in after if before[t] != after[t]}
            if problems or changed or revision != target:
                raise StateError("RIVET_STATE_VERIFY_FAILED",
                                 f"after migrating to {target}: integrity {problems[:3] or 'ok'}, row counts changed "
                                 f"{changed or 'none'}, revision {revision}; the state was not changed")
            result.verified_rows = after
            ctx.on_step("verified")
    ctx.on_step("finished")
    result.applied = True
    result.message = f"migrated from {result.from_revision} to {target}"


def _revision(conn: Connection) -> str | None:
    """The version table's one value."""
    return conn.exec_driver_sql(f"SELECT version_num FROM {VERSION_TABLE}").scalar()


def _upgrade(ctx: Context, conn: Connection, result: MigrateResult, legacy: bool) -> None:
    """The alembic steps to ``result.to_revision`` on ``conn`` (a legacy state stamped
    ``0001`` first), with their progress."""
    backend = ctx.backend()
    if legacy:
        migrations.stamp(conn, migrations.revisions()[0].id, backend.schema)
    with ctx.progress(f"migrating to {result.to_revision}") as update:
        total = len(result.steps)
        done = iter(range(1, total + 1))
        update(0, total)
        if result.direction != "none":
            migrations.apply(conn, result.to_revision, backend.schema, result.direction,
                             lambda _rev: update(next(done), total))
