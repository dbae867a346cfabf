"""A restore is a write of the whole state that a kill never leaves half done (issue 14 item 3;
SPEC §8, §9).

``restore --allow-older COPY`` over a live SQLite state runs in a real process
(tests/support/crash_driver.py) that SIGKILLs itself at each step of
``restore.CRASH_POINTS``, and in a forked CLI SIGKILLed blind at delays over its measured
run time. After each kill the state at the path passes ``integrity_check`` and holds either
every value of the live state it had (cursors, rows, serial, audit) or every value of the
restored copy (serial past both, one ``restore`` audit row), never a mix; whatever else the
kill left is the restore's private directory or a second name of the live state, both of
which the re-run removes. The re-run of the same command converges: the copy's values at
serial max(live, copy) + 1, the state it replaced kept once as ``….backup-restore-<time>``.

Where no state is, ``restore PATH --if-absent`` into an empty declared directory is killed
at each step of ``restore.CREATE_POINTS``: afterwards nothing is at the state's path or the
whole restored state is, and the re-run converges.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from support import describe, fork_cli, process_env, run_cli, run_cli_forked, tree_digest, write_config
from statetool.operations.restore import CRASH_POINTS, CREATE_POINTS
from statetool.runtime import StateStore
from support.crash_driver import run_killed_at
from support.states import add_runs
from test_move_crashes import _kill_when

STATE = ".rivet_state.db"
EXPORTS_YAML = """\
exports:
  - name: orders
    mode: incremental
  - name: order_lines
    mode: chunked
"""
#: Runs in the state: enough that copying it takes a few milliseconds, for the blind kills.
RUNS = 20_000
#: The copy restored: the backup taken before the third cursor change (serial 3).
COPY_SERIAL, LIVE_SERIAL = 3, 5
RESTORED_SERIAL = max(COPY_SERIAL, LIVE_SERIAL) + 1
#: The tables whose rows a restore itself writes (the serial, the audit row).
WRITTEN = ("rivet_lineage", "rivet_audit")
RESTORE_BACKUP = re.compile(rf"^{re.escape(STATE)}\.backup-restore-\d{{8}}T\d{{6}}Z$")
#: Blind kills: evenly over the measured run time, and one at twice it.
KILLS = 8


def _cli(config: Path, *args: str) -> None:
    proc = run_cli("-c", str(config), *args)
    assert proc.returncode == 0, describe(proc)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pipeline whose state (``init``: WAL, identity) holds :data:`RUNS` runs and four
    cursor changes, each backed up first: the live state is at serial 5 with cursors
    orders 200, order_lines 20 and a few runs more; the backup taken before the third
    change (serial 3) has orders 100, order_lines 10."""
    directory = tmp_path_factory.mktemp("restores") / "pipeline"
    config = write_config(directory, exports=EXPORTS_YAML)
    _cli(config, "init")
    add_runs(directory / STATE, RUNS)
    for export, value in (("orders", "100"), ("order_lines", "10"), ("orders", "200"), ("order_lines", "20")):
        _cli(config, "exports", "set-cursor", export, value)
    db = sqlite3.connect(directory / STATE)
    with db:
        db.execute("INSERT INTO rivet_runs (run_id, export_name, mode, status, started_at, finished_at, rows) "
                   "VALUES ('after-the-backups', 'orders', 'incremental', 'succeeded', '2026-02-01T00:00:00Z', "
                   "'2026-02-01T00:01:00Z', 7)")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    return config


def _pipeline(template: Path, base: Path) -> tuple[Path, str]:
    """A copy of the template pipeline in ``base``; its config and the copy to restore (a
    backup's file name)."""
    shutil.copytree(template.parent, base / "pipeline")
    config = base / "pipeline" / template.name
    backups = sorted((p for p in config.parent.glob(f"{STATE}.backup-set-cursor-orders-*")), key=lambda p: p.name)
    return config, backups[-1].name


