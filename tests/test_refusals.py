"""SPEC §4 and §9: foreign and unusable states are refused before anything is written, and a
refused file is byte-identical afterwards, with no -wal, -shm or -journal beside it."""

from __future__ import annotations

import json
import sqlite3
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from support import describe, error_object, run_cli, tree_digest, write_config
from statetool import migrations
from statetool.operations.context import Context
from statetool.operations.create import init
from statetool.runtime import StateStore

STATE = ".rivet_state.db"
OTHER = "postgresql://reader@db-old.internal:5432/sales"
OTHER_KEY = "postgresql://db-old.internal:5432/sales"
UNKNOWN_REVISION = "0099_from_the_future"
ERROR_KEYS = {"error", "exit_class", "code", "kind", "class", "exit_code", "retryable", "action", "message", "failures"}
WRITES = (("migrate",), ("identity", "adopt"), ("exports", "reset", "orders"))


def listing(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def real_state(state_dir: Path, source: str) -> Path:
    """A state at head in ``state_dir`` stamped with ``source``'s key, with a run's progress."""
    config = write_config(state_dir.parent / f"maker-{state_dir.name}", source_url=source)
    env = {"RIVET_STATE_URL": f"sqlite:{state_dir}"}
    init(Context(config, None, env, 30.0))
    store = StateStore.open(config, env=env, lock_wait=30, create=True)
    with store.transaction() as tx:
        for i in range(200):
            run_id = tx.start_run("orders", "incremental", run_id=f"run-{i:05d}")
            tx.finish_run(run_id, "succeeded", rows=i, files=1, error="x" * 200)
        tx.commit_cursor("orders", "incremental", "2026-11-29T00:00:00.000000Z")
    path = state_dir / STATE
    assert not Path(f"{path}-wal").exists()
    return path


def foreign(state_dir: Path) -> None:
    real_state(state_dir, OTHER)


def plain_text(state_dir: Path) -> None:
    (state_dir / STATE).write_text("these are my notes, not a database\n" * 20)


def empty_file(state_dir: Path) -> None:
    (state_dir / STATE).write_bytes(b"")


def other_application(state_dir: Path) -> None:
    conn = sqlite3.connect(state_dir / STATE)
    with conn:
        conn.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)")
        conn.execute("INSERT INTO alembic_version VALUES ('3f2a9c1d7b44')")
        conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, email TEXT)")
        conn.executemany("INSERT INTO users (email) VALUES (?)", [(f"u{i}@example.com",) for i in range(50)])
    conn.close()


