"""The pod rule, ``statetool check --target pods`` (ADR-0039 D5, issue 15 item 6): a pod keeps
nothing of its own, so its pre-flight refuses a SQLite state and, under PostgreSQL state, a
CDC export whose position is in a checkpoint file (relative or absolute); a position in the
state or in a postgres stream's slot passes. Plain ``check`` (and ``--strict``) on a
long-lived host with an absolute checkpoint is not refused. docs/decisions.md, "The pod
rule: check --target pods".

Real states on both backends (PostgreSQL: the conftest server), real checkpoint files,
the CLI in-process; every refusal leaves the files and the state as they were.
"""

from __future__ import annotations

import json
import re
import shlex
import textwrap
from pathlib import Path
from typing import Any

import pytest

from support import CDC_EXPORTS, describe, error_object, process_env, run_cli, tree_digest, write_config
from support.backends import StateBackend
from statetool.errors import REGISTRY
from statetool.runtime import StateStore

POSITION = {"file": "mysql-bin.000042", "pos": 91234}
#: Five CDC exports, one per place a position can live: a relative file (order_events,
#: mysql), an absolute file on a volume (audit, oracle), a server slot (ledger, postgres, no
#: file), the state (carts, mongodb, committed through the runtime), and nowhere yet
#: (returns, mysql, a new export).
EXPORTS = CDC_EXPORTS + """\
  - name: returns
    mode: cdc
    cdc:
      engine: mysql
      checkpoint: checkpoints/returns.json
"""


def pipeline(backend: StateBackend, tmp_path: Path) -> tuple[Path, Path]:
    """The config of :data:`EXPORTS` with a state holding carts' position (its file never
    written), order_events' file beside the config and audit's on the volume; returns
    (config, volume)."""
    volume = tmp_path / "volume"
    volume.mkdir()
    config = write_config(backend.pipeline, exports=EXPORTS.format(absolute=volume / "audit.json"))
    store = StateStore.open(config, env=process_env(backend.env), create=True)
    with store.transaction() as tx:
        run = tx.start_run("carts", "cdc")
        tx.commit_position("carts", "mongodb", {"resume_token": "8263A1"}, run_id=run)
        tx.finish_run(run, "succeeded", rows=3)
    (config.parent / "checkpoints").mkdir()
    (config.parent / "checkpoints" / "order_events.json").write_text(json.dumps(POSITION))
    (volume / "audit.json").write_text(json.dumps({"scn": 7710021}))
    return config, volume


def rows_of(proc: Any) -> dict[str, dict[str, Any]]:
    return {row["id"]: row for row in json.loads(proc.stdout)["checks"]}


def state_export(config: Path, env: dict[str, str]) -> dict[str, Any]:
    """The state as ``statetool export --with-history`` gives it, but the time of the export:
    what a read must not change."""
    proc = run_cli("-c", str(config), "--json", "export", "--with-history", env=env)
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    doc.pop("exported_at")
    return doc  # type: ignore[no-any-return]


@pytest.mark.postgres
def test_pods_refuse_each_cdc_position_in_a_file_relative_or_absolute_and_pass_state_and_slot(
        tmp_path: Path, pg_url: str) -> None:
    backend = StateBackend.postgres(tmp_path, pg_url)
    config, volume = pipeline(backend, tmp_path)
    before = (tree_digest(config.parent), tree_digest(volume), state_export(config, backend.env))

    proc = run_cli("-c", str(config), "--json", "--json-errors", "check", "--target", "pods", env=backend.env)
    assert proc.returncode == REGISTRY["RIVET_STATE_CHECKPOINT_ON_POD_DISK"].exit_code == 5, describe(proc)
    rows = rows_of(proc)
    refused = {rid: row for rid, row in rows.items() if rid.startswith("pods:")}
    assert sorted(refused) == ["pods:audit", "pods:order_events"], rows
    for name, path in (("order_events", config.parent / "checkpoints" / "order_events.json"),
                       ("audit", volume / "audit.json")):
        row = refused[f"pods:{name}"]
        assert set(row) == {"id", "status", "code", "message", "action"}, row  # check's row shape
        assert (row["status"], row["code"]) == ("fail", "RIVET_STATE_CHECKPOINT_ON_POD_DISK"), row
        assert name in row["message"] and str(path) in row["message"], row
        assert f"statetool checkpoints import --export {name}" in row["message"], row
        assert row["action"] == REGISTRY["RIVET_STATE_CHECKPOINT_ON_POD_DISK"].action
    pods = rows["pods"]
    assert pods["status"] == "ok" and "PostgreSQL" in pods["message"], pods
    for said in ("carts in the state", "ledger in its replication slot", "returns no position yet"):
        assert said in pods["message"], pods
    obj = error_object(proc)
    assert obj["code"] == "RIVET_STATE_CHECKPOINT_ON_POD_DISK" and obj["exit_code"] == 5, obj
    assert sorted(f["export"] for f in obj["failures"]) == ["audit", "order_events"], obj
    assert (tree_digest(config.parent), tree_digest(volume), state_export(config, backend.env)) == before