def _look(path: Path, scratch: Path) -> dict[str, Any]:
    """What the SQLite file ``path`` holds, read from a copy of it (and of its ``-wal``) in
    ``scratch`` so that nothing beside it is touched: ``integrity`` (``integrity_check``),
    ``serial`` (the lineage's), ``cursors`` (``{export: cursor}``), ``rows`` (every table
    but :data:`WRITTEN`) and ``audit`` (``[(action, detail)]``)."""
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    shutil.copyfile(path, scratch / STATE)
    if os.path.exists(f"{path}-wal"):
        shutil.copyfile(f"{path}-wal", scratch / f"{STATE}-wal")
    db = sqlite3.connect(scratch / STATE)
    try:
        tables = [name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                                 "AND name NOT LIKE 'sqlite_%' ORDER BY name")]
        return {
            "integrity": [row[0] for row in db.execute("PRAGMA integrity_check")],
            "serial": db.execute("SELECT serial FROM rivet_lineage").fetchone()[0],
            "cursors": dict(db.execute("SELECT export_name, cursor_value FROM rivet_exports")),
            "rows": {t: sorted(map(repr, db.execute(f'SELECT * FROM "{t}"'))) for t in tables if t not in WRITTEN},
            "audit": [(a, json.loads(d)) for a, d in db.execute("SELECT action, detail FROM rivet_audit ORDER BY id")],
        }
    finally:
        db.close()
        shutil.rmtree(scratch)


def _exported(config: Path, *global_args: str) -> tuple[int, dict[str, str | None]]:
    """The state's serial and each export's cursor, as ``statetool export`` gives them."""
    proc = run_cli("-c", str(config), *global_args, "export")
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    return doc["state"]["serial"], {name: e["cursor"]["value"] if e["cursor"] else None
                                    for name, e in doc["exports"].items()}


def _whole_old_or_restored(now: dict[str, Any], old: dict[str, Any], copy: dict[str, Any], where: str) -> str:
    """``"old"`` or ``"restored"``: which whole state ``now`` is (asserting it is one)."""
    assert now["integrity"] == ["ok"], f"{where}: {now['integrity']}"
    if now["serial"] == old["serial"]:
        assert {k: now[k] for k in ("cursors", "rows", "audit")} == \
            {k: old[k] for k in ("cursors", "rows", "audit")}, f"{where}: the live state was changed"
        return "old"
    assert now["serial"] == RESTORED_SERIAL, f"{where}: serial {now['serial']}"
    assert now["cursors"] == copy["cursors"] and now["rows"] == copy["rows"], f"{where}: a mix of two states"
    assert now["audit"][:-1] == copy["audit"] and now["audit"][-1][0] == "restore", f"{where}: {now['audit'][-1:]}"
    return "restored"


def _new_names(directory: Path, before: set[str]) -> set[str]:
    return {p.name for p in directory.iterdir()} - before


def _restore_backups(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if RESTORE_BACKUP.match(p.name))


def _after_a_kill(config: Path, before: set[str], old: dict[str, Any], copy: dict[str, Any], scratch: Path,
                  where: str) -> str:
    """The checks after a kill: one whole state (which one is returned), and nothing beside
    it but what a re-run removes (the restore's private directory, a second name of the
    live state) or, once the copy is in place, the replaced state kept."""
    directory = config.parent
    path = directory / STATE
    assert path.is_file() and not path.is_symlink(), where
    which = _whole_old_or_restored(_look(path, scratch), old, copy, where)
    serial, cursors = _exported(config)
    assert (serial, cursors) == (old["serial"] if which == "old" else RESTORED_SERIAL,
                                 old["cursors"] if which == "old" else copy["cursors"]), where
    for name in _new_names(directory, before):
        left = directory / name
        if name in (f"{STATE}-wal", f"{STATE}-shm"):
            continue
        if name.startswith(f"{STATE}.backup-restore-") and name.endswith(".tmp"):
            assert left.is_dir() and which == "old", f"{where}: {name}"
        else:
            assert RESTORE_BACKUP.match(name), f"{where}: the kill left {name}"
            if which == "old":
                assert os.path.samefile(left, path), f"{where}: {name} is not the live state's second name"
            else:
                assert _look(left, scratch) == old, f"{where}: {name} does not hold the replaced state"
    return which


