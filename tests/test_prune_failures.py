"""``statetool prune`` when something fails, and what it is told (issue 16 item 2; a fresh
user's findings on it).

Real states, real faults: a trigger of the state's database refusing one row of batch 3
of 8, a tmpfs that fills while a batch's archive member is being written, a process killed
after a batch's member is in the archive and before that batch committed, a read-only bind
mount and a directory owned by another user (the CLI as ``nobody``), numbers out of range
and empty file names given to the real CLI in a subprocess. What must hold: a failure after
committed batches says which batches and how many rows of each table were committed (and
archived), and that the same prune run again finishes the rest; the archive holds only
whole gzip members of committed batches, every line names its prune and batch, and its
reader keeps only lines whose batch has an audit row; a dry run where a real prune would be
refused gives its counts with the warning saying so.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from referencing import Registry, Resource

from support import describe, error_object, fork_code, process_env, run_cli_process, tree_digest, write_config
from support.backends import StateBackend
from support.crash_driver import run_killed_at
from support.history import PRUNED, bulk_history, committed_batches, read_archive, store_of, table_rows
from statetool.cli import command_tree
from statetool.errors import REGISTRY, StateError
from test_checkpoint_reading import CLI_AS_NOBODY, nobody_dir  # noqa: F401 - a fixture
from test_relocate import TmpfsMount

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = ROOT / "docs" / "schemas"


def _require_root() -> None:
    if os.geteuid() != 0:  # said loudly: mounts and another user need root
        if os.environ.get("CI"):
            pytest.fail("these tests need root (mounts, another user)")
        pytest.skip("these tests need root (mounts, another user)")


def _pipeline(tmp_path: Path, runs: int = 100, ledger: int = 50) -> tuple[Path, dict[str, str]]:
    """A SQLite state beside its config with ``runs`` runs and ``ledger`` ledger rows of
    export orders (bulk_history: the latest succeeded run is the last one)."""
    backend = StateBackend.sqlite(tmp_path)
    config = write_config(backend.pipeline)
    env = process_env(backend.env)
    store_of(config, env)
    bulk_history(config, env, "orders", runs, ledger)
    return config, env


def _cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli_process("-c", str(config), *args)


def _removed(before: dict[str, Any], after: dict[str, Any]) -> dict[str, set[Any]]:
    return {t: set(before[t]) - set(after[t]) for t in PRUNED}


def _keys(rows: list[tuple[str, dict[str, Any]]]) -> dict[str, set[Any]]:
    out: dict[str, set[Any]] = {t: set() for t in PRUNED}
    for table, row in rows:
        out[table].add(row[PRUNED[table]])
    return out


# -- finding 1: a failure after committed batches says what was done --------------------------


def test_a_database_error_in_batch_3_says_which_batches_were_committed_and_archived(tmp_path: Path) -> None:
    config, env = _pipeline(tmp_path)
    state = config.parent / ".rivet_state.db"
    with sqlite3.connect(state) as db:  # the DBA's trigger refuses one row of the third batch
        db.execute("CREATE TRIGGER keep_45 BEFORE DELETE ON rivet_runs WHEN OLD.run_id = 'orders-0000045' "
                   "BEGIN SELECT RAISE(ABORT, 'orders-0000045 is kept by the DBA'); END")
    db.close()
    before = table_rows(config, env)
    archive = tmp_path / "first.jsonl.gz"
    proc = _cli(config, "--json-errors", "prune", "--keep-runs", "0", "--batch-size", "20", "--archive", str(archive))
    err = error_object(proc)
    assert err["code"] == "RIVET_STATE_PRUNE_INCOMPLETE", describe(proc)
    message = err["message"]
    assert "nothing was written" not in message, message
    assert "2 batches" in message and "40 runs" in message and "0 ledger rows" in message, message
    assert "batch 3" in message and "orders-0000045 is kept by the DBA" in message, message
    assert str(archive) in message and "run the same prune again" in message and "new file" in message, message
    cause = re.search(r"kept by the DBA \((RIVET_[A-Z_]+)\); batch 3 was rolled back", message)
    assert cause is not None and cause[1] == "RIVET_STATE_WRITE_REFUSED" in REGISTRY, message  # where the action says
    assert "in parentheses" in err["action"] and "details" not in err["action"] + message, err
    assert "details" not in err, "the object's keys are SPEC §7's, and failures"
    after = table_rows(config, env)
    removed = _removed(before, after)
    assert {t: len(k) for t, k in removed.items()} == {"rivet_runs": 40, "rivet_load_ledger": 0}
    assert _keys(read_archive(archive, committed_batches(config, env))) == removed, \
        "the archive holds exactly the rows of the two committed batches, whole"
    with sqlite3.connect(state) as db:
        db.execute("DROP TRIGGER keep_45")
    db.close()
    again = _cli(config, "--json", "prune", "--keep-runs", "0", "--batch-size", "20", "--archive",
                 str(tmp_path / "second.jsonl.gz"))
    assert again.returncode == 0, describe(again)
    assert json.loads(again.stdout)["removed"] == {"rivet_runs": 59, "rivet_load_ledger": 50}, "the rest"


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of 2 MiB (root only; tests/test_relocate.py's mount), unmounted afterwards."""
    _require_root()
    mount = TmpfsMount(tmp_path / "small")
    try:
        yield mount.mount("2m")
    finally:
        mount.unmount()