def truncated(state_dir: Path) -> None:
    path = real_state(state_dir, "postgresql://reader@db.internal:5432/sales")
    data = path.read_bytes()
    page_size = int.from_bytes(data[16:18], "big")
    assert len(data) >= 8 * page_size
    path.write_bytes(data[: len(data) // 2 // page_size * page_size])


def overwritten_page(state_dir: Path) -> None:
    path = real_state(state_dir, "postgresql://reader@db.internal:5432/sales")
    conn = sqlite3.connect(f"file:{path}?immutable=1", uri=True)
    root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'rivet_runs'").fetchone()[0]
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    leaves = conn.execute("SELECT count(*) FROM rivet_runs").fetchone()[0]
    conn.close()
    assert root > 1 and leaves == 200
    with open(path, "r+b") as fh:
        fh.seek((root - 1) * page_size)
        fh.write(bytes([0x0D, 0xFF, 0xFF, 0x7F]) + b"\xa5" * (page_size - 4))


def newer_revision(state_dir: Path) -> None:
    path = real_state(state_dir, "postgresql://reader@db.internal:5432/sales")
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("UPDATE rivet_state_version SET version_num = ?", (UNKNOWN_REVISION,))
    conn.close()
    assert not Path(f"{path}-wal").exists()


def hand_edited_versions(rows: list[str]) -> Callable[[Path], None]:
    """A state whose version table was edited by hand to hold ``rows`` (none, or several)."""
    def build(state_dir: Path) -> None:
        path = real_state(state_dir, "postgresql://reader@db.internal:5432/sales")
        conn = sqlite3.connect(path)
        with conn:
            conn.execute("DELETE FROM rivet_state_version")
            conn.executemany("INSERT INTO rivet_state_version VALUES (?)", [(r,) for r in rows])
        conn.close()
    return build


def expect_hand_edit(message: str, state_dir: Path) -> None:
    """Found by a fresh user: an empty table read "at revision None ... written by a newer release"."""
    assert "rivet_state_version" in message and "by hand" in message and "None" not in message
    assert "newer" not in message


def expect_foreign(message: str, state_dir: Path) -> None:
    assert str(state_dir) in message and OTHER_KEY in message


def expect_path(message: str, state_dir: Path) -> None:
    assert str(state_dir / STATE) in message


def expect_revisions(message: str, state_dir: Path) -> None:
    assert UNKNOWN_REVISION in message and migrations.head() in message


# name -> (builder, code, exit, check that the message says what it must)
CASES: dict[str, tuple[Callable[[Path], None], str, int, Callable[[str, Path], None]]] = {
    "foreign": (foreign, "RIVET_STATE_FOREIGN", 5, expect_foreign),
    "plain-text-file": (plain_text, "RIVET_STATE_NOT_A_STATE", 5, expect_path),
    "empty-file": (empty_file, "RIVET_STATE_NOT_A_STATE", 5, expect_path),
    "other-application-with-alembic-version": (other_application, "RIVET_STATE_NOT_A_STATE", 5, expect_path),
    "truncated": (truncated, "RIVET_STATE_CORRUPT", 4, expect_path),
    "overwritten-page": (overwritten_page, "RIVET_STATE_CORRUPT", 4, expect_path),
    "unknown-revision": (newer_revision, "RIVET_STATE_SCHEMA_NEWER", 3, expect_revisions),
    "empty-version-table": (hand_edited_versions([]), "RIVET_STATE_SCHEMA_UNEXPECTED", 3, expect_hand_edit),
    "two-version-rows": (hand_edited_versions(["0003", "0002"]), "RIVET_STATE_SCHEMA_UNEXPECTED", 3,
                         expect_hand_edit),
}


def assert_error_object(proc: subprocess.CompletedProcess[str], code: str, exit_code: int) -> dict:
    assert proc.returncode == exit_code, describe(proc)
    error = error_object(proc)
    assert set(error) == ERROR_KEYS, describe(proc)
    assert error["code"] == code, describe(proc)
    assert isinstance(error["exit_class"], int) and error["exit_class"] == exit_code == error["exit_code"], \
        describe(proc)
    assert error["class"] == {3: "schema_drift", 4: "data_integrity", 5: "refusal"}[exit_code], describe(proc)
    assert error["retryable"] is False, describe(proc)
    assert error["action"] and error["kind"] and error["message"] == error["error"], describe(proc)
    assert "Traceback" not in proc.stderr, describe(proc)
    return error


@pytest.mark.parametrize("case", list(CASES))
def test_unusable_state_is_refused_byte_identical_by_every_command(tmp_path: Path, case: str) -> None:
    build, code, exit_code, says = CASES[case]
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    build(state_dir)
    config = write_config(tmp_path / "pipeline")
    env = {"RIVET_STATE_URL": f"sqlite:{state_dir}"}
    before = (tree_digest(state_dir), listing(state_dir), tree_digest(config.parent), listing(config.parent))

    def unchanged(proc: subprocess.CompletedProcess[str]) -> None:
        after = (tree_digest(state_dir), listing(state_dir), tree_digest(config.parent), listing(config.parent))
        assert after == before, describe(proc)
        for suffix in ("-wal", "-shm", "-journal"):
            assert not (state_dir / f"{STATE}{suffix}").exists(), describe(proc)

    check = run_cli("-c", str(config), "check", "--json", "--json-errors", env=env)
    says(assert_error_object(check, code, exit_code)["message"], state_dir)
    failing = [c for c in json.loads(check.stdout)["checks"] if c["status"] == "fail"]
    assert failing and failing[0]["code"] == code, describe(check)
    unchanged(check)

    info = run_cli("-c", str(config), "info", "--json", "--json-errors", env=env)
    if code == "RIVET_STATE_FOREIGN":
        # info describes what it finds: the verdict a write would meet.
        assert info.returncode == 0, describe(info)
        assert json.loads(info.stdout)["identity"]["code"] == code, describe(info)
    elif code == "RIVET_STATE_SCHEMA_NEWER":
        assert info.returncode == 0, describe(info)
        revision = json.loads(info.stdout)["revision"]
        assert (revision["current"], revision["status"]) == (UNKNOWN_REVISION, "unknown"), describe(info)
    elif code == "RIVET_STATE_SCHEMA_UNEXPECTED":
        assert info.returncode == 0, describe(info)
        assert json.loads(info.stdout)["revision"]["status"] == "unknown", describe(info)
    else:
        says(assert_error_object(info, code, exit_code)["message"], state_dir)
    unchanged(info)

    for command in WRITES:
        proc = run_cli("-c", str(config), *command, "--json-errors", env=env)
        says(assert_error_object(proc, code, exit_code)["message"], state_dir)
        unchanged(proc)


@pytest.mark.parametrize("where", ["declared_dir", "beside_config"])
def test_missing_state_fails_check_and_migrate_points_to_init_creating_nothing(tmp_path: Path, where: str) -> None:
    config = write_config(tmp_path / "pipeline")
    state_dir = tmp_path / "state" if where == "declared_dir" else config.parent
    state_dir.mkdir(exist_ok=True)
    env = {"RIVET_STATE_URL": f"sqlite:{state_dir}"} if where == "declared_dir" else {}
    before = (listing(tmp_path), tree_digest(tmp_path))

    check = run_cli("-c", str(config), "check", "--json", env=env)
    assert check.returncode == 5, describe(check)
    row = next(c for c in json.loads(check.stdout)["checks"] if c["status"] == "fail")
    assert row["code"] == "RIVET_STATE_MISSING", describe(check)
    assert str(state_dir / STATE) in row["message"], describe(check)
    assert (listing(tmp_path), tree_digest(tmp_path)) == before, describe(check)

    migrate = run_cli("-c", str(config), "migrate", "--json-errors", env=env)
    error = assert_error_object(migrate, "RIVET_STATE_MISSING", 5)
    assert "statetool init" in error["message"] + error["action"], describe(migrate)
    assert (listing(tmp_path), tree_digest(tmp_path)) == before, describe(migrate)


def test_missing_declared_directory_is_not_created_by_any_command(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    missing = tmp_path / "mount" / "state"
    env = {"RIVET_STATE_URL": f"sqlite:{missing}"}
    for command in (("check",), ("migrate",), ("init",), ("exports", "reset", "orders")):
        proc = run_cli("-c", str(config), *command, "--json-errors", env=env)
        assert proc.returncode != 0, describe(proc)
        assert not (tmp_path / "mount").exists(), describe(proc)
    assert listing(config.parent) == ["rivet.yaml"]
