"""CDC checkpoints (SPEC §6): one resolver, the PostgreSQL relative-checkpoint warning, and
``statetool checkpoints``.

Every rule is exercised on real files in tmp_path; the PostgreSQL cases run against the
real throwaway server of conftest. ``checkpoints`` and ``check`` change no byte.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from support import CDC_EXPORTS, describe, process_env, run_cli, tree_digest, write_config
from support.backends import StateBackend
from statetool.render import timestamp
from statetool.runtime import StateStore
from statetool.location import (
    FILE_CHECKPOINT_ENGINES,
    checkpoint_relative_message,
    resolve_checkpoint,
    resolve_location,
)



def cdc_config(tmp_path: Path) -> tuple[Path, Path]:
    """A config with four CDC exports (relative mysql, relative mongodb, postgres with no
    file, absolute oracle) and one incremental; returns (config, the absolute checkpoint)."""
    absolute = tmp_path / "volume" / "audit.json"
    return write_config(tmp_path / "pipeline", exports=CDC_EXPORTS.format(absolute=absolute)), absolute


def by_export(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["export"]: c for c in doc["checkpoints"]}


# -- resolve_checkpoint: the rules ------------------------------------------------------


def test_absolute_checkpoint_is_used_as_given_under_every_location(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    absolute = tmp_path / "volume" / "cdc" / ".." / "pos.json"
    for env in (None, f"sqlite:{tmp_path / 'state'}", "postgresql://u@h/db"):
        location = resolve_location(env, None, config)
        place = resolve_checkpoint(str(absolute), "mysql", location, config.parent)
        assert place.path == tmp_path / "volume" / "pos.json", env
        assert place.warning is None, env
        assert "absolute" in place.why


def test_relative_checkpoint_resolves_under_the_declared_directory(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    state_dir = tmp_path / "state"
    location = resolve_location(f"sqlite:{state_dir}", None, config)
    # Neither file exists yet: the declared directory is where it will be written.
    place = resolve_checkpoint("checkpoints/e.json", "mysql", location, config.parent)
    assert place.path == state_dir / "checkpoints" / "e.json"
    assert place.warning is None and "declared" in place.why
    # Present in both places: the declared directory wins.
    for base in (state_dir, config.parent):
        (base / "checkpoints").mkdir(parents=True, exist_ok=True)
        (base / "checkpoints" / "e.json").write_text("{}")
    place = resolve_checkpoint("checkpoints/e.json", "mysql", location, config.parent)
    assert place.path == state_dir / "checkpoints" / "e.json" and place.warning is None


def test_relative_checkpoint_found_only_beside_the_config_is_used_with_a_warning(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (config.parent / "checkpoints").mkdir()
    (config.parent / "checkpoints" / "e.json").write_text("{}")
    location = resolve_location(f"sqlite:{state_dir}", None, config)
    place = resolve_checkpoint("checkpoints/e.json", "mysql", location, config.parent)
    assert place.path == config.parent / "checkpoints" / "e.json"
    assert place.warning == "RIVET_STATE_CHECKPOINT_BESIDE_CONFIG"


def test_relative_checkpoint_resolves_beside_the_config_with_a_state_beside_the_config(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    location = resolve_location(None, None, config)
    place = resolve_checkpoint("./cp/../checkpoints/e.json", "mongodb", location, config.parent)
    assert place.path == config.parent / "checkpoints" / "e.json"
    assert place.warning is None


def test_relative_checkpoint_under_postgresql_state_gets_the_relative_warning(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    location = resolve_location("postgresql://reader@db.internal/state", None, config)
    place = resolve_checkpoint("checkpoints/e.json", "mysql", location, config.parent)
    assert place.path == config.parent / "checkpoints" / "e.json"
    assert place.warning == "RIVET_STATE_CHECKPOINT_RELATIVE"


def test_postgres_engine_without_a_file_keeps_its_position_in_the_slot(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    for env in (None, "postgresql://reader@db.internal/state"):
        place = resolve_checkpoint(None, "postgres", resolve_location(env, None, config), config.parent)
        assert place.path is None and place.warning is None
        assert "slot" in place.why


@pytest.mark.parametrize("engine", sorted(FILE_CHECKPOINT_ENGINES))
def test_file_engines_without_a_checkpoint_configured_say_it_is_mandatory(tmp_path: Path, engine: str) -> None:
    config = write_config(tmp_path / "pipeline")
    place = resolve_checkpoint(None, engine, resolve_location(None, None, config), config.parent)
    assert place.path is None
    assert "no cdc.checkpoint" in place.why and engine in place.why


# -- the RIVET_STATE_CHECKPOINT_RELATIVE text ----------------------------------------------


def assert_relative_warning_states_every_element(text: str, export: str, path: Path) -> None:
    """SPEC §6: each element the warning must state, checked on its own (not a fixed sentence)."""
    flat = " ".join(text.split())
    low = flat.lower()
    assert export in flat, f"names the export: {flat}"
    assert str(path) in flat and path.is_absolute(), f"names the absolute path: {flat}"
    assert re.search(r"(worker|pod|machine|host)'?s? own (local )?disk", low), f"own disk of the worker: {flat}"
    assert "postgresql" in low, f"says the state is in PostgreSQL: {flat}"
    assert re.search(r"\blost\b|\bdeleted\b|\bgone\b", low), f"says the file may be lost: {flat}"
    assert "first run" in low, f"a lost file makes the next run a first run: {flat}"
    assert re.search(r"re-?anchor", low), f"the stream re-anchors: {flat}"
    assert re.search(r"changes between .*lost.* position .*(new )?anchor", low), f"the gap is named: {flat}"
    assert "without an error" in low or "silently" in low, f"the loss is silent: {flat}"
    assert re.search(r"absolute .*cdc\.checkpoint|cdc\.checkpoint.* absolute", low), f"remedy: absolute: {flat}"
    assert re.search(r"outlives? the worker|survives? the worker", low), f"remedy: durable storage: {flat}"
    assert f"statetool checkpoints import --export {export}" in flat, f"remedy: the position into the state: {flat}"


def test_relative_warning_text_states_each_required_element() -> None:
    path = Path("/work/pipeline/checkpoints/order_events.json")
    assert_relative_warning_states_every_element(checkpoint_relative_message("order_events", path),
                                                 "order_events", path)
    odd = checkpoint_relative_message("order events; rm -rf /", path)
    assert "statetool checkpoints import --export 'order events; rm -rf /', or" in odd, "a command to copy, quoted"


@pytest.mark.postgres
def test_relative_warning_once_per_cdc_export_under_postgresql_and_no_exit_change(tmp_path: Path,
                                                                                  pg_url: str) -> None:
    config, absolute = cdc_config(tmp_path)
    env = {"RIVET_STATE_URL": pg_url}
    proc = run_cli("-c", str(config), "init", env=env)
    assert proc.returncode == 0, describe(proc)

    proc = run_cli("-c", str(config), "--json", "checkpoints", env=env)
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    relative = [w for w in doc["warnings"] if w["code"] == "RIVET_STATE_CHECKPOINT_RELATIVE"]
    warned = sorted(re.search(r"CDC export (\w+)", w["message"]).group(1) for w in relative)  # type: ignore[union-attr]
    assert warned == ["carts", "order_events"], doc["warnings"]  # once each; not the absolute, not the slot
    rows = by_export(doc)
    assert_relative_warning_states_every_element(rows["order_events"]["warnings"][0]["message"], "order_events",
                                                 config.parent / "checkpoints" / "order_events.json")
    assert_relative_warning_states_every_element(rows["carts"]["warnings"][0]["message"], "carts",
                                                 config.parent / "carts.pos")
    assert rows["audit"]["warnings"] == [] and rows["audit"]["path"] == str(absolute)
    assert rows["ledger"]["warnings"] == [] and rows["ledger"]["path"] is None

    # check: a warning row per relative CDC export, exit 0; --strict fails them as refusal (5).
    proc = run_cli("-c", str(config), "--json", "check", env=env)
    assert proc.returncode == 0, describe(proc)
    checks = json.loads(proc.stdout)["checks"]
    rel_rows = [c for c in checks if c["code"] == "RIVET_STATE_CHECKPOINT_RELATIVE"]
    assert sorted(c["id"] for c in rel_rows) == ["doctor:carts", "doctor:order_events"], checks
    assert {c["status"] for c in rel_rows} == {"warn"}
    proc = run_cli("-c", str(config), "--json", "check", "--strict", env=env)
    assert proc.returncode == 5, describe(proc)
    strict = [c for c in json.loads(proc.stdout)["checks"] if c["code"] == "RIVET_STATE_CHECKPOINT_RELATIVE"]
    assert len(strict) == 2 and {c["status"] for c in strict} == {"fail"}

    # The human output of checkpoints names the warning too, once per export.
    proc = run_cli("-c", str(config), "checkpoints", env=env)
    assert proc.returncode == 0, describe(proc)
    assert proc.stdout.count("RIVET_STATE_CHECKPOINT_RELATIVE") + proc.stderr.count(
        "RIVET_STATE_CHECKPOINT_RELATIVE") == 2, describe(proc)


def test_no_relative_warning_when_the_state_is_sqlite(tmp_path: Path) -> None:
    config, _ = cdc_config(tmp_path)
    proc = run_cli("-c", str(config), "--json", "checkpoints")
    assert proc.returncode == 0, describe(proc)
    assert json.loads(proc.stdout)["warnings"] == []


# -- statetool checkpoints --json ------------------------------------------------------------


def test_checkpoints_json_reports_each_field(tmp_path: Path) -> None:
    config, absolute = cdc_config(tmp_path)
    present = config.parent / "checkpoints" / "order_events.json"
    present.parent.mkdir()
    body = json.dumps({"file": "mysql-bin.000042", "pos": 91234})
    present.write_text(body)
    hour_ago = time.time() - 3600
    os.utime(present, (hour_ago, hour_ago))
    absolute.parent.mkdir()
    absolute.write_text('{"scn": 12')  # truncated JSON
    # carts.pos: missing.

    proc = run_cli("-c", str(config), "--json", "checkpoints")
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    rows = by_export(doc)
    assert sorted(rows) == ["audit", "carts", "ledger", "order_events"]  # CDC exports only
    for row in rows.values():
        assert {"configured", "path", "why", "present", "size_bytes", "age_seconds", "position", "error"} <= set(row)

    ok = rows["order_events"]
    assert ok["configured"] == "checkpoints/order_events.json"
    assert ok["path"] == str(present) and "beside the config" in ok["why"]
    assert ok["present"] is True and ok["size_bytes"] == len(body)
    assert 3590 <= ok["age_seconds"] <= 3700
    assert ok["position"] == {"file": "mysql-bin.000042", "pos": 91234} and ok["error"] is None

    missing = rows["carts"]
    assert missing["path"] == str(config.parent / "carts.pos")
    assert missing["present"] is False
    assert (missing["size_bytes"], missing["age_seconds"], missing["position"], missing["error"]) == (
        None, None, None, None)

    bad = rows["audit"]
    assert bad["path"] == str(absolute) and "absolute" in bad["why"]
    assert bad["present"] is True and bad["position"] is None
    assert str(absolute) in bad["error"] and "JSON" in bad["error"]

    slot = rows["ledger"]
    assert slot["configured"] is None and slot["path"] is None and "slot" in slot["why"]
    assert slot["present"] is False and slot["error"] is None


def column(table: str, header: str, export: str) -> str:
    """The value of column ``header`` in ``export``'s row of a table printed with no width
    (a log: every column as wide as its widest value, nothing wrapped)."""
    lines = table.splitlines()
    head = next(line for line in lines if line.startswith("export "))
    start = head.index(header)
    after = re.search(r"  +\S", head[start + len(header):])
    end = start + len(header) + after.start() + len(after.group()) - 1 if after else None
    row = next(line for line in lines if line.startswith(f"{export} "))
    return row[start:end].strip()


def test_the_checkpoints_table_says_where_each_position_is_stored(state_backend: StateBackend) -> None:
    """Issue 15 item 5, for people: a ``stored in`` column (state, file, server slot), and
    for a position in the state when it was committed (UTC to the second) and by which run;
    those two columns are left out when no position is in the state."""
    config = write_config(state_backend.pipeline, exports=CDC_EXPORTS.format(absolute="/nowhere/audit.json"))
    store = StateStore.open(config, env=process_env(state_backend.env), create=True)
    (config.parent / "checkpoints").mkdir()
    (config.parent / "checkpoints" / "order_events.json").write_text('{"pos": 7}')
    proc = run_cli("-c", str(config), "checkpoints", env=state_backend.env, columns=None)
    assert proc.returncode == 0, describe(proc)
    assert column(proc.stdout, "stored in", "order_events") == "file", describe(proc)
    assert column(proc.stdout, "stored in", "ledger") == "server slot", describe(proc)
    assert "committed" not in proc.stdout.splitlines()[1], describe(proc)

    with store.transaction() as tx:
        run = tx.start_run("carts", "cdc")
        tx.commit_position("carts", "mongodb", {"resume_token": "8263A1"}, run_id=run)
    proc = run_cli("-c", str(config), "checkpoints", env=state_backend.env, columns=None)
    assert proc.returncode == 0, describe(proc)
    committed = json.loads(run_cli("-c", str(config), "--json", "checkpoints", env=state_backend.env).stdout)
    carts = by_export(committed)["carts"]
    assert column(proc.stdout, "stored in", "carts") == "state", describe(proc)
    assert column(proc.stdout, "committed", "carts") == timestamp(carts["committed_at"]), describe(proc)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ", column(proc.stdout, "committed", "carts"))
    assert column(proc.stdout, "run", "carts") == run == carts["run_id"], describe(proc)
    assert column(proc.stdout, "committed", "order_events") == "-", describe(proc)
    assert column(proc.stdout, "stored in", "order_events") == "file", describe(proc)
    proc = run_cli("-c", str(config), "checkpoints", env=state_backend.env, columns=80)  # no room: a list
    assert proc.returncode == 0, describe(proc)
    assert "  stored in      state" in proc.stdout and f"  run            {run}" in proc.stdout, describe(proc)


def test_checkpoint_path_that_is_a_directory_is_an_error_not_a_crash(tmp_path: Path) -> None:
    config, _ = cdc_config(tmp_path)
    (config.parent / "carts.pos").mkdir()
    proc = run_cli("-c", str(config), "--json", "checkpoints")
    assert proc.returncode == 0, describe(proc)
    carts = by_export(json.loads(proc.stdout))["carts"]
    assert carts["present"] is False and "not a regular file" in carts["error"]


def test_checkpoints_follow_a_declared_directory_and_warn_when_read_beside_the_config(tmp_path: Path) -> None:
    config, _ = cdc_config(tmp_path)
    state_dir = tmp_path / "state"
    (state_dir / "checkpoints").mkdir(parents=True)
    (state_dir / "checkpoints" / "order_events.json").write_text('{"pos": 1}')
    (config.parent / "carts.pos").write_text('{"resume_token": "x"}')
    proc = run_cli("-c", str(config), "--json", "checkpoints", env={"RIVET_STATE_URL": f"sqlite:{state_dir}"})
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    rows = by_export(doc)
    assert rows["order_events"]["path"] == str(state_dir / "checkpoints" / "order_events.json")
    assert rows["order_events"]["warnings"] == []
    assert rows["carts"]["path"] == str(config.parent / "carts.pos")
    assert [w["code"] for w in rows["carts"]["warnings"]] == ["RIVET_STATE_CHECKPOINT_BESIDE_CONFIG"]
    assert str(config.parent / "carts.pos") in rows["carts"]["warnings"][0]["message"]


def test_checkpoints_and_check_change_nothing(tmp_path: Path) -> None:
    config, absolute = cdc_config(tmp_path)
    (config.parent / "checkpoints").mkdir()
    (config.parent / "checkpoints" / "order_events.json").write_text('{"pos": 7}')
    absolute.parent.mkdir()
    absolute.write_text("garbage")
    assert run_cli("-c", str(config), "init").returncode == 0
    before = tree_digest(tmp_path), sorted(str(p) for p in tmp_path.rglob("*"))
    for args in (["checkpoints"], ["--json", "checkpoints"], ["check"], ["--json", "check", "--strict"]):
        run_cli("-c", str(config), *args)
        assert (tree_digest(tmp_path), sorted(str(p) for p in tmp_path.rglob("*"))) == before, args


def test_runtime_api_resolves_checkpoints_through_the_same_function(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    state_dir = tmp_path / "volume"
    state_dir.mkdir()
    declared = StateStore.open(config, state_url=f"sqlite:{state_dir}", env={}, create=True)
    assert declared.checkpoint_path("order_events") == state_dir / "checkpoints" / "order_events.json"
    assert declared.checkpoint_path("orders") is None
    beside = StateStore.open(config, env={}, create=True)
    assert beside.checkpoint_path("order_events") == config.parent / "checkpoints" / "order_events.json"


@pytest.mark.postgres
def test_runtime_open_under_postgresql_warns_once_per_relative_cdc_checkpoint(tmp_path: Path, pg_url: str) -> None:
    config = write_config(tmp_path / "pipeline")
    store = StateStore.open(config, state_url=pg_url, env={}, create=True)
    relative = [w for w in store.warnings if w.code == "RIVET_STATE_CHECKPOINT_RELATIVE"]
    assert len(relative) == 1
    assert str(config.parent / "checkpoints" / "order_events.json") in relative[0].message
