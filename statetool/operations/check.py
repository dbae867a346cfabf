"""``statetool check``: the CI pre-flight (SPEC §8), read-only and byte-identical; with
``--target pods``, also the pod rule of ADR-0039 D5 (issue 15 item 6)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from statetool.errors import REGISTRY, StateError, failure_exit_code, unit_failure, worst
from statetool.operations.checkpoints import checkpoints, shared_checkpoint
from statetool.operations.context import Context
from statetool.operations.preflight import Check, Preflight, run_preflight

#: Where ``check --target`` can be told the next run will run (docs/decisions.md, "The pod
#: rule: check --target pods").
TARGETS = ("pods",)
#: How the ``pods`` row says where a position that passes the pod rule lives (a ``file``
#: that passes is one with no file there: no position yet).
_POSITION_PLACES = {"state": "in the state", "server_slot": "in its replication slot",
                    "unknown": "not known (the state or its position row could not be read)"}


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
        export (``doctor:<export>``, ``pods:<export>``) as :func:`~statetool.errors.unit_failure`."""
        return [unit_failure(c.id.split(":", 1)[1], c.code, c.message, c.error) for c in self.checks
                if c.status == "fail" and c.code and ":" in c.id]

    def as_dict(self) -> dict[str, object]:
        """``{"ok": bool, "checks": [{id, status, code, message, action}, ...]}``."""
        return {"ok": self.ok, "checks": [c.as_dict() for c in self.checks]}


def require_target(target: str | None) -> None:
    """``RIVET_CLI_USAGE`` for a ``check --target`` that is not one of :data:`TARGETS`
    (asked before anything is read, for one pipeline or a fleet)."""
    if target is not None and target not in TARGETS:
        raise StateError("RIVET_CLI_USAGE", f"--target {target!r} is not a target statetool knows; known: "
                         f"{', '.join(TARGETS)}", {"target": target})


def check(ctx: Context, *, strict: bool = False, target: str | None = None) -> CheckResult:
    """Run every pre-flight check. Never writes, never raises for a failing check.

    Besides the pre-flight rows, CDC exports sharing one checkpoint file fail row
    ``checkpoints`` (:func:`_shared_rows`), and ``doctor``'s findings are rows too (``doctor`` and
    ``doctor:<export>``). With ``target`` ``"pods"`` (one of :data:`TARGETS`), the pod rule
    adds rows ``pods`` and ``pods:<export>`` (:func:`pod_rows`). Exit code: the class of the worst failing row
    (:func:`statetool.errors.worst`, SPEC §7: data_integrity > internal > refusal > schema_drift > retryable >
    generic); pending revisions fail with ``RIVET_STATE_MIGRATION_PENDING`` (3). With ``strict``, ``warn`` rows
    fail, as refusal (5, :func:`statetool.errors.failure_class`). A failing ``config`` row
    (a config not found, or one that exists and does not parse or validate:
    ``RIVET_CONFIG_INVALID``) decides the exit code and :attr:`CheckResult.worst` alone,
    whatever the state's rows say (a state missing beside it is not what to fix first).
    Raises ``RIVET_CLI_USAGE`` for a ``target``
    that is not one of :data:`TARGETS`, before anything is read.
    """
    require_target(target)
    pf = run_preflight(ctx)
    # doctor reads the config: with a config that failed its row there is nothing more to diagnose.
    config_read = not any(c.id == "config" and c.status == "fail" for c in pf.checks)
    shared = _shared_rows(ctx, pf, config_read)
    rows = pf.checks + shared + (_doctor_rows(ctx, pf, shared) if pf.snapshot is not None and config_read else [])
    if target == "pods":
        rows += pod_rows(ctx, pf, config_read)
    if strict:
        rows = [Check(c.id, "fail", c.message, c.code, c.error) if c.status == "warn" else c for c in rows]
    failed = [c for c in rows if c.status == "fail" and c.code]
    # A config that cannot be read decides: nothing else is judged against it (docs/commands.md).
    failed = [c for c in failed if c.id == "config"] or failed
    code = worst([c.code for c in failed if c.code])
    row = next((c for c in reversed(failed) if c.code == code), None)
    return CheckResult(rows, failure_exit_code(code) if code else 0, row)


