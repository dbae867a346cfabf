"""``statetool check``: the CI pre-flight (SPEC §8), read-only and byte-identical."""

from __future__ import annotations

from dataclasses import dataclass

from statetool.errors import EXIT_CODES, REGISTRY, STOP_RANK
from statetool.operations.context import Context
from statetool.operations.preflight import Check, run_preflight


@dataclass
class CheckResult:
    """The rows of a check and the exit code they add up to (0 when ``ok``)."""

    checks: list[Check]
    exit_code: int

    @property
    def ok(self) -> bool:
        """True when no row failed."""
        return self.exit_code == 0

    def as_dict(self) -> dict[str, object]:
        """``{"ok": bool, "checks": [{id, status, code, message, action}, ...]}``."""
        return {"ok": self.ok, "checks": [c.as_dict() for c in self.checks]}


def check(ctx: Context, *, strict: bool = False) -> CheckResult:
    """Run every pre-flight check. Never writes, never raises for a failing check.

    Exit code: the class of the worst failing row by stop rank (SPEC §7: data_integrity >
    internal > refusal > schema_drift > retryable > generic); pending revisions fail with
    ``RIVET_STATE_MIGRATION_PENDING`` (3). With ``strict``, ``warn`` rows fail as refusal (5).
    """
    pf = run_preflight(ctx)
    rows = pf.checks
    if strict:
        rows = [Check(c.id, "fail", c.message, c.code) if c.status == "warn" else c for c in rows]
    classes = [REGISTRY[c.code].exit_class if c.code in REGISTRY else "refusal"
               for c in rows if c.status == "fail" and c.code]
    worst = max(classes, key=lambda k: STOP_RANK[k], default=None)
    return CheckResult(rows, EXIT_CODES[worst] if worst else 0)
