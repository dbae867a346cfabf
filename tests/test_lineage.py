"""The state's lineage id and serial (SPEC §9, revision 0005): set once, kept by every copy,
advanced by exactly one by every write and by nothing else."""

from __future__ import annotations

import json
import sqlite3
import uuid
from pathlib import Path

from support import describe, write_config
from statetool.runtime import StateStore
from test_migrate import EXPORTS_YAML, SOURCE_KEY, Target, backups, build_state, cli, target  # noqa: F401 - two-backend fixture


def lineage(target: Target) -> tuple[str, int]:
    """``(id, serial)`` as ``info --json`` reports them."""
    proc = cli(target, "info", "--json")
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)["lineage"]
    return doc["id"], doc["serial"]


def test_every_write_advances_the_serial_by_one_and_nothing_else_does(target: Target) -> None:
    assert cli(target, "init").returncode == 0
    first, serial = lineage(target)
    assert uuid.UUID(first) and serial == 1, (first, serial)
    writes = [("exports", "set-cursor", "orders", "2026-01-01"), ("exports", "reset", "orders"),
              ("identity", "rekey", "--old", SOURCE_KEY, "--new", "postgresql://db.new:5432/sales", "--reason", "x"),
              ("identity", "rekey", "--old", "postgresql://db.new:5432/sales", "--new", SOURCE_KEY, "--reason", "y")]
    for args in writes:
        proc = cli(target, *args)
        assert proc.returncode == 0, describe(proc)
        serial += 1
        assert lineage(target) == (first, serial), args
    store = StateStore.open(target.config, env=dict(target.context().env))
    with store.transaction() as tx:  # the pipeline's own write, through the runtime API
        tx.finish_run(tx.start_run("orders", "incremental"), "succeeded", rows=1)
    assert lineage(target) == (first, serial + 1)
    for args in (("check",), ("doctor",), ("exports", "list"), ("leases",), ("exports", "set-cursor", "nosuch", "1")):
        cli(target, *args)  # reads, and a refused write
    assert lineage(target) == (first, serial + 1)


def test_a_backup_carries_the_serial_before_its_change_and_the_same_lineage(tmp_path: Path) -> None:
    target = Target("sqlite", write_config(tmp_path / "pipeline", exports=EXPORTS_YAML))
    assert cli(target, "init").returncode == 0
    before = lineage(target)
    assert cli(target, "exports", "set-cursor", "orders", "5").returncode == 0
    (backup,) = backups(target)
    db = sqlite3.connect(f"file:{backup}?mode=ro", uri=True)
    try:
        assert db.execute("SELECT lineage, serial FROM rivet_lineage").fetchone() == before
    finally:
        db.close()
    assert lineage(target) == (before[0], before[1] + 1)


def test_a_migrated_state_gets_a_lineage(target: Target) -> None:
    build_state(target, "0004")
    assert lineage(target) == (None, None)
    proc = cli(target, "migrate")
    assert proc.returncode == 0, describe(proc)
    got = lineage(target)
    assert uuid.UUID(got[0]) and got[1] == 2, "the revision gives serial 1, the migration's write advances it"


def test_a_relocation_and_a_transfer_keep_the_lineage_and_the_serial(tmp_path: Path, pg_url: str) -> None:
    target = Target("sqlite", write_config(tmp_path / "pipeline", exports=EXPORTS_YAML))
    assert cli(target, "init").returncode == 0
    assert cli(target, "exports", "set-cursor", "orders", "5").returncode == 0
    got = lineage(target)
    moved = tmp_path / "moved"
    moved.mkdir()
    assert cli(target, "relocate", "--to", str(moved)).returncode == 0
    relocated = Target("sqlite", target.config, extra_env={"RIVET_STATE_URL": f"sqlite:{moved}"})
    assert lineage(relocated) == got
    proc = cli(relocated, "transfer", "--to", pg_url)
    assert proc.returncode == 0, describe(proc)
    assert lineage(Target("postgres", target.config, pg_url)) == got
