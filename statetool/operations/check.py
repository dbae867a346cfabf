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
    worst: Check | None = None

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
    failed = [c for c in rows if c.status == "fail" and c.code]
    worst = max(reversed(failed), key=lambda c: STOP_RANK[_exit_class(c.code)], default=None)
    return CheckResult(rows, EXIT_CODES[_exit_class(worst.code)] if worst and worst.code else 0, worst)


def _exit_class(code: str | None) -> str:
    """A registered code's class; a warning failed by ``--strict`` is a refusal."""
    return REGISTRY[code].exit_class if code in REGISTRY else "refusal"
