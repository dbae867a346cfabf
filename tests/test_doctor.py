"""``statetool doctor``: one scenario per reason a next run would (or would not) be a FIRST RUN.

Every scenario is built for real: SQLite files through ``statetool init``, the runtime API
and ``statetool relocate``/``exports reset``; a real tmpfs mount; a real PostgreSQL for the
PostgreSQL cases. Each asserts the verdict, the code, and that the evidence names the right
path. Every ``doctor`` call also proves the command read-only: the config's and the
state's directory trees (files, directories, bytes) are identical before and after.
The setup guides that show doctor's answers run in ``tests/test_guides.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support import describe, error_object, run_cli, write_config
from statetool import mounts
from statetool.errors import EXIT_CODES, failure_class, failure_exit_code, worst
from statetool.location import STATE_FILE
from statetool.operations.context import Context
from statetool.operations.doctor import doctor as doctor_op
from statetool.operations.migrate import migrate
from statetool.runtime import StateStore
from support.states import (CURSOR, FINISHED, POSITION, build_state, orphan_wal_beside, rollback_journal_state,
                            write_checkpoint)

SALES = "postgresql://db.internal:5432/sales"
CRM_URL = "postgresql://reader@crm.internal:5432/crm"


# -- helpers -----------------------------------------------------------------------------


def tree(*roots: Path) -> dict[str, str]:
    """Every file (sha256), directory and symlink below ``roots``: what "changes nothing" compares."""
    out: dict[str, str] = {}
    for root in roots:
        if not root.exists():
            out[str(root)] = "absent"
            continue
        for path in sorted([root, *root.rglob("*")]):
            if path.is_symlink():
                out[str(path)] = f"link:{os.readlink(path)}"
            elif path.is_dir():
                out[str(path)] = "dir"
            else:
                out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def doctor(config: Path, *args: str, env: dict[str, str] | None = None,
           watch: tuple[Path, ...] = ()) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """``statetool -c CONFIG --json doctor ARGS``; asserts it changed nothing under the
    config's directory, the declared state directory and ``watch``."""
    roots = [config.parent, *watch]
    url = (env or {}).get("RIVET_STATE_URL", "")
    if url.startswith("sqlite:"):
        roots.append(Path(url[len("sqlite:"):]))
    before = tree(*roots)
    proc = run_cli("-c", str(config), "--json", "doctor", *args, env=env)
    assert tree(*roots) == before, f"doctor changed files:\n{describe(proc)}"
    assert proc.returncode in (0, 1, 4, 5), describe(proc)
    doc = json.loads(proc.stdout)
    # the exit code of the reason on top (docs/commands.md, doctor): a missing declared directory's, else the
    # failing exports' worst code's (4 for a damaged checkpoint or state), else 0
    failing = [r["code"] for e in doc["exports"] if e["verdict"] != "resumes" for r in e["reasons"]]
    top = "RIVET_STATE_DIR_MISSING" if "RIVET_STATE_DIR_MISSING" in failing else worst(failing)
    assert proc.returncode == (0 if top is None else failure_exit_code(top)), describe(proc)
    return proc, doc


def exports(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in doc["exports"]}


def codes(export: dict[str, Any]) -> list[str]:
    return [r["code"] for r in export["reasons"]]


def reason(reasons: list[dict[str, Any]], code: str) -> dict[str, Any]:
    found = [r for r in reasons if r["code"] == code]
    assert len(found) == 1, f"expected one {code} in {json.dumps(reasons, indent=1)}"
    assert set(found[0]) == {"code", "message", "evidence", "action"}
    assert found[0]["message"] and found[0]["action"]
    return found[0]


def other_source_config(directory: Path) -> Path:
    """The same exports, another source (crm.internal/crm)."""
    return write_config(directory, source_url=CRM_URL)


# -- a state that resumes ------------------------------------------------------------------


def test_every_export_resumes_from_its_cursor_chunk_and_cdc_position(config: Path) -> None:
    build_state(config, checkpoint_dir=config.parent)
    proc, doc = doctor(config)
    assert proc.returncode == 0
    found = exports(doc)
    assert {n: e["verdict"] for n, e in found.items()} == dict.fromkeys(found, "resumes")
    assert CURSOR in found["orders"]["resumes_from"] and found["orders"]["age_seconds"] > 0
    assert "1 of 2 chunks" in found["order_lines"]["resumes_from"]
    events = found["order_events"]
    assert str(config.parent / "checkpoints" / "order_events.json") in events["resumes_from"]
    assert "mysql-bin.000042" in events["resumes_from"] and events["age_seconds"] is not None
    assert all(e["reasons"] == [] for e in found.values())
    assert doc["state"]["reasons"] == [] and "candidates" not in doc["state"]
    assert doc["state"]["identity"] == {"recorded": SALES, "computed": SALES, "verdict": "ok"}

    human = run_cli("-c", str(config), "doctor")
    assert human.returncode == 0, describe(human)
    assert "orders (incremental): resumes from cursor" in human.stdout and "FIRST RUN" not in human.stdout