@pytest.mark.postgres
def test_the_refusals_own_command_moves_the_position_and_then_the_pod_passes(tmp_path: Path, pg_url: str) -> None:
    """The remedy the message names, run as it is written, is the whole fix: after it the
    pod's pre-flight passes, and the stream resumes from the state with no file on disk."""
    backend = StateBackend.postgres(tmp_path, pg_url)
    config, _volume = pipeline(backend, tmp_path)
    proc = run_cli("-c", str(config), "--json", "check", "--target", "pods", env=backend.env)
    for row in rows_of(proc).values():
        if row["code"] == "RIVET_STATE_CHECKPOINT_ON_POD_DISK":
            command = re.search(r"statetool (checkpoints import --export \S+)$", row["message"])
            assert command, row
            moved = run_cli("-c", str(config), *shlex.split(command.group(1)), env=backend.env)
            assert moved.returncode == 0, describe(moved)
    proc = run_cli("-c", str(config), "--json", "check", "--target", "pods", env=backend.env)
    assert proc.returncode == 0, describe(proc)
    rows = rows_of(proc)
    assert not [rid for rid in rows if rid.startswith("pods:")], rows
    assert "order_events in the state" in rows["pods"]["message"] and "audit in the state" in rows["pods"]["message"]
    assert not (config.parent / "checkpoints" / "order_events.json").exists()
    doc = json.loads(run_cli("-c", str(config), "--json", "doctor", "--export", "order_events",
                             env=backend.env).stdout)
    assert doc["exports"][0]["verdict"] == "resumes" and "in the state" in doc["exports"][0]["resumes_from"], doc


@pytest.mark.postgres
def test_an_absolute_checkpoint_on_a_long_lived_host_is_refused_only_for_pods(tmp_path: Path, pg_url: str) -> None:
    """An operator on a VM with an absolute checkpoint path and PostgreSQL state runs plain
    ``check``, or ``check --strict``: neither refuses it (it works, and warns of nothing)."""
    volume = tmp_path / "volume"
    volume.mkdir()
    config = write_config(tmp_path / "pipeline", exports=textwrap.dedent(f"""\
        exports:
          - name: audit
            mode: cdc
            cdc:
              engine: oracle
              checkpoint: {volume}/audit.json
        """))
    env = {"RIVET_STATE_URL": pg_url}
    store = StateStore.open(config, env=process_env(env), create=True)
    with store.transaction() as tx:
        tx.finish_run(tx.start_run("audit", "cdc"), "succeeded", rows=1)
    (volume / "audit.json").write_text(json.dumps({"scn": 7710021}))
    for args in (("check",), ("check", "--strict")):
        proc = run_cli("-c", str(config), "--json", *args, env=env)
        assert proc.returncode == 0, describe(proc)
        assert "RIVET_STATE_CHECKPOINT_ON_POD_DISK" not in proc.stdout + proc.stderr, describe(proc)
        assert "pods" not in rows_of(proc), describe(proc)
    proc = run_cli("-c", str(config), "--json", "check", "--target", "pods", env=env)
    assert proc.returncode == 5 and rows_of(proc)["pods:audit"]["status"] == "fail", describe(proc)


