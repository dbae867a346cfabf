"""A hostile or broken environment (SPEC §8a): nothing of the state's own is followed, user
text is never markup, bad numbers are refused, and a database that refuses a write says so.

Each test names the class of fault it closes; the inputs are the ones operators tried.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support import describe, error_object, run_cli, run_cli_as_needed, run_cli_process, tree_digest, write_config
from statetool.errors import StateError
from statetool.operations.context import MAX_LOCK_WAIT, Context


@pytest.fixture
def state(tmp_path: Path) -> Path:
    """A config with a state beside it (``statetool init``); returns the config path."""
    config = write_config(tmp_path / "pipeline")
    proc = run_cli("-c", str(config), "init")
    assert proc.returncode == 0, describe(proc)
    return config


@pytest.mark.parametrize("where", ["sidecar", "folder"])
def test_a_symlink_where_a_lease_file_belongs_is_refused_and_its_target_is_never_written(
        state: Path, tmp_path: Path, where: str) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    leases = state.parent / ".rivet_state.leases"
    if where == "sidecar":
        leases.mkdir(exist_ok=True)
        (leases / "chunk-run%3Aorders").symlink_to(victim)
    else:
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (elsewhere / "chunk-run%3Aorders").symlink_to(victim)
        leases.symlink_to(elsewhere)
    before = tree_digest(state.parent)
    for args in (("exports", "set-cursor", "orders", "2026-01-01"), ("leases", "run", "--export", "orders", "--", "true")):
        proc = run_cli_as_needed("-c", str(state), "--json-errors", "--lock-wait", "0", *args)
        assert proc.returncode == 5 and error_object(proc)["code"] == "RIVET_STATE_UNSAFE_FILE", describe(proc)
        assert victim.read_text() == "precious\n", describe(proc)
        assert tree_digest(state.parent) == before, describe(proc)


def test_a_lease_folder_that_is_a_plain_file_is_refused_unsafe_not_internal(state: Path) -> None:
    (state.parent / ".rivet_state.leases").write_text("not a folder\n")
    before = tree_digest(state.parent)
    proc = run_cli_process("-c", str(state), "--json-errors", "--lock-wait", "0", "leases", "run", "--export", "orders",
                           "--", "true")
    assert proc.returncode == 5 and error_object(proc)["code"] == "RIVET_STATE_UNSAFE_FILE", describe(proc)
    assert tree_digest(state.parent) == before


def test_a_fifo_where_a_lease_file_belongs_is_refused_without_blocking(state: Path) -> None:
    leases = state.parent / ".rivet_state.leases"
    leases.mkdir(exist_ok=True)
    os.mkfifo(leases / "chunk-run%3Aorders")
    proc = run_cli_process("-c", str(state), "--json-errors", "--lock-wait", "0", "leases", "run", "--export", "orders",
                           "--", "true", timeout=30)
    assert proc.returncode == 5 and error_object(proc)["code"] == "RIVET_STATE_UNSAFE_FILE", describe(proc)


def test_text_that_looks_like_markup_is_printed_as_it_is_and_never_crashes(state: Path) -> None:
    proc = run_cli("--state-url", "sqlite:[/x]", "-c", str(state), "info")
    assert proc.returncode == 1, describe(proc)
    assert "'[/x]'" in proc.stderr and "Traceback" not in proc.stderr, describe(proc)
    assert "RIVET_STATE_DIR_RELATIVE" in proc.stderr, describe(proc)

    cursor = "[bold red]2026[/bold red][/x]"
    proc = run_cli("-c", str(state), "exports", "set-cursor", "orders", cursor)
    assert proc.returncode == 0, describe(proc)
    for args in (("info",), ("exports", "show", "orders"), ("check",)):
        proc = run_cli("-c", str(state), *args)
        assert "Traceback" not in proc.stderr and proc.returncode in (0, 5), describe(proc)
    shown = run_cli("-c", str(state), "exports", "show", "orders")
    assert "[bold red]2026" in shown.stdout, describe(shown)


def test_a_lock_wait_past_its_documented_maximum_is_refused_as_usage(state: Path) -> None:
    proc = run_cli_process("-c", str(state), "--json-errors", "--lock-wait", "3000000", "leases", "run", "--export",
                           "orders", "--", "true")
    assert proc.returncode == 1 and error_object(proc)["code"] == "RIVET_CLI_USAGE", describe(proc)
    with pytest.raises(StateError) as err:
        Context(state, lock_wait=MAX_LOCK_WAIT + 1)
    assert err.value.code == "RIVET_CLI_USAGE" and "7 days" in err.value.message
    assert Context(state, lock_wait=MAX_LOCK_WAIT).lock_wait == MAX_LOCK_WAIT


def _rollback_journal_state(config: Path) -> Path:
    """The state beside ``config`` switched to a rollback journal (as a legacy state is)."""
    path = config.parent / ".rivet_state.db"
    db = sqlite3.connect(path)
    try:
        assert db.execute("PRAGMA journal_mode = DELETE").fetchone()[0] == "delete"
    finally:
        db.close()
    return path


def test_another_copys_wal_beside_a_rollback_journal_state_is_never_merged_by_a_write(
        state: Path, tmp_path: Path) -> None:
    path = _rollback_journal_state(state)
    # another copy of the state, written in WAL mode with its frames left in its -wal
    copy = tmp_path / "copy" / ".rivet_state.db"
    copy.parent.mkdir()
    shutil.copyfile(path, copy)
    other = sqlite3.connect(copy, isolation_level=None)
    other.execute("PRAGMA journal_mode = WAL")
    other.execute("PRAGMA wal_autocheckpoint = 0")
    other.execute("INSERT INTO rivet_exports (export_name, mode, cursor_value, updated_at) "
                  "VALUES ('order_lines', 'chunked', 'FROM-THE-OTHER-COPY', 'now')")
    shutil.copyfile(f"{copy}-wal", f"{path}-wal")  # while the copy is open: its frames are not checkpointed
    other.close()
    before = tree_digest(state.parent)

    for args in (("exports", "set-cursor", "orders", "2026-01-01"), ("migrate", "--to", "0003", "--allow-data-loss"),
                 ("identity", "rekey", "--old", "postgresql://db.internal:5432/sales", "--new",
                  "postgresql://db.moved:5432/sales"), ("exports", "reset", "orders")):
        proc = run_cli("-c", str(state), "--json-errors", "--lock-wait", "0", *args)
        assert proc.returncode == 5, describe(proc)
        err = error_object(proc)
        assert err["code"] == "RIVET_STATE_FOREIGN_WAL" and f"{path}-wal" in str(err["message"]), describe(proc)
        assert tree_digest(state.parent) == before, f"{args} changed the state or its directory"
    db = sqlite3.connect(f"file:{path}?immutable=1", uri=True)
    try:
        assert db.execute("SELECT count(*) FROM rivet_exports WHERE cursor_value = 'FROM-THE-OTHER-COPY'"
                          ).fetchone() == (0,)
    finally:
        db.close()


def test_a_wal_of_another_page_size_beside_a_wal_state_is_refused_by_a_write(state: Path, tmp_path: Path) -> None:
    path = state.parent / ".rivet_state.db"
    assert path.read_bytes()[18] == 2, "statetool init makes WAL states"
    other = tmp_path / "other.db"
    db = sqlite3.connect(other, isolation_level=None)
    db.execute("PRAGMA page_size = 8192")
    db.execute("PRAGMA journal_mode = WAL")
    db.execute("PRAGMA wal_autocheckpoint = 0")
    db.execute("CREATE TABLE t (x)")
    db.execute("INSERT INTO t VALUES (1)")
    shutil.copyfile(f"{other}-wal", f"{path}-wal")
    db.close()
    before = tree_digest(state.parent)
    proc = run_cli("-c", str(state), "--json-errors", "exports", "set-cursor", "orders", "2026-01-01")
    assert proc.returncode == 5 and error_object(proc)["code"] == "RIVET_STATE_FOREIGN_WAL", describe(proc)
    assert "8192" in str(error_object(proc)["message"]), describe(proc)
    assert tree_digest(state.parent) == before


@pytest.mark.parametrize("leftover", ["-wal", "-journal"])
def test_files_of_a_former_state_beside_a_missing_one_are_never_applied_to_a_new_state(
        state: Path, tmp_path: Path, leftover: str) -> None:
    """An old state's -wal (committed frames) or -journal (a transaction to roll back) left
    where a new state would be created: SQLite would apply it to the new file."""
    old = state.parent / ".rivet_state.db"
    other = tmp_path / "other" / "rivet.yaml"
    other.parent.mkdir()
    (other.parent / f".rivet_state.db{leftover}").write_bytes(b"leftover of a state that was here\n")
    shutil.copyfile(state, other)
    before = tree_digest(other.parent)
    proc = run_cli("-c", str(other), "--json-errors", "init")
    assert proc.returncode == 5 and error_object(proc)["code"] == "RIVET_STATE_TARGET_NOT_EMPTY", describe(proc)
    assert f".rivet_state.db{leftover}" in str(error_object(proc)["message"]), describe(proc)
    from statetool.runtime import StateStore

    with pytest.raises(StateError) as err:
        StateStore.open(other, env={}, create=True)
    assert err.value.code == "RIVET_STATE_VANISHED" and f".rivet_state.db{leftover}" in err.value.message
    assert tree_digest(other.parent) == before
    assert old.is_file()


def test_an_unsafe_entry_in_the_lease_folder_fails_check_and_leases_and_a_refused_rekey_creates_nothing(
        state: Path, tmp_path: Path) -> None:
    leases = state.parent / ".rivet_state.leases"
    leases.mkdir(exist_ok=True)
    (leases / "chunk-run%3Aorders").symlink_to(tmp_path / "victim-that-does-not-exist")
    before = tree_digest(state.parent)
    listing = sorted(p.name for p in leases.iterdir())
    for args in (("leases",), ("check",), ("identity", "rekey", "--old", "postgresql://db.internal:5432/sales",
                                           "--new", "postgresql://db.moved:5432/sales")):
        proc = run_cli("-c", str(state), "--json-errors", "--lock-wait", "0", *args)
        assert proc.returncode == 5, describe(proc)
        assert "RIVET_STATE_UNSAFE_FILE" in proc.stderr + proc.stdout, describe(proc)
        assert tree_digest(state.parent) == before and sorted(p.name for p in leases.iterdir()) == listing, args
    assert not (tmp_path / "victim-that-does-not-exist").exists()


@pytest.fixture
def read_only(state: Path, tmp_path: Path) -> Any:
    """The state's directory bind-mounted read-only at a second path, with a config there;
    yields that config. A real mount (root may make one), unmounted afterwards."""
    mount_point = tmp_path / "ro"
    mount_point.mkdir()
    proc = subprocess.run(["mount", "--bind", "-o", "ro", str(state.parent), str(mount_point)], capture_output=True,
                          text=True)
    if proc.returncode != 0:  # said loudly: the fault class is untested on this machine
        pytest.fail(f"cannot make a read-only bind mount here: {proc.stderr.strip()}")
    try:
        yield mount_point / state.name
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_writes_on_a_read_only_mount_are_read_only_errors_that_change_nothing(read_only: Path) -> None:
    before = tree_digest(read_only.parent)
    for args in (("exports", "set-cursor", "orders", "2026-01-01"), ("exports", "reset", "orders"),
                 ("leases", "run", "--export", "orders", "--", "true"),
                 ("identity", "rekey", "--old", "postgresql://db.internal:5432/sales", "--new",
                  "postgresql://db.moved:5432/sales")):
        proc = run_cli_as_needed("-c", str(read_only), "--json-errors", "--lock-wait", "0", *args)
        assert proc.returncode == 1, describe(proc)
        err = error_object(proc)
        assert (err["code"], err["retryable"]) == ("RIVET_STATE_READ_ONLY", False), describe(proc)
        assert tree_digest(read_only.parent) == before, args
    proc = run_cli("-c", str(read_only), "check")
    assert proc.returncode == 0, describe(proc)  # reads still work on a read-only mount


def test_the_exit_code_of_a_refusal_does_not_depend_on_whether_stderr_is_still_read(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    empty = tmp_path / "empty"
    empty.mkdir()
    argv = [sys.executable, "-m", "statetool", "-c", str(config), "--state-url", f"sqlite:{empty}", "leases", "run",
            "--export", "orders", "--", "true"]
    env = {k: v for k, v in os.environ.items() if k != "RIVET_STATE_URL"}
    read, write = os.pipe()
    os.close(read)  # nobody reads stderr
    try:
        proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=write, env=env, timeout=120)
    finally:
        os.close(write)
    kept = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert kept.returncode == 5, describe(kept)
    assert proc.returncode == kept.returncode


@pytest.mark.parametrize("cursor", ["", "   ", "2026\x1b[2J", "line\nbreak"])
def test_an_empty_cursor_or_one_with_control_characters_is_refused_and_nothing_changes(state: Path,
                                                                                       cursor: str) -> None:
    before = tree_digest(state.parent)
    proc = run_cli("-c", str(state), "--json-errors", "exports", "set-cursor", "orders", cursor)
    assert proc.returncode == 1 and error_object(proc)["code"] == "RIVET_CLI_USAGE", describe(proc)
    assert "\x1b" not in proc.stderr
    assert tree_digest(state.parent) == before


def test_an_export_name_too_long_for_its_lease_is_refused_where_the_config_says_it(tmp_path: Path) -> None:
    name = "é" * 50  # 2 bytes each, 6 characters each percent-encoded: 300 bytes
    config = write_config(tmp_path / "pipeline", exports=f"exports:\n  - name: {name}\n    mode: full\n")
    (tmp_path / "new").mkdir()
    for args in (("check",), ("relocate", "--to", str(tmp_path / "new"), "--dry-run")):
        proc = run_cli("-c", str(config), "--json-errors", "--json", *args)
        assert proc.returncode != 0, describe(proc)  # check: the worst row wins (no state: 5); relocate: 1
        out = proc.stdout + proc.stderr
        assert "RIVET_CONFIG_INVALID" in out and f"{config}:4:" in out, describe(proc)


#: The longest export names the config accepts (their lease file name takes 240 bytes at
#: most): two that differ only in their last character, and one that percent-encodes long.
LONGEST_NAMES = ("o" * 227 + "a", "o" * 227 + "b", "o" * 200 + "é" * 4)


def test_the_longest_export_names_get_backups_whose_names_fit_and_stay_apart(tmp_path: Path) -> None:
    """A backup's name embeds the export name (issue 12 fixB item 3): with the longest
    names it is shortened to fit 255 bytes with room for its temporary directory, the
    names of two exports still differ, and nothing temporary is left behind."""
    exports = "exports:\n" + "".join(f"  - name: {n}\n    mode: incremental\n" for n in LONGEST_NAMES)
    config = write_config(tmp_path / "pipeline", exports=exports)
    assert run_cli("-c", str(config), "init").returncode == 0
    backups: list[str] = []
    for name in LONGEST_NAMES:
        for args in (("set-cursor", name, "2026-01-01"), ("reset", name)):
            proc = run_cli("-c", str(config), "--json", "exports", *args)
            assert proc.returncode == 0, describe(proc)
            backups.append(Path(json.loads(proc.stdout)["backup"]).name)
    assert len(set(backups)) == len(backups), backups
    assert all(len(b.encode()) <= 255 - 13 and b.startswith(".rivet_state.db.backup-") for b in backups), backups
    left = [p.name for p in config.parent.iterdir() if p.name.endswith((".tmp", "-journal"))]
    assert left == [], left


def test_a_checkpoint_whose_file_name_takes_255_bytes_is_moved_by_relocate(tmp_path: Path) -> None:
    """A move copies a CDC checkpoint beside its target first (``.<name>.relocating``):
    that name is shortened too, so the longest name a file system allows still moves."""
    point = "p" * 250 + ".json"
    exports = (f"exports:\n  - name: order_events\n    mode: cdc\n    cdc:\n      engine: mysql\n"
               f"      checkpoint: {point}\n")
    config = write_config(tmp_path / "pipeline", exports=exports)
    assert run_cli("-c", str(config), "init").returncode == 0
    (config.parent / point).write_text('{"file": "mysql-bin.000042", "pos": 91234}')
    target = tmp_path / "declared"
    target.mkdir()
    proc = run_cli("-c", str(config), "relocate", "--to", str(target))
    assert proc.returncode == 0, describe(proc)
    assert (target / point).read_text() == '{"file": "mysql-bin.000042", "pos": 91234}'
    assert [p.name for p in target.iterdir() if p.name.endswith(".relocating")] == []


def test_doctor_json_errors_prints_the_error_object_of_its_worst_verdict(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")  # no state: every export would be a first run
    proc = run_cli("-c", str(config), "--json-errors", "doctor")
    assert proc.returncode == 5, describe(proc)
    err = error_object(proc)
    assert err["code"] == "RIVET_STATE_MISSING" and err["exit_code"] == 5, describe(proc)
    assert set(err) >= {"error", "exit_class", "code", "kind", "class", "exit_code", "retryable", "action", "message"}


#: ISO-8601 times whose UTC falls outside Python's years 1 to 9999, as a pipeline may write them.
FAR_TIMES = ("9999-12-31T23:59:59-01:00", "0001-01-01T00:00:00+01:00")


@pytest.mark.parametrize("command", [("info",), ("exports", "list"), ("exports", "show", "orders"), ("doctor",),
                                     ("metrics",), ("check",), ("prune", "--keep-runs", "0", "--dry-run")],
                         ids=" ".join)
def test_a_state_time_beyond_the_years_1_to_9999_in_utc_is_shown_as_it_is_never_internal(
        state: Path, command: tuple[str, ...]) -> None:
    late, early = FAR_TIMES
    with sqlite3.connect(state.parent / ".rivet_state.db") as db:
        db.execute("INSERT INTO rivet_runs (run_id, export_name, mode, status, started_at, finished_at) "
                   "VALUES ('far', 'orders', 'incremental', 'succeeded', ?, ?)", (late, late))
        db.execute("INSERT INTO rivet_exports VALUES ('orders', 'incremental', '5', ?, ?)", (late, early))
    db.close()
    for output in ([], ["--json"]):
        proc = run_cli("-c", str(state), "--json-errors", *output, *command)
        assert "RIVET_INTERNAL" not in proc.stderr and proc.returncode != 6, describe(proc)


#: Every option that names a file statetool creates, with the words before the file.
OUTPUT_FILES = {"prune --archive": ("prune", "--keep-runs", "3", "--archive"),
                "prune --archive --dry-run": ("prune", "--keep-runs", "3", "--dry-run", "--archive"),
                "export -o": ("export", "-o"), "metrics --textfile": ("metrics", "--textfile")}


@pytest.mark.parametrize("kernel", ["/proc", "/sys"])
@pytest.mark.parametrize("words", OUTPUT_FILES.values(), ids=OUTPUT_FILES.keys())
def test_a_file_named_on_a_kernel_filesystem_is_refused_as_such_never_a_full_disk(
        state: Path, words: tuple[str, ...], kernel: str) -> None:
    target = f"{kernel}/statetool-test.gz"
    proc = run_cli_process("-c", str(state), "--json-errors", *words, target)
    obj = error_object(proc)
    assert (proc.returncode, obj["code"]) == (1, "RIVET_PLACE_HOLDS_NO_FILES"), describe(proc)
    assert target in obj["message"] and "kernel filesystem" in obj["message"], obj
    assert "free" not in obj["message"] and not os.path.exists(target), obj
