"""``statetool prune``: history retention (issue 16 item 2; SPEC §3, §5, §5a).

Real states on both backends, filled the way runs leave them (the runtime API, and many
rows at once through the state's own writer), pruned by the CLI. What must hold, each
tested here: the rows the options reach go, in batches, each audited; the latest
succeeded run of an export, an unfinished run, a run with chunk checkpoints and the ledger
rows a resumed chunked run needs stay, and so does the newest ledger row of an export whose
only progress is its ledger (the progress rule, so no export's next run becomes a first
run); cursors, chunk checkpoints and CDC positions are never touched; the archive holds
exactly the removed rows, each fsynced before its batch committed; a dry run changes no
byte; a live run of another export (a real process committing cursors in a loop) is never
held off a second, and its own export is skipped; a SIGKILL at a batch boundary or in the
middle of one leaves a state that passes ``check``, an archive holding every removed row,
and a re-run that goes on. The JSON document is validated against
docs/schemas/prune.schema.json.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from support import describe, error_object, fork_call, process_env, run_cli, run_cli_forked, tree_digest, write_config
from support.backends import StateBackend
from support.crash_driver import run_killed_at
from statetool.cli import command_tree
from statetool.operations.retention import DEFAULT_BATCH, MAX_BATCH
from support.files import declare_export
from support.history import (PRUNED, UNTOUCHED, bulk_history, committed_batches, read_archive, stamp, store_of,
                             table_rows)
from test_pg_faults import _sql, _url_as

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "docs" / "schemas" / "prune.schema.json").read_text())
#: A --before that reaches every row the history holds.
LATE = "2025-03-01"
Rows = dict[str, dict[Any, dict[str, Any]]]


def _history(backend: StateBackend) -> tuple[Path, dict[str, str]]:
    """A pipeline whose state holds the history of four exports (see the module docstring):
    orders (a cursor; 120 runs, then three newer runs that all failed), order_lines (chunked:
    80 runs and 90 ledger rows, a finished run with its chunk checkpoints, and a run
    interrupted after its first chunk, started on day 3), order_events (CDC: 40 runs and a
    position in the state), ledger_only (60 ledger rows, nothing else)."""
    config = write_config(backend.pipeline)
    declare_export(config, "ledger_only")
    env = process_env(backend.env)
    store = store_of(config, env)
    bulk_history(config, env, "orders", 120, 0)
    bulk_history(config, env, "order_lines", 80, 90, mode="chunked")
    bulk_history(config, env, "order_events", 40, 0, first_day=5, mode="cdc")
    bulk_history(config, env, "ledger_only", 0, 60, first_day=2)
    with store.run("orders", "incremental") as run:
        run.commit_cursor("2025-02-01T00:00:00Z")
        for i in range(3):
            failed = run.start_run(started_at=stamp(20, i * 60))
            run.finish_run(failed, "failed", finished_at=stamp(20, i * 60 + 30))
    with store.run("order_lines", "chunked") as run:
        done = run.start_run(started_at=stamp(2, 7))
        run.record_chunk(done, 0, "0", "10", "done", rows=10)
        run.finish_run(done, "succeeded", finished_at=stamp(2, 70))
        interrupted = run.start_run(started_at=stamp(3))
        run.record_chunk(interrupted, 0, "0", "100", "done", rows=100)
        run.record_chunk(interrupted, 1, "100", "200", "pending")
    with store.run("order_events", "cdc") as run:
        run.commit_position({"file": "mysql-bin.000042", "pos": 91234})
    return config, env


def _expected_removal(rows: Rows, *, before: str | None = None, keep: int | None = None) -> dict[str, set[Any]]:
    """The keys of the rows a prune with these options removes, by the rules of issue 16 as
    docs/commands.md states them, computed here from a dump of the state (not by statetool)."""
    runs, ledger = rows["rivet_runs"].values(), rows["rivet_load_ledger"].values()
    chunks = list(rows["rivet_chunks"].values())
    cursors = {r["export_name"]: r["cursor_value"] for r in rows["rivet_exports"].values()}
    gone: dict[str, set[Any]] = {"rivet_runs": set(), "rivet_load_ledger": set()}
    for export in {r["export_name"] for r in runs} | {r["export_name"] for r in ledger}:
        mine = sorted((r for r in runs if r["export_name"] == export), key=lambda r: (r["started_at"], r["run_id"]))
        newest = mine[::-1]
        kept_ids = {r["run_id"] for r in newest[:keep]} if keep else set()
        succeeded = [r["started_at"] for r in mine if r["status"] == "succeeded"]
        chunked = {c["run_id"] for c in chunks if c["export_name"] == export}
        pending = {c["run_id"] for c in chunks if c["export_name"] == export and c["status"] != "done"}
        for r in mine:
            reached = (before is None or r["started_at"] < before) and (keep is None or r["run_id"] not in kept_ids)
            if keep is not None and keep > 0 and len(mine) <= keep:
                reached = False
            protected = (r["status"] == "running" or r["finished_at"] is None or r["run_id"] in chunked
                         or (r["status"] == "succeeded" and r["started_at"] == max(succeeded)))
            if reached and not protected:
                gone["rivet_runs"].add(r["run_id"])
        resumed = [r["started_at"] for r in mine if r["run_id"] in pending or
                   (r["mode"] == "chunked" and (r["status"] == "running" or r["finished_at"] is None))]
        rows_of = sorted((l for l in ledger if l["export_name"] == export), key=lambda l: l["id"])
        only_ledger = cursors.get(export) is None and not succeeded and not chunked
        for l in rows_of:
            at = l["loaded_at"]
            reached = (before is None or (at is not None and at < before))
            if keep is not None and keep > 0:
                reached = reached and len(mine) > keep and at is not None and at < newest[keep - 1]["started_at"]
            protected = (resumed and at is not None and at >= min(resumed)) or \
                (only_ledger and l["id"] == rows_of[-1]["id"])
            if reached and not protected:
                gone["rivet_load_ledger"].add(l["id"])
    return gone


def _cli(config: Path, env: dict[str, str], *args: str, code: int = 0) -> dict[str, Any]:
    proc = run_cli("-c", str(config), "--json", *args, env=env)
    assert proc.returncode == code, describe(proc)
    doc = json.loads(proc.stdout)
    jsonschema.validate(doc, SCHEMA)
    return doc


def _removed(before: Rows, after: Rows) -> dict[str, set[Any]]:
    return {t: set(before[t]) - set(after[t]) for t in PRUNED}


def _archived(rows: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[Any, dict[str, Any]]]:
    out: dict[str, dict[Any, dict[str, Any]]] = {t: {} for t in PRUNED}
    for table, row in rows:
        out[table][row[PRUNED[table]]] = row
    return out


def _read(archive: Path, config: Path, env: dict[str, str], *, cut_short: bool = False) -> list[tuple[str, Any]]:
    """The archive's rows of the batches that committed (their audit rows say which)."""
    return read_archive(archive, committed_batches(config, env), cut_short=cut_short)


