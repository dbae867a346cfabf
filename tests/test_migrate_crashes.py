"""A SQLite migration is its own backup (issue 13 item 2; SPEC §9): killed at any of its steps,
the original is complete and usable, or the migrated state is in place with the original
beside it as the backup, and a re-run converges.

Each test runs ``migrate`` in a real process (tests/support/crash_driver.py) that SIGKILLs
itself at one named step of ``migrate.CRASH_POINTS``, on a rollback-journal legacy state
and on a WAL state at 0002 (a pipeline's state since ``init``). After the kill every read
(``info``) sees one whole state and creates or removes no file; the re-run leaves the state
at head with every row, its identity and its ``migrate`` audit row in the new file,
exactly one backup holding the original, and no temporary file.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import stat
from pathlib import Path

import pytest

from support import describe, run_cli, tree_digest, write_config
from statetool.example import build_legacy_state
from statetool.operations.migrate import CRASH_POINTS
from support.crash_driver import run_killed_at
from test_migrate import BACKUP_NAME, EXPORTS_YAML, HEAD, Target, build_state, project, sqlite_dump

STATE = ".rivet_state.db"
VERSION_TABLE = "rivet_state_version"


def _build(kind: str, directory: Path) -> Target:
    """A state beside a config in ``directory``: ``legacy`` (revision 0001's shape, rollback
    journal, thousands of runs) or ``wal`` (revision 0002 with data in every table, WAL)."""
    target = Target("sqlite", write_config(directory, exports=EXPORTS_YAML))
    if kind == "legacy":
        build_legacy_state(target.path, [("orders", "incremental"), ("order_lines", "chunked")], 3000)
    else:
        build_state(target, "0002")
        db = sqlite3.connect(target.path)
        assert db.execute("PRAGMA journal_mode = WAL").fetchone()[0] == "wal"
        db.close()
    os.chmod(target.path, 0o640)
    return target


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()
                  if p.name.endswith((".tmp", "-journal")) or ".tmp" in p.name)


def _backups(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob(f"{STATE}.backup-*") if BACKUP_NAME.match(p.name))


def _assert_same_rows(before: dict, after: dict, where: str) -> None:
    for table, (cols, rows) in before["data"].items():
        if table != VERSION_TABLE:
            assert project(after, table, cols) == rows, f"{where}: {table} changed"


@pytest.mark.parametrize("kind", ["legacy", "wal"])
@pytest.mark.parametrize("point", CRASH_POINTS)
def test_a_migration_killed_at_each_step_leaves_one_whole_state_and_a_rerun_converges(
        tmp_path: Path, kind: str, point: str) -> None:
    target = _build(kind, tmp_path / "pipeline")
    original = sqlite_dump(target.path)
    mode = stat.S_IMODE(target.path.stat().st_mode)

    proc = run_killed_at(point, "-c", str(target.config), "migrate")
    assert proc.returncode == -signal.SIGKILL, f"not killed at {point}: {describe(proc)}"

    # After the kill: the state at its path is whole, the original or the migrated one.
    digest = tree_digest(target.directory)
    info = run_cli("-c", str(target.config), "info", "--json")
    assert info.returncode == 0, f"after a kill at {point}: {describe(info)}"
    doc = json.loads(info.stdout)
    assert tree_digest(target.directory) == digest, f"info changed a file after a kill at {point}"
    now = sqlite_dump(target.path)
    _assert_same_rows(original, now, f"after a kill at {point}")
    if target.revision() == HEAD:
        assert point in ("swapped", "finished"), f"the state was switched before {point}"
        found = _backups(target.directory)
        assert len(found) == 1 and sqlite_dump(found[0]) == original, found
    else:
        assert now == original, f"the state was written before the switch (killed at {point})"
        assert doc["revision"]["status"] in ("legacy", "pending"), describe(info)

    rerun = run_cli("-c", str(target.config), "migrate", "--json")
    assert rerun.returncode == 0, f"re-run after a kill at {point}: {describe(rerun)}"
    assert target.revision() == HEAD
    final = sqlite_dump(target.path)
    _assert_same_rows(original, final, f"re-run after a kill at {point}")
    assert _leftovers(target.directory) == [], f"after the re-run of a kill at {point}"
    found = _backups(target.directory)
    assert len(found) == 1, f"after the re-run of a kill at {point}: {found}"
    assert sqlite_dump(found[0]) == original
    assert not os.path.samefile(found[0], target.path)
    audit = [json.loads(r["detail"]) for r in target.rows("rivet_audit") if r["action"] == "migrate"]
    assert audit == [{"from": "legacy" if kind == "legacy" else "0002", "to": HEAD, "backup": str(found[0])}]
    assert [r["state_key"] for r in target.rows("rivet_identity")] == ["postgresql://db.internal:5432/sales"]
    # the migrated file keeps the original's permissions and journal mode
    assert stat.S_IMODE(target.path.stat().st_mode) == mode
    assert target.path.read_bytes()[18] == (2 if kind == "wal" else 1)
    check = run_cli("-c", str(target.config), "check", "--json")
    assert check.returncode == 0, describe(check)


def test_a_symlinked_state_is_migrated_by_replacing_its_real_file(tmp_path: Path) -> None:
    """The configured path stays the symlink; the real file is replaced, and its backup
    and the migration's copy are made beside the real file."""
    target = _build("legacy", tmp_path / "pipeline")
    real_dir = tmp_path / "data"
    real_dir.mkdir()
    real = real_dir / STATE
    target.path.rename(real)
    target.path.symlink_to(real)
    original = sqlite_dump(real)

    proc = run_cli("-c", str(target.config), "migrate", "--json")
    assert proc.returncode == 0, describe(proc)
    assert target.path.is_symlink() and target.path.resolve() == real
    found = _backups(real_dir)
    assert len(found) == 1 and json.loads(proc.stdout)["backup"] == str(found[0]), describe(proc)
    assert sqlite_dump(found[0]) == original
    _assert_same_rows(original, sqlite_dump(real), "after the migration")
    assert target.revision() == HEAD
    assert _leftovers(real_dir) == [] and _leftovers(target.directory) == []


