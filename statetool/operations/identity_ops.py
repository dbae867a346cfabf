"""``statetool identity show | adopt | rekey`` (SPEC §3).

``adopt`` and ``rekey`` are planned first (:func:`~statetool.operations.writes.plan_write`),
by the one function their ``--dry-run`` returns the plan of."""

from __future__ import annotations

from dataclasses import dataclass, field

from statetool.errors import StateError, StateWarning
from statetool.identity import identity_message, identity_verdict, state_key
from statetool.operations.context import Context
from statetool.operations.preflight import DESCRIBABLE, Preflight, raise_failures, require, run_preflight
from statetool.operations.probe import recorded_key
from statetool.operations.writes import WHOLE_STATE, WritePlan, plan_write, write_planned
from statetool.redact import mask_userinfo

_SCOPES = ("declared_dir", "beside_config", "shared")
#: The pre-flight refusal a re-key passes: a foreign key is what it changes on purpose.
_REKEY_ALLOWS = frozenset({"RIVET_STATE_FOREIGN"})


@dataclass
class IdentityResult:
    """Recorded and computed keys, this scope's verdict, and what each scope would do."""

    recorded: str | None
    computed: str
    scope: str
    verdict: str
    code: str | None
    message: str
    by_scope: dict[str, str] = field(default_factory=dict)
    changed: bool = False
    warnings: list[StateWarning] = field(default_factory=list)
    #: A dry run of adopt or rekey: nothing was changed (``changed`` false, ``recorded``
    #: what the state records now); ``plan`` says what the real run would write.
    dry_run: bool = False
    #: The plan of adopt or rekey (:meth:`~statetool.operations.writes.WritePlan.as_dict`);
    #: None for ``identity show``.
    plan: dict[str, object] | None = None

    def as_dict(self) -> dict[str, object]:
        """JSON shape: keys, scope, verdict, code, message, by_scope, changed, warnings, and
        for adopt and rekey (whose ``plan`` is set) dry_run and plan."""
        doc: dict[str, object] = {"recorded": self.recorded, "computed": self.computed, "scope": self.scope,
                                  "verdict": self.verdict, "code": self.code, "message": self.message,
                                  "by_scope": self.by_scope, "changed": self.changed,
                                  "warnings": [w.as_dict() for w in self.warnings]}
        if self.plan is not None:
            doc.update(dry_run=self.dry_run, plan=self.plan)
        return doc


def show(ctx: Context) -> IdentityResult:
    """Read the recorded key and compute this config's; say what a write would do. Read-only."""
    pf = run_preflight(ctx)
    raise_failures(pf, allow=DESCRIBABLE - {"RIVET_STATE_MISSING"})
    snap = pf.snapshot
    assert snap is not None
    computed = ctx.computed_key
    progress = snap.has_progress
    verdict = identity_verdict(snap.recorded_key, computed, ctx.location.scope, progress)
    where = str(ctx.location.directory or ctx.location.display)
    by_scope = {s: identity_verdict(snap.recorded_key, computed, s, progress).action for s in _SCOPES}
    return IdentityResult(snap.recorded_key, computed, ctx.location.scope, verdict.action, verdict.code,
                          identity_message(verdict, where, for_write=False), by_scope,
                          warnings=[w for w in pf.warnings if w.code == "RIVET_STATE_HOT_JOURNAL"])


def adopt(ctx: Context, *, dry_run: bool = False) -> IdentityResult:
    """Record this config's key on a state that has none (stamp, or adopt with a warning).

    Raises ``RIVET_STATE_KEY_UNCOMPUTABLE`` (no source URL), ``RIVET_STATE_FOREIGN``
    (declared directory, another key recorded), ``RIVET_STATE_IDENTITY_MISMATCH``
    (another key recorded elsewhere: use rekey), and every pre-flight code. ``dry_run``
    makes the same checks and returns the plan (the key none -> this config's, the leases
    of the whole state); it writes nothing and creates no file.
    """
    if not ctx.computed_key:
        raise StateError("RIVET_STATE_KEY_UNCOMPUTABLE", "the config's source URL is not set here; nothing to adopt")

    def unclaimed(recorded: str | None) -> None:
        if recorded and recorded != ctx.computed_key:
            raise StateError("RIVET_STATE_IDENTITY_MISMATCH",
                             f"the state already records {recorded}; to change it on purpose run "
                             f"statetool identity rekey --old {recorded} --new {ctx.computed_key}")

    pf = run_preflight(ctx, for_write=True)
    snap = require(pf)
    unclaimed(snap.recorded_key)
    if snap.recorded_key == ctx.computed_key:  # nothing to write: no lease, no audit row
        return _unchanged(show_after(ctx, snap.recorded_key, changed=False), pf, dry_run)
    plan = plan_write(ctx, WHOLE_STATE, preflight=pf, dry_run=dry_run)
    if dry_run:
        return _planned(ctx, snap.recorded_key, plan, f"adopt would record {ctx.computed_key} "
                        f"(was {snap.recorded_key or 'none'})")
    with write_planned(ctx, plan) as session:
        unclaimed(recorded_key(session.reader))  # another writer may have claimed it meanwhile
        result = show_after(ctx, snap.recorded_key, changed=True)
        result.warnings = session.warnings
        result.plan = plan.as_dict()
        return result


