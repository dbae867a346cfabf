"""The write side of CDC positions (issue 15, a fresh user's findings; SPEC §5a, §8a, §9):
``run.commit_position``, ``statetool checkpoints import|export`` and ``migrate --to`` below
revision 0006, on real files, a real read-only mount and both backends.

Each rule here is one the user broke: a position no checkpoint file may hold is never
committed, and one in the state is never half-exported; an import whose file cannot be
renamed is refused before its commit (and a rename that fails after the commit says where
the position is); the exported file keeps the owner and mode of the file it was imported
from; a file at the export's target that holds no position is not ours; two exports of one
config never share one checkpoint file; a command that moves nothing changes no byte, not
even a lease record; and a downgrade never drops a stored position.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from support import describe, error_object, process_env, run_cli, write_config
from support.backends import StateBackend
from statetool.errors import StateError
from statetool.operations.checkpoint_file import MAX_CHECKPOINT_BYTES
from statetool.runtime import StateStore

POSITION = {"file": "mysql-bin.000042", "pos": 91234}
ORIGINAL = b'{"file":"mysql-bin.000042",   "pos":91234}\n'
#: Two CDC exports of one config whose checkpoints name one file.
SHARED = """\
exports:
  - name: order_events
    mode: cdc
    cdc:
      engine: mysql
      checkpoint: checkpoints/shared.json
  - name: refund_events
    mode: cdc
    cdc:
      engine: mysql
      checkpoint: ./checkpoints/../checkpoints/shared.json
"""


def _pipeline(backend: StateBackend, **config: Any) -> tuple[StateStore, Path]:
    """A state at head for a config in ``backend.pipeline`` (``config``: :func:`write_config`'s
    options) and the checkpoint file of ``order_events`` (not written)."""
    path = write_config(backend.pipeline, **config)
    store = StateStore.open(path, env=process_env(backend.env), create=True)
    checkpoint = store.checkpoint_path("order_events")
    assert checkpoint is not None
    return store, checkpoint


def _cli(store: StateStore, backend: StateBackend, *args: str) -> Any:
    return run_cli("-c", str(store.ctx.config.path), *args, env=backend.env)


def _files(directory: Path) -> dict[str, tuple[str, int, int, int, int]]:
    """``{relative path: (sha256, mtime ns, mode, uid, gid)}`` of every file below ``directory``
    (lease sidecars too): a command that changes nothing leaves this equal."""
    out = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and not path.is_symlink():
            st = path.stat()
            out[str(path.relative_to(directory))] = (hashlib.sha256(path.read_bytes()).hexdigest(), st.st_mtime_ns,
                                                     st.st_mode, st.st_uid, st.st_gid)
    return out


def _rows(store: StateStore) -> dict[str, list[str]]:
    """Every row of every table of the state (lease rows and the serial too), read-only."""
    backend = store.ctx.backend()
    with backend.reading() as conn:
        return {t: sorted(repr(r) for r in conn.rows(f'SELECT * FROM "{t}"')) for t in sorted(backend.table_names(conn))}


def _unchanged(store: StateStore, where: Path) -> Iterator[None]:
    before = (_files(where), _rows(store))
    yield
    assert (_files(where), _rows(store)) == before, "a refused or idle command changed a byte"


unchanged = contextmanager(_unchanged)


def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("SKIPPED LOUDLY: a read-only bind mount and chown need root")


@contextmanager
def _read_only(directory: Path) -> Iterator[None]:
    """``directory`` bind-mounted on itself, read-only, for the body (unmounted after)."""
    _require_root()
    subprocess.run(["mount", "--bind", str(directory), str(directory)], check=True, capture_output=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(directory)], check=True, capture_output=True)
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=True, capture_output=True)


# -- 1. the cap of a checkpoint file is the cap of a position ---------------------------------


def test_a_position_larger_than_a_checkpoint_file_may_be_is_refused_on_commit_and_nothing_is_written(
        state_backend: StateBackend) -> None:
    """A 2 MB position used to be committed, then could never be exported back (the file
    reader caps at 1 MiB): the commit refuses it by a registered code, through the run and
    through a grouped transaction, and writes nothing; a position of exactly the cap is
    committed and goes back to its file."""
    store, checkpoint = _pipeline(state_backend)
    with store.run("order_events", "cdc") as run, unchanged(store, state_backend.pipeline):
        with pytest.raises(StateError) as caught:
            run.commit_position({"blob": "x" * 2_000_000})
        assert caught.value.code == "RIVET_STATE_POSITION_TOO_LARGE", caught.value
        assert "1 MiB" in caught.value.message and "nothing was written" in caught.value.message, caught.value
    with unchanged(store, state_backend.pipeline):
        with pytest.raises(StateError) as caught:
            with store.transaction() as tx:
                tx.commit_position("order_events", "mysql", {"blob": "x" * 2_000_000})
        assert caught.value.code == "RIVET_STATE_POSITION_TOO_LARGE"
    largest = {"blob": "x" * (MAX_CHECKPOINT_BYTES - len('{"blob": ""}'))}
    with store.run("order_events", "cdc") as run:
        run.commit_position(largest)
    proc = _cli(store, state_backend, "--json", "checkpoints", "export")
    assert proc.returncode == 0, describe(proc)
    assert json.loads(checkpoint.read_bytes()) == largest and store.stored_position("order_events") is None


def _put_oversized(store: StateStore, text: str) -> None:
    """A position row no checkpoint file can hold, as a release without the cap committed it."""
    backend = store.ctx.backend()
    with backend.writing("RIVET_STATE_LOCK_TIMEOUT") as conn:
        conn.exec_driver_sql("INSERT INTO rivet_cdc_positions (export_name, engine, position, committed_at) "
                             "VALUES ('order_events', 'mysql', %s, '2026-01-01T00:00:00Z')"
                             if backend.location.backend == "postgres" else
                             "INSERT INTO rivet_cdc_positions (export_name, engine, position, committed_at) "
                             "VALUES ('order_events', 'mysql', ?, '2026-01-01T00:00:00Z')", (text,))


def test_export_of_a_position_over_the_cap_is_refused_before_any_byte_of_the_file(
        state_backend: StateBackend) -> None:
    """``checkpoints export`` used to write the file, then refuse it on the read back: it
    decides the size before it writes, so the refusal leaves no file, no temporary file, and
    the state's row (the position runs resume from) where it was; the dry run refuses alike."""
    store, checkpoint = _pipeline(state_backend)
    _put_oversized(store, json.dumps({"blob": "x" * 2_000_000}))
    with unchanged(store, state_backend.pipeline):
        for dry in ((), ("--dry-run",)):
            proc = _cli(store, state_backend, "--json-errors", "checkpoints", "export", *dry)
            err = error_object(proc)
            assert (err["code"], err["exit_code"]) == ("RIVET_STATE_POSITION_TOO_LARGE", 1), describe(proc)
            assert "stays in the state" in err["message"], err["message"]
    assert not checkpoint.parent.exists(), "nothing was written, not even the checkpoint's directory"


