"""``--dry-run`` of the changes (issue 14 item 7): ``exports set-cursor``, ``exports reset``,
``identity adopt``, ``identity rekey`` and ``leases release``, through the real CLI run as a
process, on SQLite and on PostgreSQL.

Each dry run leaves every byte as it was and creates no file (the state directory hashed
and listed before and after, and on PostgreSQL every row of the schema), exits 0 with its
plan, and the plan is what the real run then does: its planned after-values are the state
after the real run, its backup name is the real backup's but for the time, and the real
run plans the same. A dry run refuses what its real run refuses, with the same code.
(A read-only mount, permission and disk faults: tests/test_fault_matrix.py.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from support import describe, error_object, process_env, run_cli_process, tree_digest
from test_migrate import SOURCE_KEY, Target, build_state, target  # noqa: F401 - target is the two-backend fixture
from test_writes import seed_progress

MOVED_KEY = "postgresql://db.moved.internal:5432/sales"
#: What every plan document holds.
PLAN_KEYS = {"changes", "backup", "leases", "audit", "warnings"}
#: The run leases of the exports of test_migrate.EXPORTS_YAML and of seed_progress, sorted.
RUN_LEASES = ["chunk-run:customers", "chunk-run:order_events", "chunk-run:order_lines", "chunk-run:orders",
              "chunk-run:refunds"]


def cli(target: Target, *args: str) -> subprocess.CompletedProcess[str]:
    """The real CLI, as a process, on ``target``'s state (``--lock-wait 0``: nothing waits)."""
    return run_cli_process("-c", str(target.config), "--lock-wait", "0", *args, env=target.env)


def everything(target: Target) -> dict[str, Any]:
    """Every byte a write could change: each file and directory below the pipeline's
    directory (a SQLite state, its companions, lease sidecars, backups) with its sha256,
    and on PostgreSQL every table and row of the state's schema."""
    digests = tree_digest(target.directory)
    listing = sorted((str(p.relative_to(target.directory)), digests.get(str(p.relative_to(target.directory)), "dir"))
                     for p in target.directory.rglob("*"))
    return {"files": listing, "database": target.dump() if target.kind == "postgres" else None}


