"""``statetool check``: the CI pre-flight (SPEC §8), read-only and byte-identical."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from statetool.errors import REGISTRY, failure_exit_code, unit_failure, worst
from statetool.operations.context import Context
from statetool.operations.preflight import Check, Preflight, run_preflight


@dataclass
class CheckResult:
    """The rows of a check and the exit code they add up to (0 when ``ok``)."""

    checks: list[Check]
    exit_code: int
    worst: Check | None = None

    @property
    def ok(self) -> bool:
        """True when no row failed."""
        return self.exit_code == 0

    @property
    def failures(self) -> list[dict[str, Any]]:
        """The ``failures[]`` of ``--json-errors`` (ADR-0039 D2): each failing row of one
        export (``doctor:<export>``) as :func:`~statetool.errors.unit_failure`."""
        return [unit_failure(c.id.split(":", 1)[1], c.code, c.message, c.error) for c in self.checks
                if c.status == "fail" and c.code and c.id.startswith("doctor:")]

    def as_dict(self) -> dict[str, object]:
        """``{"ok": bool, "checks": [{id, status, code, message, action}, ...]}``."""
        return {"ok": self.ok, "checks": [c.as_dict() for c in self.checks]}


def check(ctx: Context, *, strict: bool = False) -> CheckResult:
    """Run every pre-flight check. Never writes, never raises for a failing check.

    Besides the pre-flight rows, ``doctor``'s findings are rows too (``doctor`` and
    ``doctor:<export>``). Exit code: the class of the worst failing row (:func:`statetool.errors.worst`,
    SPEC §7: data_integrity > internal > refusal > schema_drift > retryable > generic); pending revisions fail
    with ``RIVET_STATE_MIGRATION_PENDING`` (3). With ``strict``, ``warn`` rows fail, as refusal (5,
    :func:`statetool.errors.failure_class`).
    """
    pf = run_preflight(ctx)
    # doctor reads the config: with a config that failed its row there is nothing more to diagnose.
    config_read = not any(c.id == "config" and c.status == "fail" for c in pf.checks)
    rows = pf.checks + (_doctor_rows(ctx, pf) if pf.snapshot is not None and config_read else [])
    if strict:
        rows = [Check(c.id, "fail", c.message, c.code, c.error) if c.status == "warn" else c for c in rows]
    failed = [c for c in rows if c.status == "fail" and c.code]
    code = worst([c.code for c in failed if c.code])
    row = next((c for c in reversed(failed) if c.code == code), None)
    return CheckResult(rows, failure_exit_code(code) if code else 0, row)


def _doctor_rows(ctx: Context, pf: Preflight) -> list[Check]:
    """What ``doctor`` finds beyond the pre-flight rows: lost or unreadable CDC checkpoints
    (fail), exports with no progress, relative checkpoints under PostgreSQL, ephemeral or
    network state directories, orphaned -wal/-shm files (warn)."""
    from statetool.operations.doctor import doctor

    seen = {c.code for c in pf.checks if c.code}
    rows: list[Check] = []
    reported: set[tuple[str, str]] = set()
    for diagnosis in doctor(ctx).exports:
        for reason in diagnosis.reasons:
            state_level = reason.code in _STATE_LEVEL
            row_id = "doctor" if state_level else f"doctor:{diagnosis.name}"
            if reason.code in seen or (row_id, reason.code) in reported:
                continue
            reported.add((row_id, reason.code))
            rows.append(Check(row_id, "fail" if reason.code in REGISTRY else "warn", reason.message, reason.code))
    return rows


#: Doctor findings about the state as a whole (reported once, not per export).
_STATE_LEVEL = frozenset({"RIVET_STATE_DIR_EPHEMERAL", "RIVET_STATE_DIR_NETWORK", "RIVET_STATE_ORPHAN_WAL",
                          "RIVET_STATE_DIR_MISSING", "RIVET_STATE_HOT_JOURNAL", "RIVET_STATE_ROLLED_BACK"})