def _verdicts(config: Path, env: dict[str, str]) -> dict[str, Any]:
    proc = run_cli("-c", str(config), "--json", "doctor", env=env)
    return {e["name"]: (e["verdict"], e["reasons"][0]["code"] if e["reasons"] else None)
            for e in json.loads(proc.stdout)["exports"]}


def _audit(config: Path, env: dict[str, str], action: str) -> list[dict[str, Any]]:
    from statetool.operations.context import Context

    backend = Context(config, None, env).backend()
    with backend.reading() as conn:
        return [json.loads(r[0]) for r in conn.rows("SELECT detail FROM rivet_audit WHERE action = :a ORDER BY id",
                                                    {"a": action})]


# -- what goes, what stays, what the archive holds --------------------------------------------


def test_prune_removes_what_the_options_reach_keeps_every_protected_row_and_archives_exactly_that(
        state_backend: StateBackend, tmp_path: Path) -> None:
    config, env = _history(state_backend)
    before, verdicts = table_rows(config, env), _verdicts(config, env)
    expected = _expected_removal(before, before=f"{LATE}T00:00:00.000000Z")
    archive = tmp_path / "history.jsonl.gz"
    plan = _cli(config, env, "prune", "--before", LATE, "--archive", str(archive), "--dry-run")
    assert plan["dry_run"] and not archive.exists()
    assert plan["removed"] == {t: len(expected[t]) for t in PRUNED}, plan["removed"]
    doc = _cli(config, env, "prune", "--before", LATE, "--archive", str(archive), "--batch-size", "25")
    after = table_rows(config, env)
    removed = _removed(before, after)
    assert removed == expected, "the rows removed are those the rules let go, no more, no fewer"
    assert doc["removed"] == plan["removed"] and doc["archive"]["rows"] == sum(map(len, removed.values()))
    assert {e["export"]: e["removed"] for e in doc["exports"]} == {e["export"]: e["removed"] for e in plan["exports"]}
    for table in UNTOUCHED:
        assert after[table] == before[table], f"{table} is never touched by a prune"
    kept = after["rivet_runs"]
    assert {"orders-0000118"} <= set(kept), "the latest succeeded run of orders stays, however old"
    assert {r["run_id"] for r in kept.values() if r["export_name"] == "order_lines" and r["status"] != "succeeded"}, \
        "the interrupted chunked run stays"
    assert len([r for r in after["rivet_load_ledger"].values() if r["export_name"] == "ledger_only"]) == 1, \
        "an export whose only progress is its ledger keeps its newest row"
    assert _archived(_read(archive, config, env)) == {t: {k: before[t][k] for k in removed[t]} for t in PRUNED}, \
        "the archive holds exactly the removed rows, as they were"
    assert stat.S_IMODE(os.stat(archive).st_mode) == 0o600
    assert _verdicts(config, env) == verdicts, "no export's next run changed: no first run made"
    audits = _audit(config, env, "prune")
    assert len(audits) == doc["batches"] and all(len(a["removed"]) == 1 for a in audits)
    assert {t: sum(a["removed"].get(t, 0) for a in audits) for t in PRUNED} == doc["removed"]
    assert max(sum(a["removed"].values()) for a in audits) == 25, "batches of --batch-size rows"
    again = _cli(config, env, "prune", "--before", LATE)
    assert again["removed"] == {t: 0 for t in PRUNED} and again["batches"] == 0
    assert len(_audit(config, env, "prune")) == len(audits), "nothing to remove writes nothing"


