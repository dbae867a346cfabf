"""``statetool metrics [--textfile PATH]`` (issue 16 item 3): OpenMetrics text whose values
are those ``info``, ``leases`` and ``backups list`` give for the same state, on SQLite and
PostgreSQL, parsed by a real OpenMetrics parser (prometheus_client's) and by the
Prometheus text-format parser node-exporter's textfile collector stands for; a live lease
held by a real process; ``--textfile`` replaced whole while a reader polls it; read-only,
every file hashed before and after; a state that cannot be read still gives its metrics.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from prometheus_client.parser import text_string_to_metric_families as text_format_families

from statetool.errors import StateError
from statetool.moments import parse_time
from statetool.openmetrics import Family, exposition, label_value
from statetool.operations.context import Context
from statetool.operations.metrics import FAMILIES, metrics
from support import (declare_export, describe, error_object, fork_cli, fork_code, process_env, run_cli, run_cli_process,
                     tree_digest)
from support import write_config
from support.backends import StateBackend
from support.states import build_state

#: ``{(sample name, frozenset of its labels): value}``: one parsed text.
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parsed(text: str) -> Samples:
    """Every sample of ``text``, parsed by the OpenMetrics parser (which fails on anything
    the format does not allow: no ``# EOF`` last, a family split in two, a unit that is not
    the name's suffix, ...), each series exactly once."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series = (sample.name, frozenset(sample.labels.items()))
            assert series not in out, f"series given twice: {series}"
            out[series] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The value of the series ``name{labels}``, None when the text has none."""
    return samples.get((name, frozenset(labels.items())))


def of(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    """Every series of the sample name ``name``: ``{labels: value}``."""
    return {labels: v for (found, labels), v in samples.items() if found == name}


def cli_json(config: Path, env: dict[str, str], *args: str) -> dict[str, Any]:
    proc = run_cli("-c", str(config), "--json", *args, env=env)
    assert proc.returncode == 0, describe(proc)
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def run_metrics(config: Path, env: dict[str, str], *args: str, code: int = 0) -> tuple[Samples, str]:
    """``statetool -c CONFIG metrics ARGS``, which must exit ``code``: its parsed stdout
    (empty with ``--textfile``) and its stderr."""
    proc = run_cli("-c", str(config), "metrics", *args, env=env)
    assert proc.returncode == code, describe(proc)
    return (parsed(proc.stdout) if proc.stdout else {}), proc.stderr


def assert_age(age: float | None, at: object, before: float, after: float) -> None:
    """``age`` is the seconds from the time ``at`` to a moment between ``before`` and ``after``."""
    when = parse_time(at)
    assert when is not None and age is not None, (age, at)
    assert before - when.timestamp() - 0.01 <= age <= after - when.timestamp() + 0.01, (age, at)


@pytest.fixture
def built(state_backend: StateBackend) -> Path:
    """A state as a pipeline's runs leave it (orders a cursor, order_lines an interrupted
    chunked run, order_events a CDC run with its checkpoint file), then one cursor set on
    purpose (on SQLite that leaves a backup); returns the config."""
    config = write_config(state_backend.pipeline)
    build_state(config, state_backend.url, checkpoint_dir=config.parent, env=state_backend.env)
    proc = run_cli("-c", str(config), "exports", "set-cursor", "orders", "2026-11-01T00:00:00Z", env=state_backend.env)
    assert proc.returncode == 0, describe(proc)
    return config


def pg_size(pg_url: str) -> int:
    """``pg_total_relation_size`` of every table of the state's schema, asked of the server."""
    import psycopg
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    parts = urlsplit(pg_url)
    query = parse_qsl(parts.query)
    schema = dict(query)["schema"]
    dsn = urlunsplit(parts._replace(scheme="postgresql", query=urlencode([(k, v) for k, v in query if k != "schema"])))
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c JOIN pg_namespace n ON "
                           "n.oid = c.relnamespace WHERE n.nspname = %s AND c.relkind = 'r'", (schema,)).fetchone()
    assert row is not None
    return int(row[0])