@pytest.mark.parametrize("point", ["copied", "kept"])
def test_info_and_check_report_what_a_killed_migration_left_and_say_what_to_do(tmp_path: Path, point: str) -> None:
    """A migration SIGKILLed after its copy was made leaves the copy's private directory
    (``….backup-….tmp``; killed after keeping the original, also a backup name that is a
    second name of the state itself): ``info`` and ``check``, for people and in JSON, warn
    ``RIVET_STATE_LEFTOVER_TEMP`` naming it and saying that a re-run of migrate converges and
    that it is safe to delete; after the re-run the warning is gone."""
    target = _build("wal", tmp_path / "pipeline")
    proc = run_killed_at(point, "-c", str(target.config), "migrate")
    assert proc.returncode == -signal.SIGKILL, f"not killed at {point}: {describe(proc)}"
    left = [target.directory / name for name in _leftovers(target.directory)]
    if point == "kept":
        left += [p for p in _backups(target.directory) if os.path.samefile(p, target.path)]
    assert left, f"a kill at {point} left nothing to report"
    digest = tree_digest(target.directory)

    info = run_cli("-c", str(target.config), "--json", "info")
    assert info.returncode == 0, describe(info)
    warned = [w for w in json.loads(info.stdout)["warnings"] if w["code"] == "RIVET_STATE_LEFTOVER_TEMP"]
    assert len(warned) == 1 and all(str(p) in warned[0]["message"] for p in left), describe(info)
    assert "a migration that still has a revision to cross" in warned[0]["message"].lower() and \
        "safe to delete" in warned[0]["message"]
    check = run_cli("-c", str(target.config), "--json", "check")
    rows = {row["id"]: row for row in json.loads(check.stdout)["checks"]}
    assert rows["leftovers"]["status"] == "warn" and rows["leftovers"]["code"] == "RIVET_STATE_LEFTOVER_TEMP", \
        describe(check)
    assert all(str(p) in rows["leftovers"]["message"] for p in left) and rows["leftovers"]["action"], describe(check)
    for args in (("info",), ("check",)):  # and for people
        human = run_cli("-c", str(target.config), *args)
        text = " ".join((human.stdout + human.stderr).split())
        assert "RIVET_STATE_LEFTOVER_TEMP" in text and "safe to delete" in text, describe(human)
        assert left[0].name in text.replace(" ", ""), describe(human)
    assert tree_digest(target.directory) == digest, "a read removed or changed what the kill left"

    rerun = run_cli("-c", str(target.config), "migrate")
    assert rerun.returncode == 0, describe(rerun)
    check = run_cli("-c", str(target.config), "--json", "check")
    rows = {row["id"]: row for row in json.loads(check.stdout)["checks"]}
    assert check.returncode == 0 and rows["leftovers"]["status"] == "ok", describe(check)
