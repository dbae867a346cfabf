"""What statetool says of CDC positions, checked against what is there (issue 15, a second
fresh user's trial; SPEC §5a, §6, §10): the next run a reset's dry run foresees, the
``present`` of ``checkpoints``, the dry runs of ``checkpoints import|export`` on a read-only
mount, and one checkpoint file shared by two exports, through the real CLI as a process and
the runtime, on both backends (the PostgreSQL one is the session's throwaway server).
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest

from support import describe, error_object, process_env, run_cli_process, write_config
from support.backends import StateBackend
from statetool.errors import StateError
from statetool.runtime import StateStore

POSITION = {"file": "mysql-bin.000042", "pos": 91234}
#: One incremental export and one CDC export whose position is in ``checkpoints/ev.json``.
EV = textwrap.dedent("""\
    exports:
      - name: orders
        mode: incremental
      - name: ev
        mode: cdc
        cdc:
          engine: mysql
          checkpoint: checkpoints/ev.json
    """)


def cli(backend: StateBackend, config: Path, *args: str) -> Any:
    """The real CLI, as a process, on ``backend``'s state (``--lock-wait 0``: nothing waits)."""
    return run_cli_process("-c", str(config), "--lock-wait", "0", *args, env=backend.env)


def cli_json(backend: StateBackend, config: Path, *args: str, code: int = 0) -> dict[str, Any]:
    proc = cli(backend, config, "--json", *args)
    assert proc.returncode == code, describe(proc)
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def pipeline(backend: StateBackend, exports: str = EV) -> tuple[StateStore, Path]:
    """A state at head for a config of ``exports`` in ``backend.pipeline``, and the config."""
    config = write_config(backend.pipeline, exports=exports)
    return StateStore.open(config, env=process_env(backend.env), create=True), config


def a_finished_run(store: StateStore, export: str) -> None:
    """One succeeded run of ``export`` that commits nothing (a CDC export's position is its file's)."""
    with store.run(export, "cdc") as run:
        run.finish_run(run.start_run(), "succeeded", rows=1)


# -- 2. a reset's dry run foresees the next run by the real run's rule ------------------------


@pytest.mark.parametrize("where", ["file", "state"])
def test_a_reset_dry_run_of_a_cdc_export_foresees_what_the_real_run_then_says(state_backend: StateBackend,
                                                                             where: str) -> None:
    """A CDC export keeps its stream position through a reset (in its file or in the state):
    its dry run said "FIRST RUN: reads everything from the start", the real run "resumes
    from CDC position …". Both now give doctor's verdict on the export as it is once reset,
    in ``next_run`` and for people, and the real run's ``next_run`` is its ``diagnosis``."""
    store, config = pipeline(state_backend)
    checkpoint = config.parent / "checkpoints" / "ev.json"
    checkpoint.parent.mkdir()
    checkpoint.write_text(json.dumps(POSITION))
    a_finished_run(store, "ev")
    if where == "state":
        cli_json(state_backend, config, "checkpoints", "import", "--export", "ev")
    dry = cli_json(state_backend, config, "exports", "reset", "ev", "--dry-run")
    human = cli(state_backend, config, "exports", "reset", "ev", "--dry-run")
    real = cli_json(state_backend, config, "exports", "reset", "ev")
    assert "resumes from CDC position" in dry["next_run"] and "000042" in dry["next_run"], dry
    assert dry["next_run"] == real["next_run"], (dry["next_run"], real["next_run"])
    assert real["diagnosis"]["verdict"] == "resumes" and real["next_run"] == \
        f"resumes from {real['diagnosis']['resumes_from']}", real
    said = next(line for line in human.stdout.splitlines() if line.startswith("Next run of ev after it: "))
    assert "resumes from CDC position" in said, describe(human)


def test_the_dry_runs_of_set_cursor_and_reset_foresee_what_their_real_runs_say(state_backend: StateBackend) -> None:
    """The same rule for the exports without a stream: a reset incremental export
    first-runs, a cursor set resumes from it, in the dry run as in the real run."""
    store, config = pipeline(state_backend)
    with store.run("orders", "incremental") as run:
        run.commit_cursor("2026-11-01")
    for args, words in ((("set-cursor", "orders", "2026-11-02"), "resumes from cursor '2026-11-02'"),
                        (("reset", "orders"), "FIRST RUN")):
        dry = cli_json(state_backend, config, "exports", *args, "--dry-run")
        real = cli_json(state_backend, config, "exports", *args)
        assert dry["next_run"] == real["next_run"] and words in real["next_run"], (dry, real)


