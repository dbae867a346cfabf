"""One reader of CDC checkpoint files (issue 15, a fresh user's findings 1-6; SPEC §5a, §6,
§8a): the runtime, ``checkpoints``, ``doctor``, ``check`` and ``checkpoints import`` read a
checkpoint file by one set of rules and refuse it by one set of registered codes.

- a FIFO, a directory or a symlink to nothing at the checkpoint path is
  ``RIVET_STATE_CHECKPOINT_NOT_A_FILE``, never a first run, and a FIFO is never waited on;
  a symlink to a regular file is followed (the operator's link to durable storage);
- a file this user may not read is ``RIVET_STATE_PERMISSION_DENIED`` everywhere (run as
  ``nobody``, for real: the process drops root before it opens anything);
- a file over the cap, with a byte-order mark, in UTF-16, with ``NaN`` or holding JSON
  ``null`` is ``RIVET_STATE_CHECKPOINT_UNREADABLE`` everywhere;
- a state row holding null is never "no row" (the runtime never reads the file then), and
  a state that cannot be read is never reported as one that holds no position.

The runtime is exercised through ``StateStore.open(...).run(...)`` on both backends.
"""

from __future__ import annotations

import codecs
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support import describe, error_object, fork_code, process_env, run_cli, tree_digest, write_config
from support.backends import StateBackend
from statetool.errors import StateError, failure_exit_code
from statetool.operations.checkpoint_file import MAX_CHECKPOINT_BYTES
from statetool.operations.positions import put_position
from statetool.runtime import StateStore

POSITION = {"file": "mysql-bin.000042", "pos": 91234}
NOBODY = 65534


def _store(backend: StateBackend) -> tuple[StateStore, Path]:
    """A state with the default config (order_events: mysql, ``checkpoints/order_events.json``
    beside the config), and the checkpoint's path (its directory made)."""
    config = write_config(backend.pipeline)
    store = StateStore.open(config, env=process_env(backend.env), create=True)
    checkpoint = config.parent / "checkpoints" / "order_events.json"
    checkpoint.parent.mkdir(exist_ok=True)
    return store, checkpoint


def _read_position(store: StateStore) -> object:
    """The runtime's read of order_events' position, bounded: a reader that waited on a
    FIFO would hang the test instead of failing it."""
    signal.alarm(20)
    try:
        with store.run("order_events", "cdc") as run:
            return run.read_position()
    finally:
        signal.alarm(0)


def _refused(store: StateStore) -> StateError:
    with pytest.raises(StateError) as caught:
        _read_position(store)
    return caught.value


def _cli(store: StateStore, backend: StateBackend, *args: str) -> Any:
    return run_cli("-c", str(store.ctx.config.path), *args, env=backend.env)


def _listed(store: StateStore, backend: StateBackend) -> dict[str, Any]:
    proc = _cli(store, backend, "--json", "checkpoints")
    assert proc.returncode == 0, describe(proc)
    return {c["export"]: c for c in json.loads(proc.stdout)["checkpoints"]}["order_events"]


def _doctor_says(store: StateStore, backend: StateBackend, code: str) -> None:
    """``doctor`` gives order_events' checkpoint ``code`` as a reason its next run will not
    resume (verdict ``first_run``, exiting with ``code``'s own exit code: it is the reason on
    top, as ``--json-errors`` says), never "resumes" nor a missing file."""
    proc = _cli(store, backend, "--json", "doctor", "--export", "order_events")
    (diagnosis,) = json.loads(proc.stdout)["exports"]
    codes = [r["code"] for r in diagnosis["reasons"]]
    assert (proc.returncode, diagnosis["verdict"]) == (failure_exit_code(code), "first_run") and code in codes, describe(proc)
    assert "RIVET_STATE_CHECKPOINT_MISSING" not in codes, describe(proc)


def _import_refused(store: StateStore, backend: StateBackend, code: str) -> None:
    """``checkpoints import`` refuses with ``code`` and changes no byte beside the config."""
    before = tree_digest(store.ctx.config.directory)
    proc = _cli(store, backend, "--json-errors", "checkpoints", "import")
    assert error_object(proc)["code"] == code, describe(proc)
    assert tree_digest(store.ctx.config.directory) == before
    assert store.stored_position("order_events") is None


# -- finding 1: a FIFO, a directory, a symlink ---------------------------------------------