def dry_then_real(target: Target, *args: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``args --dry-run --json``, check it changed nothing, then the real run; both docs."""
    before = everything(target)
    dry = cli(target, "--json", *args, "--dry-run")
    assert dry.returncode == 0, describe(dry)
    assert everything(target) == before, f"the dry run of {args} changed the state\n{describe(dry)}"
    human = cli(target, *args, "--dry-run")
    assert human.returncode == 0 and "Dry run: nothing was changed" in human.stdout, describe(human)
    assert everything(target) == before, f"the dry run of {args}, for people, changed the state"
    real = cli(target, "--json", *args)
    assert real.returncode == 0, describe(real)
    dry_doc, real_doc = json.loads(dry.stdout), json.loads(real.stdout)
    assert dry_doc["dry_run"] is True and real_doc["dry_run"] is False, describe(dry)
    assert set(dry_doc) == set(real_doc), "a dry run's document has the real run's keys"
    assert set(dry_doc["plan"]) == PLAN_KEYS, dry_doc
    assert real_doc["plan"] == dry_doc["plan"], "the real run planned what its dry run printed"
    return dry_doc, real_doc


def change(plan: dict[str, Any], what: str) -> tuple[Any, Any]:
    """``(before, after)`` of the plan's change row ``what``."""
    (row,) = [row for row in plan["changes"] if row["what"] == what]
    return row["before"], row["after"]


def exports_row(target: Target, name: str) -> dict[str, Any]:
    (row,) = [row for row in target.rows("rivet_exports") if row["export_name"] == name]
    return row


def count(target: Target, table: str, export: str) -> int:
    return sum(1 for row in target.rows(table) if row["export_name"] == export)


def new_audit_actions(target: Target, before: int) -> list[str]:
    """The actions of the audit rows after the first ``before``, oldest first."""
    return [row["action"] for row in sorted(target.rows("rivet_audit"), key=lambda r: r["id"])][before:]


def assert_backup_as_planned(target: Target, dry: dict[str, Any], real: dict[str, Any]) -> None:
    """SQLite: the real backup's path is the planned one with its time; PostgreSQL: none."""
    if target.kind == "postgres":
        assert dry["plan"]["backup"] is None and real["backup"] is None, real
        return
    planned = dry["plan"]["backup"]
    assert planned.startswith(str(target.directory)) and planned.endswith("-YYYYmmddTHHMMSSZ"), planned
    pattern = re.escape(planned).replace("YYYYmmddTHHMMSSZ", r"\d{8}T\d{6}Z")
    assert re.fullmatch(pattern, real["backup"]), (planned, real["backup"])
    assert dry["backup"] is None, "a dry run takes no backup"


# -- what each dry run plans, and the real run does ----------------------------------------


def test_set_cursor_dry_run_changes_nothing_and_plans_the_cursor_backup_and_lease(target: Target) -> None:
    seed_progress(target)
    old = exports_row(target, "orders")["cursor_value"]
    audits = len(target.rows("rivet_audit"))
    dry, real = dry_then_real(target, "exports", "set-cursor", "orders", "2026-04-15T00:00:00Z")

    assert change(dry["plan"], "cursor") == (old, "2026-04-15T00:00:00Z"), dry
    assert (dry["before"], dry["after"]) == (real["before"], real["after"]) == (
        {"cursor": old}, {"cursor": "2026-04-15T00:00:00Z"}), dry
    assert dry["plan"]["leases"] == [{"key": "chunk-run:orders", "state": "free", "holder": None}], dry
    assert dry["plan"]["audit"] == ["exports.set-cursor"] and dry["diagnosis"] is None, dry
    assert exports_row(target, "orders")["cursor_value"] == change(dry["plan"], "cursor")[1]
    assert new_audit_actions(target, audits) == dry["plan"]["audit"]
    assert_backup_as_planned(target, dry, real)


def test_reset_dry_run_counts_the_checkpoints_it_would_delete_and_the_history_it_keeps(target: Target) -> None:
    seed_progress(target)
    runs, ledger = count(target, "rivet_runs", "order_lines"), count(target, "rivet_load_ledger", "order_lines")
    assert (count(target, "rivet_chunks", "order_lines"), ledger) == (5, 3)
    audits = len(target.rows("rivet_audit"))
    dry, real = dry_then_real(target, "exports", "reset", "order_lines")

    plan = dry["plan"]
    assert change(plan, "cursor") == ("40", None) and change(plan, "chunk checkpoints") == (5, 0), plan
    assert change(plan, "runs") == (runs, runs) and change(plan, "load-ledger rows") == (ledger, ledger), plan
    assert dry["before"] == real["before"] == {"cursor": "40", "chunks": 5}, (dry, real)
    assert exports_row(target, "order_lines")["cursor_value"] is change(plan, "cursor")[1]
    assert count(target, "rivet_chunks", "order_lines") == change(plan, "chunk checkpoints")[1]
    assert count(target, "rivet_runs", "order_lines") == change(plan, "runs")[1]
    assert count(target, "rivet_load_ledger", "order_lines") == change(plan, "load-ledger rows")[1]
    assert count(target, "rivet_chunks", "customers") == 3, "another export's checkpoints are not planned nor touched"
    assert new_audit_actions(target, audits) == plan["audit"] == ["exports.reset"]
    assert_backup_as_planned(target, dry, real)


def test_rekey_dry_run_plans_the_key_old_to_new_and_every_lease_of_the_whole_state(target: Target) -> None:
    seed_progress(target)
    audits = len(target.rows("rivet_audit"))
    dry, real = dry_then_real(target, "identity", "rekey", "--old", SOURCE_KEY, "--new", MOVED_KEY,
                              "--reason", "the source moved")

    assert change(dry["plan"], "state_key") == (SOURCE_KEY, MOVED_KEY), dry
    assert (dry["recorded"], dry["changed"], real["recorded"], real["changed"]) == (SOURCE_KEY, False, MOVED_KEY,
                                                                                    True), (dry, real)
    assert [lease["key"] for lease in dry["plan"]["leases"]] == ["state:exclusive", *RUN_LEASES], dry
    assert dry["plan"]["backup"] is None and dry["plan"]["audit"] == ["identity.rekey"], dry
    (identity,) = target.rows("rivet_identity")
    assert identity["state_key"] == change(dry["plan"], "state_key")[1]
    assert new_audit_actions(target, audits) == dry["plan"]["audit"]


def test_adopt_dry_run_plans_none_to_this_configs_key_with_the_warning_the_real_run_gives(target: Target) -> None:
    seed_progress(target)
    engine = target.engine()
    try:
        with engine.begin() as conn:  # a state an older release left without an identity
            conn.execute(sa.text("DELETE FROM rivet_identity"))
    finally:
        engine.dispose()
    audits = len(target.rows("rivet_audit"))
    dry, real = dry_then_real(target, "identity", "adopt")

    assert change(dry["plan"], "state_key") == (None, SOURCE_KEY), dry
    assert dry["plan"]["audit"] == ["identity.adopt"] and dry["recorded"] is None and not dry["changed"], dry
    assert [w["code"] for w in dry["warnings"]] == ["RIVET_STATE_IDENTITY_ADOPTED"], dry
    assert [w["code"] for w in real["warnings"]] == ["RIVET_STATE_IDENTITY_ADOPTED"], real
    (identity,) = target.rows("rivet_identity")
    assert identity["state_key"] == change(dry["plan"], "state_key")[1]
    assert new_audit_actions(target, audits) == dry["plan"]["audit"]
    again = cli(target, "--json", "identity", "adopt", "--dry-run")  # recorded now: nothing to plan
    assert again.returncode == 0 and json.loads(again.stdout)["plan"]["changes"] == [], describe(again)


# -- leases: a holder that is gone, and one that lives ---------------------------------------


@pytest.fixture
def holder(target: Target) -> Iterator[Any]:
    """``start()``: a ``leases run --export orders -- sleep 300`` process in a session of
    its own, returned once its lease shows live; every one started is SIGKILLed at the end."""
    started: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-m", "statetool", "-c", str(target.config), "leases", "run",
                                 "--export", "orders", "--", "sleep", "300"], env=process_env(target.env),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        started.append(proc)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if lease_state(target, "chunk-run:orders") == "live":
                return proc
            time.sleep(0.1)
        pytest.fail("the lease holder never showed as live")

    yield start
    for proc in started:
        with_group_killed(proc)