def _shared_rows(ctx: Context, pf: Preflight, config_read: bool) -> list[Check]:
    """Row ``checkpoints``, failing ``RIVET_STATE_CHECKPOINT_SHARED`` when CDC exports of
    this one config share a checkpoint file (:func:`~statetool.operations.checkpoints.shared_checkpoint`),
    whatever the state; no row when each has its own, or the location or config did not resolve."""
    if not config_read or any(c.id == "location" and c.status == "fail" for c in pf.checks):
        return []
    err = shared_checkpoint(ctx)
    return [] if err is None else [Check("checkpoints", "fail", err.message, err.code, err)]


def _doctor_rows(ctx: Context, pf: Preflight, before: list[Check]) -> list[Check]:
    """What ``doctor`` finds beyond the pre-flight rows and the rows ``before`` it (a shared
    checkpoint file is row ``checkpoints`` once, not again per export): lost or unreadable CDC checkpoints
    (fail), exports with no progress, relative checkpoints under PostgreSQL, ephemeral or
    network state directories, orphaned -wal/-shm files (warn). Where doctor can give no
    verdict (a checkpoint file this user may not read, a state row that holds no position),
    its error is row ``doctor``, failing with its own code: never a first run."""
    from statetool.operations.doctor import doctor

    seen = {c.code for c in pf.checks + before if c.code}
    rows: list[Check] = []
    reported: set[tuple[str, str]] = set()
    try:
        diagnoses = doctor(ctx).exports
    except StateError as err:
        return [] if err.code in seen else [Check("doctor", "fail", err.message, err.code, err)]
    for diagnosis in diagnoses:
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


def pod_rows(ctx: Context, pf: Preflight, config_read: bool) -> list[Check]:
    """The pod rule (ADR-0039 D5, issue 15 item 6): what a pod needs that a long-lived host
    does not, since whatever a pod keeps on its own disk, or on a volume bound to it, is
    gone or left behind when the next run starts on another pod.

    Row ``pods`` is about the state: it fails ``RIVET_STATE_SQLITE_ON_POD`` (refusal, 5)
    when the state is a SQLite file, whatever its directory (a SQLite state is a file on
    one disk; the pod's own or one volume's, it is not where the next pod runs), and is
    ``ok`` under PostgreSQL, naming where each CDC export's position lives. Under
    PostgreSQL, row ``pods:<export>`` fails ``RIVET_STATE_CHECKPOINT_ON_POD_DISK``
    (refusal, 5) for each CDC export whose position is in a checkpoint file that is there,
    relative or absolute (``stored_in`` ``file``, :func:`~statetool.operations.checkpoints.checkpoints`);
    a position in the state, or in a postgres stream's replication slot, passes, and so
    does an export with no position anywhere yet (its first is committed into the state;
    ``doctor``'s rows say whether that is a first run or a lost file). ``pods`` is
    ``skip`` when the location, the config or the state could not be read."""
    if any(c.id == "location" and c.status == "fail" for c in pf.checks):
        return [Check("pods", "skip", "no state location: the pod rule needs one")]
    if ctx.location.backend == "sqlite":
        message = (f"the state is a SQLite file, {ctx.location.display}: on a pod it is on the pod's own disk or on "
                   "one volume, and a pod started without it starts every export from an empty state (a CDC "
                   "stream re-anchors, the changes in between are lost without an error); a pod needs the state "
                   "in PostgreSQL")
        error = StateError("RIVET_STATE_SQLITE_ON_POD", message, {"state": ctx.location.display})
        return [Check("pods", "fail", error.message, error.code, error)]
    if not config_read or pf.snapshot is None:
        return [Check("pods", "skip", "the config or the state could not be read: where each CDC position lives "
                                      "is not known")]
    rows: list[Check] = []
    where: list[str] = []
    for report in checkpoints(ctx).checkpoints:
        if report.stored_in == "file" and report.path is not None and report.present:
            message = (f"CDC export {report.export} keeps its position in the file {report.path}, on the pod's "
                       "own disk or on a volume mounted into it, not in the state in PostgreSQL: a pod started "
                       "without that file re-anchors the stream, and the changes in between are lost without an "
                       "error. Move the position into the state with statetool checkpoints import --export "
                       f"{shlex.quote(report.export)}")
            error = StateError("RIVET_STATE_CHECKPOINT_ON_POD_DISK", message,
                               {"export": report.export, "path": report.path})
            rows.append(Check(f"pods:{report.export}", "fail", error.message, error.code, error))
            continue
        where.append(f"{report.export} {_POSITION_PLACES.get(report.stored_in, 'no position yet')}")
    summary = "the state is in PostgreSQL, shared by every pod"
    if where:
        summary += "; CDC positions: " + ", ".join(where)
    return [Check("pods", "ok", summary), *rows]