def test_a_fifo_at_the_checkpoint_path_is_refused_everywhere_and_never_waited_on(
        state_backend: StateBackend) -> None:
    store, checkpoint = _store(state_backend)
    os.mkfifo(checkpoint)
    started = time.monotonic()
    err = _refused(store)
    assert err.code == "RIVET_STATE_CHECKPOINT_NOT_A_FILE" and "a FIFO" in err.message, err
    assert time.monotonic() - started < 10
    listed = _listed(store, state_backend)
    assert listed["present"] is False and listed["error"].startswith("RIVET_STATE_CHECKPOINT_NOT_A_FILE"), listed
    _doctor_says(store, state_backend, "RIVET_STATE_CHECKPOINT_NOT_A_FILE")
    _import_refused(store, state_backend, "RIVET_STATE_CHECKPOINT_NOT_A_FILE")


def test_a_directory_at_the_checkpoint_path_is_not_a_first_run(state_backend: StateBackend) -> None:
    store, checkpoint = _store(state_backend)
    checkpoint.mkdir()
    err = _refused(store)
    assert err.code == "RIVET_STATE_CHECKPOINT_NOT_A_FILE" and "a directory" in err.message, err
    assert err.details == {"path": str(checkpoint)}
    _doctor_says(store, state_backend, "RIVET_STATE_CHECKPOINT_NOT_A_FILE")
    _import_refused(store, state_backend, "RIVET_STATE_CHECKPOINT_NOT_A_FILE")


def test_a_symlink_to_a_file_is_followed_and_a_symlink_to_nothing_is_refused(state_backend: StateBackend,
                                                                             tmp_path: Path) -> None:
    """The config names the path; an operator's link from it to durable storage is read.
    A link whose target is gone (the volume not mounted) is never "no file": a run would
    start the stream from no position while its position is on that volume."""
    store, checkpoint = _store(state_backend)
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "order_events.json").write_text(json.dumps(POSITION))
    checkpoint.symlink_to(volume / "order_events.json")
    assert _read_position(store) == POSITION
    assert _listed(store, state_backend)["position"] == POSITION
    shutil.rmtree(volume)
    err = _refused(store)
    assert err.code == "RIVET_STATE_CHECKPOINT_NOT_A_FILE" and "a symlink to nothing" in err.message, err
    listed = _listed(store, state_backend)
    assert listed["present"] is False and "symlink to nothing" in listed["error"], listed
    _doctor_says(store, state_backend, "RIVET_STATE_CHECKPOINT_NOT_A_FILE")
    _import_refused(store, state_backend, "RIVET_STATE_CHECKPOINT_NOT_A_FILE")


def test_a_symlink_to_nothing_in_the_declared_directory_is_not_passed_over_for_a_file_beside_the_config(
        tmp_path: Path) -> None:
    """The resolver uses a file beside the config only when nothing at all is under the
    declared directory: a link there whose volume is not mounted must not make a stale
    file beside the config the position."""
    declared = tmp_path / "state"
    declared.mkdir()
    store, beside = _store(StateBackend.sqlite(tmp_path, declared))
    beside.write_text(json.dumps({"file": "mysql-bin.000001", "pos": 4}))
    (declared / "checkpoints").mkdir()
    (declared / "checkpoints" / "order_events.json").symlink_to(tmp_path / "unmounted" / "order_events.json")
    err = _refused(store)
    assert err.code == "RIVET_STATE_CHECKPOINT_NOT_A_FILE" and str(declared) in err.message, err


# -- finding 2: a file this user may not read, as nobody for real ---------------------------

DROP = f"import os, sys\nos.setgroups([])\nos.setgid({NOBODY})\nos.setuid({NOBODY})\n"
RUNTIME_AS_NOBODY = DROP + """\
import json
from statetool.errors import StateError
from statetool.runtime import StateStore
try:
    with StateStore.open(sys.argv[1]).run("order_events", "cdc") as run:
        print(json.dumps({"position": run.read_position()}))
except StateError as err:
    print(json.dumps({"code": err.code, "message": err.message}))
"""
CLI_AS_NOBODY = DROP + "from statetool.cli import main\nmain(sys.argv[1:])\n"