def with_group_killed(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc``'s process group (the wrapper; its command dies with it) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def lease_state(target: Target, key: str) -> str:
    listing = cli(target, "--json", "leases", "list")
    assert listing.returncode == 0, describe(listing)
    return next((row["state"] for row in json.loads(listing.stdout)["leases"] if row["key"] == key), "free")


def test_release_dry_run_names_the_stale_holder_it_would_remove_and_the_real_run_removes_it(
        target: Target, holder: Any) -> None:
    seed_progress(target)
    gone = holder()
    with_group_killed(gone)
    assert lease_state(target, "chunk-run:orders") == "stale"
    audits = len(target.rows("rivet_audit"))
    dry, real = dry_then_real(target, "leases", "release", "chunk-run:orders", "--reason", "worker rebooted")

    assert dry["released"]["holder_pid"] == real["released"]["holder_pid"] == gone.pid, (dry, real)
    assert change(dry["plan"], "lease chunk-run:orders") == ("stale", "free"), dry
    assert dry["plan"]["leases"] == [] and dry["plan"]["backup"] is None, dry
    assert lease_state(target, "chunk-run:orders") == change(dry["plan"], "lease chunk-run:orders")[1]
    assert new_audit_actions(target, audits) == dry["plan"]["audit"] == ["leases.release"]


def test_a_dry_run_shows_a_live_lease_the_real_run_would_wait_for(target: Target, holder: Any) -> None:
    """What changes with time (a run holding the export's lease) is no refusal of the plan:
    the plan shows the lease live, with its holder, and the real run (``--lock-wait 0``)
    is refused ``RIVET_STATE_RUN_IN_PROGRESS``."""
    seed_progress(target)
    running = holder()
    before = everything(target)
    dry = cli(target, "--json", "exports", "set-cursor", "orders", "2026-04-15T00:00:00Z", "--dry-run")
    assert dry.returncode == 0, describe(dry)
    (lease,) = json.loads(dry.stdout)["plan"]["leases"]
    assert (lease["key"], lease["state"]) == ("chunk-run:orders", "live") and "sleep 300" in lease["holder"], lease
    assert f"pid {running.pid}" in lease["holder"], lease
    real = cli(target, "--json-errors", "exports", "set-cursor", "orders", "2026-04-15T00:00:00Z")
    assert error_object(real)["code"] == "RIVET_STATE_RUN_IN_PROGRESS", describe(real)
    assert everything(target) == before


# -- a dry run refuses what its real run refuses -------------------------------------------


REFUSALS = {
    "set-cursor of an unknown export": (("exports", "set-cursor", "nope", "5"), "RIVET_EXPORT_UNKNOWN"),
    "reset of an unknown export": (("exports", "reset", "nope"), "RIVET_EXPORT_UNKNOWN"),
    "an empty cursor": (("exports", "set-cursor", "orders", " "), "RIVET_CLI_USAGE"),
    "rekey from a key not recorded": (("identity", "rekey", "--old", MOVED_KEY, "--new", SOURCE_KEY),
                                      "RIVET_STATE_IDENTITY_MISMATCH"),
    "adopt beside another key": (("identity", "adopt"), "RIVET_STATE_IDENTITY_MISMATCH"),
    "release of a lease never taken": (("leases", "release", "load-table:dw.nothing"), "RIVET_STATE_LEASE_UNKNOWN"),
    "release of a malformed key": (("leases", "release", "orders"), "RIVET_STATE_LEASE_KEY_INVALID"),
}


def assert_refused_alike(target: Target, args: tuple[str, ...], code: str) -> None:
    """The dry run and then the real run of ``args`` both refused ``code``, nothing changed."""
    before = everything(target)
    for dry_run in (("--dry-run",), ()):
        proc = cli(target, "--json-errors", *args, *dry_run)
        assert proc.returncode != 0 and error_object(proc)["code"] == code, describe(proc)
        assert everything(target) == before, f"{' '.join(args + dry_run)} changed the state"


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_dry_run_refuses_what_its_real_run_refuses_and_changes_nothing(target: Target, case: str) -> None:
    seed_progress(target)
    args, code = REFUSALS[case]
    if case == "adopt beside another key":
        ok = cli(target, "identity", "rekey", "--old", SOURCE_KEY, "--new", MOVED_KEY)
        assert ok.returncode == 0, describe(ok)
    assert_refused_alike(target, args, code)


def test_a_dry_run_refuses_a_live_holders_release_as_the_real_run(target: Target, holder: Any) -> None:
    seed_progress(target)
    holder()
    assert_refused_alike(target, ("leases", "release", "chunk-run:orders"), "RIVET_STATE_RUN_IN_PROGRESS")


@pytest.mark.parametrize("args", [("exports", "set-cursor", "orders", "5"), ("exports", "reset", "orders"),
                                  ("identity", "adopt"), ("identity", "rekey", "--old", SOURCE_KEY),
                                  ("leases", "release", "chunk-run:orders")], ids=" ".join)
def test_every_dry_run_runs_the_pre_flight_of_its_real_run(target: Target, args: tuple[str, ...]) -> None:
    """A state below head: the write pre-flight refuses the dry run and the real run alike."""
    build_state(target, "0003")
    assert_refused_alike(target, args, "RIVET_STATE_MIGRATION_PENDING")