def test_keep_runs_keeps_the_newest_runs_of_each_export_and_never_a_first_run(state_backend: StateBackend) -> None:
    config, env = _history(state_backend)
    verdicts = _verdicts(config, env)
    before = table_rows(config, env)
    doc = _cli(config, env, "prune", "--keep-runs", "2", "--export", "orders")
    after = table_rows(config, env)
    only_orders = {t: {k: r for k, r in before[t].items() if t not in PRUNED or r["export_name"] == "orders"}
                   for t in before}
    assert _removed(before, after) == _expected_removal(only_orders, keep=2)
    assert [e["export"] for e in doc["exports"]] == ["orders"] and doc["criteria"]["export"] == "orders"
    orders = sorted((r for r in after["rivet_runs"].values() if r["export_name"] == "orders"),
                    key=lambda r: r["started_at"])
    assert len(orders) == 3 and orders[0]["run_id"] == "orders-0000118", \
        "the 2 newest (both failed), and the latest succeeded one, older than them"
    before = after
    _cli(config, env, "prune", "--keep-runs", "0")
    after = table_rows(config, env)
    assert _removed(before, after) == _expected_removal(before, keep=0)
    ledger_only = [r for r in after["rivet_load_ledger"].values() if r["export_name"] == "ledger_only"]
    assert [r["part"] for r in ledger_only] == ["part-0000059"], "the progress rule keeps the newest ledger row"
    assert _verdicts(config, env) == verdicts


def test_a_dry_run_changes_no_byte_and_creates_no_file(state_backend: StateBackend, tmp_path: Path) -> None:
    config, env = _history(state_backend)
    archive = tmp_path / "out" / "archive.gz"
    archive.parent.mkdir()
    rows, files = table_rows(config, env), tree_digest(tmp_path)
    doc = _cli(config, env, "prune", "--keep-runs", "0", "--archive", str(archive), "--vacuum", "--dry-run")
    assert doc["dry_run"] and doc["removed"]["rivet_runs"] > 0 and doc["vacuum"]["ran"] is False
    assert {e["state"] for e in doc["exports"]} == {"planned"}
    assert tree_digest(tmp_path) == files, "every file's bytes as they were, no file added"
    assert table_rows(config, env) == rows and not _audit(config, env, "prune")