def _assert_converged(config: Path, before: set[str], old: dict[str, Any], copy: dict[str, Any], scratch: Path,
                      where: str, restores: int = 1) -> None:
    """The state is the copy's at :data:`RESTORED_SERIAL` (+1 for each restore more), the
    state it replaced kept once, and nothing else is new beside it."""
    directory = config.parent
    path = directory / STATE
    now = _look(path, scratch)
    assert now["integrity"] == ["ok"], where
    assert now["serial"] == RESTORED_SERIAL + restores - 1, where
    assert now["cursors"] == copy["cursors"] and now["rows"] == copy["rows"], where
    assert [a for a, _ in now["audit"]] == [a for a, _ in copy["audit"]] + ["restore"], where
    kept = _restore_backups(directory)
    assert _new_names(directory, before) - {f"{STATE}-wal", f"{STATE}-shm"} == {p.name for p in kept}, where
    assert len(kept) == restores, f"{where}: {kept}"
    assert not any(os.path.samefile(p, path) for p in kept), where
    assert _look(kept[0], scratch) == old, f"{where}: the replaced state is not kept whole"
    assert now["audit"][-1][1]["backup"] == str(kept[-1]), where
    assert not list(directory.glob("*.tmp")) and not list(directory.glob("*-journal")), where
    check = run_cli("-c", str(config), "--json", "check")
    assert check.returncode == 0, f"{where}: {describe(check)}"


@pytest.fixture()
def pipeline(template: Path, tmp_path: Path) -> tuple[Path, str, set[str], dict[str, Any], dict[str, Any]]:
    """A fresh pipeline: its config, the copy to restore, the names in its directory, what
    its live state holds and what the copy holds."""
    config, copy_name = _pipeline(template, tmp_path)
    directory = config.parent
    scratch = tmp_path / "scratch"
    old, copy = _look(directory / STATE, scratch), _look(directory / copy_name, scratch)
    assert (old["serial"], copy["serial"]) == (LIVE_SERIAL, COPY_SERIAL)
    assert old["cursors"] == {"orders": "200", "order_lines": "20"}
    assert copy["cursors"] == {"orders": "100", "order_lines": "10"}
    return config, copy_name, {p.name for p in directory.iterdir()}, old, copy


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_a_restore_killed_at_each_step_leaves_one_whole_state_and_a_rerun_converges(
        pipeline: tuple[Path, str, set[str], dict[str, Any], dict[str, Any]], tmp_path: Path, point: str) -> None:
    config, copy_name, before, old, copy = pipeline
    scratch = tmp_path / "scratch"
    proc = run_killed_at(point, "-c", str(config), "restore", copy_name, "--allow-older")
    assert proc.returncode == -signal.SIGKILL, f"not killed at {point}: {describe(proc)}"

    digest = tree_digest(config.parent)
    which = _after_a_kill(config, before, old, copy, scratch, f"after a kill at {point}")
    assert which == ("restored" if point == "swapped" else "old"), f"killed at {point}: the {which} state is there"
    info = run_cli("-c", str(config), "--json", "info")
    assert info.returncode == 0, describe(info)
    assert tree_digest(config.parent) == digest, f"a read changed a file after a kill at {point}"
    StateStore.open(config, state_url=None, env={}, lock_wait=0)  # a pipeline's next run opens it

    rerun = run_cli("-c", str(config), "restore", copy_name, "--allow-older", "--json")
    assert rerun.returncode == 0, f"re-run after a kill at {point}: {describe(rerun)}"
    _assert_converged(config, before, old, copy, scratch, f"re-run after a kill at {point}",
                      restores=2 if point == "swapped" else 1)
    assert json.loads(rerun.stdout)["after"]["serial"] == _look(config.parent / STATE, scratch)["serial"]