def test_doctor_gives_the_cycle_collector_back_as_it_found_it(config: Path) -> None:
    """doctor pauses the cyclic garbage collector while it reads and prints (issue 13):
    on or off before, it is the same after, whether the diagnosis passes or fails."""
    import gc

    build_state(config, checkpoint_dir=config.parent)
    was = gc.isenabled()
    try:
        for before in (True, False):
            (gc.enable if before else gc.disable)()
            assert run_cli("-c", str(config), "doctor").returncode == 0
            assert gc.isenabled() is before
            assert run_cli("-c", str(config), "doctor", "--export", "no_such_export").returncode != 0
            assert gc.isenabled() is before
    finally:
        (gc.enable if was else gc.disable)()


# -- no state at the resolved location, and where it probably is -------------------------


def test_no_state_beside_the_config_makes_every_export_first_run(config: Path) -> None:
    proc, doc = doctor(config)
    assert proc.returncode == 5
    expected = config.parent / STATE_FILE
    for export in doc["exports"]:
        assert export["verdict"] == "first_run" and export["resumes_from"] is None
        assert reason(export["reasons"], "RIVET_STATE_MISSING")["evidence"]["path"] == str(expected)
    assert not expected.exists()  # doctor never creates a state
    assert doc["state"]["candidates"] == []

    human = run_cli("-c", str(config), "doctor")
    assert human.returncode == 5 and human.stdout.count("FIRST RUN") == 3, describe(human)
    assert "RIVET_STATE_MISSING" in human.stdout and "fix:" in human.stdout


def test_empty_declared_directory_finds_the_state_beside_the_config(config: Path, tmp_path: Path) -> None:
    build_state(config, checkpoint_dir=config.parent)
    state_dir = tmp_path / "volume"
    state_dir.mkdir()
    proc, doc = doctor(config, env={"RIVET_STATE_URL": f"sqlite:{state_dir}"})
    assert proc.returncode == 5
    for export in doc["exports"]:
        assert export["verdict"] == "first_run"
        assert reason(export["reasons"], "RIVET_STATE_MISSING")["evidence"]["directory"] == str(state_dir)
    [candidate] = doc["state"]["candidates"]
    assert candidate["kind"] == "state"
    assert candidate["path"] == str(config.parent / STATE_FILE)
    assert candidate["identity"] == SALES
    assert candidate["last_run_finished_at"] == FINISHED
    assert candidate["exports_with_cursor"] == 1
    assert candidate["state_url"] == ""  # RIVET_STATE_URL unset (or empty) opens it


def test_missing_state_finds_the_state_a_relocation_left_behind(config: Path, tmp_path: Path) -> None:
    build_state(config, checkpoint_dir=config.parent)
    moved_to = tmp_path / "srv-state"
    proc = run_cli("-c", str(config), "relocate", "--to", str(moved_to), "--create-dir")
    assert proc.returncode == 0, describe(proc)
    old = config.parent / STATE_FILE

    # 1. The old place, RIVET_STATE_URL forgotten: the tombstone answers, and the search
    #    shows the state it names.
    proc, doc = doctor(config, watch=(moved_to,))
    assert proc.returncode == 5
    for export in doc["exports"]:
        assert export["verdict"] == "first_run"
        evidence = reason(export["reasons"], "RIVET_STATE_RELOCATED")["evidence"]
        assert evidence["path"] == str(old)
        assert evidence["to"] == str(moved_to / STATE_FILE)
        assert evidence["state_url"] == f"sqlite:{moved_to}"
    [moved] = doc["state"]["candidates"]
    assert moved["path"] == str(moved_to / STATE_FILE) and moved["state_url"] == f"sqlite:{moved_to}"
    assert (moved["identity"], moved["last_run_finished_at"], moved["exports_with_cursor"]) == (SALES, FINISHED, 1)

    # 2. A third, empty directory declared: the search finds the tombstone beside the config,
    #    with where it went and what the state there holds.
    empty = tmp_path / "fresh-volume"
    empty.mkdir()
    proc, doc = doctor(config, env={"RIVET_STATE_URL": f"sqlite:{empty}"}, watch=(moved_to,))
    assert proc.returncode == 5
    assert {e["verdict"] for e in doc["exports"]} == {"first_run"}
    assert reason(doc["state"]["reasons"], "RIVET_STATE_MISSING")["evidence"]["directory"] == str(empty)
    [left] = doc["state"]["candidates"]
    assert left["kind"] == "relocated" and left["path"] == str(old)
    assert left["moved_to"] == str(moved_to / STATE_FILE) and left["state_url"] == f"sqlite:{moved_to}"
    assert (left["identity"], left["last_run_finished_at"], left["exports_with_cursor"]) == (SALES, FINISHED, 1)