# -- 2. an import whose file cannot be renamed -------------------------------------------------


def test_import_from_a_read_only_checkpoint_directory_is_refused_before_the_commit_and_changes_no_byte(
        state_backend: StateBackend, tmp_path: Path) -> None:
    """The import used to commit the position, then fail to rename the file and say
    "READ_ONLY … nothing was written": a lie, with a file and a row both live. The rename is
    proved possible before anything is written: on a read-only mount the import is refused
    ``RIVET_STATE_READ_ONLY`` naming the checkpoint's directory, and changes no byte (no
    row, no lease record); its dry run gives the plan with ``RIVET_STATE_READ_ONLY_DRY_RUN``."""
    directory = tmp_path / "positions"
    directory.mkdir()
    (directory / "order_events.json").write_bytes(ORIGINAL)
    store, checkpoint = _pipeline(state_backend, checkpoint=str(directory / "order_events.json"))
    with _read_only(directory), unchanged(store, tmp_path):
        proc = _cli(store, state_backend, "--json-errors", "checkpoints", "import")
        err = error_object(proc)
        assert err["code"] == "RIVET_STATE_READ_ONLY", describe(proc)
        assert str(directory) in err["message"] and "renames" in err["message"], err["message"]
        assert "nothing was written" in err["message"]
        plan = _cli(store, state_backend, "--json", "checkpoints", "import", "--dry-run")
        assert plan.returncode == 0, describe(plan)
        assert [w["code"] for w in json.loads(plan.stdout)["warnings"]] == ["RIVET_STATE_READ_ONLY_DRY_RUN"], plan
    assert store.stored_position("order_events") is None and checkpoint.read_bytes() == ORIGINAL