def test_a_restore_killed_blind_at_any_instant_leaves_one_whole_state_and_a_rerun_converges(
        template: Path, tmp_path: Path) -> None:
    """No hook: the kill lands wherever the process is, at delays evenly over the measured
    run time of a whole restore (and at twice it: a restore that ended is re-run too)."""
    config, copy_name = _pipeline(template, tmp_path / "timed")
    start = time.monotonic()
    timed = run_cli_forked("-c", str(config), "restore", copy_name, "--allow-older", timeout=300)
    total = time.monotonic() - start
    assert timed.returncode == 0, describe(timed)
    seen: dict[str, int] = {}
    for i in range(KILLS + 1):
        delay = total * i / (KILLS - 1) if i < KILLS else 2 * total
        base = tmp_path / f"kill-{i}"
        config, copy_name = _pipeline(template, base)
        directory, scratch = config.parent, base / "scratch"
        before = {p.name for p in directory.iterdir()}
        old, copy = _look(directory / STATE, scratch), _look(directory / copy_name, scratch)
        args = ("-c", str(config), "restore", copy_name, "--allow-older")
        status = _kill_when(args, lambda: True, delay)
        where = f"kill {i} ({delay * 1000:.1f} ms of {total * 1000:.1f} ms, exit {status})"
        assert status in (0, -signal.SIGKILL), where
        which = _after_a_kill(config, before, old, copy, scratch, where)
        seen[which] = seen.get(which, 0) + 1
        rerun = run_cli(*args)
        assert rerun.returncode == 0, f"{where}: {describe(rerun)}"
        _assert_converged(config, before, old, copy, scratch, where, restores=1 if which == "old" else 2)
    assert seen.get("old") and seen.get("restored"), f"the kills never fell on both sides of the switch: {seen}"