def test_missing_state_finds_states_of_the_same_identity_under_the_config_tree(config: Path, tmp_path: Path) -> None:
    pipeline = config.parent
    ours, theirs = pipeline / "old" / "state", pipeline / "vendored" / "crm-state"
    ours.mkdir(parents=True)
    theirs.mkdir(parents=True)
    build_state(config, f"sqlite:{ours}", checkpoint_dir=ours)
    build_state(other_source_config(tmp_path / "crm"), f"sqlite:{theirs}", only=("orders",))

    proc, doc = doctor(config)
    assert proc.returncode == 5
    for export in doc["exports"]:
        assert export["verdict"] == "first_run"
        assert reason(export["reasons"], "RIVET_STATE_MISSING")["evidence"]["path"] == str(pipeline / STATE_FILE)
    [candidate] = doc["state"]["candidates"]  # the crm state under the same tree is not offered
    assert candidate["path"] == str(ours / STATE_FILE)
    assert candidate["identity"] == SALES and candidate["last_run_finished_at"] == FINISHED
    assert candidate["exports_with_cursor"] == 1
    assert candidate["state_url"] == f"sqlite:{ours}"

    # The RIVET_STATE_URL it names really opens it: every export resumes.
    proc, doc = doctor(config, env={"RIVET_STATE_URL": candidate["state_url"]})
    assert proc.returncode == 0 and {e["verdict"] for e in doc["exports"]} == {"resumes"}


# -- the declared directory ----------------------------------------------------------------


def test_declared_directory_that_does_not_exist(config: Path, tmp_path: Path) -> None:
    build_state(config, checkpoint_dir=config.parent)
    missing = tmp_path / "not-mounted" / "state"
    proc, doc = doctor(config, env={"RIVET_STATE_URL": f"sqlite:{missing}"})
    assert proc.returncode == 1, "exits as every command refuses a missing declared directory (fresh user's finding)"
    for export in doc["exports"]:
        assert export["verdict"] == "first_run"
        assert reason(export["reasons"], "RIVET_STATE_DIR_MISSING")["evidence"]["directory"] == str(missing)
        assert "RIVET_STATE_MISSING" not in {r["code"] for r in export["reasons"]}, "init is no fix for a mount"
    assert not missing.exists() and not missing.parent.exists()
    assert [c["path"] for c in doc["state"]["candidates"]] == [str(config.parent / STATE_FILE)]


def test_empty_declared_directory(config: Path, tmp_path: Path) -> None:
    empty = tmp_path / "new-volume"
    empty.mkdir()
    proc, doc = doctor(config, env={"RIVET_STATE_URL": f"sqlite:{empty}"})
    assert proc.returncode == 5
    for export in doc["exports"]:
        assert export["verdict"] == "first_run"
        evidence = reason(export["reasons"], "RIVET_STATE_MISSING")["evidence"]
        assert evidence["directory"] == str(empty)
    assert list(empty.iterdir()) == []
    # A real disk is neither ephemeral nor a network filesystem.
    assert not {"RIVET_STATE_DIR_EPHEMERAL", "RIVET_STATE_DIR_NETWORK"} & {r["code"] for r in doc["state"]["reasons"]}


@pytest.fixture
def tmpfs_dir(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs mounted at ``tmp_path/tmpfs`` (unmounted afterwards)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    target = tmp_path / "tmpfs"
    target.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(target)], check=True, capture_output=True)
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=True, capture_output=True)


def test_declared_directory_on_tmpfs_is_lost_with_the_container(config: Path, tmpfs_dir: Path) -> None:
    build_state(config, f"sqlite:{tmpfs_dir}", checkpoint_dir=tmpfs_dir)
    proc, doc = doctor(config, env={"RIVET_STATE_URL": f"sqlite:{tmpfs_dir}"})
    # A warning: the state is there today, every export resumes; the reason says why it will not last.
    assert proc.returncode == 0
    for export in doc["exports"]:
        assert export["verdict"] == "resumes"
        evidence = reason(export["reasons"], "RIVET_STATE_DIR_EPHEMERAL")["evidence"]
        assert evidence == {"directory": str(tmpfs_dir), "fstype": "tmpfs", "mount_point": str(tmpfs_dir)}

    # check reports it once, as a warning (exit 0), and --strict fails on it.
    proc = run_cli("-c", str(config), "--json", "check", env={"RIVET_STATE_URL": f"sqlite:{tmpfs_dir}"})
    assert proc.returncode == 0, describe(proc)
    rows = [c for c in json.loads(proc.stdout)["checks"] if c["code"] == "RIVET_STATE_DIR_EPHEMERAL"]
    assert [(c["id"], c["status"]) for c in rows] == [("doctor", "warn")]


def test_mount_of_reads_the_mount_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = tmp_path / "mounts"
    table.write_text(textwrap.dedent(f"""\
        /dev/vda / ext4 rw,relatime 0 0
        filer.internal:/exports/rivet {tmp_path}/nfs nfs4 rw,vers=4.2,hard 0 0
        tmpfs {tmp_path}/nfs/scratch tmpfs rw 0 0
        //nas/share {tmp_path}/with\\040space cifs rw 0 0
        """))
    monkeypatch.setattr(mounts, "PROC_MOUNTS", table)
    (tmp_path / "nfs" / "state").mkdir(parents=True)
    nfs = mounts.mount_of(tmp_path / "nfs" / "state")
    assert nfs == mounts.Mount(f"{tmp_path}/nfs", "nfs4", "filer.internal:/exports/rivet")
    assert nfs.network and not nfs.ephemeral
    scratch = mounts.mount_of(tmp_path / "nfs" / "scratch" / "x")  # the longest mount point wins
    assert scratch is not None and scratch.fstype == "tmpfs" and scratch.ephemeral
    spaced = mounts.mount_of(tmp_path / "with space" / "state")  # /proc/mounts escapes spaces as \040
    assert spaced is not None and spaced.point == f"{tmp_path}/with space" and spaced.network
    assert mounts.mount_of(tmp_path / "nfsish") == mounts.Mount("/", "ext4", "/dev/vda")  # a prefix, not a parent
    monkeypatch.setattr(mounts, "PROC_MOUNTS", tmp_path / "absent")
    assert mounts.mount_of(tmp_path) is None