def test_import_of_a_checkpoint_file_mounted_alone_is_refused_before_the_commit(state_backend: StateBackend,
                                                                                tmp_path: Path) -> None:
    """A checkpoint file bind-mounted by itself (a container's volume of one file) can never
    be renamed: refused ``RIVET_STATE_CHECKPOINT_MOUNTED`` before anything is written."""
    _require_root()
    directory = tmp_path / "positions"
    directory.mkdir()
    source = tmp_path / "volume.json"
    source.write_bytes(ORIGINAL)
    checkpoint = directory / "order_events.json"
    checkpoint.touch()
    store, _ = _pipeline(state_backend, checkpoint=str(checkpoint))
    subprocess.run(["mount", "--bind", str(source), str(checkpoint)], check=True, capture_output=True)
    try:
        with unchanged(store, state_backend.pipeline):
            proc = _cli(store, state_backend, "--json-errors", "checkpoints", "import")
            err = error_object(proc)
            assert (err["code"], err["exit_code"]) == ("RIVET_STATE_CHECKPOINT_MOUNTED", 1), describe(proc)
            assert str(checkpoint) in err["message"] and "nothing was written" in err["message"], err["message"]
    finally:
        subprocess.run(["umount", str(checkpoint)], check=True, capture_output=True)
    assert store.stored_position("order_events") is None and source.read_bytes() == ORIGINAL


def test_a_rename_that_fails_after_the_commit_says_where_the_position_is_and_what_to_run(
        state_backend: StateBackend, tmp_path: Path) -> None:
    """The directory turns read-only between the commit and the rename (a remount at that
    instant): the error is not "nothing was written" but says the position is in the state
    (which every reader takes), the file is still there, and which command finishes it; that
    command, once the directory is writable, only renames the file."""
    from statetool.operations.context import Context
    from statetool.operations.positions import import_positions

    _require_root()
    directory = tmp_path / "positions"
    directory.mkdir()
    (directory / "order_events.json").write_bytes(ORIGINAL)
    store, checkpoint = _pipeline(state_backend, checkpoint=str(directory / "order_events.json"))
    mounted: list[Path] = []

    def remount_at(step: str) -> None:
        if step == "committed":
            subprocess.run(["mount", "--bind", str(directory), str(directory)], check=True)
            mounted.append(directory)
            subprocess.run(["mount", "-o", "remount,ro,bind", str(directory)], check=True)

    ctx = Context(store.ctx.config.path, None, env=process_env(state_backend.env), lock_wait=10,
                  on_step=remount_at)
    try:
        with pytest.raises(StateError) as caught:
            import_positions(ctx)
    finally:
        for point in mounted:
            subprocess.run(["umount", str(point)], check=True)
    err = caught.value
    assert err.code == "RIVET_STATE_CHECKPOINT_NOT_RENAMED", err
    assert "nothing was written" not in err.message and "is in the state" in err.message, err.message
    assert str(checkpoint) in err.message and "statetool checkpoints import --export order_events" in err.message
    assert f"; {err.details['cause']})" in err.message, "the cause's code is in the message, for a CLI user"
    assert store.stored_position("order_events") == POSITION and checkpoint.read_bytes() == ORIGINAL
    proc = _cli(store, state_backend, "--json", "checkpoints", "import", "--export", "order_events")
    assert proc.returncode == 0, describe(proc)
    (moved,) = json.loads(proc.stdout)["moved"]
    assert not checkpoint.exists() and Path(moved["kept_as"]).read_bytes() == ORIGINAL
    with store.ctx.backend().reading() as conn:
        assert conn.scalar("SELECT count(*) FROM rivet_audit WHERE action = 'checkpoints.import'") == 1


# -- 3. the exported file keeps the owner and mode of the imported one -------------------------


def _owned(path: Path) -> tuple[int, int, str]:
    st = path.stat()
    return st.st_uid, st.st_gid, oct(st.st_mode & 0o7777)


def test_the_exported_file_keeps_the_owner_and_mode_of_the_file_it_was_imported_from(
        state_backend: StateBackend) -> None:
    """Root's ``checkpoints export`` used to leave a root-owned 0644 file the pipeline's own
    user may not replace: the file gets the owner, group and mode of the file the position
    was imported from (kept beside it as ``<name>.imported-<time>``)."""
    _require_root()
    store, checkpoint = _pipeline(state_backend)
    checkpoint.parent.mkdir()
    checkpoint.write_bytes(ORIGINAL)
    os.chown(checkpoint, 65534, 65534)
    os.chmod(checkpoint, 0o640)
    assert _cli(store, state_backend, "checkpoints", "import").returncode == 0
    proc = _cli(store, state_backend, "checkpoints", "export")
    assert proc.returncode == 0, describe(proc)
    assert checkpoint.read_bytes() == ORIGINAL and _owned(checkpoint) == (65534, 65534, "0o640"), describe(proc)