@pytest.mark.parametrize("declared", [False, True], ids=["beside-the-config", "declared-directory"])
def test_a_sqlite_state_is_refused_for_pods_even_with_every_position_in_it(tmp_path: Path, declared: bool) -> None:
    """A SQLite state on a pod is itself on local disk (the pod's own, or one volume's): one
    refusal about the state, whatever the CDC positions; plain ``check`` passes."""
    backend = StateBackend.sqlite(tmp_path, tmp_path / "srv" / "state" if declared else None)
    if backend.state_dir is not None:
        backend.state_dir.mkdir(parents=True, exist_ok=True)
    config, _volume = pipeline(backend, tmp_path)
    for name in ("order_events", "audit"):
        proc = run_cli("-c", str(config), "checkpoints", "import", "--export", name, env=backend.env)
        assert proc.returncode == 0, describe(proc)
    before = tree_digest(tmp_path)
    proc = run_cli("-c", str(config), "--json", "--json-errors", "check", "--target", "pods", env=backend.env)
    assert proc.returncode == 5, describe(proc)
    rows = rows_of(proc)
    assert [rid for rid in rows if rid.startswith("pods")] == ["pods"], rows
    assert (rows["pods"]["status"], rows["pods"]["code"]) == ("fail", "RIVET_STATE_SQLITE_ON_POD"), rows
    assert str(backend.state_dir / ".rivet_state.db") in rows["pods"]["message"], rows  # type: ignore[operator]
    assert "statetool transfer" in rows["pods"]["action"]
    obj = error_object(proc)
    assert obj["code"] == "RIVET_STATE_SQLITE_ON_POD" and obj["failures"] == [], obj  # the state's, no export's
    assert tree_digest(tmp_path) == before
    proc = run_cli("-c", str(config), "check", env=backend.env)
    assert proc.returncode == 0, describe(proc)


def test_a_pod_started_without_its_state_url_is_refused_and_nothing_is_created(tmp_path: Path) -> None:
    """The Secret with ``RIVET_STATE_URL`` forgotten: the state would be a new SQLite file
    beside the config. Refused as missing and as SQLite on a pod; no file appears."""
    config = write_config(tmp_path / "pipeline")
    before = tree_digest(tmp_path)
    proc = run_cli("-c", str(config), "--json", "check", "--target", "pods")
    assert proc.returncode == 5, describe(proc)
    rows = rows_of(proc)
    assert rows["state"]["code"] == "RIVET_STATE_MISSING" and rows["pods"]["code"] == "RIVET_STATE_SQLITE_ON_POD"
    assert tree_digest(tmp_path) == before


def test_an_unknown_target_is_a_usage_error_before_anything_is_read(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    before = tree_digest(tmp_path)
    proc = run_cli("-c", str(config), "--json-errors", "check", "--target", "vm")
    assert proc.returncode == 1, describe(proc)
    obj = error_object(proc)
    assert obj["code"] == "RIVET_CLI_USAGE" and "pods" in obj["message"], obj
    assert tree_digest(tmp_path) == before


def test_the_pods_rows_are_a_paragraph_for_people_each_with_its_command(state_backend: StateBackend,
                                                                       tmp_path: Path) -> None:
    """For people, each refused row follows the table with its message and its ``Try``
    line; on PostgreSQL the command to run is in it, whole on its line."""
    config, _volume = pipeline(state_backend, tmp_path)
    proc = run_cli("-c", str(config), "check", "--target", "pods", env=state_backend.env, columns=80)
    assert proc.returncode == 5, describe(proc)
    lines = proc.stdout.splitlines()
    if state_backend.kind == "sqlite":
        assert any(line.startswith("pods: fail [RIVET_STATE_SQLITE_ON_POD]") for line in lines), describe(proc)
        assert f"Try (pods): {REGISTRY['RIVET_STATE_SQLITE_ON_POD'].action}" in lines, describe(proc)
        return
    for name in ("order_events", "audit"):
        assert any(line.startswith(f"pods:{name}: fail [RIVET_STATE_CHECKPOINT_ON_POD_DISK]") for line in lines)
        assert f"Try (pods:{name}): {REGISTRY['RIVET_STATE_CHECKPOINT_ON_POD_DISK'].action}" in lines
    flat = " ".join(proc.stdout.split())
    assert "statetool checkpoints import --export order_events" in flat, describe(proc)