# -- the values are those of info, leases and backups list ---------------------------------


def test_metrics_parse_and_match_info_leases_and_backups_of_the_same_state(state_backend: StateBackend,
                                                                          built: Path) -> None:
    env = state_backend.env
    start = time.time()
    described = cli_json(built, env, "info")
    leases = cli_json(built, env, "leases")["leases"]
    backups = cli_json(built, env, "backups", "list")["copies"]
    runs = {name: cli_json(built, env, "exports", "show", name)["recent_runs"]
            for name in ("orders", "order_lines", "order_events")}
    before = time.time()
    samples, stderr = run_metrics(built, env)
    after = time.time()
    assert stderr == ""

    assert value(samples, "statetool_state_up") == 1
    assert not of(samples, "statetool_state_error")
    where = described["location"]
    assert value(samples, "statetool_state_info", backend=where["backend"], scope=where["scope"],
                 location=where["display"], revision=described["revision"]["current"]) == 1
    assert value(samples, "statetool_state_revision_pending") == len(described["revision"]["pending"]) == 0
    assert value(samples, "statetool_state_identity_ok", verdict=described["identity"]["verdict"]) == 1
    if state_backend.kind == "sqlite":
        assert value(samples, "statetool_state_size_bytes") == (built.parent / ".rivet_state.db").stat().st_size
    else:
        assert value(samples, "statetool_state_size_bytes") == pg_size(str(state_backend.url))
    codes = [w["code"] for w in described["warnings"]]
    assert {dict(labels)["code"]: v for labels, v in of(samples, "statetool_state_warnings").items()} == \
        {code: codes.count(code) for code in codes}

    for row in described["exports"]:
        name = row["name"]
        by_status = {dict(labels)["status"]: v for labels, v in of(samples, "statetool_export_runs_total").items()
                     if dict(labels)["export"] == name}
        assert by_status["succeeded"] == row["runs_succeeded"] and by_status["failed"] == row["runs_failed"], name
        assert sum(by_status.values()) == row["runs_total"], (name, by_status)
        assert value(samples, "statetool_export_chunks_pending", export=name) == \
            row["chunks_total"] - row["chunks_done"]
        cursor_age = value(samples, "statetool_export_cursor_age_seconds", export=name)
        if row["cursor_updated_at"] is None:
            assert cursor_age is None, name
        else:
            assert_age(cursor_age, row["cursor_updated_at"], before, after)
        succeeded = [r for r in runs[name] if r["status"] == "succeeded"]
        success_age = value(samples, "statetool_export_last_success_age_seconds", export=name)
        if succeeded:
            assert_age(success_age, succeeded[0]["finished_at"], before, after)
        else:
            assert success_age is None, name
    assert value(samples, "statetool_export_chunks_pending", export="order_lines") == 1
    assert value(samples, "statetool_export_runs_total", export="order_lines", status="running") == 1

    (checkpoint,) = described["checkpoints"]
    assert checkpoint["stored_in"] == "file"
    age = value(samples, "statetool_export_position_age_seconds", export="order_events")
    assert age is not None and checkpoint["age_seconds"] - 0.01 <= age <= checkpoint["age_seconds"] + after - start

    assert {dict(labels)["key"]: v for labels, v in of(samples, "statetool_lease_held").items()} == \
        {lease["key"]: int(lease["state"] == "live") for lease in leases}
    assert not of(samples, "statetool_lease_age_seconds")

    if state_backend.kind == "postgres":
        assert backups == [] and not of(samples, "statetool_backup_copies")
        assert value(samples, "statetool_backup_age_seconds") is None
        return
    for kind in ("backup", "keep"):
        for usable in (True, False):
            assert value(samples, "statetool_backup_copies", kind=kind, usable=str(usable).lower()) == \
                sum(1 for c in backups if c["kind"] == kind and (c["problem"] is None) == usable)
    newest = max(c["taken_at"] for c in backups if c["problem"] is None)
    when = parse_time(newest)
    assert when is not None
    backup_age = value(samples, "statetool_backup_age_seconds")
    assert backup_age is not None and before - when.timestamp() - 0.01 <= backup_age <= after - when.timestamp() + 0.01