def test_a_position_transferred_to_postgresql_goes_back_to_a_file_of_its_owner_and_mode(
        tmp_path: Path, pg_url: str) -> None:
    """``transfer --with-checkpoints`` keeps the file renamed as an import does: the export
    from the PostgreSQL state gives the file back with the original's owner and mode."""
    _require_root()
    store, checkpoint = _pipeline(StateBackend.sqlite(tmp_path))
    checkpoint.parent.mkdir()
    checkpoint.write_bytes(ORIGINAL)
    os.chown(checkpoint, 65534, 65534)
    os.chmod(checkpoint, 0o600)
    config = str(store.ctx.config.path)
    moved = run_cli("-c", config, "transfer", "--to-env", "DEST", "--with-checkpoints", env={"DEST": pg_url})
    assert moved.returncode == 0 and not checkpoint.exists(), describe(moved)
    proc = run_cli("-c", config, "checkpoints", "export", env={"RIVET_STATE_URL": pg_url})
    assert proc.returncode == 0, describe(proc)
    assert checkpoint.read_bytes() == ORIGINAL and _owned(checkpoint) == (65534, 65534, "0o600")


def test_a_position_never_imported_is_exported_to_a_file_of_its_directory_owner(state_backend: StateBackend) -> None:
    """A position the runtime committed has no original file: the one export writes belongs
    to the owner and group of its directory (the pipeline's), not to root."""
    _require_root()
    store, checkpoint = _pipeline(state_backend)
    checkpoint.parent.mkdir()
    os.chown(checkpoint.parent, 65534, 65534)
    with store.run("order_events", "cdc") as run:
        run.commit_position(POSITION)
    proc = _cli(store, state_backend, "checkpoints", "export")
    assert proc.returncode == 0, describe(proc)
    assert _owned(checkpoint)[:2] == (65534, 65534) and json.loads(checkpoint.read_bytes()) == POSITION


# -- 4. what stands at the export's target -----------------------------------------------------


@pytest.mark.parametrize("there", ["text", "binary", "directory", "symlink"])
def test_what_is_not_a_position_at_the_export_target_is_not_ours_and_is_refused_unchanged(
        state_backend: StateBackend, tmp_path: Path, there: str) -> None:
    """A file at the checkpoint's place that holds no position is no checkpoint file of
    this export (SPEC §8a): refused ``RIVET_STATE_TARGET_NOT_EMPTY`` (5), move it aside, never
    ``RIVET_STATE_CHECKPOINT_UNREADABLE`` (4), whose advice (restore it from a backup) is
    for a position that was damaged; a directory or a symlink there is
    ``RIVET_STATE_UNSAFE_FILE`` (5). The state's position and the thing stay as they are."""
    store, checkpoint = _pipeline(state_backend)
    checkpoint.parent.mkdir()
    with store.run("order_events", "cdc") as run:
        run.commit_position(POSITION)
    if there == "text":
        checkpoint.write_text("# notes of the on-call engineer\n")
    elif there == "binary":
        checkpoint.write_bytes(b"\x00\xff garbage")
    elif there == "directory":
        checkpoint.mkdir()
    else:
        checkpoint.symlink_to(tmp_path / "elsewhere.json")
    with unchanged(store, state_backend.pipeline):
        for dry in ((), ("--dry-run",)):
            proc = _cli(store, state_backend, "--json-errors", "checkpoints", "export", *dry)
            err = error_object(proc)
            expected = "RIVET_STATE_UNSAFE_FILE" if there in ("directory", "symlink") else "RIVET_STATE_TARGET_NOT_EMPTY"
            assert (err["code"], err["exit_code"]) == (expected, 5), describe(proc)
            assert str(checkpoint) in err["message"] and "nothing was changed" in err["message"], err["message"]
    assert not (tmp_path / "elsewhere.json").exists()
    assert store.stored_position("order_events") == POSITION


# -- 5. two exports of one config, one file ----------------------------------------------------