def test_declared_directory_on_a_network_filesystem(config: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    state_dir = tmp_path / "nfs" / "state"
    state_dir.mkdir(parents=True)
    build_state(config, f"sqlite:{state_dir}", checkpoint_dir=state_dir)
    # NFS cannot be mounted here: a copy of the real mount table with an nfs4 line for the directory.
    table = tmp_path / "mounts"
    table.write_text(Path("/proc/mounts").read_text() + f"filer.internal:/exports/rivet {tmp_path}/nfs nfs4 rw 0 0\n")
    monkeypatch.setattr(mounts, "PROC_MOUNTS", table)
    result = doctor_op(Context(config, f"sqlite:{state_dir}", env={}))
    assert result.exit_code == 0
    for export in result.exports:
        assert export.verdict == "resumes"
        [found] = [r for r in export.reasons if r.code == "RIVET_STATE_DIR_NETWORK"]
        assert found.evidence == {"directory": str(state_dir), "fstype": "nfs4",
                                  "source": "filer.internal:/exports/rivet"}
        assert "flock" in found.message and "WAL" in found.message


# -- identity ------------------------------------------------------------------------------


def test_foreign_state_in_a_declared_directory_is_a_first_run(config: Path, tmp_path: Path) -> None:
    state_dir = tmp_path / "shared-volume"
    state_dir.mkdir()
    build_state(other_source_config(tmp_path / "crm"), f"sqlite:{state_dir}", checkpoint_dir=state_dir)
    proc, doc = doctor(config, env={"RIVET_STATE_URL": f"sqlite:{state_dir}"})
    assert proc.returncode == 5
    for export in doc["exports"]:
        assert export["verdict"] == "first_run"
        found = reason(export["reasons"], "RIVET_STATE_FOREIGN")
        assert found["evidence"]["state"] == str(state_dir / STATE_FILE)
        assert found["evidence"]["recorded"] == "postgresql://crm.internal:5432/crm"
        assert found["evidence"]["computed"] == SALES
        assert str(state_dir) in found["message"]
    assert doc["state"]["identity"]["verdict"] == "refuse"


def test_foreign_state_beside_the_config_is_a_warning(config: Path, tmp_path: Path) -> None:
    build_state(config, checkpoint_dir=config.parent)
    crm = other_source_config(config.parent)  # the same file, now naming another source
    assert crm == config
    proc, doc = doctor(config)
    assert proc.returncode == 0
    for export in doc["exports"]:
        assert export["verdict"] == "resumes"
        found = reason(export["reasons"], "RIVET_STATE_FOREIGN_BESIDE_CONFIG")
        assert found["evidence"]["state"] == str(config.parent / STATE_FILE)
        assert found["evidence"]["recorded"] == SALES
        assert found["evidence"]["computed"] == "postgresql://crm.internal:5432/crm"


# -- exports with no progress -------------------------------------------------------------


def test_export_that_never_ran_has_no_progress(config: Path) -> None:
    build_state(config, only=("orders",))
    proc, doc = doctor(config)
    assert proc.returncode == 5
    found = exports(doc)
    assert found["orders"]["verdict"] == "resumes"
    for name in ("order_lines", "order_events"):
        assert found[name]["verdict"] == "first_run"
        evidence = reason(found[name]["reasons"], "RIVET_EXPORT_NO_PROGRESS")["evidence"]
        assert evidence == {"export": name, "state": str(config.parent / STATE_FILE)}
    # No progress for the CDC export: its missing checkpoint is not a loss.
    assert "RIVET_STATE_CHECKPOINT_MISSING" not in codes(found["order_events"])


def test_reset_export_shows_the_audit_row(config: Path) -> None:
    build_state(config, checkpoint_dir=config.parent)
    proc = run_cli("-c", str(config), "exports", "reset", "orders")
    assert proc.returncode == 0, describe(proc)
    proc, doc = doctor(config)
    assert proc.returncode == 5
    found = exports(doc)
    # Its run history is kept, but the cursor is gone: the next run reads everything.
    assert found["orders"]["verdict"] == "first_run"
    no_progress = reason(found["orders"]["reasons"], "RIVET_EXPORT_NO_PROGRESS")
    assert no_progress["evidence"]["state"] == str(config.parent / STATE_FILE)
    row = no_progress["evidence"]["reset"]
    assert row["detail"] == {"export": "orders", "old_cursor": CURSOR, "chunks_removed": 0}
    assert re.match(r"^.+@.+$", row["by"]) and row["at"] > FINISHED
    assert row["at"] in no_progress["message"] and "reset" in no_progress["message"]
    assert found["order_lines"]["verdict"] == found["order_events"]["verdict"] == "resumes"

    # A run that commits a cursor after the reset is progress again.
    store = StateStore.open(config, env={}, create=True)
    with store.transaction() as tx:
        run = tx.start_run("orders", "incremental")
        tx.commit_cursor("orders", "incremental", "2026-12-01T00:00:00Z")
        tx.finish_run(run, "succeeded")
    proc, doc = doctor(config, "--export", "orders")
    assert [e["name"] for e in doc["exports"]] == ["orders"]
    assert doc["exports"][0]["verdict"] == "resumes" and doc["exports"][0]["reasons"] == []


def test_unknown_export_is_refused_by_name(config: Path) -> None:
    build_state(config, checkpoint_dir=config.parent)
    proc = run_cli("-c", str(config), "--json-errors", "doctor", "--export", "nope")
    assert proc.returncode == 1, describe(proc)
    assert error_object(proc)["code"] == "RIVET_EXPORT_UNKNOWN"


# -- CDC checkpoints -------------------------------------------------------------------------


def test_cdc_checkpoint_missing_while_the_state_shows_progress(config: Path) -> None:
    build_state(config, checkpoint_dir=None)
    proc, doc = doctor(config)
    assert proc.returncode == 5
    found = exports(doc)
    events = found["order_events"]
    assert events["verdict"] == "first_run"
    missing = reason(events["reasons"], "RIVET_STATE_CHECKPOINT_MISSING")
    assert missing["evidence"]["path"] == str(config.parent / "checkpoints" / "order_events.json")
    assert "re-anchor" in missing["message"]
    assert found["orders"]["verdict"] == found["order_lines"]["verdict"] == "resumes"


def test_cdc_checkpoint_under_the_declared_directory_is_looked_for_there(config: Path, tmp_path: Path) -> None:
    state_dir = tmp_path / "volume"
    state_dir.mkdir()
    build_state(config, f"sqlite:{state_dir}", checkpoint_dir=None)
    proc, doc = doctor(config, env={"RIVET_STATE_URL": f"sqlite:{state_dir}"})
    events = exports(doc)["order_events"]
    assert events["verdict"] == "first_run"
    missing = reason(events["reasons"], "RIVET_STATE_CHECKPOINT_MISSING")
    assert missing["evidence"]["path"] == str(state_dir / "checkpoints" / "order_events.json")

    # The file left beside the config is used, with its warning: the export resumes.
    write_checkpoint(config.parent / "checkpoints" / "order_events.json", json.dumps(POSITION))
    proc, doc = doctor(config, env={"RIVET_STATE_URL": f"sqlite:{state_dir}"})
    events = exports(doc)["order_events"]
    assert events["verdict"] == "resumes" and "mysql-bin.000042" in events["resumes_from"]
    beside = reason(events["reasons"], "RIVET_STATE_CHECKPOINT_BESIDE_CONFIG")
    assert beside["evidence"]["path"] == str(config.parent / "checkpoints" / "order_events.json")


def test_cdc_checkpoint_that_is_not_json_is_unreadable(config: Path) -> None:
    build_state(config, checkpoint_dir=None)
    path = write_checkpoint(config.parent / "checkpoints" / "order_events.json", '{"file": "mysql-bin.0000')
    proc, doc = doctor(config)
    assert proc.returncode == 4  # the reason on top is data_integrity (its own exit code, as --json-errors says)
    events = exports(doc)["order_events"]
    assert events["verdict"] == "first_run"
    unreadable = reason(events["reasons"], "RIVET_STATE_CHECKPOINT_UNREADABLE")
    assert unreadable["evidence"]["path"] == str(path) and str(path) in unreadable["message"]


def test_cdc_export_with_a_file_engine_and_no_checkpoint_configured(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline", exports=textwrap.dedent("""\
        exports:
          - name: carts
            mode: cdc
            cdc:
              engine: mongodb
          - name: ledger
            mode: cdc
            cdc:
              engine: postgres
        """))
    store = StateStore.open(config, env={}, create=True)
    with store.transaction() as tx:
        for name in ("carts", "ledger"):
            tx.finish_run(tx.start_run(name, "cdc"), "succeeded")
    proc, doc = doctor(config)
    found = exports(doc)
    assert found["carts"]["verdict"] == "first_run"
    missing = reason(found["carts"]["reasons"], "RIVET_STATE_CHECKPOINT_MISSING")
    assert missing["evidence"] == {"configured": None} and "mongodb" in missing["message"]
    assert found["ledger"]["verdict"] == "resumes" and "slot" in found["ledger"]["resumes_from"]


# -- the state file: orphaned -wal/-shm, pending revisions ---------------------------------


def test_orphaned_wal_and_shm_beside_a_rollback_journal_state(config: Path, tmp_path: Path) -> None:
    path = rollback_journal_state(config)
    migrate(Context(config, None, env={}))
    for name in (f"{STATE_FILE}-wal", f"{STATE_FILE}-shm", f"{STATE_FILE}-journal"):
        assert not (config.parent / name).exists()
    with open(path, "rb") as fh:
        assert fh.read(20)[18] == 1, "the state should be in rollback-journal mode"
    # Another copy of a state's -wal/-shm beside ours, as a careless restore leaves them.
    orphan_wal_beside(path, tmp_path / "elsewhere")

    proc, doc = doctor(config)
    assert proc.returncode == 0
    orphan = reason(doc["state"]["reasons"], "RIVET_STATE_ORPHAN_WAL")
    assert orphan["evidence"] == {"wal": f"{path}-wal", "shm": f"{path}-shm"}
    for export in doc["exports"]:  # the main file is read alone: the foreign frames are not applied
        assert export["verdict"] == "resumes"
        assert "RIVET_STATE_ORPHAN_WAL" in codes(export)
    assert exports(doc)["orders"]["resumes_from"].startswith("cursor '2026-01-01T00:")


@pytest.mark.parametrize("beside", ["rollback-journal state", "wal state"])
def test_info_shows_the_orphan_wal_warning_once_as_check_does(config: Path, tmp_path: Path, beside: str) -> None:
    """``info`` shows the warnings a write would give (issue 12 fixB item 5): a -wal/-shm the
    state did not leave (a write refuses it, RIVET_STATE_FOREIGN_WAL) is warned once, as in
    ``check``, in the JSON and for people."""
    build_state(config, checkpoint_dir=config.parent)
    path = config.parent / STATE_FILE
    if beside == "wal state":
        Path(f"{path}-shm").write_bytes(b"\0" * 32768)
    else:
        db = sqlite3.connect(path)
        db.execute("PRAGMA journal_mode=DELETE").fetchone()
        db.close()
        orphan_wal_beside(path, tmp_path / "elsewhere")
    proc = run_cli("-c", str(config), "--json", "info")
    assert proc.returncode == 0, describe(proc)
    found = [w for w in json.loads(proc.stdout)["warnings"] if w["code"] == "RIVET_STATE_ORPHAN_WAL"]
    assert len(found) == 1, describe(proc)
    checked = run_cli("-c", str(config), "--json", "check")
    rows = [r for r in json.loads(checked.stdout)["checks"] if r["code"] == "RIVET_STATE_ORPHAN_WAL"]
    assert [r["message"] for r in rows] == [found[0]["message"]], describe(checked)
    proc = run_cli("-c", str(config), "info")
    assert proc.stderr.count("Warning [RIVET_STATE_ORPHAN_WAL]") == 1, describe(proc)  # warnings go to stderr


def test_stray_shm_without_its_wal_beside_a_wal_state(config: Path) -> None:
    build_state(config, checkpoint_dir=config.parent)
    path = config.parent / STATE_FILE
    with open(path, "rb") as fh:
        assert fh.read(20)[18] == 2, "statetool init writes a WAL state"
    Path(f"{path}-shm").write_bytes(b"\0" * 32768)
    proc, doc = doctor(config)
    orphan = reason(doc["state"]["reasons"], "RIVET_STATE_ORPHAN_WAL")
    assert orphan["evidence"] == {"shm": f"{path}-shm"}
    assert {e["verdict"] for e in doc["exports"]} == {"resumes"}


def test_state_written_by_an_older_release_has_pending_revisions(config: Path) -> None:
    path = rollback_journal_state(config)
    proc, doc = doctor(config)
    pending = reason(doc["state"]["reasons"], "RIVET_STATE_MIGRATION_PENDING")
    assert pending["evidence"]["state"] == str(path)
    assert pending["evidence"]["revision"] == "legacy" and pending["evidence"]["pending"] == ["0002", "0003", "0004", "0005", "0006"]
    assert "statetool migrate" in pending["action"]
    assert doc["state"]["revision"] == "legacy"
    # The progress is there (a migration keeps it): no export first-runs because of the revision.
    assert proc.returncode == 0
    for export in doc["exports"]:
        assert export["verdict"] == "resumes"
        assert "RIVET_STATE_MIGRATION_PENDING" in codes(export)
    # What a write would do, said and not done: the legacy state has no identity yet.
    assert doc["state"]["identity"] == {"recorded": None, "computed": SALES, "verdict": "adopt"}


# -- where the setting came from ------------------------------------------------------------


def test_set_by_and_the_line_every_task_must_share(config: Path, tmp_path: Path) -> None:
    state_dir = tmp_path / "volume"
    state_dir.mkdir()
    build_state(config, f"sqlite:{state_dir}", checkpoint_dir=state_dir)

    default = doctor_op(Context(config, None, env={})).state
    assert default["set_by"].startswith("nothing")
    assert "RIVET_STATE_URL unset" in default["every_task_must_share"]
    assert default["location"]["origin"] == "default"

    env = doctor_op(Context(config, None, env={"RIVET_STATE_URL": f"sqlite:{state_dir}"})).state
    assert env["set_by"] == "RIVET_STATE_URL"
    assert env["every_task_must_share"] == f"RIVET_STATE_URL=sqlite:{state_dir}"

    # The flag beats the environment, and says so; through the real CLI.
    before = tree(config.parent, state_dir)
    proc = run_cli("-c", str(config), "--json", "doctor", "--state-url", f"sqlite:{state_dir}",
                   env={"RIVET_STATE_URL": f"sqlite:{tmp_path / 'elsewhere'}"})
    assert proc.returncode == 0, describe(proc)
    assert tree(config.parent, state_dir) == before
    state = json.loads(proc.stdout)["state"]
    assert state["set_by"] == "--state-url" and state["location"]["origin"] == "flag"
    assert state["every_task_must_share"] == f"RIVET_STATE_URL=sqlite:{state_dir}"
    assert state["location"]["path"] == str(state_dir / STATE_FILE)

    human = run_cli("-c", str(config), "doctor", env={"RIVET_STATE_URL": f"sqlite:{state_dir}"})
    assert human.returncode == 0, describe(human)
    assert "set by" in human.stdout and f"RIVET_STATE_URL=sqlite:{state_dir}" in human.stdout


# -- PostgreSQL ------------------------------------------------------------------------------


@pytest.mark.postgres
def test_postgres_state_missing_every_export_first_runs(config: Path, pg_url: str) -> None:
    proc, doc = doctor(config, env={"RIVET_STATE_URL": pg_url})
    assert proc.returncode == 5
    schema = pg_url.rsplit("schema=", 1)[1]
    for export in doc["exports"]:
        assert export["verdict"] == "first_run"
        evidence = reason(export["reasons"], "RIVET_STATE_MISSING")["evidence"]
        assert f"(schema {schema})" in evidence["state"]
    assert doc["state"]["set_by"] == "RIVET_STATE_URL"
    assert doc["state"]["every_task_must_share"].startswith("RIVET_STATE_URL=postgresql://")


@pytest.mark.postgres
def test_postgres_state_with_relative_checkpoint_on_the_workers_disk(config: Path, pg_url: str,
                                                                    pg_server: dict[str, str]) -> None:
    env = {"RIVET_STATE_URL": pg_url}
    build_state(config, pg_url, checkpoint_dir=config.parent)
    checkpoint = config.parent / "checkpoints" / "order_events.json"

    # The file is there: the export resumes, and the warning says why that is fragile.
    proc, doc = doctor(config, env=env)
    assert proc.returncode == 0
    found = exports(doc)
    assert {e["verdict"] for e in found.values()} == {"resumes"}
    relative = reason(found["order_events"]["reasons"], "RIVET_STATE_CHECKPOINT_RELATIVE")
    assert relative["evidence"]["path"] == str(checkpoint)
    assert str(checkpoint) in relative["message"] and "PostgreSQL" in relative["message"]
    assert codes(found["orders"]) == [] and codes(found["order_lines"]) == []  # once, on the CDC export only

    # A new pod: the worker's disk is fresh, the state in PostgreSQL still shows progress.
    checkpoint.unlink()
    proc, doc = doctor(config, env=env)
    assert proc.returncode == 5
    events = exports(doc)["order_events"]
    assert events["verdict"] == "first_run"
    assert reason(events["reasons"], "RIVET_STATE_CHECKPOINT_MISSING")["evidence"]["path"] == str(checkpoint)
    assert "RIVET_STATE_CHECKPOINT_RELATIVE" in codes(events)


@pytest.mark.postgres
def test_postgres_state_of_another_source_is_reported_not_refused(tmp_path: Path, config: Path, pg_url: str) -> None:
    absolute = tmp_path / "volume" / "order_events.json"
    crm = write_config(tmp_path / "crm", source_url=CRM_URL, exports=textwrap.dedent(f"""\
        exports:
          - name: orders
            mode: incremental
          - name: order_events
            mode: cdc
            cdc:
              engine: mysql
              checkpoint: {absolute}
        """))
    store = StateStore.open(crm, state_url=pg_url, env={}, create=True)
    with store.transaction() as tx:
        run = tx.start_run("orders", "incremental")
        tx.commit_cursor("orders", "incremental", CURSOR)
        tx.finish_run(run, "succeeded")
        tx.finish_run(tx.start_run("order_events", "cdc"), "succeeded")
    write_checkpoint(absolute, json.dumps(POSITION))
    shared = write_config(tmp_path / "sales", exports=textwrap.dedent(f"""\
        exports:
          - name: orders
            mode: incremental
          - name: order_events
            mode: cdc
            cdc:
              engine: mysql
              checkpoint: {absolute}
        """))
    proc, doc = doctor(shared, env={"RIVET_STATE_URL": pg_url}, watch=(absolute.parent,))
    assert proc.returncode == 0
    assert doc["state"]["identity"] == {"recorded": "postgresql://crm.internal:5432/crm", "computed": SALES,
                                        "verdict": "report"}
    for export in doc["exports"]:
        assert export["verdict"] == "resumes"
        assert not {"RIVET_STATE_FOREIGN", "RIVET_STATE_FOREIGN_BESIDE_CONFIG",
                    "RIVET_STATE_CHECKPOINT_RELATIVE"} & set(codes(export))  # absolute: no warning


@pytest.mark.postgres
def test_postgres_password_never_reaches_the_line_every_task_must_share(config: Path,
                                                                      pg_server: dict[str, str]) -> None:
    if not pg_server["password_url"]:
        pytest.skip("needs the fixture's password role")
    url = pg_server["password_url"] + "&schema=t_doctor_pw"
    proc = run_cli("-c", str(config), "--json", "doctor", env={"RIVET_STATE_URL": url})
    assert proc.returncode == 5, describe(proc)
    assert "correct-horse-battery" not in proc.stdout + proc.stderr
    assert "statetool_pw" in json.loads(proc.stdout)["state"]["every_task_must_share"]


# -- check folds doctor in; GitHub annotations ---------------------------------------------


def test_check_reports_doctor_findings_and_github_annotations(config: Path) -> None:
    build_state(config, only=("orders", "order_events"))
    write_checkpoint(config.parent / "checkpoints" / "order_events.json", "not json")
    before = tree(config.parent)
    proc = run_cli("-c", str(config), "--json", "check")
    assert tree(config.parent) == before
    assert proc.returncode == 4, describe(proc)  # an unreadable checkpoint is data_integrity
    rows = {(c["id"], c["code"]): c["status"] for c in json.loads(proc.stdout)["checks"] if c["code"]}
    assert rows[("doctor:order_events", "RIVET_STATE_CHECKPOINT_UNREADABLE")] == "fail"
    assert rows[("doctor:order_lines", "RIVET_EXPORT_NO_PROGRESS")] == "warn"
    assert "::error" not in proc.stdout + proc.stderr

    proc = run_cli("-c", str(config), "check", env={"GITHUB_ACTIONS": "true"})
    assert proc.returncode == 4, describe(proc)
    lines = proc.stdout.splitlines()
    errors = [line for line in lines if line.startswith("::error ")]
    warnings = [line for line in lines if line.startswith("::warning ")]
    assert any("RIVET_STATE_CHECKPOINT_UNREADABLE" in line and "order_events.json" in line for line in errors), lines
    assert any("RIVET_EXPORT_NO_PROGRESS" in line and "order_lines" in line for line in warnings), lines
    for line in errors + warnings:
        assert re.match(r"^::(error|warning) title=[^:\n]+::\S", line), line

    # --json keeps stdout one JSON document: the annotations go to stderr.
    proc = run_cli("-c", str(config), "--json", "check", env={"GITHUB_ACTIONS": "true"})
    json.loads(proc.stdout)
    assert any(line.startswith("::error ") for line in proc.stderr.splitlines()), describe(proc)


def test_a_warning_made_to_fail_is_a_refusal_for_check_strict_and_doctor_alike(config: Path) -> None:
    """One rule (errors.failure_class): a warning that fails, under check --strict or as the
    only reason of a first run, fails as refusal; the worst outcome is one rule (errors.worst)."""
    assert failure_class("RIVET_EXPORT_NO_PROGRESS") == "refusal"
    assert worst(["RIVET_STATE_CORRUPT", "RIVET_STATE_MISSING", "RIVET_EXPORT_NO_PROGRESS"]) == "RIVET_STATE_CORRUPT"
    assert worst(["RIVET_STATE_MISSING", "RIVET_EXPORT_NO_PROGRESS"]) == "RIVET_EXPORT_NO_PROGRESS"  # last of equals
    assert worst([]) is None
    with pytest.raises(KeyError):
        failure_class("RIVET_NOT_REGISTERED")

    build_state(config, only=("orders",))  # order_lines never ran: RIVET_EXPORT_NO_PROGRESS, a warning
    for command in (("check", "--strict"), ("doctor",)):
        proc = run_cli("-c", str(config), "--json-errors", *command)
        assert proc.returncode == EXIT_CODES["refusal"], describe(proc)
        line = error_object(proc)
        assert (line["kind"], line["class"], line["exit_code"]) == ("warning", "refusal", 5), describe(proc)
        failed = {f["export"]: f for f in line["failures"]}
        assert failed["order_lines"]["code"] == "RIVET_EXPORT_NO_PROGRESS", describe(proc)
        assert failed["order_lines"]["class"] == "refusal", describe(proc)


def test_doctor_checkpoints_and_check_change_nothing(config: Path, tmp_path: Path) -> None:
    """A WAL state just written by the runtime, a missing declared directory, a relocated
    state: every read command, nothing created, nothing changed."""
    build_state(config, checkpoint_dir=config.parent)
    # (doctor --json is checked by every scenario above, through doctor())
    commands = (["doctor"], ["checkpoints"], ["--json", "check", "--strict"])

    def reads_change_nothing(env: dict[str, str] | None) -> None:
        before = tree(tmp_path)
        for args in commands:
            proc = run_cli("-c", str(config), *args, env=env)
            assert proc.returncode in (0, 1, 3, 4, 5), describe(proc)
            assert tree(tmp_path) == before, f"{args} with {env} changed files:\n{describe(proc)}"

    reads_change_nothing(None)
    reads_change_nothing({"RIVET_STATE_URL": f"sqlite:{tmp_path / 'not-mounted'}"})
    proc = run_cli("-c", str(config), "relocate", "--to", str(tmp_path / "volume"), "--create-dir")
    assert proc.returncode == 0, describe(proc)
    reads_change_nothing(None)