def test_what_prune_needs_to_be_told_and_an_unknown_export(tmp_path: Path) -> None:
    config, env = _history(StateBackend.sqlite(tmp_path))
    files = tree_digest(tmp_path)
    for args, words in ((["prune"], "--before DATE and/or --keep-runs N"),
                        (["prune", "--before", "last tuesday"], "no ISO-8601 date"),
                        (["prune", "--keep-runs", "1", "--export", "nope"], "export 'nope'")):
        proc = run_cli("-c", str(config), "--json-errors", *args, env=env)
        assert proc.returncode == 1 and words in error_object(proc)["message"], describe(proc)
    proc = run_cli("-c", str(config), "prune", "--keep-runs", "1", "--batch-size", "0", env=env)
    assert proc.returncode == 1, describe(proc)
    batch = next(p for p in command_tree().commands["prune"].params if p.name == "batch_size")
    assert (batch.default, batch.type.max) == (DEFAULT_BATCH, MAX_BATCH), "the CLI's batch bounds are the operation's"
    assert tree_digest(tmp_path) == files


def test_the_archive_is_a_new_file_never_one_that_is_there_nor_a_link(tmp_path: Path) -> None:
    config, env = _history(StateBackend.sqlite(tmp_path))
    there = tmp_path / "there.gz"
    there.write_text("keep me")
    link = tmp_path / "link.gz"
    link.symlink_to(tmp_path / "nowhere.gz")
    files = tree_digest(tmp_path)
    for archive, code, exit_code in ((there, "RIVET_STATE_TARGET_NOT_EMPTY", 5), (link, "RIVET_STATE_UNSAFE_FILE", 5),
                                     (tmp_path / "no-dir" / "a.gz", "RIVET_CLI_USAGE", 1)):
        proc = run_cli("-c", str(config), "--json-errors", "prune", "--keep-runs", "0", "--archive", str(archive),
                       env=env)
        assert (proc.returncode, error_object(proc)["code"]) == (exit_code, code), describe(proc)
    assert tree_digest(tmp_path) == files and not (tmp_path / "nowhere.gz").exists()


# -- beside a live run --------------------------------------------------------------------------