def _unchanged(result: IdentityResult, pf: Preflight, dry_run: bool) -> IdentityResult:
    """``result`` of a write that has nothing to change (the key is recorded already): its
    plan is empty, its dry run the same as its real run."""
    result.dry_run, result.plan = dry_run, WritePlan(pf).as_dict()
    return result


def _planned(ctx: Context, recorded: str | None, plan: WritePlan, would: str) -> IdentityResult:
    """The result of a dry run of adopt or rekey: nothing changed, ``recorded`` as the state
    records it now, the ``plan``, and ``would`` (what the real run would do) in the message."""
    verdict = plan.preflight.verdict
    return IdentityResult(recorded, ctx.computed_key, ctx.location.scope, verdict.action if verdict else "skip",
                          verdict.code if verdict else None, f"dry run: nothing was changed; {would}",
                          warnings=plan.warnings, dry_run=True, plan=plan.as_dict())


def show_after(ctx: Context, previous: str | None, *, changed: bool) -> IdentityResult:
    """The identity result after a write that left ``ctx.computed_key`` recorded."""
    verb = "recorded" if changed else "already recorded"
    return IdentityResult(ctx.computed_key, ctx.computed_key, ctx.location.scope, "ok", None,
                          f"{verb} {ctx.computed_key} (was {previous or 'none'})", changed=changed)


def rekey(ctx: Context, old: str, new: str | None = None, reason: str = "", *, dry_run: bool = False
          ) -> IdentityResult:
    """Deliberately change the recorded key from ``old`` to ``new`` (default: this config's key).

    For a source that moved (new host, new port). Refuses ``RIVET_STATE_IDENTITY_MISMATCH``
    when the recorded key is not exactly ``old``; writes an audit row with both keys and
    ``reason``. The pre-flight's identity refusal does not apply (re-keying is the point).
    A ``new`` whose key is ``old`` changes nothing: the recorded key is checked, and no
    lease, backup or audit row is taken or written (``changed`` false; issue 12,
    docs/decisions.md "State identity"). ``dry_run`` makes the same checks and returns
    the plan (the key old -> new, the leases of the whole state, the audit row); it writes
    nothing and creates no file.
    """
    # --new may be a key or a source URL: record its canonical key, never a user or password.
    target = state_key(new) if new else ctx.computed_key
    if new and not target:
        raise StateError("RIVET_STATE_KEY_UNCOMPUTABLE", f"--new '{mask_userinfo(new)}' is neither a state key nor a source URL "
                         "(scheme://host[:port]/database)")
    if not target:
        raise StateError("RIVET_STATE_KEY_UNCOMPUTABLE", "give --new, or set the config's source URL")

    def recorded_is_old(recorded: str | None) -> None:
        if recorded != old:
            raise StateError("RIVET_STATE_IDENTITY_MISMATCH",
                             f"the state records {recorded or 'no key'}, not {old}; nothing was changed")

    if target == old:  # a re-key to the same key is no change: say so, write nothing
        pf = run_preflight(ctx, for_write=True)
        recorded_is_old(require(pf, allow=_REKEY_ALLOWS).recorded_key)
        return _unchanged(IdentityResult(old, ctx.computed_key, ctx.location.scope, "ok", None,
                                         f"the state already records {old}: a re-key to the same key changes "
                                         "nothing"), pf, dry_run)
    plan = plan_write(ctx, WHOLE_STATE, "identity.rekey", claim=False, allow=_REKEY_ALLOWS,
                      check=lambda snap: recorded_is_old(snap.recorded_key), dry_run=dry_run)
    plan.change("state_key", old, target)
    if dry_run:
        return _planned(ctx, old, plan, f"rekey would re-key from {old} to {target}")
    with write_planned(ctx, plan) as session:
        recorded_is_old(recorded_key(session.reader))  # another writer may have re-keyed it meanwhile
        session.record_identity(target, "rekey", old=old, reason=reason)
    return IdentityResult(target, ctx.computed_key, ctx.location.scope, "ok", None,
                          f"re-keyed from {old} to {target}", changed=True, plan=plan.as_dict())