@pytest.fixture
def nobody_dir() -> Iterator[Path]:
    """A directory ``nobody`` owns, on a path every user may walk (``tmp_path`` is not)."""
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("dropping to nobody needs root")
        pytest.skip("dropping to nobody needs root")
    where = Path(tempfile.mkdtemp(prefix="statetool-ckread-"))
    where.chmod(0o755)
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _as_nobody(code: str, *args: str, env: dict[str, str]) -> tuple[int, str, str]:
    proc = fork_code(code, *args, env=process_env(env), stdout=-1, stderr=-1)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def test_a_checkpoint_file_nobody_may_read_is_permission_denied_everywhere_never_a_first_run(
        request: pytest.FixtureRequest, nobody_dir: Path, backend_kind: str) -> None:
    backend = (StateBackend.postgres(nobody_dir, request.getfixturevalue("pg_url")) if backend_kind == "postgres"
               else StateBackend.sqlite(nobody_dir))
    store, checkpoint = _store(backend)
    checkpoint.write_text(json.dumps(POSITION))
    shutil.chown(checkpoint, "root", "root")
    checkpoint.chmod(0)
    for path in [nobody_dir, *nobody_dir.rglob("*")]:
        if path != checkpoint:
            shutil.chown(path, "nobody", "nogroup")
    config = str(store.ctx.config.path)
    code, out, err = _as_nobody(RUNTIME_AS_NOBODY, config, env=backend.env)
    assert code == 0 and json.loads(out)["code"] == "RIVET_STATE_PERMISSION_DENIED", (out, err)
    before = tree_digest(nobody_dir)  # (the run's lease record is there now, as after every run)
    code, out, err = _as_nobody(CLI_AS_NOBODY, "-c", config, "--json", "--json-errors", "doctor", env=backend.env)
    assert "FIRST RUN" not in out and "first_run" not in out, (out, err)
    assert (code, json.loads(err.splitlines()[-1])["code"]) == (1, "RIVET_STATE_PERMISSION_DENIED"), (out, err)
    code, out, err = _as_nobody(CLI_AS_NOBODY, "-c", config, "--json", "checkpoints", env=backend.env)
    listed = {c["export"]: c for c in json.loads(out)["checkpoints"]}["order_events"]
    assert listed["present"] is True and listed["error"].startswith("RIVET_STATE_PERMISSION_DENIED"), listed
    code, out, err = _as_nobody(CLI_AS_NOBODY, "-c", config, "--json", "check", env=backend.env)
    rows = {r["id"]: r for r in json.loads(out)["checks"]}
    assert rows["doctor"]["code"] == "RIVET_STATE_PERMISSION_DENIED", (out, err)
    assert not any(r["code"] in {"RIVET_STATE_CHECKPOINT_UNREADABLE", "RIVET_EXPORT_NO_PROGRESS"}
                   for r in rows.values()), rows
    code, out, err = _as_nobody(CLI_AS_NOBODY, "-c", config, "--json-errors", "checkpoints", "import",
                                env=backend.env)
    assert (code, json.loads(err.splitlines()[-1])["code"]) == (1, "RIVET_STATE_PERMISSION_DENIED"), (out, err)
    assert tree_digest(nobody_dir) == before


@pytest.fixture(params=[pytest.param("sqlite"), pytest.param("postgres", marks=pytest.mark.postgres)])
def backend_kind(request: pytest.FixtureRequest) -> str:
    """``sqlite`` or ``postgres``: for a test whose state lives where ``nobody`` may walk."""
    return str(request.param)


# -- finding 3: one cap, read at most cap + 1 bytes ----------------------------------------


def test_a_file_over_the_cap_is_refused_everywhere_though_it_is_json(state_backend: StateBackend) -> None:
    store, checkpoint = _store(state_backend)
    body = json.dumps({"pos": 1, "pad": ""})
    checkpoint.write_text(body[:-2] + "x" * (MAX_CHECKPOINT_BYTES + 1 - len(body)) + body[-2:])
    assert checkpoint.stat().st_size == MAX_CHECKPOINT_BYTES + 1
    err = _refused(store)
    assert err.code == "RIVET_STATE_CHECKPOINT_UNREADABLE" and str(MAX_CHECKPOINT_BYTES) in err.message, err
    assert _listed(store, state_backend)["error"].startswith("RIVET_STATE_CHECKPOINT_UNREADABLE")
    _doctor_says(store, state_backend, "RIVET_STATE_CHECKPOINT_UNREADABLE")
    _import_refused(store, state_backend, "RIVET_STATE_CHECKPOINT_UNREADABLE")


def test_a_3_gb_checkpoint_is_refused_without_being_read(tmp_path: Path) -> None:
    store, checkpoint = _store(StateBackend.sqlite(tmp_path))
    with open(checkpoint, "wb") as fh:  # sparse: no disk, but a reader of the whole file reads 3 GB
        fh.truncate(3 << 30)
    started = time.monotonic()
    assert _refused(store).code == "RIVET_STATE_CHECKPOINT_UNREADABLE"
    assert time.monotonic() - started < 5


# -- finding 4: strict UTF-8 JSON, one rule ------------------------------------------------