# -- 3. `present` is the file's presence, and `why` agrees with `stored_in` -------------------


def test_present_is_whether_a_file_is_at_the_resolved_path(state_backend: StateBackend, tmp_path: Path) -> None:
    """`present` said yes for a position in the state with no file there (renamed by the
    import, moved away by hand) and for a mongodb export with no `cdc.checkpoint` at all,
    whose `why` said the stream keeps its position only in that file while `stored_in` said
    `state`. `present` is the file's presence at the resolved path (with its size and age),
    whatever holds the position."""
    exports = EV + "  - name: carts\n    mode: cdc\n    cdc:\n      engine: mongodb\n"
    store, config = pipeline(state_backend, exports)
    checkpoint = config.parent / "checkpoints" / "ev.json"
    checkpoint.parent.mkdir()
    checkpoint.write_text(json.dumps(POSITION))
    with store.transaction() as tx:
        tx.commit_position("carts", "mongodb", {"resume_token": "8263A1"})

    def rows() -> dict[str, dict[str, Any]]:
        return {c["export"]: c for c in cli_json(state_backend, config, "checkpoints")["checkpoints"]}

    carts = rows()["carts"]
    assert (carts["stored_in"], carts["path"], carts["present"], carts["size_bytes"]) == ("state", None, False, None)
    assert "only in that file" not in carts["why"] and "state" in carts["why"], carts["why"]
    assert carts["position"] == {"resume_token": "8263A1"}, carts
    moved = tmp_path / "elsewhere.json"
    os.rename(checkpoint, moved)
    ev = rows()["ev"]
    assert (ev["stored_in"], ev["present"], ev["size_bytes"]) == ("file", False, None), ev
    os.rename(moved, checkpoint)
    cli_json(state_backend, config, "checkpoints", "import", "--export", "ev")
    ev = rows()["ev"]
    assert (ev["stored_in"], ev["present"], ev["size_bytes"], ev["position"]) == ("state", False, None, POSITION), ev
    checkpoint.write_text(json.dumps(POSITION))  # a file put back beside a position in the state
    ev = rows()["ev"]
    assert (ev["stored_in"], ev["present"], ev["size_bytes"]) == ("state", True, len(json.dumps(POSITION))), ev
    human = cli(state_backend, config, "checkpoints")
    assert human.returncode == 0, describe(human)


# -- 4. the dry runs of checkpoints import and export on a read-only mount --------------------


def test_import_and_export_dry_runs_on_a_read_only_checkpoint_directory_warn_and_their_real_runs_refuse(
        state_backend: StateBackend, tmp_path: Path) -> None:
    """docs/decisions.md "Dry runs on a read-only mount": a dry run gives its plan, exit 0,
    with ``RIVET_STATE_READ_ONLY_DRY_RUN``; the real run is refused ``RIVET_STATE_READ_ONLY``
    (1). Import and export alike; the docs say so of both."""
    from test_position_writes import _read_only

    directory = tmp_path / "positions"
    directory.mkdir()
    exports = EV.replace("checkpoints/ev.json", str(directory / "ev.json"))
    store, config = pipeline(state_backend, exports)
    (directory / "ev.json").write_text(json.dumps(POSITION))
    with _read_only(directory):
        plan = cli_json(state_backend, config, "checkpoints", "import", "--dry-run")
        assert [w["code"] for w in plan["warnings"]] == ["RIVET_STATE_READ_ONLY_DRY_RUN"], plan
        proc = cli(state_backend, config, "--json-errors", "checkpoints", "import")
        assert (proc.returncode, error_object(proc)["code"]) == (1, "RIVET_STATE_READ_ONLY"), describe(proc)
    cli_json(state_backend, config, "checkpoints", "import")
    with _read_only(directory):
        plan = cli_json(state_backend, config, "checkpoints", "export", "--dry-run")
        assert [w["code"] for w in plan["warnings"]] == ["RIVET_STATE_READ_ONLY_DRY_RUN"], plan
        assert [m["export"] for m in plan["moved"]] == ["ev"], plan
        proc = cli(state_backend, config, "--json-errors", "checkpoints", "export")
        assert (proc.returncode, error_object(proc)["code"]) == (1, "RIVET_STATE_READ_ONLY"), describe(proc)
    assert store.stored_position("ev") == POSITION
    docs = Path(__file__).parent.parent / "docs"
    errors = docs.joinpath("errors.md").read_text()
    when = errors[errors.index("### `RIVET_STATE_READ_ONLY_DRY_RUN`"):].split("\n### ", 1)[0]
    assert "`checkpoints import`" in when and "`checkpoints export`" in when, when