def _copy_with_journal(copy: Path, target: Path, journal: str) -> None:
    """At ``target``, the state ``copy`` after one more committed change (orders at 150, the
    serial at 13), taken the way ``cp`` takes a state in use: the file with its ``-wal``
    holding that change in committed frames not yet folded into it (``journal`` ``wal``),
    or, a rollback-journal file, with the hot ``-journal`` of a later change that never
    committed, whose pages were already written into the file (``journal`` ``hot``)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    work = target.parent / "work.db"
    shutil.copyfile(copy, work)
    db = sqlite3.connect(work, isolation_level=None)
    try:
        if journal == "wal":
            assert db.execute("PRAGMA journal_mode = WAL").fetchone()[0] == "wal"
            db.execute("PRAGMA wal_autocheckpoint = 0")
        db.execute("BEGIN")
        db.execute("UPDATE rivet_exports SET cursor_value = '150' WHERE export_name = 'orders'")
        db.execute("UPDATE rivet_lineage SET serial = 13")
        db.execute("COMMIT")
        if journal == "hot":
            db.execute("PRAGMA cache_size = 5")  # the change spills its pages into the file before a commit
            db.execute("BEGIN")
            db.execute("UPDATE rivet_runs SET rows = rows + 1000000")
            db.execute("UPDATE rivet_exports SET cursor_value = '999'")
        suffix = "-wal" if journal == "wal" else "-journal"
        shutil.copyfile(work, target)
        shutil.copyfile(f"{work}{suffix}", f"{target}{suffix}")
        assert os.path.getsize(f"{target}{suffix}") > 0
    finally:
        db.close()
    os.unlink(work)


def _volume(base: Path) -> tuple[Path, Path]:
    """A pipeline config in ``base`` whose state belongs in the declared directory
    ``base/volume`` (empty): the config, and the directory."""
    config = write_config(base / "pipeline", exports=EXPORTS_YAML)
    volume = base / "volume"
    volume.mkdir()
    return config, volume


@pytest.mark.parametrize("journal", ["wal", "hot"])
@pytest.mark.parametrize("where", ["over-live", "where-none"])
def test_a_copy_is_restored_with_the_journal_its_verification_read(
        template: Path, tmp_path: Path, journal: str, where: str) -> None:
    """A state file copied with its ``-wal`` (committed frames) or its hot ``-journal``:
    the verification reads it with them (the frames applied, the journal rolled back), and
    the state restored holds exactly that, over a live state and where none is. The bug:
    the restore started from the file's bytes alone, so the WAL copy came back without its
    last change at a serial judged from it (an older copy restored without
    ``--allow-older``), and the hot-journal copy came back with half of a write that never
    committed (``RIVET_STATE_VERIFY_FAILED`` over a live state; a torn state where none was)."""
    config, copy_name = _pipeline(template, tmp_path)
    copy = tmp_path / "backups" / "state.db"
    _copy_with_journal(config.parent / copy_name, copy, journal)
    scratch = tmp_path / "scratch"
    expected = _look(config.parent / copy_name, scratch)
    args: tuple[str, ...] = ("-c", str(config))
    if where == "where-none":
        config, volume = _volume(tmp_path / "empty")
        args = ("-c", str(config), "--state-url", f"sqlite:{volume}")
        state = volume / STATE
    else:
        state = config.parent / STATE

    copied = tree_digest(copy.parent)
    proc = run_cli(*args, "restore", str(copy), "--json")
    assert proc.returncode == 0, describe(proc)
    assert tree_digest(copy.parent) == copied, "the restore wrote into the copy or its journal"
    now = _look(state, scratch)
    assert now["integrity"] == ["ok"]
    assert now["cursors"] == {**expected["cursors"], "orders": "150"}
    assert now["rows"]["rivet_runs"] == expected["rows"]["rivet_runs"], "a write that never committed came back"
    assert now["serial"] == 14 == json.loads(proc.stdout)["after"]["serial"]
    assert _exported(config, *args[2:])[1]["orders"] == "150"
    assert not [p for p in state.parent.iterdir() if p.name.endswith((".tmp", "-journal"))]


@pytest.mark.parametrize("point", CREATE_POINTS)
def test_a_restore_where_no_state_is_killed_at_each_step_leaves_nothing_or_the_whole_state(
        template: Path, tmp_path: Path, point: str) -> None:
    """``restore PATH --if-absent`` into an empty declared directory (a container's boot),
    killed at each step of the atomic create: nothing is at the state's path, or the whole
    restored state is (serial the copy's + 1, one ``restore`` audit row); the re-run exits 0
    and leaves the restored state and nothing else in the directory."""
    source, copy_name = _pipeline(template, tmp_path / "source")
    copy = tmp_path / "backups" / "rivet_state.db"
    copy.parent.mkdir()
    shutil.copyfile(source.parent / copy_name, copy)
    scratch = tmp_path / "scratch"
    expected = _look(copy, scratch)
    config, volume = _volume(tmp_path / "boot")
    args = ("-c", str(config), "--state-url", f"sqlite:{volume}", "restore", str(copy), "--if-absent")
    state = volume / STATE

    proc = run_killed_at(point, *args)
    assert proc.returncode == -signal.SIGKILL, f"not killed at {point}: {describe(proc)}"
    if point == "linked":
        now = _look(state, scratch)
        assert now["integrity"] == ["ok"]
        assert (now["serial"], now["cursors"], now["rows"]) == (COPY_SERIAL + 1, expected["cursors"], expected["rows"])
        assert now["audit"][:-1] == expected["audit"] and now["audit"][-1][0] == "restore"
        assert sorted(p.name for p in volume.iterdir()) == [STATE], f"killed at {point}"
    else:
        assert not os.path.lexists(state), f"a state is at its path after a kill at {point}"
        assert [p.name for p in volume.iterdir() if p.name != ".rivet_state.leases"] and all(
            p.name.startswith(f"{STATE}.init-") and p.name.endswith(".tmp") for p in volume.iterdir()), \
            f"killed at {point}: {sorted(p.name for p in volume.iterdir())}"
        gone = run_cli("-c", str(config), "--state-url", f"sqlite:{volume}", "info", "--json")
        assert gone.returncode == 0 and json.loads(gone.stdout)["revision"]["status"] == "missing", describe(gone)

    rerun = run_cli(*args, "--json")
    assert rerun.returncode == 0, f"re-run after a kill at {point}: {describe(rerun)}"
    assert json.loads(rerun.stdout)["action"] == ("none" if point == "linked" else "created"), describe(rerun)
    now = _look(state, scratch)
    assert now["integrity"] == ["ok"]
    assert (now["serial"], now["cursors"], now["rows"]) == (COPY_SERIAL + 1, expected["cursors"], expected["rows"])
    assert [a for a, _ in now["audit"]] == [a for a, _ in expected["audit"]] + ["restore"]
    assert now["audit"][-1][1]["copy"] == str(copy)
    assert sorted(p.name for p in volume.iterdir()) == [STATE], f"after the re-run of a kill at {point}"
    assert _exported(config, "--state-url", f"sqlite:{volume}") == (COPY_SERIAL + 1, expected["cursors"])


def test_a_create_removes_what_a_killed_create_left_never_what_another_is_building(
        template: Path, tmp_path: Path) -> None:
    """The private directories new states are built in: one whose lock nobody holds (a
    killed create's) is removed by the next create, or by the next write that takes a
    backup; one another create holds (here the test, by ``flock``) is left alone. And two ``restore --if-absent`` at once at one empty
    directory (two containers booting): both exit 0, one restored, the other found it done,
    and nothing but the state is left."""
    import fcntl

    source, copy_name = _pipeline(template, tmp_path / "source")
    copy = source.parent / copy_name
    config, volume = _volume(tmp_path / "boot")
    abandoned, building = volume / f"{STATE}.init-abandoned.tmp", volume / f"{STATE}.init-building.tmp"
    for made in (abandoned, building):
        made.mkdir(mode=0o700)
        (made / STATE).write_bytes(copy.read_bytes())
    held = os.open(building, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = run_cli("-c", str(config), "--state-url", f"sqlite:{volume}", "restore", str(copy), "--if-absent")
        assert proc.returncode == 0, describe(proc)
        assert sorted(p.name for p in volume.iterdir()) == sorted([STATE, building.name])
    finally:
        os.close(held)
    # unlocked now, as a create killed between its link and its directory's removal leaves
    # it: the next write that takes a backup removes it with its own leftovers
    proc = run_cli("-c", str(config), "--state-url", f"sqlite:{volume}", "exports", "set-cursor", "orders", "1")
    assert proc.returncode == 0, describe(proc)
    assert not building.exists() and len(list(volume.glob(f"{STATE}.backup-set-cursor-orders-*"))) == 1

    config, volume = _volume(tmp_path / "twice")
    args = ("-c", str(config), "--state-url", f"sqlite:{volume}", "--json", "restore", str(copy), "--if-absent")
    procs = [fork_cli(*args, env=process_env()) for _ in range(2)]
    outs = [(p.communicate(120), p.wait()) for p in procs]
    assert [status for _, status in outs] == [0, 0], outs
    assert sorted(json.loads(out)["action"] for (out, _err), _ in outs) == ["created", "none"], outs
    assert sorted(p.name for p in volume.iterdir()) == [STATE]
    assert _look(volume / STATE, tmp_path / "scratch")["serial"] == COPY_SERIAL + 1