def _fill(directory: Path) -> None:
    """Write a file in ``directory`` until its filesystem has no byte left."""
    with open(directory / "filler", "wb", buffering=0) as fh:
        for chunk in (1 << 16, 4096, 1):  # each size until ENOSPC, then a smaller one
            try:
                while True:
                    fh.write(b"x" * chunk)
            except OSError:
                pass


def test_an_archive_whose_disk_fills_mid_member_keeps_whole_members_of_committed_batches_only(
        tmp_path: Path, small_fs: Path) -> None:
    from statetool.operations.context import Context
    from statetool.operations.retention import prune_history

    config, env = _pipeline(tmp_path, runs=3000, ledger=0)
    before = table_rows(config, env)
    archive = small_fs / "history.jsonl.gz"

    def fill_at(step: str) -> None:
        if step == "committed-2":  # the disk fills between two batches: the third member is cut
            _fill(small_fs)

    ctx = Context(config, None, env=env, lock_wait=10, on_step=fill_at)
    with pytest.raises(StateError) as caught:
        prune_history(ctx, keep_runs=0, batch_size=500, archive=archive)
    err = caught.value
    assert err.code == "RIVET_STATE_PRUNE_INCOMPLETE", err
    assert err.details["cause"] == "RIVET_STATE_DISK_FULL" and err.details["batches"] == 2, err.details
    assert "1000 runs" in err.message and "run the same prune again" in err.message, err.message
    removed = _removed(before, table_rows(config, env))
    assert len(removed["rivet_runs"]) == 1000
    assert archive.stat().st_size == err.details["archive_bytes"], "the cut member was truncated away"
    assert _keys(read_archive(archive, committed_batches(config, env))) == removed, \
        "whole members only (read strictly), holding exactly the removed rows"
    (small_fs / "filler").unlink()
    again = _cli(config, "--json", "prune", "--keep-runs", "0", "--batch-size", "500")
    assert again.returncode == 0 and json.loads(again.stdout)["removed"]["rivet_runs"] == 1999, describe(again)


def _interrupted_at(tmp_path: Path, point: str) -> tuple[str, dict[str, set[Any]], set[tuple[str, int]], Path]:
    """A prune of 100 runs in batches of 20, archived, whose step ``point`` raises
    KeyboardInterrupt (Ctrl-C): ``(the one line it logged, the rows removed per table, the
    committed batches by their audit rows, the archive)``."""
    from statetool.operations.context import Context
    from statetool.operations.retention import prune_history

    config, env = _pipeline(tmp_path)
    before = table_rows(config, env)
    archive = tmp_path / "history.jsonl.gz"

    def interrupt_at(step: str) -> None:
        if step == point:
            raise KeyboardInterrupt

    said: list[str] = []
    ctx = Context(config, None, env=env, lock_wait=10, on_step=interrupt_at, log=said.append)
    with pytest.raises(KeyboardInterrupt):
        prune_history(ctx, keep_runs=0, batch_size=20, archive=archive)
    (note,) = said
    return note, _removed(before, table_rows(config, env)), committed_batches(config, env), archive


def test_ctrl_c_in_batch_3_says_on_its_way_out_which_two_batches_were_committed(tmp_path: Path) -> None:
    note, removed, committed, archive = _interrupted_at(tmp_path, "deleted-3")  # archived, deleted, not committed
    assert "was interrupted" in note and "batch 3 was rolled back" in note and "2 batches" in note, note
    assert "40 runs" in note and str(archive) in note and "run the same prune again" in note, note
    assert len(removed["rivet_runs"]) == 40
    assert _keys(read_archive(archive, committed)) == removed, \
        "the member of batch 3 was cut away: whole members of the committed batches only"


