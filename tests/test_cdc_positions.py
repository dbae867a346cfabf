"""CDC positions kept in the state (issue 15; SPEC §6, ADR-0039 D5), through the runtime
API on both backends: a committed position is read back from the state, and then the
checkpoint file is never read again; before it, the file is. The lease-loss case is in
tests/test_guarded_writes.py (fencing on SQLite)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from support import process_env, write_config
from support.backends import StateBackend
from statetool.errors import StateError
from statetool.runtime import StateStore

POSITION = {"file": "mysql-bin.000042", "pos": 91234}


def _store(backend: StateBackend) -> tuple[StateStore, Path]:
    config = write_config(backend.pipeline)
    store = StateStore.open(config, env=process_env(backend.env), create=True)
    return store, config.parent / "checkpoints" / "order_events.json"


def _committed(backend: StateBackend) -> tuple[StateStore, Path, str]:
    """:func:`_store`, then a succeeded run of order_events that committed :data:`POSITION`
    into the state; returns the store, the checkpoint file's place and the run's id."""
    store, checkpoint = _store(backend)
    with store.run("order_events", "cdc") as run:
        run_id = run.start_run()
        run.commit_position(POSITION)
        run.finish_run(run_id, "succeeded", rows=1)
    return store, checkpoint, run_id


def test_a_committed_position_is_read_from_the_state_and_the_file_never_again(state_backend: StateBackend) -> None:
    store, checkpoint = _store(state_backend)
    checkpoint.parent.mkdir()
    checkpoint.write_text(json.dumps({"file": "mysql-bin.000007", "pos": 4}))
    with store.run("order_events", "cdc") as run:
        assert run.read_position() == {"file": "mysql-bin.000007", "pos": 4}, "no position in the state: the file's"
        run.commit_position(POSITION)
        checkpoint.write_text("{not json at all")  # a worker's stale or broken file: never read again
        assert run.read_position() == POSITION
        token = run.token
    with store.run("order_events", "cdc") as run:
        assert run.read_position() == POSITION
    backend = store.ctx.backend()
    with backend.reading() as conn:
        row = conn.one("SELECT engine, position, fencing_token FROM rivet_cdc_positions WHERE export_name = :e",
                       {"e": "order_events"})
    assert row is not None and (row[0], json.loads(row[1])) == ("mysql", POSITION)
    assert row[2] == token, "the position records the fencing token of the lease it was committed under"


def test_a_position_committed_in_a_run_names_that_run_and_checkpoints_shows_it(state_backend: StateBackend) -> None:
    """Issue 15 item 1: the position records by which run it was committed (the run the
    Run object started, or the one named), and ``checkpoints`` reports it."""
    from support import describe, run_cli

    store, _checkpoint = _store(state_backend)
    with store.run("order_events", "cdc") as run:
        run_id = run.start_run()
        run.commit_position(POSITION)
        run.finish_run(run_id, "succeeded")
    proc = run_cli("-c", str(store.ctx.config.path), "--json", "checkpoints", env=state_backend.env)
    assert proc.returncode == 0, describe(proc)
    (listed,) = json.loads(proc.stdout)["checkpoints"]
    assert (listed["stored_in"], listed["run_id"]) == ("state", run_id), listed
    with store.run("order_events", "cdc") as run:
        run.commit_position({"file": "mysql-bin.000043", "pos": 4}, run_id="backfill-7")
    proc = run_cli("-c", str(store.ctx.config.path), "--json", "checkpoints", env=state_backend.env)
    assert json.loads(proc.stdout)["checkpoints"][0]["run_id"] == "backfill-7"


def test_a_position_is_only_for_a_cdc_export_and_only_json(state_backend: StateBackend) -> None:
    store, _checkpoint = _store(state_backend)
    with store.run("orders", "incremental") as run:
        with pytest.raises(StateError) as caught:
            run.commit_position(POSITION)
        assert caught.value.code == "RIVET_CLI_USAGE"
    with store.run("order_events", "cdc") as run:
        assert run.read_position() is None, "no file and no position: a first run of the stream"
        with pytest.raises(ValueError):
            run.commit_position({"pos": float("nan")})
        assert run.read_position() is None


def test_a_position_in_the_state_travels_through_export_import_and_diff(state_backend: StateBackend,
                                                                         tmp_path: Path) -> None:
    """An export that dropped the state's positions would make an import a silent
    re-anchor of every stream (SPEC §5a): the position is in the document, comes back in
    the imported state, and diff sees a change of it."""
    from support import describe, run_cli

    store, _checkpoint = _store(state_backend)
    with store.run("order_events", "cdc") as run:
        run.commit_position(POSITION)
    config = store.ctx.config.path
    out = tmp_path / "state.json"
    proc = run_cli("-c", str(config), "export", "--with-history", "-o", str(out), env=state_backend.env)
    assert proc.returncode == 0, describe(proc)
    carried = json.loads(out.read_text())["exports"]["order_events"]["cdc_position"]
    assert carried["position"] == POSITION and carried["engine"] == "mysql", carried
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    proc = run_cli("-c", str(config), "--state-url", f"sqlite:{fresh}", "import", str(out), env={})
    assert proc.returncode == 0, describe(proc)
    proc = run_cli("-c", str(config), "diff", str(out), f"sqlite:{fresh}", env={})
    assert proc.returncode == 0, describe(proc)
    again = StateStore.open(config, state_url=f"sqlite:{fresh}", env=process_env({}))
    with again.run("order_events", "cdc") as run:
        assert run.read_position() == POSITION
        run.commit_position({"file": "mysql-bin.000043", "pos": 1})
    proc = run_cli("-c", str(config), "--json", "diff", str(out), f"sqlite:{fresh}", env={})
    assert proc.returncode == 1, describe(proc)
    fields = {(d["export"], d["field"]) for d in json.loads(proc.stdout)["differences"]}
    assert ("order_events", "cdc_position") in fields, fields


def test_doctor_and_checkpoints_say_the_position_is_in_the_state_with_no_file(state_backend: StateBackend) -> None:
    """Issue 15: with the position in the state, a CDC export resumes with no file on disk
    (a pod without a volume), no relative-path warning is given under PostgreSQL state,
    and a file a worker wrote later is reported with both values, never merged."""
    from support import describe, run_cli

    store, checkpoint, run_id = _committed(state_backend)
    config = store.ctx.config.path
    assert not checkpoint.exists()
    proc = run_cli("-c", str(config), "--json", "doctor", "--export", "order_events", env=state_backend.env)
    assert proc.returncode == 0, describe(proc)
    (events,) = json.loads(proc.stdout)["exports"]
    assert events["verdict"] == "resumes" and "in the state" in events["resumes_from"], events
    assert not [r for r in events["reasons"] if r["code"] == "RIVET_STATE_CHECKPOINT_RELATIVE"], events["reasons"]
    doc = json.loads(run_cli("-c", str(config), "--json", "checkpoints", env=state_backend.env).stdout)
    (row,) = doc["checkpoints"]
    assert (row["stored_in"], row["position"], row["run_id"]) == ("state", POSITION, run_id), row
    assert json.loads(run_cli("-c", str(config), "--json", "info", env=state_backend.env).stdout)[
        "checkpoints"][0]["stored_in"] == "state"
    checkpoint.parent.mkdir()
    checkpoint.write_text(json.dumps({"file": "mysql-bin.000099", "pos": 1}))
    doc = json.loads(run_cli("-c", str(config), "--json", "checkpoints", env=state_backend.env).stdout)
    (warning,) = doc["checkpoints"][0]["warnings"]
    assert warning["code"] == "RIVET_STATE_CHECKPOINT_FILE_NEWER" and "000099" in warning["message"] and \
        "000042" in warning["message"], warning
    assert doc["checkpoints"][0]["position"] == POSITION, "the state's position stays the one reported"


def test_checkpoints_import_then_the_runtime_reads_the_state_and_export_gives_the_file_back_byte_for_byte(
        state_backend: StateBackend, tmp_path: Path) -> None:
    """Issue 15 item 3 on both backends: the file's position moves into the state (audited,
    the file renamed so it is never read as the position again), the runtime reads it from
    the state, and `checkpoints export` writes the very bytes back (the rollback)."""
    from support import describe, run_cli, tree_digest

    store, checkpoint = _store(state_backend)
    config = store.ctx.config.path
    checkpoint.parent.mkdir()
    original = b'{"file":"mysql-bin.000042",   "pos":91234}\n'
    checkpoint.write_bytes(original)

    def cli(*args: str) -> dict[str, object]:
        proc = run_cli("-c", str(config), "--json", "checkpoints", *args, env=state_backend.env)
        assert proc.returncode == 0, describe(proc)
        return json.loads(proc.stdout)  # type: ignore[no-any-return]

    before = tree_digest(config.parent)
    plan = cli("import", "--dry-run")
    assert plan["dry_run"] and [m["export"] for m in plan["moved"]] == ["order_events"]  # type: ignore[index]
    assert tree_digest(config.parent) == before and store.stored_position("order_events") is None
    done = cli("import")
    (moved,) = done["moved"]  # type: ignore[misc]
    kept = Path(moved["kept_as"])
    assert not checkpoint.exists() and kept.read_bytes() == original and kept.name.startswith("order_events.json.")
    kept.write_text("{broken")  # the renamed file is never read again
    with store.ctx.backend().reading() as conn:
        imported_token = conn.scalar("SELECT fencing_token FROM rivet_cdc_positions WHERE export_name = :e",
                                     {"e": "order_events"})
    with store.run("order_events", "cdc") as run:
        assert run.read_position() == POSITION
        assert imported_token is not None and run.token is not None and imported_token < run.token, \
            "the imported row records the fencing token of the run lease the import held (a re-check's finding)"
    again = cli("import")
    assert again["moved"] == [] and [s["export"] for s in again["skipped"]] == ["order_events"]  # type: ignore[index]
    back = cli("export")
    assert [m["export"] for m in back["moved"]] == ["order_events"]  # type: ignore[index]
    assert checkpoint.read_bytes() == original, "the rollback gives the file back byte for byte"
    assert store.stored_position("order_events") is None
    with store.run("order_events", "cdc") as run:
        assert run.read_position() == POSITION, "read from the file again"
    backend = store.ctx.backend()
    with backend.reading() as conn:
        actions = [r[0] for r in conn.rows("SELECT action FROM rivet_audit WHERE action LIKE 'checkpoints.%' "
                                           "ORDER BY id")]
    assert actions == ["checkpoints.import", "checkpoints.export"], actions


def test_a_position_alone_is_progress_so_a_state_without_identity_is_adopted_with_a_warning_not_stamped(
        state_backend: StateBackend) -> None:
    """SPEC §3's progress rule counts a CDC position (a stream resumes from it): a state
    holding only an imported position and no identity is adopted with the warning that asks
    to check it belongs to this source, never stamped silently as an empty state would be."""
    from support import describe, run_cli

    config = write_config(state_backend.pipeline, source_url=None)
    StateStore.open(config, env=process_env(state_backend.env), create=True)
    checkpoint = config.parent / "checkpoints" / "order_events.json"
    checkpoint.parent.mkdir()
    checkpoint.write_text(json.dumps(POSITION))
    moved = run_cli("-c", str(config), "--json", "checkpoints", "import", env=state_backend.env)
    assert moved.returncode == 0, describe(moved)
    write_config(state_backend.pipeline)  # the config now names its source
    proc = run_cli("-c", str(config), "--json", "check", env=state_backend.env)
    (identity,) = [c for c in json.loads(proc.stdout)["checks"] if c["id"] == "identity"]
    assert identity["code"] == "RIVET_STATE_IDENTITY_ADOPTED", describe(proc)
    exports = run_cli("-c", str(config), "--json", "info", env=state_backend.env)
    assert exports.returncode == 0, describe(exports)
    (events,) = [e for e in json.loads(exports.stdout)["exports"] if e["name"] == "order_events"]
    assert events["position_committed_at"] is not None, events


def test_import_export_and_import_again_in_one_second_keep_both_imported_files(state_backend: StateBackend) -> None:
    """The kept name has the second of the import: a second one in the same second gets
    ``-2`` and never replaces the first kept file."""
    from support import describe, run_cli

    store, checkpoint = _store(state_backend)
    config = store.ctx.config.path
    checkpoint.parent.mkdir()
    checkpoint.write_text(json.dumps(POSITION))
    kept = []
    for verb in ("import", "export", "import"):
        proc = run_cli("-c", str(config), "--json", "checkpoints", verb, env=state_backend.env)
        assert proc.returncode == 0, describe(proc)
        kept += [m["kept_as"] for m in json.loads(proc.stdout)["moved"] if m["kept_as"]]
    files = sorted(checkpoint.parent.glob("order_events.json.imported-*"))
    assert len(kept) == 2 and sorted(map(str, files)) == sorted(kept), (kept, files)
    assert all(json.loads(f.read_text()) == POSITION for f in files)


def test_checkpoints_export_and_import_of_a_state_that_cannot_be_read_are_refused_not_nothing_to_move(
        tmp_path: Path) -> None:
    """A fresh user's finding: ``checkpoints export`` (the rollback) of an unreachable or
    missing state answered "the state holds no position", exit 0; now the pre-flight's
    code, dry run or not, and no byte changes."""
    from support import describe, error_object, run_cli, tree_digest

    config = write_config(tmp_path / "pipeline")
    checkpoint = config.parent / "checkpoints" / "order_events.json"
    checkpoint.parent.mkdir()
    checkpoint.write_text(json.dumps(POSITION))
    before = tree_digest(tmp_path)
    unreachable = {"RIVET_STATE_URL": f"postgresql://postgres@/postgres?host={tmp_path}/no-socket&schema=x"}
    for env, code in (({}, "RIVET_STATE_MISSING"), (unreachable, "RIVET_STATE_UNREACHABLE")):
        for verb in (("export",), ("import", "--dry-run"), ("export", "--dry-run")):
            proc = run_cli("-c", str(config), "--json-errors", "checkpoints", *verb, env=env)
            assert proc.returncode != 0 and error_object(proc)["code"] == code, (verb, describe(proc))
    assert tree_digest(tmp_path) == before


# -- issue 15's fresh user, findings 4-6: what checkpoints, doctor and info report ---------


def _cli_json(backend: StateBackend, config: Path, *args: str, code: int = 0) -> dict[str, Any]:
    from support import describe, run_cli

    proc = run_cli("-c", str(config), "--json", *args, env=backend.env)
    assert proc.returncode == code, describe(proc)
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


@pytest.mark.parametrize(("shift", "code"), [(-3600, "RIVET_STATE_CHECKPOINT_FILE_OLDER"),
                                             (3600, "RIVET_STATE_CHECKPOINT_FILE_NEWER")])
def test_a_checkpoint_file_with_another_position_is_reported_with_both_values_whichever_is_newer(
        shift: int, code: str, state_backend: StateBackend) -> None:
    """Finding 4: a file that holds another position than the state's is a fact to see
    whether it was written before the state's commit (a restored backup, a copy) or after
    (something still writes it): `checkpoints`, `doctor` and `info` name both values."""
    store, checkpoint = _store(state_backend)
    config = store.ctx.config.path
    with store.run("order_events", "cdc") as run:
        run.commit_position(POSITION)
    checkpoint.parent.mkdir()
    checkpoint.write_text(json.dumps({"file": "mysql-bin.000007", "pos": 4}))
    when = time.time() + shift  # a restored backup keeps its old mtime
    os.utime(checkpoint, (when, when))

    def both(warning: dict[str, Any]) -> None:
        assert warning["code"] == code and "000007" in warning["message"] and "000042" in warning["message"], warning
        assert str(checkpoint) in warning["message"], warning

    listed = _cli_json(state_backend, config, "checkpoints")
    (warning,) = listed["checkpoints"][0]["warnings"]
    both(warning)
    assert listed["checkpoints"][0]["position"] == POSITION, "the state's position stays the one reported"
    (events,) = _cli_json(state_backend, config, "doctor", "--export", "order_events")["exports"]
    assert events["verdict"] == "resumes" and "000042" in events["resumes_from"], events
    both(next(r for r in events["reasons"] if r["code"] == code))
    both(next(w for w in _cli_json(state_backend, config, "info")["warnings"] if w["code"] == code))
    checkpoint.write_text(json.dumps(POSITION))
    assert _cli_json(state_backend, config, "checkpoints")["warnings"] == [], "the same position is no finding"


def test_doctor_json_says_where_each_export_s_position_lives(state_backend: StateBackend, tmp_path: Path) -> None:
    """Finding 6: `stored_in` per export in doctor --json, as checkpoints gives it (issue 15 item 5)."""
    from support import CDC_EXPORTS

    config = write_config(state_backend.pipeline, exports=CDC_EXPORTS.format(absolute=tmp_path / "audit.scn"))
    store = StateStore.open(config, env=process_env(state_backend.env), create=True)
    with store.run("order_events", "cdc") as run:
        run_id = run.start_run()
        run.commit_position(POSITION)
    (tmp_path / "audit.scn").write_text('{"scn": 1}')
    # exit 5: the exports without progress would first-run
    doctor = {e["name"]: e["stored_in"] for e in _cli_json(state_backend, config, "doctor", code=5)["exports"]}
    assert doctor == {"orders": None, "order_events": "state", "carts": "file", "ledger": "server_slot",
                      "audit": "file"}, doctor
    listed = {c["export"]: c["stored_in"] for c in _cli_json(state_backend, config, "checkpoints")["checkpoints"]}
    assert listed == {k: v for k, v in doctor.items() if v is not None}
    (events,) = _cli_json(state_backend, config, "doctor", "--export", "order_events")["exports"]
    assert f"by run {run_id}" in events["resumes_from"] and events["age_seconds"] is not None, events


def test_info_for_people_shows_where_each_position_lives_its_age_and_run(state_backend: StateBackend) -> None:
    """Finding 5: SPEC §8 lists checkpoints among what `info` shows; the human page had none."""
    from support import describe, run_cli_process

    store, _, run_id = _committed(state_backend)
    proc = run_cli_process("-c", str(store.ctx.config.path), "info", env=state_backend.env)
    assert proc.returncode == 0, describe(proc)
    page = proc.stdout[proc.stdout.index("CDC checkpoints"):]
    assert "order_events" in page and "state" in page and run_id in page and "000042" in page, proc.stdout
