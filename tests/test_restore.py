"""``statetool backups list | verify | prune`` and ``statetool restore`` on real SQLite
states through the CLI (issue 14 items 2, 3; SPEC §9): a copy is verified before it is
used, an older, foreign or other-lineage copy is refused byte-identical, a restore keeps
the state it replaces, and a live state rolled back behind one of its copies is reported.
The SIGKILL sweeps of a restore are tests/test_restore_crashes.py."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from support import describe, error_object, run_cli, tree_digest, write_config

KEY = "postgresql://db.internal:5432/sales"


class Place:
    """A SQLite state in a declared directory, its config beside in ``pipeline/``."""

    def __init__(self, tmp_path: Path, name: str = "state") -> None:
        self.config = write_config(tmp_path / "pipeline")
        self.directory = tmp_path / name
        self.directory.mkdir()
        self.env = {"RIVET_STATE_URL": f"sqlite:{self.directory}"}

    @property
    def file(self) -> Path:
        return self.directory / ".rivet_state.db"

    def cli(self, *args: str) -> Any:
        return run_cli("-c", str(self.config), "--json-errors", *args, env=self.env)

    def doc(self, *args: str) -> dict[str, Any]:
        proc = self.cli("--json", *args)
        assert proc.returncode == 0, describe(proc)
        return json.loads(proc.stdout)

    def cursor(self) -> str | None:
        return next(e["cursor"] for e in self.doc("exports", "list")["exports"] if e["name"] == "orders")

    def serial(self) -> int:
        return self.doc("info")["lineage"]["serial"]

    def backups(self, label: str = "") -> list[Path]:
        return sorted(self.directory.glob(f".rivet_state.db.backup-{label}*"))

    def audit(self, action: str) -> list[dict[str, Any]]:
        db = sqlite3.connect(f"file:{self.file}?mode=ro", uri=True)
        try:
            rows = db.execute("SELECT detail FROM rivet_audit WHERE action = ? ORDER BY id", (action,)).fetchall()
        finally:
            db.close()
        return [json.loads(r[0]) for r in rows]


@pytest.fixture
def place(tmp_path: Path) -> Place:
    """A state whose orders cursor went 1 -> 2 -> 3, with the two backups of those changes."""
    p = Place(tmp_path)
    assert p.cli("init").returncode == 0
    for value in ("1", "2", "3"):
        assert p.cli("exports", "set-cursor", "orders", value).returncode == 0
    return p


def test_backups_list_names_every_copy_with_its_serial_and_changes_no_byte(place: Place) -> None:
    before = tree_digest(place.directory)
    doc = place.doc("backups", "list")
    assert [(c["kind"], c["label"], c["serial"]) for c in doc["copies"]] == [
        ("backup", "set-cursor-orders", 1), ("backup", "set-cursor-orders", 2), ("backup", "set-cursor-orders", 3)]
    assert {c["lineage"] for c in doc["copies"]} == {doc["live"]["lineage"]} and doc["live"]["serial"] == 4
    assert all(c["state_key"] == KEY and c["revision"] and c["size"] > 0 and c["problem"] is None
               for c in doc["copies"])
    verified = place.doc("backups", "verify")
    assert verified["verified"] and all(c["checked"] for c in verified["copies"])
    assert tree_digest(place.directory) == before


def test_verify_names_a_damaged_copy_and_a_symlink_is_never_followed(place: Place, tmp_path: Path) -> None:
    first, second, _third = place.backups()
    with open(second, "r+b") as damaged:  # a page of the table b-tree overwritten
        damaged.seek(4096 * 2)
        damaged.write(b"\xff" * 4096)
    elsewhere = tmp_path / "elsewhere.db"
    shutil.copy(first, elsewhere)
    planted = place.directory / ".rivet_state.db.backup-planted-20260101T000000Z"
    planted.symlink_to(elsewhere)
    before = tree_digest(place.directory)
    proc = place.cli("--json", "backups", "verify")
    assert proc.returncode == 4, describe(proc)
    found = {c["name"]: c for c in json.loads(proc.stdout)["copies"]}
    assert found[second.name]["code"] == "RIVET_STATE_CORRUPT", found[second.name]
    assert found[planted.name]["code"] == "RIVET_STATE_UNSAFE_FILE" and found[planted.name]["serial"] is None
    assert found[first.name]["problem"] is None
    one = place.cli("backups", "verify", first.name)
    assert one.returncode == 0, describe(one)
    unknown = place.cli("backups", "verify", "nosuch")
    assert unknown.returncode == 1 and error_object(unknown)["code"] == "RIVET_STATE_BACKUP_UNKNOWN", describe(unknown)
    assert tree_digest(place.directory) == before


def test_an_older_copy_is_refused_byte_identical_and_allow_older_restores_it_keeping_the_replaced(
        place: Place) -> None:
    oldest = place.backups()[0]  # serial 1: the cursor before the first change
    before = tree_digest(place.directory)
    for extra in ((), ("--dry-run",)):
        proc = place.cli("restore", oldest.name, *extra)
        assert proc.returncode == 5, describe(proc)
        err = error_object(proc)
        assert err["code"] == "RIVET_STATE_COPY_OLDER" and "serial 1" in err["message"] and "4" in err["message"]
        assert tree_digest(place.directory) == before
    plan = place.doc("restore", oldest.name, "--allow-older", "--dry-run")
    assert plan["dry_run"] and plan["after"]["serial"] == 5 and plan["before"]["serial"] == 4
    assert {lease["key"] for lease in plan["plan"]["leases"]} >= {"state:exclusive", "chunk-run:orders"}
    assert tree_digest(place.directory) == before
    done = place.doc("restore", oldest.name, "--allow-older")
    assert done["action"] == "restored" and (done["before"]["serial"], done["after"]["serial"]) == (4, 5)
    assert place.cursor() is None and place.serial() == 5
    (kept,) = place.backups("restore")
    assert done["backup"] == str(kept)
    assert tree_digest(place.directory)[".rivet_state.db.backup-restore-" + kept.name.rsplit("-", 1)[1]] == \
        before[".rivet_state.db"], "the replaced state is kept whole"
    (row,) = place.audit("restore")
    assert (row["copy_serial"], row["live_serial"], row["allow_older"], row["backup"]) == (1, 4, True, str(kept))
    rows = place.doc("check")["checks"]
    assert "RIVET_STATE_ROLLED_BACK" not in {c["code"] for c in rows}, "the restored state is ahead of every copy"


def test_a_rolled_back_state_is_reported_and_its_newer_copy_restores_without_allow_older(place: Place) -> None:
    newest = place.backups()[-1]  # serial 3, cursor 2
    shutil.copy(place.backups()[0], place.file)  # the live file replaced by an older copy (serial 1)
    for wal in place.directory.glob(".rivet_state.db-*"):
        wal.unlink()
    proc = place.cli("--json", "check")
    assert proc.returncode == 0, describe(proc)
    rows = [c for c in json.loads(proc.stdout)["checks"] if c["code"] == "RIVET_STATE_ROLLED_BACK"]
    assert [r["status"] for r in rows] == ["warn"] and "serial 3" in rows[0]["message"], rows
    strict = json.loads(place.cli("--json", "check", "--strict").stdout)
    assert [c["status"] for c in strict["checks"] if c["code"] == "RIVET_STATE_ROLLED_BACK"] == ["fail"]
    doctor = json.loads(place.cli("--json", "doctor").stdout)
    (reason,) = [r for r in doctor["state"]["reasons"] if r["code"] == "RIVET_STATE_ROLLED_BACK"]
    assert [c["serial"] for c in reason["evidence"]["newer"]] == [2, 3]
    done = place.doc("restore", newest.name)
    assert done["after"]["serial"] == 4 and place.cursor() == "2"
    assert not [c for c in place.doc("check")["checks"] if c["code"] == "RIVET_STATE_ROLLED_BACK"]


def test_a_copy_of_another_source_or_lineage_is_refused_byte_identical(place: Place, tmp_path: Path) -> None:
    other = Place(tmp_path, "other")
    assert other.cli("init").returncode == 0
    assert other.cli("exports", "set-cursor", "orders", "9").returncode == 0
    for _ in range(5):  # ahead of place's serial: only the lineage tells them apart
        assert other.cli("exports", "set-cursor", "orders", "9").returncode == 0
    foreign = tmp_path / "foreign.db"
    shutil.copy(other.backups()[-1], foreign)
    db = sqlite3.connect(foreign)
    db.execute("UPDATE rivet_identity SET state_key = 'postgresql://elsewhere:5432/sales'")
    db.commit()
    db.close()
    before = tree_digest(place.directory)
    for copy, says in ((other.backups()[-1], "lineage"), (foreign, "elsewhere")):
        proc = place.cli("restore", str(copy), "--allow-older")
        assert proc.returncode == 5, describe(proc)
        err = error_object(proc)
        assert err["code"] == "RIVET_STATE_FOREIGN" and says in err["message"], err
        assert tree_digest(place.directory) == before


def test_if_absent_restores_into_an_empty_directory_and_leaves_a_live_state_alone(place: Place,
                                                                                tmp_path: Path) -> None:
    copy = tmp_path / "brought.db"
    shutil.copy(place.backups()[-1], copy)  # serial 3, cursor 2
    empty = Place(tmp_path, "volume")
    plan = empty.doc("restore", str(copy), "--if-absent", "--dry-run")
    assert plan["action"] == "created" and os.listdir(empty.directory) == []
    done = empty.doc("restore", str(copy), "--if-absent")
    assert done["action"] == "created" and done["after"]["serial"] == 4
    assert empty.cursor() == "2" and empty.serial() == 4
    assert empty.file.stat().st_mode & 0o777 == copy.stat().st_mode & 0o777, "the copy's mode, as init's state has"
    assert empty.doc("info")["lineage"]["id"] == place.doc("info")["lineage"]["id"]
    assert [row["copy"] for row in empty.audit("restore")] == [str(copy)]
    before = tree_digest(place.directory)
    again = place.doc("restore", str(copy), "--if-absent")
    assert again["action"] == "none" and tree_digest(place.directory) == before
    missing = Place(tmp_path, "unused")
    missing.directory.rmdir()
    proc = missing.cli("restore", str(copy), "--if-absent")
    assert proc.returncode == 1 and error_object(proc)["code"] == "RIVET_STATE_DIR_MISSING", describe(proc)
    assert not missing.directory.exists()


def test_prune_keeps_the_newest_good_copy_audits_and_its_dry_run_changes_nothing(place: Place,
                                                                                 tmp_path: Path) -> None:
    """Prune removes only verified copies of the live lineage, never the newest of them; a
    damaged copy, a symlink and another lineage's copy stay (a fresh user's findings: it
    removed the only copy of the lineage and kept a planted foreign one, and said it had
    removed symlinks it left)."""
    first, second, third = place.backups()
    with open(third, "r+b") as damaged:
        damaged.seek(4096 * 2)
        damaged.write(b"\xff" * 4096)
    other = Place(tmp_path, "other")
    assert other.cli("init").returncode == 0
    foreign = place.directory / ".rivet_state.db.backup-migrate-20991231T235959Z"
    shutil.copy(other.file, foreign)
    planted = place.directory / ".rivet_state.db.backup-planted-20000101T000000Z"
    planted.symlink_to(first)
    before = tree_digest(place.directory)
    plan = place.doc("backups", "prune", "--keep", "0", "--dry-run")
    assert [c["name"] for c in plan["removed"]] == [first.name], "the newest good copy of the lineage stays"
    assert tree_digest(place.directory) == before
    usage = place.cli("backups", "prune")
    assert usage.returncode == 1 and error_object(usage)["code"] == "RIVET_CLI_USAGE", describe(usage)
    done = place.doc("backups", "prune", "--keep", "0")
    assert [c["name"] for c in done["removed"]] == [first.name]
    assert place.backups() == sorted([second, third, foreign, planted]) and planted.is_symlink()
    (row,) = place.audit("backups.prune")
    assert row["removed"] == [first.name] and row["failed"] == [] and row["keep"] == 0
    assert place.doc("backups", "prune", "--older-than", "1")["removed"] == [], "a copy of today is not old"


def test_prune_never_removes_a_copy_ahead_of_a_rolled_back_state(place: Place) -> None:
    """A fresh user's finding: after a rollback, prune removed the copies ahead of the live
    state (the only record of the newer progress) and kept the newest by time, which was
    the old one; check then said nothing."""
    first, second, third = place.backups()  # serials 1, 2, 3
    shutil.copy(first, place.file)
    for wal in place.directory.glob(".rivet_state.db-*"):
        wal.unlink()
    assert place.cli("exports", "set-cursor", "orders", "r").returncode == 0  # live at 2, its backup at 1
    done = place.doc("backups", "prune", "--keep", "0")
    left = {p.name for p in place.backups()}
    assert {second.name, third.name} <= left, "the copies ahead of (or gone apart from) the live state stay"
    assert all(c["serial"] == 1 for c in done["removed"]), done["removed"]
    assert [c for c in place.doc("check")["checks"] if c["code"] == "RIVET_STATE_ROLLED_BACK"]


@pytest.mark.postgres
def test_a_postgresql_state_has_no_copy_of_ours_and_restore_says_what_to_use(tmp_path: Path, pg_url: str) -> None:
    config = write_config(tmp_path / "pipeline")
    env = {"RIVET_STATE_URL": pg_url}
    assert run_cli("-c", str(config), "init", env=env).returncode == 0
    proc = run_cli("-c", str(config), "--json", "backups", "list", env=env)
    assert proc.returncode == 0 and json.loads(proc.stdout)["copies"] == [], describe(proc)
    copy = tmp_path / "some.db"
    copy.write_bytes(b"")
    proc = run_cli("-c", str(config), "--json-errors", "restore", str(copy), env=env)
    assert proc.returncode == 1, describe(proc)
    err = error_object(proc)
    assert err["code"] == "RIVET_STATE_BACKEND_UNSUPPORTED" and "import" in err["message"], err


def test_a_rollback_written_over_up_to_the_copys_serial_is_still_told_apart(place: Place) -> None:
    """A fresh user's finding: roll the state back by hand to a copy at serial 2, write it
    twice, and it is at serial 4 again, as the backup of serial 4 (taken before the last
    change) is, with other progress; the rollback warning went quiet and the backup
    restored without --allow-older, taking the newer cursor back."""
    assert place.cli("exports", "set-cursor", "orders", "4").returncode == 0  # backup at serial 4, live at 5
    at_four = place.backups()[-1]
    shutil.copy(place.backups()[1], place.file)  # serial 2 (cursor 1)
    for wal in place.directory.glob(".rivet_state.db-*"):
        wal.unlink()
    for value in ("a", "b"):
        assert place.cli("exports", "set-cursor", "orders", value).returncode == 0
    assert place.serial() == 4
    rows = [c for c in place.doc("check")["checks"] if c["code"] == "RIVET_STATE_ROLLED_BACK"]
    assert rows and "went apart" in rows[0]["message"], place.doc("check")["checks"]
    before = tree_digest(place.directory)
    for extra in ((), ("--dry-run",)):
        proc = place.cli("restore", at_four.name, *extra)
        assert proc.returncode == 5 and error_object(proc)["code"] == "RIVET_STATE_COPY_DIVERGED", describe(proc)
    assert tree_digest(place.directory) == before
    done = place.doc("restore", at_four.name, "--allow-older")
    assert place.cursor() == "3" and done["after"]["serial"] == 5


def test_a_symlinked_state_file_whose_target_is_gone_is_missing_with_where_it_pointed(tmp_path: Path) -> None:
    """A fresh user's finding: every command was RIVET_INTERNAL on a symlink to nothing."""
    p = Place(tmp_path)
    p.file.symlink_to(tmp_path / "unmounted" / ".rivet_state.db")
    for args, code in ((("check",), 5), (("leases",), 5), (("exports", "list"), 0), (("info",), 0)):
        proc = p.cli(*args)  # info and exports list describe a missing state; the others refuse it
        assert proc.returncode == code and "RIVET_INTERNAL" not in proc.stderr, describe(proc)
    proc = p.cli("--json", "check")
    (row,) = [c for c in json.loads(proc.stdout)["checks"] if c["code"] == "RIVET_STATE_MISSING"]
    assert "is a symlink to" in row["message"] and "unmounted" in row["message"], row


def test_a_legacy_live_state_is_restored_over_like_any_other(place: Place) -> None:
    """A fresh user's finding: restoring over a live state of the legacy shape (no identity
    table: a legacy copy restored before) was RIVET_INTERNAL after its dry run passed."""
    from statetool.example import build_legacy_state

    newest = place.backups()[-1]
    place.file.unlink()
    for companion in place.directory.glob(".rivet_state.db-*"):
        companion.unlink()
    build_legacy_state(place.file, [("orders", "incremental")], 3)
    plan = place.doc("restore", newest.name, "--allow-older", "--dry-run")
    assert plan["dry_run"], plan
    done = place.doc("restore", newest.name, "--allow-older")
    assert done["action"] == "restored" and place.cursor() == "2", done
