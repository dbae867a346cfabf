"""What every write does besides its own change: claim the identity, write the audit row,
back up first (SQLite). One place, so no write path can forget a step."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from statetool import migrations, schema
from statetool.errors import StateError, StateWarning
from statetool.identity import Verdict
from statetool.operations.context import Context, now_iso
from statetool.operations.preflight import identity_message, require, run_preflight
from statetool.operations.probe import Snapshot
from statetool.redact import redact_text


def audit(conn: Connection, ctx: Context, action: str, detail: dict[str, object]) -> None:
    """Append one row to ``rivet_audit``: who (user@host), when, which command, what.

    The command line and the detail are redacted: a ``--state-url`` or ``--new`` given with
    a password must not land in the audit trail (SPEC §7)."""
    conn.execute(sa.insert(schema.audit).values(
        at=now_iso(), actor=ctx.actor, command=redact_text(ctx.command), action=action,
        detail=redact_text(json.dumps(detail, sort_keys=True, default=str)),
    ))


def record_identity(conn: Connection, ctx: Context, key: str, action: str, old: str | None = None,
                    reason: str = "") -> None:
    """Write ``key`` as the state's identity (insert or replace the single row) and audit it."""
    conn.execute(sa.delete(schema.identity))
    conn.execute(sa.insert(schema.identity).values(id=1, state_key=key, recorded_at=now_iso(), recorded_by=ctx.actor))
    audit(conn, ctx, f"identity.{action}", {"old": old, "new": key, "reason": reason or None})


def claim_identity(conn: Connection, ctx: Context, verdict: Verdict | None) -> list[StateWarning]:
    """Apply a write's identity verdict (SPEC §3): stamp or adopt the computed key.

    Returns the warnings the claim gives (``RIVET_STATE_IDENTITY_ADOPTED``,
    ``RIVET_STATE_FOREIGN_BESIDE_CONFIG``). A ``refuse`` verdict never reaches here: the
    pre-flight raised ``RIVET_STATE_FOREIGN`` first.
    """
    if verdict is None:
        return []
    where = str(ctx.location.directory or ctx.location.display)
    if verdict.writes:
        record_identity(conn, ctx, verdict.computed, verdict.action)
    if verdict.code in ("RIVET_STATE_IDENTITY_ADOPTED", "RIVET_STATE_FOREIGN_BESIDE_CONFIG"):
        return [StateWarning(verdict.code, identity_message(verdict, where, for_write=True))]
    return []


@dataclass
class WriteSession:
    """An open writing transaction at head, with the pre-flight it passed."""

    conn: Connection
    snapshot: Snapshot
    backup: Path | None
    warnings: list[StateWarning] = field(default_factory=list)


@contextmanager
def head_write(ctx: Context, *, backup_label: str | None, lock_code: str = "RIVET_STATE_LOCK_TIMEOUT",
               claim: bool = True, allow: frozenset[str] = frozenset(),
               lease_key: str | None = None,
               check: Callable[[Snapshot], object] | None = None) -> Iterator[WriteSession]:
    """Pre-flight, then one writing transaction on a state at head.

    Raises every pre-flight failure (a state with pending revisions:
    ``RIVET_STATE_MIGRATION_PENDING``) before anything is written. With ``backup_label``,
    a SQLite state is backed up (verified) inside the write lock before the change.
    With ``claim``, the identity verdict is applied in the same transaction. ``allow``
    lists pre-flight codes this write may pass (rekey passes ``RIVET_STATE_FOREIGN``).
    With ``lease_key``, that lease is held (waited on up to ``--lock-wait``) from after
    the pre-flight until the transaction ends. ``check`` validates the request against
    the pre-flight's snapshot (an unknown export) before any lease, backup or write, so a
    refused request leaves no file behind.
    """
    pf = run_preflight(ctx, for_write=True, recover=True)
    snap = require(pf, allow=allow)
    if check is not None:
        check(snap)
    backend = ctx.backend()
    with contextlib.ExitStack() as stack:
        if lease_key is not None:
            from statetool.operations.leases import holding

            stack.enter_context(holding(ctx, lease_key, ctx.command))
        conn = stack.enter_context(backend.writing(lock_code))
        current = conn.execute(sa.text(f"SELECT version_num FROM {schema.VERSION_TABLE}")).scalar()
        if current != migrations.head():
            raise StateError("RIVET_STATE_MIGRATION_PENDING",
                             f"the state changed to revision {current} while waiting; re-run")
        backup = None
        if backup_label:
            with ctx.progress("backup") as update:
                backup = backend.backup(conn, backup_label, update)
        warnings = claim_identity(conn, ctx, pf.verdict) if claim else []
        yield WriteSession(conn, snap, backup, warnings)