def test_the_same_text_reads_alike_through_the_prometheus_text_parser_of_the_textfile_collector(
        state_backend: StateBackend, built: Path) -> None:
    """node-exporter's textfile collector parses Prometheus text format 0.0.4, not
    OpenMetrics: the text is valid there too (no ``info`` or ``stateset`` type, no
    timestamp; ``# UNIT`` and ``# EOF`` read as comments), with the same series and values.
    The one difference is the counter's type: its ``# TYPE`` names the family without
    ``_total``, so that parser reads its samples as untyped (docs/decisions.md, "Metrics")."""
    proc = run_cli("-c", str(built), "metrics", env=state_backend.env)
    assert proc.returncode == 0, describe(proc)
    om = parsed(proc.stdout)
    text: Samples = {}
    for family in text_format_families(proc.stdout):
        if not family.samples:  # the counter's own name, which no sample has (node-exporter drops it)
            continue
        assert family.type == ("unknown" if family.name == "statetool_export_runs_total" else "gauge"), family
        for sample in family.samples:
            text[(sample.name, frozenset(sample.labels.items()))] = sample.value
    assert text == om
    for family in FAMILIES:
        assert '"' not in family.help and "\\" not in family.help, family  # the text format escapes neither in HELP


def test_a_position_committed_in_the_state_gives_its_age_from_the_commit(state_backend: StateBackend,
                                                                        built: Path) -> None:
    proc = run_cli("-c", str(built), "checkpoints", "import", env=state_backend.env)
    assert proc.returncode == 0, describe(proc)
    (checkpoint,) = cli_json(built, state_backend.env, "checkpoints")["checkpoints"]
    assert checkpoint["stored_in"] == "state"
    before = time.time()
    samples, _ = run_metrics(built, state_backend.env)
    assert_age(value(samples, "statetool_export_position_age_seconds", export="order_events"),
               checkpoint["committed_at"], before, time.time())


def test_a_state_with_revisions_pending_reads_and_says_how_many(state_backend: StateBackend) -> None:
    config = write_config(state_backend.pipeline)
    for args in (["init"], ["migrate", "--to", "0002", "--allow-data-loss"]):
        proc = run_cli("-c", str(config), *args, env=state_backend.env)
        assert proc.returncode == 0, describe(proc)
    pending = cli_json(config, state_backend.env, "info")["revision"]["pending"]
    samples, _ = run_metrics(config, state_backend.env)
    assert value(samples, "statetool_state_up") == 1
    assert value(samples, "statetool_state_revision_pending") == len(pending) > 0


def test_a_state_of_another_source_reads_with_its_identity_not_ok(tmp_path: Path) -> None:
    state_dir = tmp_path / "declared"
    state_dir.mkdir()
    env = {"RIVET_STATE_URL": f"sqlite:{state_dir}"}
    build_state(write_config(tmp_path / "other", source_url="postgresql://reader@db-old.internal/sales"),
                env["RIVET_STATE_URL"])
    config = write_config(tmp_path / "pipeline")
    assert cli_json(config, env, "info")["identity"]["verdict"] == "refuse"
    samples, _ = run_metrics(config, env)
    assert value(samples, "statetool_state_up") == 1
    assert value(samples, "statetool_state_identity_ok", verdict="refuse") == 0


# -- a live lease held by a real process ----------------------------------------------------

#: The command a holder runs: it says it runs (file argv[1]), then waits for file argv[2].
WAIT = ("import pathlib, sys, time; pathlib.Path(sys.argv[1]).touch()\n"
        "while not pathlib.Path(sys.argv[2]).exists(): time.sleep(0.02)")