def _live_run(config: Path, env: dict[str, str], tmp_path: Path) -> tuple[Any, Path, Path]:
    """Start :func:`support.history.live_writer` (a real process) on export orders; returns it
    with its result and stop files once it holds the lease."""
    out, stop = tmp_path / "latencies.json", tmp_path / "stop"
    proc = fork_call("support.history:live_writer", str(config), str(out), str(stop), env=env)
    deadline = time.monotonic() + 30
    while not Path(f"{out}.ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    return proc, out, stop


def _stopped(proc: Any, out: Path, stop: Path) -> dict[str, Any]:
    stop.write_text("1")
    stdout, stderr = proc.communicate(60)
    assert proc.returncode == 0, stderr
    return json.loads(out.read_text())


def test_a_dry_run_beside_a_live_run_skips_its_export_as_the_real_run_does(state_backend: StateBackend,
                                                                           tmp_path: Path) -> None:
    """A fresh user's finding: the dry run counted the export whose run lease was live,
    which the real run then skipped; both now agree, holder and warning included."""
    config, env = _history(state_backend)
    proc, out, stop = _live_run(config, env, tmp_path)
    try:
        plan = run_cli_forked("-c", str(config), "--json", "prune", "--keep-runs", "3", "--dry-run", env=env)
    finally:
        _stopped(proc, out, stop)
    assert plan.returncode == 0, describe(plan)
    doc = json.loads(plan.stdout)
    jsonschema.validate(doc, SCHEMA)
    orders = {e["export"]: e for e in doc["exports"]}["orders"]
    assert orders["state"] == "skipped" and orders["holder"] and str(proc.pid) in orders["holder"], orders
    assert orders["removed"] == {"rivet_runs": 0, "rivet_load_ledger": 0}, orders
    assert [w["code"] for w in doc["warnings"]] == ["RIVET_STATE_PRUNE_SKIPPED"], doc["warnings"]
    assert doc["removed"]["rivet_runs"] == sum(e["removed"]["rivet_runs"] for e in doc["exports"])


def test_a_live_run_is_never_blocked_a_second_and_its_own_export_is_skipped(state_backend: StateBackend,
                                                                             tmp_path: Path) -> None:
    config, env = _history(state_backend)
    bulk_history(config, env, "order_lines", 50000, 50000, first_day=6, mode="chunked", prefix="lines-more")
    bulk_history(config, env, "orders", 3000, 0, prefix="orders-more")
    before = table_rows(config, env)
    archive = tmp_path / "archive.gz"
    proc, out, stop = _live_run(config, env, tmp_path)
    try:
        time.sleep(0.3)  # the writer's commits are under way
        began = time.monotonic()
        pruned = run_cli_forked("-c", str(config), "--json", "prune", "--keep-runs", "3", "--archive", str(archive),
                                env=env)
        took = time.monotonic() - began
    finally:
        live = _stopped(proc, out, stop)
    assert pruned.returncode == 0, describe(pruned)
    doc = json.loads(pruned.stdout)
    jsonschema.validate(doc, SCHEMA)
    latencies = live["latencies"]
    assert len(latencies) > 20 and took > 1, (len(latencies), took)
    assert max(latencies) < 1.0, f"the live run waited {max(latencies):.3f} s for one commit (bound: 1 s)"
    skipped = {e["export"]: e for e in doc["exports"]}["orders"]
    assert skipped["state"] == "skipped" and str(proc.pid) in skipped["holder"], skipped
    assert [w["code"] for w in doc["warnings"]] == ["RIVET_STATE_PRUNE_SKIPPED"]
    after = table_rows(config, env)
    assert after["rivet_exports"]  # the live run's last cursor is in the state
    assert {r["export_name"]: r["cursor_value"] for r in after["rivet_exports"].values()}["orders"] == live["last"]
    removed = _removed(before, after)
    others = {t: {k: r for k, r in before[t].items() if r["export_name"] != "orders"} for t in before}
    assert removed == _expected_removal(others, keep=3)
    assert not any(before["rivet_runs"][k]["export_name"] == "orders" for k in removed["rivet_runs"])
    assert _archived(_read(archive, config, env)) == {t: {k: before[t][k] for k in removed[t]} for t in PRUNED}


def test_reads_beside_a_live_run_never_fail_when_its_wal_goes(tmp_path: Path) -> None:
    """A prune's pre-flight and plan read the state beside a live run, whose every commit's
    close folds the ``-wal`` into the file and removes it: a read that found the ``-wal`` and
    then lost it failed RIVET_INTERNAL (FileNotFoundError, a few reads in a thousand; found
    by bench/bench_prune.py). It looks again instead."""
    from statetool.operations.context import Context

    config, env = _history(StateBackend.sqlite(tmp_path / "s"))
    backend = Context(config, None, env).backend()
    proc, out, stop = _live_run(config, env, tmp_path)
    failures: list[str] = []
    reads = 0
    try:
        until = time.monotonic() + 5
        while time.monotonic() < until:
            reads += 1
            try:
                with backend.reading() as conn:
                    conn.scalar("SELECT count(*) FROM rivet_exports")
            except Exception as err:  # noqa: BLE001 - every failure is counted, none expected
                failures.append(repr(err))
    finally:
        live = _stopped(proc, out, stop)
    assert len(live["latencies"]) > 50 and reads > 1000, (len(live["latencies"]), reads)
    assert not failures, f"{len(failures)} of {reads} reads failed: {failures[:3]}"


def test_prune_of_the_export_a_live_run_holds_waits_for_it_then_refuses(tmp_path: Path) -> None:
    config, env = _history(StateBackend.sqlite(tmp_path / "s"))
    proc, out, stop = _live_run(config, env, tmp_path)
    try:
        state = tree_digest(config.parent)
        began = time.monotonic()
        refused = run_cli("-c", str(config), "--json-errors", "--lock-wait", "1", "prune", "--keep-runs", "0",
                          "--export", "orders", "--archive", str(tmp_path / "a.gz"), env=env)
        waited = time.monotonic() - began
        assert (refused.returncode, error_object(refused)["code"]) == (2, "RIVET_STATE_LOCK_TIMEOUT"), \
            describe(refused)
        assert waited >= 1 and "chunk-run:orders" in error_object(refused)["message"]
        assert not (tmp_path / "a.gz").exists()
        assert {k: v for k, v in tree_digest(config.parent).items() if ".rivet_state.db" not in k} == \
            {k: v for k, v in state.items() if ".rivet_state.db" not in k}
    finally:
        _stopped(proc, out, stop)
    assert not _audit(config, env, "prune"), "nothing was pruned"


# -- SIGKILL -------------------------------------------------------------------------------------


@pytest.mark.parametrize("point", ["archived-1", "archived-3", "deleted-3", "committed-3"])
def test_a_prune_killed_mid_batch_or_between_batches_loses_no_row_and_a_rerun_goes_on(
        state_backend: StateBackend, tmp_path: Path, point: str) -> None:
    config, env = _history(state_backend)
    before = table_rows(config, env)
    expected = _expected_removal(before, before=f"{LATE}T00:00:00.000000Z")
    first, second = tmp_path / "first.gz", tmp_path / "second.gz"
    url = ["--state-url", state_backend.url] if state_backend.url else []
    killed = run_killed_at(point, "-c", str(config), *url, "prune", "--before", LATE, "--batch-size", "20",
                           "--archive", str(first))
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr)
    proc = run_cli("-c", str(config), "--json", "check", env=env)
    assert proc.returncode == 0, describe(proc)
    middle = table_rows(config, env)
    removed = _removed(before, middle)
    number = int(point.rpartition("-")[2])
    audits = _audit(config, env, "prune")
    assert len(audits) == (number if point.startswith("committed") else number - 1), "the batches committed"
    assert {t: len(removed[t]) for t in PRUNED} == {t: sum(a["removed"].get(t, 0) for a in audits) for t in PRUNED}, \
        "what the committed batches' audit rows count, and nothing of the batch the kill cut"
    assert all(removed[t] <= expected[t] for t in PRUNED), "only rows the rules let go"
    saved = _archived(_read(first, config, env, cut_short=True))
    assert all(removed[t] <= set(saved[t]) for t in PRUNED), "every removed row is in the archive"
    assert all(saved[t][k] == before[t][k] for t in PRUNED for k in saved[t])
    for table in UNTOUCHED:
        assert middle[table] == before[table]
    _cli(config, env, "prune", "--before", LATE, "--batch-size", "20", "--archive", str(second))
    after = table_rows(config, env)
    assert _removed(before, after) == expected, "the re-run removes the rest, and only that"
    both = [_archived(_read(first, config, env, cut_short=True)), _archived(_read(second, config, env))]
    assert all(expected[t] <= set(both[0][t]) | set(both[1][t]) for t in PRUNED), \
        "the two archives hold every removed row"
    assert set(_archived(_read(second, config, env))["rivet_runs"]).isdisjoint(removed["rivet_runs"])