@pytest.mark.parametrize("body", [codecs.BOM_UTF8 + json.dumps(POSITION).encode(),
                                  json.dumps(POSITION).encode("utf-16"),
                                  json.dumps(POSITION).encode("utf-16-le"),
                                  b'{"pos": NaN}', b'{"pos": "\xff"}', b""],
                         ids=["utf8-bom", "utf16-bom", "utf16-no-bom", "nan", "latin1", "empty"])
def test_a_checkpoint_that_is_not_strict_utf8_json_is_refused_by_the_runtime_as_by_import(
        state_backend: StateBackend, body: bytes) -> None:
    store, checkpoint = _store(state_backend)
    checkpoint.write_bytes(body)
    err = _refused(store)
    assert err.code == "RIVET_STATE_CHECKPOINT_UNREADABLE", err
    assert _listed(store, state_backend)["error"].startswith("RIVET_STATE_CHECKPOINT_UNREADABLE")
    _import_refused(store, state_backend, "RIVET_STATE_CHECKPOINT_UNREADABLE")


# -- finding 5: JSON null -------------------------------------------------------------------


def test_a_file_holding_null_is_no_position_and_not_a_first_run(state_backend: StateBackend) -> None:
    store, checkpoint = _store(state_backend)
    checkpoint.write_text("null\n")
    err = _refused(store)
    assert err.code == "RIVET_STATE_CHECKPOINT_UNREADABLE" and "null" in err.message, err
    _import_refused(store, state_backend, "RIVET_STATE_CHECKPOINT_UNREADABLE")


def test_committing_none_is_refused_and_writes_nothing(state_backend: StateBackend) -> None:
    store, _checkpoint = _store(state_backend)
    with store.run("order_events", "cdc") as run:
        with pytest.raises(ValueError, match="no position"):
            run.commit_position(None)
    assert store.stored_position("order_events") is None


def test_a_state_row_holding_null_never_makes_the_runtime_read_the_file(state_backend: StateBackend) -> None:
    """A row an older release committed with ``commit_position(None)``: it is a row, so
    the file (a stale one here) is never read for the position; the run is refused."""
    store, checkpoint = _store(state_backend)
    checkpoint.write_text(json.dumps({"file": "mysql-bin.000001", "pos": 4}))
    with store.transaction() as tx:
        put_position(tx.conn, "order_events", "mysql", "null")
    err = _refused(store)
    assert err.code == "RIVET_STATE_POSITION_INVALID" and err.details == {"export": "order_events"}, err
    listed = _listed(store, state_backend)
    assert listed["stored_in"] == "unknown" and listed["position"] is None, listed
    assert "RIVET_STATE_POSITION_INVALID" in listed["error"], listed
    proc = _cli(store, state_backend, "--json-errors", "doctor")
    assert error_object(proc)["code"] == "RIVET_STATE_POSITION_INVALID", describe(proc)


# -- finding 6: a state that cannot be read is not one without a position ------------------


def test_checkpoints_of_a_state_that_cannot_be_read_do_not_claim_the_file_is_the_position(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    checkpoint = config.parent / "checkpoints" / "order_events.json"
    checkpoint.parent.mkdir()
    checkpoint.write_text(json.dumps(POSITION))
    (config.parent / ".rivet_state.db").write_bytes(b"this is no SQLite database" * 100)
    proc = run_cli("-c", str(config), "--json", "checkpoints")
    assert proc.returncode == 0, describe(proc)
    (listed,) = json.loads(proc.stdout)["checkpoints"]
    assert listed["stored_in"] == "unknown" and listed["position"] is None, listed
    assert listed["error"].startswith("RIVET_STATE_NOT_A_STATE"), listed
    assert listed["present"] is True and listed["size_bytes"] == checkpoint.stat().st_size, listed


def test_checkpoints_of_an_unreachable_postgresql_state_do_not_claim_the_file_is_the_position(
        tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    (config.parent / "checkpoints").mkdir()
    (config.parent / "checkpoints" / "order_events.json").write_text(json.dumps(POSITION))
    proc = run_cli("-c", str(config), "--json", "checkpoints",
                   env={"RIVET_STATE_URL": "postgresql://nobody@127.0.0.1:9/none?connect_timeout=2"})
    assert proc.returncode == 0, describe(proc)
    (listed,) = json.loads(proc.stdout)["checkpoints"]
    assert (listed["stored_in"], listed["position"]) == ("unknown", None), listed
    assert listed["error"].startswith("RIVET_STATE_UNREACHABLE"), listed