@pytest.fixture
def holder(state_backend: StateBackend, built: Path, tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """``statetool leases run --export orders`` of a real process, holding the run lease
    until the test touches the file it yields (with the config)."""
    ready, go = tmp_path / "ready", tmp_path / "go"
    proc = fork_cli("-c", str(built), "leases", "run", "--export", "orders", "--", sys.executable, "-c", WAIT,
                    str(ready), str(go), env=process_env(state_backend.env), new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        yield built, go
    finally:
        go.touch()
        proc.communicate(timeout=60)
        assert proc.returncode == 0


def test_a_live_lease_held_by_a_real_process_shows_held_with_its_ages(state_backend: StateBackend,
                                                                     holder: tuple[Path, Path]) -> None:
    config, go = holder
    env = state_backend.env
    (lease,) = [row for row in cli_json(config, env, "leases")["leases"] if row["key"] == "chunk-run:orders"]
    assert lease["state"] == "live"
    before = time.time()
    samples, _ = run_metrics(config, env)
    after = time.time()
    assert value(samples, "statetool_lease_held", key="chunk-run:orders") == 1
    assert value(samples, "statetool_state_warnings", code="RIVET_STATE_LEASE_LIVE") == 1
    assert_age(value(samples, "statetool_lease_age_seconds", key="chunk-run:orders"), lease["acquired_at"],
               before, after)
    heartbeat = value(samples, "statetool_lease_heartbeat_age_seconds", key="chunk-run:orders")
    if state_backend.kind == "postgres":  # a row the holder's heartbeat refreshes, by the database clock
        assert heartbeat is not None and 0 <= heartbeat <= 30, heartbeat
    else:  # a flock has no heartbeat: the kernel holds it for as long as the holder lives
        assert heartbeat is None
    go.touch()
    deadline = time.monotonic() + 60
    while any(row["state"] == "live" for row in cli_json(config, env, "leases")["leases"]):
        assert time.monotonic() < deadline, "the lease stayed live after its command ended"
        time.sleep(0.05)
    samples, _ = run_metrics(config, env)
    assert value(samples, "statetool_lease_held", key="chunk-run:orders") in (0, None)
    assert not of(samples, "statetool_lease_age_seconds")


# -- read-only -----------------------------------------------------------------------------


def test_metrics_change_no_byte_and_take_no_lease(state_backend: StateBackend, built: Path, tmp_path: Path) -> None:
    """Every file under the test's directory (the config, the SQLite state, its backup and
    lease records, the checkpoint) hashed before and after a run to stdout and one to a
    textfile elsewhere; on PostgreSQL the whole state, history and leases too, as
    ``export --with-history`` and ``leases`` read them."""
    env = state_backend.env
    collector = tmp_path / "collector"
    collector.mkdir()

    def whole() -> tuple[dict[str, Any], dict[str, Any]]:
        exported = cli_json(built, env, "export", "--with-history")
        exported.pop("exported_at")
        return exported, cli_json(built, env, "leases")

    files, before = tree_digest(state_backend.pipeline), whole()
    run_metrics(built, env)
    run_metrics(built, env, "--textfile", str(collector / "rivet.prom"))
    assert tree_digest(state_backend.pipeline) == files
    assert whole() == before
    assert sorted(os.listdir(collector)) == ["rivet.prom"]


# -- a state that cannot be read -----------------------------------------------------------


def test_a_missing_state_writes_its_textfile_saying_so_and_exits_with_its_code(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    target = tmp_path / "rivet.prom"
    _, stderr = run_metrics(config, {}, "--textfile", str(target), code=5)
    assert "RIVET_STATE_MISSING" in stderr and "Try:" in stderr
    samples = parsed(target.read_text())
    assert value(samples, "statetool_state_up") == 0
    assert value(samples, "statetool_state_error", code="RIVET_STATE_MISSING") == 1
    assert not of(samples, "statetool_export_runs_total")
    assert not (config.parent / ".rivet_state.db").exists()


def test_a_file_that_is_no_state_gives_its_code_and_one_json_error_line(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    (config.parent / ".rivet_state.db").write_bytes(b"not a database" * 100)
    proc = run_cli("-c", str(config), "--json-errors", "metrics")
    assert proc.returncode == 5, describe(proc)
    assert error_object(proc)["code"] == "RIVET_STATE_NOT_A_STATE"
    samples = parsed(proc.stdout)
    assert value(samples, "statetool_state_up") == 0
    assert value(samples, "statetool_state_error", code="RIVET_STATE_NOT_A_STATE") == 1


def test_an_unreachable_server_is_down_and_retryable(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    env = {"RIVET_STATE_URL": f"postgresql://nobody@/postgres?host={tmp_path}&port=1"}
    samples, _ = run_metrics(config, env, code=2)
    assert value(samples, "statetool_state_up") == 0
    (labels,) = of(samples, "statetool_state_error")
    assert dict(labels) == {"code": "RIVET_STATE_UNREACHABLE"}


# -- --textfile ------------------------------------------------------------------------------

#: Writes the metrics to argv[2] again and again until file argv[3] exists, then says how often.
LOOP = """\
import pathlib, sys
from statetool.cli import main
config, target, stop = sys.argv[1:4]
runs = 0
while not pathlib.Path(stop).exists():
    try:
        main(["-c", config, "metrics", "--textfile", target])
    except SystemExit as done:
        assert done.code == 0, done.code
    runs += 1
pathlib.Path(stop + ".runs").write_text(str(runs))
"""


def test_a_reader_polling_the_textfile_never_sees_part_of_one(tmp_path: Path) -> None:
    """A state with 300 exports (a text of about 100 KB) rewritten in a loop by another
    process while this one reads the file as fast as it can for 4 s: every read is a whole text
    (the OpenMetrics parser refuses one without its ``# EOF``), and the directory never
    holds a second ``*.prom``."""
    config = write_config(tmp_path / "pipeline")
    for n in range(300):
        declare_export(config, f"export_{n:03d}")
    build_state(config)
    collector = tmp_path / "collector"
    collector.mkdir()
    target, stop = collector / "rivet.prom", tmp_path / "stop"
    writer = fork_code(LOOP, str(config), str(target), str(stop), env=process_env())
    reads = 0
    try:
        deadline = time.monotonic() + 120
        while not target.exists():
            assert writer.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        until = time.monotonic() + 4
        while time.monotonic() < until:
            text = target.read_text()
            assert len(of(parsed(text), "statetool_export_chunks_pending")) == 303
            assert [name for name in os.listdir(collector) if name.endswith(".prom")] == ["rivet.prom"]
            reads += 1
    finally:
        stop.touch()
        writer.wait(120)
    assert writer.returncode == 0
    runs = int(Path(f"{stop}.runs").read_text())
    assert runs >= 3 and reads >= 10, (runs, reads)  # the file was replaced under the reader, again and again
    assert os.listdir(collector) == ["rivet.prom"]


def test_a_textfile_in_a_directory_that_is_not_there_is_refused_before_any_read(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    (config.parent / ".rivet_state.db").write_bytes(b"not a database")  # never read: the refusal comes first
    proc = run_cli("-c", str(config), "--json-errors", "metrics", "--textfile", str(tmp_path / "absent" / "r.prom"))
    assert proc.returncode == 1, describe(proc)
    assert error_object(proc)["code"] == "RIVET_METRICS_DIR_MISSING"
    assert proc.stdout == "" and not (tmp_path / "absent").exists()


def test_a_symlink_at_the_textfile_or_at_its_temporary_name_is_never_followed(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    build_state(config)
    collector = tmp_path / "collector"
    collector.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    target = collector / "rivet.prom"
    target.symlink_to(victim)
    proc = run_cli("-c", str(config), "--json-errors", "metrics", "--textfile", str(target))
    assert proc.returncode == 5, describe(proc)
    assert error_object(proc)["code"] == "RIVET_STATE_UNSAFE_FILE"
    target.unlink()
    tmp = collector / f".rivet.prom.{os.getpid()}.metrics-tmp"  # the in-process run's pid is this one's
    tmp.symlink_to(victim)
    proc = run_cli("-c", str(config), "--json-errors", "metrics", "--textfile", str(target))
    assert proc.returncode == 5, describe(proc)
    assert error_object(proc)["code"] == "RIVET_STATE_UNSAFE_FILE"
    assert victim.read_text() == "keep me" and tmp.is_symlink() and not target.exists()


def test_a_temporary_file_a_killed_run_left_under_this_pid_is_replaced(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    build_state(config)
    target = tmp_path / "rivet.prom"
    (tmp_path / f".rivet.prom.{os.getpid()}.metrics-tmp").write_text("# TYPE half")
    run_metrics(config, {}, "--textfile", str(target))
    assert value(parsed(target.read_text()), "statetool_state_up") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipeline", "rivet.prom"]


def _read_only_mount(directory: Path) -> Callable[[], None]:
    """Bind-mount ``directory`` onto itself read-only (root ignores permissions, not a
    read-only mount); returns its unmount."""
    for cmd in (["mount", "--bind", str(directory), str(directory)],
                ["mount", "-o", "remount,bind,ro", str(directory), str(directory)]):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            subprocess.run(["umount", str(directory)], capture_output=True)
            pytest.skip(f"no read-only bind mount here (needs root): {done.stderr.strip()}")
    return lambda: subprocess.run(["umount", str(directory)], check=True)


UNWRITABLE = {
    "read-only-mount": ("collector/rivet.prom", "mounted read-only"),
    "a-file-for-a-directory": ("afile/rivet.prom", "is a file, not a directory"),
}


@pytest.mark.parametrize(("where", "says"), UNWRITABLE.values(), ids=UNWRITABLE.keys())
def test_a_textfile_that_cannot_be_written_is_its_own_registered_error_and_leaves_no_file(
        tmp_path: Path, where: str, says: str) -> None:
    """``--textfile`` where no file can be made (a read-only mount, a file for its
    directory): ``RIVET_METRICS_TEXTFILE_UNWRITABLE`` (exit 1) through the real CLI, no
    traceback, nothing on stdout, no temporary file. (/proc and /sys, which deny root too,
    are ``RIVET_PLACE_HOLDS_NO_FILES`` for every file option: tests/test_hostile_input.py.)"""
    config = write_config(tmp_path / "pipeline")
    build_state(config)
    (tmp_path / "collector").mkdir()
    (tmp_path / "collector" / "rivet.prom").write_text("# the old text\n")
    (tmp_path / "afile").write_text("a file")
    target = Path(where) if where.startswith("/") else tmp_path / where
    undo = _read_only_mount(tmp_path / "collector") if where.startswith("collector") else None
    try:
        proc = run_cli_process("-c", str(config), "--json-errors", "metrics", "--textfile", str(target))
        left = sorted(os.listdir(target.parent)) if target.parent.is_dir() else []
    finally:
        if undo is not None:
            undo()
    obj = error_object(proc)
    assert (proc.returncode, obj["code"], proc.stdout) == (1, "RIVET_METRICS_TEXTFILE_UNWRITABLE", ""), describe(proc)
    assert says in obj["message"] and str(target) in obj["message"] and "Traceback" not in proc.stderr, describe(proc)
    assert not [name for name in left if name.endswith(".metrics-tmp")], left
    if where.startswith("collector"):
        assert left == ["rivet.prom"] and target.read_text() == "# the old text\n"


def test_metrics_have_no_json_document(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    proc = run_cli("-c", str(config), "--json", "--json-errors", "metrics")
    assert proc.returncode == 1, describe(proc)
    assert error_object(proc)["code"] == "RIVET_CLI_USAGE" and proc.stdout == ""


# -- several pipelines (the library function a --configs run calls) ---------------------------


def test_several_pipelines_each_get_a_pipeline_label_and_the_worst_code(tmp_path: Path) -> None:
    good = write_config(tmp_path / "good")
    build_state(good)
    missing = write_config(tmp_path / "missing")
    broken = write_config(tmp_path / "broken")
    (broken.parent / ".rivet_state.db").write_bytes(b"\0" * 4096)
    contexts = [Context(path, env={}) for path in (good, missing, broken)]
    result = metrics(contexts)
    samples = parsed(result.text)
    assert all(dict(labels).get("pipeline") in {str(good), str(missing), str(broken)} for _, labels in samples)
    assert {dict(labels)["pipeline"]: v for labels, v in of(samples, "statetool_state_up").items()} == \
        {str(good): 1, str(missing): 0, str(broken): 0}
    assert value(samples, "statetool_export_runs_total", pipeline=str(good), export="orders", status="succeeded") == 1
    assert [err.code for err in result.down] == ["RIVET_STATE_MISSING", "RIVET_STATE_NOT_A_STATE"]
    assert result.exit_code == 5
    single = parsed(metrics(contexts[:1]).text)
    assert all("pipeline" not in dict(labels) for _, labels in single)
    with pytest.raises(StateError, match="distinct pipeline configs") as refused:
        metrics([contexts[0], Context(good, env={})])
    assert refused.value.code == "RIVET_CLI_USAGE"


def test_configs_and_state_url_env_give_one_text_labelled_per_pipeline_with_the_worst_code(tmp_path: Path,
                                                                                            pg_url: str) -> None:
    sqlite_config, missing, pg_config = (write_config(tmp_path / "p" / name) for name in ("a", "b", "c"))
    build_state(sqlite_config)
    build_state(pg_config, pg_url)
    env = {**process_env(), "STATE_C": pg_url}
    env.pop("RIVET_STATE_URL", None)
    digest = tree_digest(tmp_path)
    proc = run_cli("metrics", "--configs", "p/*/rivet.yaml", "--state-url-env", "p/c/rivet.yaml=STATE_C",
                   env=env, cwd=tmp_path)
    assert proc.returncode == 5 and "RIVET_STATE_MISSING" in proc.stderr, describe(proc)
    samples = parsed(proc.stdout)
    labels = ["p/a/rivet.yaml", "p/b/rivet.yaml", "p/c/rivet.yaml"]
    assert {dict(key)["pipeline"] for _, key in samples} == set(labels)
    assert {dict(key)["pipeline"]: v for key, v in of(samples, "statetool_state_up").items()} == \
        {"p/a/rivet.yaml": 1, "p/b/rivet.yaml": 0, "p/c/rivet.yaml": 1}
    for label, config, url in (("p/a/rivet.yaml", sqlite_config, None), ("p/c/rivet.yaml", pg_config, pg_url)):
        info = cli_json(config, {**env, **({"RIVET_STATE_URL": url} if url else {})}, "info")
        backend = info["location"]["backend"]
        assert [dict(key)["backend"] for key in of(samples, "statetool_state_info")
                if dict(key)["pipeline"] == label] == [backend]
        assert info["exports"]
        for row in info["exports"]:
            assert value(samples, "statetool_export_runs_total", pipeline=label, export=row["name"],
                         status="succeeded") == row["runs_succeeded"], (label, row["name"])
    assert tree_digest(tmp_path) == digest
    one = run_cli("metrics", "--configs", "p/a/*.yaml", env=env, cwd=tmp_path)
    assert one.returncode == 0, describe(one)
    assert {dict(key).get("pipeline") for _, key in parsed(one.stdout)} == {"p/a/rivet.yaml"}
    target = tmp_path / "fleet.prom"
    twice = run_cli("-c", "p/a/rivet.yaml", "-c", "p/c/rivet.yaml", "metrics", "--state-url-env",
                    "p/c/rivet.yaml=STATE_C", "--textfile", str(target), env=env, cwd=tmp_path)
    assert (twice.returncode, twice.stdout) == (0, ""), describe(twice)
    assert {dict(key)["pipeline"] for _, key in parsed(target.read_text())} == {"p/a/rivet.yaml", "p/c/rivet.yaml"}
    shared = run_cli("metrics", "--configs", "p/*/rivet.yaml", "--json-errors", env={**env, "RIVET_STATE_URL": pg_url},
                     cwd=tmp_path)
    assert (error_object(shared)["code"], shared.returncode, shared.stdout) == ("RIVET_CLI_USAGE", 1, ""), \
        describe(shared)


# -- the writer ------------------------------------------------------------------------------


def test_label_values_are_escaped_as_openmetrics_defines() -> None:
    family = Family("t_seconds", "gauge", "A test family", "seconds")
    key = 'chunk-run:a "b" \\c\nd é'
    text = exposition([family, Family("t_empty", "gauge", "never given")],
                      [(family, (("key", key),), 0.25), (family, (("key", "x"),), 3.0)])
    assert label_value(key) == 'chunk-run:a \\"b\\" \\\\c\\nd é'
    assert value(parsed(text), "t_seconds", key=key) == 0.25
    assert "t_empty" not in text and text.endswith("\n# EOF\n") and 't_seconds{key="x"} 3\n' in text
    assert value(parsed(exposition([family], [(family, (), 1e-05)])), "t_seconds") == 1e-05


def _small_collector(tmp_path: Path) -> tuple[Path, Any]:
    """A pipeline with a state, and a collector directory to mount a small tmpfs on (root
    only: the caller mounts it with its options and unmounts it)."""
    from test_prune_failures import _require_root
    from test_relocate import TmpfsMount

    _require_root()
    config = write_config(tmp_path / "pipeline")
    build_state(config)
    return config, TmpfsMount(tmp_path / "collector")


def test_a_textfile_on_a_full_disk_is_disk_full_and_keeps_the_old_file(tmp_path: Path) -> None:
    """``--textfile`` on a tmpfs filled to its last byte: ``RIVET_STATE_DISK_FULL`` (exit 1)
    with its own advice (free space), not "a directory this user may create files in";
    the old text stays and no temporary file is left."""
    from test_prune_failures import _fill

    config, mount = _small_collector(tmp_path)
    try:
        collector = mount.mount("8k")
        target = collector / "rivet.prom"
        target.write_text("# the old text\n")
        _fill(collector)
        proc = run_cli_process("-c", str(config), "--json-errors", "metrics", "--textfile", str(target))
        left = sorted(os.listdir(collector))
        old = target.read_text()
    finally:
        mount.unmount()
    obj = error_object(proc)
    assert (proc.returncode, obj["code"]) == (1, "RIVET_STATE_DISK_FULL"), describe(proc)
    assert str(target) in obj["message"] and "free space" in obj["action"], obj
    assert left == ["filler", "rivet.prom"] and old == "# the old text\n", left


def test_a_textfile_where_no_inode_is_left_says_so_not_that_space_is_short(tmp_path: Path) -> None:
    """``--textfile`` on a tmpfs whose every inode is used (``nr_inodes``), bytes free:
    ``RIVET_STATE_DISK_FULL`` whose message says no inode is left (a re-check's finding: it
    said "no space left", and ``df`` showed space)."""
    config, mount = _small_collector(tmp_path)
    try:
        collector = mount.mount("1m,nr_inodes=4")
        made = 0
        with contextlib.suppress(OSError):
            while True:
                (collector / f"file-{made}").write_text("x")
                made += 1
        assert os.statvfs(collector).f_favail == 0 and os.statvfs(collector).f_bavail > 0
        proc = run_cli_process("-c", str(config), "--json-errors", "metrics", "--textfile",
                               str(collector / "rivet.prom"))
        left = sorted(os.listdir(collector))
    finally:
        mount.unmount()
    obj = error_object(proc)
    assert (proc.returncode, obj["code"]) == (1, "RIVET_STATE_DISK_FULL"), describe(proc)
    assert "no inode left" in obj["message"] and "no space left for" not in obj["message"], obj
    assert left == [f"file-{i}" for i in range(made)], left