# -- vacuum ---------------------------------------------------------------------------------------


def test_vacuum_gives_the_space_back_once_no_run_is_live(tmp_path: Path) -> None:
    config, env = _history(StateBackend.sqlite(tmp_path / "s"))
    bulk_history(config, env, "orders", 5000, 0, prefix="orders-more")
    state = config.parent / ".rivet_state.db"
    doc = _cli(config, env, "prune", "--keep-runs", "5", "--vacuum")
    vacuum = doc["vacuum"]
    assert vacuum["ran"] and vacuum["exclusive"] and vacuum["after_bytes"] < vacuum["before_bytes"] / 2, vacuum
    assert os.stat(state).st_size == vacuum["after_bytes"]
    assert _audit(config, env, "prune.vacuum")[-1]["after_bytes"] == vacuum["after_bytes"]
    bulk_history(config, env, "order_events", 3000, 0, first_day=9, mode="cdc", prefix="events-more")
    proc, out, stop = _live_run(config, env, tmp_path)
    try:
        refused = run_cli("-c", str(config), "--json-errors", "--lock-wait", "1", "prune", "--keep-runs", "5",
                          "--vacuum", env=env)
    finally:
        _stopped(proc, out, stop)
    err = error_object(refused)
    assert (refused.returncode, err["code"]) == (2, "RIVET_STATE_RUN_IN_PROGRESS"), describe(refused)
    assert "the prune removed" in err["message"] and "re-run with --vacuum" in err["message"]
    assert len(_audit(config, env, "prune.vacuum")) == 1
    assert len([r for r in table_rows(config, env)["rivet_runs"].values() if r["export_name"] == "order_events"]) == 5
    again = _cli(config, env, "prune", "--keep-runs", "5", "--vacuum")
    assert again["removed"] == {t: 0 for t in PRUNED} and again["vacuum"]["ran"]