def test_ctrl_c_after_a_batch_committed_and_before_it_was_counted_says_it_committed(tmp_path: Path) -> None:
    """The full suite's real SIGINT once landed there: the message said batch 2 was rolled
    back while its audit row was in the state. The state's audit rows are the word."""
    note, removed, committed, archive = _interrupted_at(tmp_path, "landed-2")
    assert "2 batches before it were committed" in note and "rolled back" not in note and "40 runs" in note, note
    assert len(committed) == 2 and len(removed["rivet_runs"]) == 40
    assert _keys(read_archive(archive, committed)) == removed, "batch 2's member is kept: it committed"


def test_a_real_sigint_after_committed_batches_exits_130_saying_what_was_committed(tmp_path: Path) -> None:
    config, env = _pipeline(tmp_path, runs=20000, ledger=0)
    archive = tmp_path / "history.jsonl.gz"
    proc = subprocess.Popen([sys.executable, "-m", "statetool", "-c", str(config), "prune", "--keep-runs", "0",
                             "--batch-size", "5", "--archive", str(archive)], env=process_env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(committed_batches(config, env)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    committed = committed_batches(config, env)
    (prune_id,) = {p for p, _ in committed}
    assert f"statetool: interrupted; prune {prune_id} was interrupted: " in stderr, stderr
    assert f"{len(committed)} batches before it were committed and audited" in stderr, stderr
    assert f"{5 * len(committed)} runs" in stderr and "run the same prune again" in stderr, stderr
    assert len(read_archive(archive, committed)) == 5 * len(committed)


def test_a_failure_before_any_batch_committed_says_nothing_was_pruned_and_leaves_no_archive(
        tmp_path: Path) -> None:
    config, env = _pipeline(tmp_path, runs=10, ledger=0)
    state = config.parent / ".rivet_state.db"
    with sqlite3.connect(state) as db:
        db.execute("CREATE TRIGGER keep_all BEFORE DELETE ON rivet_runs BEGIN SELECT RAISE(ABORT, 'kept'); END")
    db.close()
    archive = tmp_path / "a.jsonl.gz"
    proc = _cli(config, "--json-errors", "prune", "--keep-runs", "0", "--archive", str(archive))
    assert error_object(proc)["code"] == "RIVET_STATE_WRITE_REFUSED", describe(proc)
    assert not archive.exists(), "the first batch never committed: its archive is not left behind"


# -- finding 6: archive lines name their prune and batch; readers keep committed batches only ---


def test_archive_lines_name_their_prune_and_batch_and_a_reader_keeps_only_committed_batches(
        tmp_path: Path) -> None:
    config, env = _pipeline(tmp_path)
    before = table_rows(config, env)
    archive = tmp_path / "killed.jsonl.gz"
    killed = run_killed_at("archived-3", "-c", str(config), "prune", "--keep-runs", "0", "--batch-size", "20",
                           "--archive", str(archive))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    with gzip.open(archive, "rt") as fh:
        lines = [json.loads(line) for line in fh]
    defs = json.loads((SCHEMAS / "defs.schema.json").read_text())
    registry = Registry().with_resource(defs["$id"], Resource.from_contents(defs))
    line_schema = {"$ref": f"{defs['$id']}#/$defs/prune_archive_line"}
    for line in lines:
        jsonschema.validate(line, line_schema, registry=registry)
    assert len({line["prune"] for line in lines}) == 1 and {line["batch"] for line in lines} == {1, 2, 3}
    committed = committed_batches(config, env)
    assert committed == {(lines[0]["prune"], 1), (lines[0]["prune"], 2)}
    removed = _removed(before, table_rows(config, env))
    assert _keys(read_archive(archive, committed)) == removed, \
        "the rows of batch 3, archived but never removed, are not read back as removed"


# -- finding 2: numbers out of range ------------------------------------------------------------


@pytest.mark.parametrize(("args", "words"), [
    (("prune", "--keep-runs", "99999999999999999999"), "--keep-runs 99999999999999999999 is outside 0 to 1000000000"),
    (("prune", "--keep-runs", "1000000001"), "--keep-runs 1000000001 is outside 0 to 1000000000"),
    (("prune", "--keep-runs", "-1"), "--keep-runs -1 is outside 0 to 1000000000"),
    (("backups", "prune", "--keep", "99999999999999999999"), "--keep 99999999999999999999 is outside 0 to 1000000000"),
    (("backups", "prune", "--keep", "-1"), "--keep -1 is outside 0 to 1000000000"),
    (("backups", "prune", "--older-than", "nan"), "--older-than nan is outside 0 to 1000000 days"),
    (("backups", "prune", "--older-than", "inf"), "--older-than inf is outside 0 to 1000000 days"),
    (("backups", "prune", "--older-than", "-inf"), "--older-than -inf is outside 0 to 1000000 days"),
    (("backups", "prune", "--older-than", "1e300"), "--older-than 1e+300 is outside 0 to 1000000 days"),
    # ISO-8601 times whose UTC leaves the years 1 to 9999 (before: OverflowError, RIVET_INTERNAL)
    (("prune", "--before", "9999-12-31T23:59:59-01:00"), "--before '9999-12-31T23:59:59-01:00' is no ISO-8601 date"),
    (("prune", "--before", "0001-01-01T00:00:00+01:00"), "--before '0001-01-01T00:00:00+01:00' is no ISO-8601 date"),
    (("prune", "--before", "99999-01-01"), "in the years 1 to 9999 (UTC)"),
])
@pytest.mark.parametrize("dry_run", [True, False])
def test_numbers_out_of_range_are_usage_errors_naming_the_option(tmp_path: Path, args: tuple[str, ...], words: str,
                                                                  dry_run: bool) -> None:
    config, _env = _pipeline(tmp_path, runs=5, ledger=0)
    files = tree_digest(tmp_path)
    proc = _cli(config, "--json-errors", *args, *(["--dry-run"] if dry_run else []))
    err = error_object(proc)
    assert (err["code"], proc.returncode) == ("RIVET_CLI_USAGE", 1), describe(proc)
    assert words in err["message"], describe(proc)
    assert tree_digest(tmp_path) == files


# -- finding 4: an empty file name, for every path option of the CLI -----------------------------


def _path_params() -> list[tuple[tuple[str, ...], Any]]:
    """``[(command path, parameter)]`` of every option and argument of the CLI that names a
    file or directory: every path type (typer's own, or :class:`statetool.cli.PathName`) and
    the names statetool checks itself (--to DIR, restore COPY, diff A B)."""
    from typer.models import TyperPath

    found: list[tuple[tuple[str, ...], Any]] = []

    def walk(command: Any, path: tuple[str, ...]) -> None:
        found.extend((path, p) for p in command.params if isinstance(p.type, TyperPath))
        for name, sub in (getattr(command, "commands", None) or {}).items():
            walk(sub, (*path, name))

    walk(command_tree(), ())
    return found


def _argv(path: tuple[str, ...], param: Any) -> list[str]:
    """A command line giving ``param`` an empty name, every other required parameter a word."""
    from statetool.cli import command_tree as tree

    command = tree()
    for name in path:
        command = command.commands[name]
    before: list[str] = []
    for other in command.params:
        given = "" if other is param else "x" if other.required else None
        if given is None:
            continue
        before += [given] if other.param_type_name == "argument" else [other.opts[0], given]
    return [*path, *before] if path else [*before, "info"]


def test_every_path_option_is_a_path_name_and_refuses_an_empty_name_naming_itself(tmp_path: Path) -> None:
    from statetool.cli import PathName

    params = _path_params()
    names = {opt for _, p in params for opt in (p.opts or [p.name])}
    assert {"--config", "--archive", "--output", "--textfile", "--to", "FILE", "COPY", "A", "B"} <= \
        names | {p.human_readable_name for _, p in params}, names
    config, _env = _pipeline(tmp_path, runs=3, ledger=0)
    files = tree_digest(tmp_path)
    for path, param in params:
        assert isinstance(param.type, PathName), f"{' '.join(path)} {param.name}: a path option of its own type"
        argv = _argv(path, param)
        proc = run_cli_process("--json-errors", *(["-c", str(config)] if param.name != "config" else []), *argv)
        err = error_object(proc)
        assert err["code"] == "RIVET_CLI_USAGE" and "an empty name names no file" in err["message"], describe(proc)
        shown = param.opts[0] if param.param_type_name == "option" else param.human_readable_name
        assert f"'{shown}'" in err["message"], (argv, err["message"])
    assert tree_digest(tmp_path) == files, "nothing written, nothing created"


# -- finding 3: a dry run where a real prune would be refused ----------------------------------

def _dry_run_warns(proc: Any, words: str) -> None:
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    assert doc["dry_run"] and doc["removed"] == {"rivet_runs": 99, "rivet_load_ledger": 50}, doc["removed"]
    codes = [w["code"] for w in doc["warnings"]]
    assert codes and set(codes) == {"RIVET_STATE_READ_ONLY_DRY_RUN"}, describe(proc)
    assert all(words in w["message"] and "the real run will be refused" in w["message"] for w in doc["warnings"]), \
        doc["warnings"]


@pytest.mark.parametrize("options", [(), ("--vacuum",), ("--archive", "{dir}/a.jsonl.gz")])
def test_a_dry_run_on_a_read_only_mount_gives_the_counts_and_says_the_real_run_is_refused(
        tmp_path: Path, options: tuple[str, ...]) -> None:
    _require_root()
    config, _env = _pipeline(tmp_path / "rw")
    view = tmp_path / "ro"
    view.mkdir()
    subprocess.run(["mount", "--bind", str(config.parent.parent), str(view)], check=True, capture_output=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(view)], check=True, capture_output=True)
        files = tree_digest(tmp_path / "rw")
        ro_config = view / config.parent.name / config.name
        args = [a.format(dir=ro_config.parent) for a in options]
        proc = _cli(ro_config, "--json", "prune", "--keep-runs", "1", "--dry-run", *args)
        _dry_run_warns(proc, "read-only")
        real = _cli(ro_config, "--json-errors", "prune", "--keep-runs", "1", *args)
        assert error_object(real)["code"] == "RIVET_STATE_READ_ONLY", describe(real)
        assert tree_digest(tmp_path / "rw") == files
    finally:
        subprocess.run(["umount", str(view)], check=True)


@pytest.mark.parametrize("options", [(), ("--vacuum",), ("--archive", "{dir}/a.jsonl.gz")])
def test_a_dry_run_by_a_user_who_may_not_write_there_gives_the_counts_and_says_the_real_run_is_refused(
        nobody_dir: Path, options: tuple[str, ...]) -> None:
    config, _env = _pipeline(nobody_dir)
    files = tree_digest(nobody_dir)
    args = [a.format(dir=config.parent) for a in options]

    def as_nobody(*argv: str) -> Any:
        proc = fork_code(CLI_AS_NOBODY, "-c", str(config), *argv, env=process_env(), stdout=-1, stderr=-1)
        out, err = proc.communicate(timeout=120)
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    _dry_run_warns(as_nobody("--json", "prune", "--keep-runs", "1", "--dry-run", *args), "may not write")
    real = as_nobody("--json-errors", "prune", "--keep-runs", "1", *args)
    assert error_object(real)["code"] == "RIVET_STATE_PERMISSION_DENIED", describe(real)
    assert tree_digest(nobody_dir) == files


# -- finding 5: --vacuum without room says how much it needs, and where -------------------------


def test_a_vacuum_without_room_says_how_much_it_needs_and_where(tmp_path: Path) -> None:
    _require_root()
    mount = TmpfsMount(tmp_path / "small")
    where = mount.mount("8m")
    try:
        config, env = _pipeline(where, runs=6000, ledger=0)
        state = config.parent / ".rivet_state.db"
        size = state.stat().st_size
        need = 2 * size + (1 << 20)  # the rebuilt copy and its WAL, and the change's margin
        free = os.statvfs(where).f_bavail * os.statvfs(where).f_frsize
        (where / "filler").write_bytes(b"x" * (free - size - (1 << 20) - (64 << 10)))
        free = os.statvfs(where).f_bavail * os.statvfs(where).f_frsize
        assert (1 << 20) < free < need
        files = tree_digest(where)
        for dry_run in (("--dry-run",), ()):
            proc = _cli(config, "--json-errors", "prune", "--keep-runs", "5", "--vacuum", *dry_run)
            err = error_object(proc)
            assert err["code"] == "RIVET_STATE_DISK_FULL", describe(proc)
            message = err["message"]
            assert f"needs at least {need} bytes ({need / (1 << 20):.0f} MiB) there" in message, message
            assert f"{free} bytes ({free / (1 << 20):.0f} MiB) free on the filesystem of {config.parent}" in message
            assert "--vacuum" in message and f"free {need - free} bytes" in message, message
        assert tree_digest(where) == files, "refused before anything was written"
    finally:
        mount.unmount()
