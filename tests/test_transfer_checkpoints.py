"""``statetool transfer --with-checkpoints`` (issue 15 item 4; SPEC §6, §9; ADR-0039 D5):
the position of each CDC export's checkpoint file goes into the destination in the same
transaction as the state, and the files are renamed ``<name>.imported-<UTC time>``.

Real SQLite files, the PostgreSQL server of ``conftest.pg_server``, the runtime API reading
the positions, the CLI, and SIGKILL at every step of the transfer (tests/support/crash_driver.py)
and at blind times: after each kill the position a run resumes from is the original one,
live in exactly one place (the source's files while the source is live, the destination
once it is), and a re-run converges.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from support import describe, error_object, fork_cli, process_env, run_cli, run_cli_process, tree_digest, write_config
from support.crash_driver import run_killed_at
from statetool.errors import StateError
from statetool.runtime import StateStore
from test_transfer import admin  # noqa: F401 - the fixture: the server's superuser URL
from test_transfer import EXPORTS, pg_fetch, schema_exists, split_url, tombstone

pytestmark = pytest.mark.postgres

#: The steps of a SQLite → PostgreSQL transfer (transfer.py and the SQLite retirement), then
#: the rename of the first checkpoint file.
POINTS = ("digested", "copied", "committed", "kept", "tombstoned", "swapped", "checkpoint-renamed", "finished")
#: Each CDC export's checkpoint file and the bytes it holds (spacing kept: a position moves
#: as its file's text exactly).
FILES = {"order_events": ("checkpoints/order_events.json", b'{"file": "mysql-bin.000042",  "pos": 91234}\n'),
         "customer_changes": ("state/customer_changes.json", b'{"resume_token": {"_data": "8263A1"}}')}
ABSOLUTE = ("invoice_changes", b'{"scn": 4711}\n')


def _pipeline(directory: Path) -> tuple[Path, dict[str, Path], dict[str, bytes]]:
    """A SQLite state with a cursor, and three CDC exports whose positions are in files
    (two relative, under the state's directory; one absolute); the exports are those of
    tests/test_transfer.py (a fourth CDC export keeps its position in a server slot). Returns the config, each
    export's file, and each file's bytes."""
    absolute = directory.parent / f"{directory.name}-shared" / "invoice_changes.json"
    absolute.parent.mkdir(parents=True)
    absolute.write_bytes(ABSOLUTE[1])
    cfg = write_config(directory, exports=EXPORTS.format(absolute=absolute))
    store = StateStore.open(cfg, env=process_env(), create=True)
    with store.run("orders", "incremental") as run:
        run.commit_cursor("2026-11-30T00:00:00Z")
    files = {ABSOLUTE[0]: absolute}
    data = {ABSOLUTE[0]: ABSOLUTE[1]}
    for name, (relative, content) in FILES.items():
        files[name] = directory / relative
        files[name].parent.mkdir(parents=True, exist_ok=True)
        files[name].write_bytes(content)
        data[name] = content
    return cfg, files, data


def _cli(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = run_cli("--json", "--json-errors", *args, env=env)
    assert proc.returncode == 0, describe(proc)
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def _pg_positions(admin: str, url: str) -> dict[str, str]:  # noqa: F811 - any URL of the server
    schema = split_url(url)[1]
    if not schema_exists(admin, schema) or not pg_fetch(
            admin, "SELECT 1 FROM information_schema.tables WHERE table_schema = %s AND table_name = "
                   "'rivet_cdc_positions'", (schema,)):
        return {}
    return dict(pg_fetch(admin, f'SELECT export_name, position FROM "{schema}".rivet_cdc_positions'))  # type: ignore[arg-type]


def _resumes_from(cfg: Path, env: dict[str, str]) -> dict[str, object]:
    """The position each CDC export's next run resumes from, read by the runtime API as a
    run of the pipeline reads it (its run lease taken and given back)."""
    store = StateStore.open(cfg, env=process_env(env))
    out = {}
    for name in (*FILES, ABSOLUTE[0]):
        with store.run(name, "cdc") as run:
            out[name] = run.read_position()
    return out


def _kept(files: dict[str, Path]) -> dict[str, list[Path]]:
    return {n: sorted(p.parent.glob(f"{p.name}.imported-*")) for n, p in files.items()}


def test_positions_move_into_postgresql_with_the_state_and_the_files_are_renamed_never_read_again(
        tmp_path: Path, admin: str, pg_url: str) -> None:  # noqa: F811
    cfg, files, data = _pipeline(tmp_path / "pipeline")
    originals = {n: json.loads(b) for n, b in data.items()}
    done = _cli("-c", str(cfg), "transfer", "--to", pg_url, "--with-checkpoints")
    assert done["done"]
    positions = done["positions"]
    assert sorted(m["export"] for m in positions["moved"]) == sorted(originals)
    assert [s["export"] for s in positions["skipped"]] == ["payment_changes"], "its position is the server's slot"
    assert not any(w["code"] == "RIVET_STATE_CHECKPOINT_RELATIVE" for w in done["warnings"]), done["warnings"]
    assert {c["export"]: c["stored_in"] for c in done["checkpoints"]} == {n: "state" for n in originals}
    # each text exactly, and each file kept under its new name only, with its bytes
    assert _pg_positions(admin, pg_url) == {n: b.decode() for n, b in data.items()}
    kept = _kept(files)
    for name, path in files.items():
        assert not path.exists(), f"{path} is still where a run would read it"
        assert [k.read_bytes() for k in kept[name]] == [data[name]]
        assert str(kept[name][0]) == next(m["kept_as"] for m in positions["moved"] if m["export"] == name)
        kept[name][0].write_text("{broken")  # never read again
    env = {"RIVET_STATE_URL": pg_url}
    assert _resumes_from(cfg, env) == originals
    listed = _cli("-c", str(cfg), "checkpoints", env=env)
    assert {c["export"]: c["stored_in"] for c in listed["checkpoints"]} == {
        **{n: "state" for n in originals}, "payment_changes": "server_slot"}
    assert listed["warnings"] == []
    audit = pg_fetch(admin, f'SELECT detail FROM "{split_url(pg_url)[1]}".rivet_audit WHERE action = \'transfer\'')
    assert sorted(c["export"] for c in json.loads(audit[0][0])["checkpoints"]) == sorted(originals)


def test_the_dry_run_lists_the_positions_it_would_move_and_changes_nothing(
        tmp_path: Path, admin: str, pg_url: str) -> None:  # noqa: F811
    cfg, files, data = _pipeline(tmp_path / "pipeline")
    before = {**tree_digest(cfg.parent), **{str(p): p.read_bytes() for p in files.values()}}
    plan = _cli("-c", str(cfg), "transfer", "--to", pg_url, "--with-checkpoints", "--dry-run")
    assert plan["dry_run"] and not plan["done"]
    assert sorted(m["export"] for m in plan["positions"]["moved"]) == sorted(data)
    assert not any(w["code"] == "RIVET_STATE_CHECKPOINT_RELATIVE" for w in plan["warnings"])
    human = run_cli("-c", str(cfg), "transfer", "--to", pg_url, "--with-checkpoints", "--dry-run")
    assert human.returncode == 0, describe(human)
    assert "position order_events: would move from" in human.stdout, human.stdout
    assert {**tree_digest(cfg.parent), **{str(p): p.read_bytes() for p in files.values()}} == before
    assert not schema_exists(admin, split_url(pg_url)[1])


def test_without_the_option_the_files_stay_and_the_relative_ones_are_warned_with_the_remedy(
        tmp_path: Path, admin: str, pg_url: str) -> None:  # noqa: F811
    cfg, files, data = _pipeline(tmp_path / "pipeline")
    done = _cli("-c", str(cfg), "transfer", "--to", pg_url)
    assert done["positions"] is None and _pg_positions(admin, pg_url) == {}
    relative = sorted(w["message"].split(":")[0] for w in done["warnings"]
                      if w["code"] == "RIVET_STATE_CHECKPOINT_RELATIVE")
    assert relative == sorted(f"CDC export {n}" for n in FILES)
    assert all(p.read_bytes() == data[n] for n, p in files.items())


def test_a_file_that_is_no_position_is_refused_before_anything_is_written(
        tmp_path: Path, admin: str, pg_url: str) -> None:  # noqa: F811
    cfg, files, _ = _pipeline(tmp_path / "pipeline")
    files["customer_changes"].write_bytes(b"\xff not json")
    before = tree_digest(cfg.parent)
    proc = run_cli("-c", str(cfg), "--json-errors", "transfer", "--to", pg_url, "--with-checkpoints")
    assert proc.returncode != 0 and error_object(proc)["code"] == "RIVET_STATE_CHECKPOINT_UNREADABLE", describe(proc)
    assert tree_digest(cfg.parent) == before and not schema_exists(admin, split_url(pg_url)[1])


def test_a_position_the_source_state_holds_wins_over_its_file_which_is_left_alone(
        tmp_path: Path, admin: str, pg_url: str) -> None:  # noqa: F811
    cfg, files, data = _pipeline(tmp_path / "pipeline")
    store = StateStore.open(cfg, env=process_env())
    with store.run("order_events", "cdc") as run:
        run.commit_position({"file": "mysql-bin.000050", "pos": 4})
    done = _cli("-c", str(cfg), "transfer", "--to", pg_url, "--with-checkpoints")
    skipped = {s["export"]: s["why"] for s in done["positions"]["skipped"]}
    assert "holds its position already" in skipped["order_events"], skipped
    assert files["order_events"].read_bytes() == data["order_events"], "a file the state overrides is not touched"
    assert json.loads(_pg_positions(admin, pg_url)["order_events"]) == {"file": "mysql-bin.000050", "pos": 4}
    assert _resumes_from(cfg, {"RIVET_STATE_URL": pg_url})["order_events"] == {"file": "mysql-bin.000050", "pos": 4}


def test_a_destination_that_holds_a_position_of_one_of_the_exports_is_refused(
        tmp_path: Path, admin: str, pg_url: str) -> None:  # noqa: F811
    cfg, files, _ = _pipeline(tmp_path / "pipeline")
    other = StateStore.open(cfg, env=process_env({"RIVET_STATE_URL": pg_url}), create=True)
    with other.run("invoice_changes", "cdc") as run:
        run.commit_position({"scn": 1})
    before = tree_digest(cfg.parent)
    proc = run_cli("-c", str(cfg), "--json-errors", "transfer", "--to", pg_url, "--with-checkpoints")
    assert proc.returncode != 0 and error_object(proc)["code"] == "RIVET_STATE_TARGET_NOT_EMPTY", describe(proc)
    assert "invoice_changes" in error_object(proc)["message"]
    assert tree_digest(cfg.parent) == before
    assert json.loads(_pg_positions(admin, pg_url)["invoice_changes"]) == {"scn": 1}


def test_postgresql_into_sqlite_takes_the_files_beside_the_config_into_the_sqlite_state(
        tmp_path: Path, admin: str, pg_url: str) -> None:  # noqa: F811
    directory = tmp_path / "pipeline"
    cfg = write_config(directory, exports=EXPORTS.format(absolute=tmp_path / "none.json"))
    env = {"RIVET_STATE_URL": pg_url}
    StateStore.open(cfg, env=process_env(env), create=True)
    checkpoint = directory / FILES["order_events"][0]  # under PostgreSQL: beside the config, on this disk
    checkpoint.parent.mkdir()
    checkpoint.write_bytes(FILES["order_events"][1])
    target = tmp_path / "into"
    target.mkdir()
    done = _cli("-c", str(cfg), "transfer", "--to", f"sqlite:{target}", "--with-checkpoints", env=env)
    assert [m["export"] for m in done["positions"]["moved"]] == ["order_events"]
    assert not checkpoint.exists()
    store = StateStore.open(cfg, env=process_env({"RIVET_STATE_URL": f"sqlite:{target}"}))
    assert store.stored_position("order_events") == json.loads(FILES["order_events"][1])


# -- kills ----------------------------------------------------------------------------------


def _live(cfg: Path, pg_url: str, files: dict[str, Path], data: dict[str, bytes]) -> str:
    """Where the positions are live after a kill: ``source`` (the source opens, and its
    runs resume from the original files; the destination does not open) or ``destination``
    (the source refuses, the destination holds every original text); asserts one of them."""
    originals = {n: json.loads(b) for n, b in data.items()}
    try:
        from_source = _resumes_from(cfg, {})
    except StateError as err:
        assert err.code == "RIVET_STATE_RELOCATED", err
    else:
        assert from_source == originals
        assert {n: p.read_bytes() for n, p in files.items()} == data, "a file changed while the source is live"
        assert _kept(files) == {n: [] for n in files}, "a file was renamed while its position was not in PostgreSQL"
        try:
            _resumes_from(cfg, {"RIVET_STATE_URL": pg_url})
        except StateError as err:
            assert err.code in ("RIVET_STATE_MOVE_IN_FLIGHT", "RIVET_STATE_MISSING"), err
        else:
            raise AssertionError("both the source and the destination open as live states")
        return "source"
    try:
        assert _resumes_from(cfg, {"RIVET_STATE_URL": pg_url}) == originals
    except StateError as err:  # killed between the switch and making it live: neither opens
        assert err.code == "RIVET_STATE_MOVE_IN_FLIGHT" and "--with-checkpoints" in err.message, err
        assert {n: json.loads(t) for n, t in _pg_positions(pg_url, pg_url).items()} == originals
    for name, path in files.items():  # each file at its place with its bytes (never read: the state's wins), or kept
        assert [p.read_bytes() for p in ([path] if path.exists() else []) + _kept(files)[name]] == [data[name]]
    return "destination"


def _converged(cfg: Path, admin: str, pg_url: str, files: dict[str, Path],  # noqa: F811
               data: dict[str, bytes]) -> None:
    rerun = _cli("-c", str(cfg), "transfer", "--to", pg_url, "--with-checkpoints")
    assert rerun["done"], rerun
    assert _pg_positions(admin, pg_url) == {n: b.decode() for n, b in data.items()}
    for name, path in files.items():
        assert not path.exists(), f"{path} left at its place after the re-run"
        assert [k.read_bytes() for k in _kept(files)[name]] == [data[name]]
    assert _live(cfg, pg_url, files, data) == "destination"
    leases = _cli("-c", str(cfg), "leases", env={"RIVET_STATE_URL": pg_url})
    assert not [entry for entry in leases["leases"] if entry.get("live")], leases


@pytest.mark.parametrize("point", POINTS)
def test_a_kill_at_each_step_leaves_every_position_live_in_one_place_and_a_rerun_converges(
        point: str, tmp_path: Path, admin: str, pg_url: str) -> None:  # noqa: F811
    cfg, files, data = _pipeline(tmp_path / "pipeline")
    killed = run_killed_at(point, "-c", str(cfg), "transfer", "--to", pg_url, "--with-checkpoints")
    assert killed.returncode == -signal.SIGKILL, describe(killed)
    where = _live(cfg, pg_url, files, data)
    assert where == ("destination" if tombstone(cfg) is not None else "source")
    assert (where == "destination") == (point in ("swapped", "checkpoint-renamed", "finished")), (point, where)
    _converged(cfg, admin, pg_url, files, data)


def test_a_file_written_after_a_kill_before_the_switch_is_the_position_the_rerun_moves(
        tmp_path: Path, admin: str, pg_url: str) -> None:  # noqa: F811
    cfg, files, data = _pipeline(tmp_path / "pipeline")
    killed = run_killed_at("committed", "-c", str(cfg), "transfer", "--to", pg_url, "--with-checkpoints")
    assert killed.returncode == -signal.SIGKILL, describe(killed)
    # the source is still live: its stream goes on, in its file, and writes nothing to the state
    newer = b'{"file": "mysql-bin.000043", "pos": 4}'
    files["order_events"].write_bytes(newer)
    _converged(cfg, admin, pg_url, files, {**data, "order_events": newer})


@pytest.mark.parametrize("delay", [0.05, 0.15, 0.3, 0.5, 0.8])
def test_a_kill_at_a_blind_time_leaves_every_position_live_in_one_place_and_a_rerun_converges(
        delay: float, tmp_path: Path, admin: str, pg_url: str) -> None:  # noqa: F811
    cfg, files, data = _pipeline(tmp_path / "pipeline")
    child = fork_cli("-c", str(cfg), "transfer", "--to", pg_url, "--with-checkpoints", env=process_env(),
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(delay)
    child.send_signal(signal.SIGKILL)
    child.wait()
    _live(cfg, pg_url, files, data)
    _converged(cfg, admin, pg_url, files, data)


# -- finding 1 of issue 15's fresh user: a position that is nowhere is refused, never lost --


def _ran(cfg: Path, export: str) -> None:
    """A succeeded run of ``export`` in the source state: progress (SPEC §3), as a pipeline
    whose stream keeps its position in the checkpoint file records it."""
    store = StateStore.open(cfg, env=process_env())
    with store.run(export, "cdc") as run:
        run.finish_run(run.start_run(), "succeeded", rows=3)


def _refused(cfg: Path, admin: str, pg_url: str, code: str, *extra: str) -> dict[str, Any]:  # noqa: F811
    """Run the transfer (and its dry run) in a process of the real CLI and assert each is
    refused with ``code`` and changes no byte of the pipeline's tree and creates no
    destination schema."""
    before = tree_digest(cfg.parent)
    for dry in ((), ("--dry-run",)):
        proc = run_cli_process("-c", str(cfg), "--json-errors", "transfer", "--to", pg_url, "--with-checkpoints",
                               *extra, *dry, timeout=60)
        err = error_object(proc)
        assert err["code"] == code, describe(proc)
        assert tree_digest(cfg.parent) == before and not schema_exists(admin, split_url(pg_url)[1])
    return err


def test_a_missing_checkpoint_file_of_an_export_with_progress_is_refused_before_anything_is_written(
        tmp_path: Path, admin: str, pg_url: str) -> None:  # noqa: F811
    cfg, files, _ = _pipeline(tmp_path / "pipeline")
    _ran(cfg, "order_events")
    files["order_events"].unlink()
    err = _refused(cfg, admin, pg_url, "RIVET_STATE_CHECKPOINT_MISSING")
    assert err["exit_code"] == 5 and "order_events" in err["message"] and str(files["order_events"]) in err["message"]


def test_a_missing_checkpoint_file_of_an_export_whose_position_the_state_holds_is_no_loss(
        tmp_path: Path, admin: str, pg_url: str) -> None:  # noqa: F811
    cfg, files, _ = _pipeline(tmp_path / "pipeline")
    _ran(cfg, "order_events")
    store = StateStore.open(cfg, env=process_env())
    with store.run("order_events", "cdc") as run:
        run.commit_position({"file": "mysql-bin.000050", "pos": 4})
    files["order_events"].unlink()
    done = _cli("-c", str(cfg), "transfer", "--to", pg_url, "--with-checkpoints")
    assert done["done"] and "order_events" in {s["export"] for s in done["positions"]["skipped"]}
    assert _resumes_from(cfg, {"RIVET_STATE_URL": pg_url})["order_events"] == {"file": "mysql-bin.000050", "pos": 4}


def test_an_export_that_never_ran_and_has_no_file_has_no_position_to_lose_and_is_skipped_with_why(
        tmp_path: Path, admin: str, pg_url: str) -> None:  # noqa: F811
    cfg, files, data = _pipeline(tmp_path / "pipeline")
    files["order_events"].unlink()
    plan = _cli("-c", str(cfg), "transfer", "--to", pg_url, "--with-checkpoints", "--dry-run")
    rows = {c["export"]: c for c in plan["checkpoints"]}
    assert rows["order_events"]["stored_in_before"] == "none", rows
    done = _cli("-c", str(cfg), "transfer", "--to", pg_url, "--with-checkpoints")
    skipped = {s["export"]: s["why"] for s in done["positions"]["skipped"]}
    assert "never ran" in skipped["order_events"], skipped
    assert sorted(_pg_positions(admin, pg_url)) == sorted(n for n in data if n != "order_events")
    assert _resumes_from(cfg, {"RIVET_STATE_URL": pg_url})["order_events"] is None


@pytest.mark.parametrize("kind", ["directory", "fifo", "dangling link"])
def test_a_checkpoint_place_that_holds_no_regular_file_is_refused_never_opened(
        kind: str, tmp_path: Path, admin: str, pg_url: str) -> None:  # noqa: F811
    cfg, files, _ = _pipeline(tmp_path / "pipeline")
    place = files["customer_changes"]
    place.unlink()
    if kind == "directory":
        place.mkdir()
    elif kind == "fifo":
        os.mkfifo(place)  # opened for reading, it would block the transfer for ever: the timeout fails it
    else:
        place.symlink_to(tmp_path / "nowhere.json")
    err = _refused(cfg, admin, pg_url, "RIVET_STATE_CHECKPOINT_NOT_A_FILE")
    assert str(place) in err["message"] and "not a regular file" in err["message"], err


def test_two_exports_whose_checkpoints_are_one_file_are_refused_before_anything_is_written(
        tmp_path: Path, admin: str, pg_url: str) -> None:  # noqa: F811
    cfg, files, _ = _pipeline(tmp_path / "pipeline")
    files["invoice_changes"].unlink()
    files["invoice_changes"].symlink_to(files["order_events"])
    err = _refused(cfg, admin, pg_url, "RIVET_STATE_CHECKPOINT_SHARED")
    assert "order_events and invoice_changes" in err["message"] or "invoice_changes and order_events" in \
        err["message"], err


def _bind_read_only(directory: Path) -> None:
    """``directory`` bind-mounted on itself, read-only (the caller unmounts it)."""
    if os.geteuid() != 0:
        pytest.skip("SKIPPED LOUDLY: a read-only bind mount needs root")
    subprocess.run(["mount", "--bind", str(directory), str(directory)], check=True, capture_output=True)
    subprocess.run(["mount", "-o", "remount,ro,bind", str(directory)], check=True, capture_output=True)


def test_a_checkpoint_directory_that_cannot_be_written_is_refused_before_the_transfer_and_the_dry_run_warns(
        tmp_path: Path, admin: str, pg_url: str) -> None:  # noqa: F811
    cfg, files, _ = _pipeline(tmp_path / "pipeline")
    directory = files["order_events"].parent
    _bind_read_only(directory)
    try:
        before = tree_digest(cfg.parent)
        proc = run_cli("-c", str(cfg), "--json-errors", "transfer", "--to", pg_url, "--with-checkpoints")
        err = error_object(proc)
        assert (err["code"], proc.returncode) == ("RIVET_STATE_READ_ONLY", 1), describe(proc)
        assert "the transfer renames" in err["message"] and str(files["order_events"]) in err["message"], err
        assert tree_digest(cfg.parent) == before and not schema_exists(admin, split_url(pg_url)[1])
        plan = _cli("-c", str(cfg), "transfer", "--to", pg_url, "--with-checkpoints", "--dry-run")
        assert "RIVET_STATE_READ_ONLY_DRY_RUN" in [w["code"] for w in plan["warnings"]], plan["warnings"]
        assert tree_digest(cfg.parent) == before and not schema_exists(admin, split_url(pg_url)[1])
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def test_a_rename_that_fails_after_the_switch_says_the_transfer_is_done_and_a_rerun_renames(
        tmp_path: Path, admin: str, pg_url: str) -> None:  # noqa: F811
    from statetool.operations.context import Context
    from statetool.operations.transfer import transfer

    cfg, files, data = _pipeline(tmp_path / "pipeline")
    directory = files["order_events"].parent
    mounted: list[Path] = []

    def remount_at(step: str) -> None:
        if step == "swapped":
            _bind_read_only(directory)
            mounted.append(directory)

    ctx = Context(cfg, None, env=process_env(), lock_wait=10, on_step=remount_at)
    try:
        with pytest.raises(StateError) as caught:
            transfer(ctx, pg_url, with_checkpoints=True)
    finally:
        for point in mounted:
            subprocess.run(["umount", str(point)], check=True)
    err = caught.value
    assert mounted and err.code == "RIVET_STATE_CHECKPOINT_NOT_RENAMED", err
    assert "nothing was written" not in err.message and "the transfer is done" in err.message, err.message
    assert f"; {err.details['cause']})" in err.message, "the cause's code is in the message, for a CLI user"
    assert files["order_events"].read_bytes() == data["order_events"]
    assert json.loads(_pg_positions(admin, pg_url)["order_events"]) == json.loads(data["order_events"])
    _cli("-c", str(cfg), "transfer", "--to", pg_url, "--with-checkpoints")
    assert not files["order_events"].exists()
    assert [p.read_bytes() for p in directory.glob("order_events.json.imported-*")] == [data["order_events"]]


# -- finding 2: the plan says where each position is now, and where it will be --------------


def test_the_plan_says_a_position_is_in_its_file_now_and_in_the_state_after(
        tmp_path: Path, admin: str, pg_url: str) -> None:  # noqa: F811
    cfg, files, data = _pipeline(tmp_path / "pipeline")
    plan = _cli("-c", str(cfg), "transfer", "--to", pg_url, "--with-checkpoints", "--dry-run")
    assert {c["export"]: (c["stored_in_before"], c["stored_in"]) for c in plan["checkpoints"]} == {
        n: ("file", "state") for n in data}
    human = run_cli("-c", str(cfg), "transfer", "--to", pg_url, "--with-checkpoints", "--dry-run")
    assert human.returncode == 0, describe(human)
    text = " ".join(human.stdout.split())
    assert "its position is in the state" not in text, human.stdout
    assert "checkpoint order_events: its position is in its checkpoint file now; the transfer moves it into the " \
           "state" in text, human.stdout
    done = run_cli("-c", str(cfg), "transfer", "--to", pg_url, "--with-checkpoints")
    assert done.returncode == 0, describe(done)
    assert "checkpoint order_events: its position was in its checkpoint file and is in the state now" in " ".join(
        done.stdout.split()), done.stdout


# -- finding 3: a re-run after the switch reads each left file once --------------------------


def test_the_rerun_after_a_kill_past_the_switch_reads_each_left_file_once(
        tmp_path: Path, admin: str, pg_url: str) -> None:  # noqa: F811
    from statetool.operations.context import Context
    from statetool.operations.transfer import transfer

    cfg, files, data = _pipeline(tmp_path / "pipeline")
    killed = run_killed_at("swapped", "-c", str(cfg), "transfer", "--to", pg_url, "--with-checkpoints")
    assert killed.returncode == -signal.SIGKILL, describe(killed)
    assert all(p.exists() for p in files.values())
    watched = {str(p) for p in files.values()}
    opened: list[str] = []
    _OPENS.append(lambda path: opened.append(path) if path in watched else None)
    try:
        result = transfer(Context(cfg, None, env=process_env(), config_given=True), pg_url, with_checkpoints=True)
    finally:
        _OPENS.clear()
    assert result.already and sorted(m["export"] for m in result.positions["moved"]) == sorted(data)
    assert sorted(opened) == sorted(watched), "each left file is read exactly once"
    assert not any(p.exists() for p in files.values())


#: The watchers of every ``open`` of this process (a Python audit hook, which cannot be
#: removed once added: added once, and idle while the list is empty).
_OPENS: list[Any] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _OPENS and isinstance(args[0], (str, os.PathLike)):
        for watch in _OPENS:
            watch(os.fspath(args[0]))


sys.addaudithook(_audit)


def test_a_file_a_run_writes_while_the_transfer_waits_for_its_lease_is_the_position_that_moves(
        tmp_path: Path, admin: str, pg_url: str) -> None:  # noqa: F811
    """What moves is decided under every run lease, never from the plan read before the
    wait: a run that held its lease when the transfer started writes its file, then ends."""
    cfg, files, data = _pipeline(tmp_path / "pipeline")
    started = tmp_path / "started"
    newer = '{"file": "mysql-bin.000043", "pos": 7}'
    script = f"touch {started}; sleep 2; printf '%s' '{newer}' > {files['order_events']}"
    run = subprocess.Popen([sys.executable, "-m", "statetool", "-c", str(cfg), "leases", "run", "--export",
                            "order_events", "--", "sh", "-c", script], env=process_env())
    try:
        deadline = time.monotonic() + 30
        while not started.exists():
            assert time.monotonic() < deadline and run.poll() is None, "the run never started"
            time.sleep(0.05)
        proc = run_cli_process("-c", str(cfg), "--json", "--lock-wait", "60", "transfer", "--to", pg_url,
                               "--with-checkpoints", timeout=120)
    finally:
        assert run.wait(timeout=60) == 0
    assert proc.returncode == 0, describe(proc)
    assert _pg_positions(admin, pg_url)["order_events"] == newer
    assert [k.read_text() for k in _kept(files)["order_events"]] == [newer]
    moved = {m["export"]: m["position"] for m in json.loads(proc.stdout)["positions"]["moved"]}
    assert moved["order_events"] == json.loads(newer)