# -- 5. one checkpoint file shared by two exports ----------------------------------------------


def _shared_pipeline(backend: StateBackend, how: str) -> tuple[StateStore, Path]:
    """A config whose CDC exports ``a`` and ``b`` keep their positions in one file, named
    two ways: ``how`` ``dots`` (``a.json`` and ``./x/../a.json``), ``symlink`` (``b.json``
    a symlink to ``a.json``) or ``hardlink`` (``b.json`` a hard link of it)."""
    second = {"dots": "./x/../checkpoints/a.json"}.get(how, "checkpoints/b.json")
    exports = textwrap.dedent(f"""\
        exports:
          - name: orders
            mode: incremental
          - name: a
            mode: cdc
            cdc:
              engine: mysql
              checkpoint: checkpoints/a.json
          - name: b
            mode: cdc
            cdc:
              engine: mysql
              checkpoint: {second}
        """)
    store, config = pipeline(backend, exports)
    directory = config.parent / "checkpoints"
    directory.mkdir()
    (directory / "a.json").write_text(json.dumps(POSITION))
    if how == "symlink":
        (directory / "b.json").symlink_to("a.json")
    elif how == "hardlink":
        os.link(directory / "a.json", directory / "b.json")
    return store, config


@pytest.mark.parametrize("how", ["dots", "symlink", "hardlink"])
def test_a_checkpoint_file_shared_by_two_exports_is_refused_by_the_runtime_and_reported_everywhere(
        state_backend: StateBackend, how: str) -> None:
    """The runtime gave each export the other's position, and doctor and checkpoints said
    nothing: one rule (the same file by device and inode where it exists, by real path
    otherwise) now refuses ``RIVET_STATE_CHECKPOINT_SHARED`` in ``StateStore.run`` and in a
    transaction's write of either export (nothing read, nothing written), and doctor,
    checkpoints and check report it naming both exports; another export still runs."""
    store, config = _shared_pipeline(state_backend, how)
    for export in ("a", "b"):
        with pytest.raises(StateError) as caught:
            with store.run(export, "cdc"):
                pytest.fail("a run of an export sharing its checkpoint file started")
        assert caught.value.code == "RIVET_STATE_CHECKPOINT_SHARED", caught.value
        assert "a and b" in caught.value.message, caught.value.message
        with pytest.raises(StateError) as caught:
            with store.transaction() as tx:
                tx.commit_position(export, "mysql", {"pos": 1})
        assert caught.value.code == "RIVET_STATE_CHECKPOINT_SHARED", caught.value
    assert store.stored_position("a") is None and store.stored_position("b") is None
    with store.run("orders", "incremental") as run:
        run.commit_cursor("2026-11-01")
    doctor = {e["name"]: e for e in cli_json(state_backend, config, "doctor", code=5)["exports"]}
    for export in ("a", "b"):
        (shared,) = [r for r in doctor[export]["reasons"] if r["code"] == "RIVET_STATE_CHECKPOINT_SHARED"]
        assert "a and b" in shared["message"] and shared["evidence"]["exports"] == ["a", "b"], shared
    assert not [r for r in doctor["orders"]["reasons"] if r["code"] == "RIVET_STATE_CHECKPOINT_SHARED"]
    listed = {c["export"]: c for c in cli_json(state_backend, config, "checkpoints")["checkpoints"]}
    for export in ("a", "b"):
        assert listed[export]["error"].startswith("RIVET_STATE_CHECKPOINT_SHARED: "), listed[export]
        assert "a and b" in listed[export]["error"], listed[export]
    human = cli(state_backend, config, "doctor")
    assert human.stdout.count("[RIVET_STATE_CHECKPOINT_SHARED]") == 2, describe(human)
    checked = cli_json(state_backend, config, "check", code=5)
    failed = [c["code"] for c in checked["checks"] if c["status"] == "fail"]
    assert "RIVET_STATE_CHECKPOINT_SHARED" in failed, checked