def test_two_cdc_exports_of_one_config_sharing_one_checkpoint_file_are_refused_before_any_write(
        state_backend: StateBackend) -> None:
    """The second export's import used to be skipped with exit 0 once the first's renamed
    the shared file: the file holds the position of whichever wrote it last, so import and
    export refuse ``RIVET_STATE_CHECKPOINT_SHARED`` (5) for the whole config and for either
    export named, before any write; ``check`` of the one config fails with it too. (The
    runtime refuses a run of either, tests/test_checkpoint_truths.py: refund_events' position
    is committed while it has a file of its own, then the config names the shared one.)"""
    store, _ = _pipeline(state_backend, exports=SHARED.replace("./checkpoints/../checkpoints/shared.json",
                                                               "checkpoints/refunds.json"))
    with store.run("refund_events", "cdc") as run:
        run.commit_position({"file": "mysql-bin.000001", "pos": 4})
    write_config(state_backend.pipeline, exports=SHARED)
    shared = state_backend.pipeline / "checkpoints" / "shared.json"
    shared.parent.mkdir()
    shared.write_bytes(ORIGINAL)
    with unchanged(store, state_backend.pipeline):
        for args in (("import",), ("import", "--export", "refund_events"), ("import", "--dry-run"), ("export",),
                     ("export", "--export", "order_events")):
            proc = _cli(store, state_backend, "--json-errors", "checkpoints", *args)
            err = error_object(proc)
            assert err["code"] == "RIVET_STATE_CHECKPOINT_SHARED", describe(proc)
            assert "order_events" in err["message"] and "refund_events" in err["message"], err["message"]
            assert str(shared) in err["message"], err["message"]
        proc = _cli(store, state_backend, "--json", "check")
        assert proc.returncode == 5, describe(proc)
        failed = [c for c in json.loads(proc.stdout)["checks"] if c["status"] == "fail"]
        assert [c["code"] for c in failed] == ["RIVET_STATE_CHECKPOINT_SHARED"], failed


# -- 6. a command that moves nothing changes no byte -------------------------------------------


def test_an_import_or_export_that_moves_nothing_changes_no_byte_not_even_a_lease_record(
        state_backend: StateBackend) -> None:
    """A skipped import used to take the run lease to decide, and so rewrote the lease
    record (SQLite: its sidecar's bytes and mtime; PostgreSQL: its rows): each move is
    decided on a read-only look first, and an export with nothing to move never takes its
    lease. Skipped: the state holds another position than the file; the state holds one and
    no file is there; the export of a state that holds none."""
    store, checkpoint = _pipeline(state_backend)
    with store.run("order_events", "cdc") as run:
        run.commit_position(POSITION)
    checkpoint.parent.mkdir()
    checkpoint.write_text(json.dumps({"file": "mysql-bin.000001", "pos": 4}))
    with unchanged(store, state_backend.pipeline):
        for dry in ((), ("--dry-run",)):
            proc = _cli(store, state_backend, "--json", "checkpoints", "import", *dry)
            assert proc.returncode == 0 and json.loads(proc.stdout)["moved"] == [], describe(proc)
    checkpoint.unlink()
    with unchanged(store, state_backend.pipeline):
        proc = _cli(store, state_backend, "--json", "checkpoints", "import")
        assert proc.returncode == 0 and json.loads(proc.stdout)["moved"] == [], describe(proc)
    assert _cli(store, state_backend, "checkpoints", "export").returncode == 0
    with unchanged(store, state_backend.pipeline):
        proc = _cli(store, state_backend, "--json", "checkpoints", "export")
        assert proc.returncode == 0 and json.loads(proc.stdout)["moved"] == [], describe(proc)


# -- 7. a downgrade below the position table -----------------------------------------------------


def test_a_downgrade_below_the_position_table_is_refused_while_a_position_is_stored(
        state_backend: StateBackend) -> None:
    """``migrate --to 0005`` used to drop the stored positions with --allow-data-loss, a
    silent re-anchor of every stream at its next run: while the state holds a position the
    downgrade is refused ``RIVET_STATE_POSITIONS_IN_STATE`` (5), with --allow-data-loss, in a
    dry run and with --sql too, naming ``statetool checkpoints export`` first; once the
    positions are back in their files the downgrade runs, dropping nothing."""
    store, checkpoint = _pipeline(state_backend)
    with store.run("order_events", "cdc") as run:
        run.commit_position(POSITION)
    forms = [(), ("--allow-data-loss",), ("--dry-run",), ("--dry-run", "--allow-data-loss")]
    if state_backend.kind == "postgres":
        forms.append(("--sql", "--allow-data-loss"))
    with unchanged(store, state_backend.pipeline):
        for form in forms:
            proc = _cli(store, state_backend, "--json-errors", "migrate", "--to", "0005", *form)
            err = error_object(proc)
            assert (err["code"], err["exit_code"]) == ("RIVET_STATE_POSITIONS_IN_STATE", 5), describe(proc)
            assert err["action"].startswith("run statetool checkpoints export"), err
            assert "statetool checkpoints export" in err["message"] and "order_events" in err["message"], err
    assert _cli(store, state_backend, "checkpoints", "export").returncode == 0
    proc = _cli(store, state_backend, "--json", "migrate", "--to", "0005")
    assert proc.returncode == 0, describe(proc)
    assert json.loads(proc.stdout)["to_revision"] == "0005" and json.loads(checkpoint.read_bytes()) == POSITION