@pytest.fixture
def role(pg_server: dict[str, str]) -> Iterator[Callable[..., str]]:
    """``role(*grants)``: a new LOGIN role, dropped with what it owns afterwards."""
    made: list[str] = []

    def make(*statements: str) -> str:
        name = f"r_{uuid.uuid4().hex[:10]}"
        made.append(name)
        _sql(pg_server["url"], f"CREATE ROLE {name} LOGIN", *(s.format(role=name) for s in statements))
        return name

    yield make
    for name in reversed(made):
        _sql(pg_server["url"], f"DROP OWNED BY {name} CASCADE", f"DROP ROLE {name}")


@pytest.mark.postgres
def test_vacuum_on_postgresql_runs_beside_a_live_run_and_needs_the_tables_owner(
        tmp_path: Path, pg_url: str, pg_server: dict[str, str], role: Callable[..., str]) -> None:
    config, env = _history(StateBackend.postgres(tmp_path, pg_url))
    proc, out, stop = _live_run(config, env, tmp_path)
    try:
        doc = _cli(config, env, "--lock-wait", "5", "prune", "--keep-runs", "5", "--vacuum")
    finally:
        _stopped(proc, out, stop)
    assert doc["vacuum"]["ran"] and not doc["vacuum"]["exclusive"] and doc["vacuum"]["before_bytes"] > 0
    assert _audit(config, env, "prune.vacuum")
    schema = pg_url.rpartition("schema=")[2]
    app = role(f'GRANT USAGE ON SCHEMA "{schema}" TO {{role}}',
               f'GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "{schema}" TO {{role}}',
               f'GRANT USAGE ON ALL SEQUENCES IN SCHEMA "{schema}" TO {{role}}')
    as_app = {**env, "RIVET_STATE_URL": _url_as(pg_server["url"], app, schema)}
    rows = table_rows(config, env)
    for dry in ([], ["--dry-run"]):
        proc = run_cli("-c", str(config), "--json-errors", "prune", "--keep-runs", "0", "--vacuum", *dry, env=as_app)
        err = error_object(proc)
        assert (proc.returncode, err["code"]) == (1, "RIVET_STATE_PERMISSION_DENIED"), describe(proc)
        assert app in err["message"] and "VACUUM" in err["message"]
    assert table_rows(config, env) == rows, "refused before the first batch"
    pruned = _cli(config, as_app, "prune", "--keep-runs", "0")
    assert pruned["removed"] == {t: len(keys) for t, keys in _expected_removal(rows, keep=0).items()}, \
        "without --vacuum the same role prunes: deleting rows needs no ownership"


@pytest.mark.parametrize("width", [80, None])
def test_prune_says_for_people_what_it_removed_kept_and_archived(tmp_path: Path, width: int | None) -> None:
    config, _env = _history(StateBackend.sqlite(tmp_path))  # beside the config: no RIVET_STATE_URL
    archive = tmp_path / "a.gz"
    plan = run_cli("-c", str(config), "prune", "--keep-runs", "0", "--archive", str(archive), "--vacuum",
                   "--dry-run", env={}, columns=width)
    assert plan.returncode == 0, describe(plan)
    said = " ".join(plan.stdout.split())
    assert said.startswith("Dry run: nothing was changed. The real run would remove 240 runs and 107 load-ledger "
                           "rows:"), plan.stdout
    assert "holding every run lease" in said and f"  {archive}\n" in plan.stdout
    done = run_cli("-c", str(config), "prune", "--keep-runs", "0", "--archive", str(archive), env={}, columns=width)
    assert done.returncode == 0, describe(done)
    said = " ".join(done.stdout.split())
    assert "Removed 240 runs and 107 load-ledger rows in 5 batches, each audited:" in said, done.stdout
    assert f"Archived 347 rows ({os.stat(archive).st_size} bytes" in said and f"  {archive}\n" in done.stdout
    for text in (plan.stdout, done.stdout):
        assert not [line for line in text.splitlines() if line != line.rstrip()]
        assert width is None or all(len(line) <= width for line in text.splitlines() if str(archive) not in line), text
    again = run_cli("-c", str(config), "prune", "--keep-runs", "0", env={}, columns=width)
    assert again.stdout.startswith("Nothing to remove."), again.stdout
    unused = tmp_path / "unused.gz"
    for dry in ([], ["--dry-run"]):
        none = run_cli("-c", str(config), "prune", "--keep-runs", "0", "--archive", str(unused), *dry, env={},
                       columns=width)
        said = " ".join(none.stdout.split())
        assert none.returncode == 0 and "not create the archive" in said and "Archived" not in said, none.stdout
        assert not unused.exists()
