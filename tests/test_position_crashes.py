"""A CDC position moved between its checkpoint file and the state is never lost to a kill
(issue 15 item 3; SPEC §5, §5a, §6, §9).

``statetool checkpoints import`` and ``checkpoints export`` run in a real process
(tests/support/crash_driver.py) that SIGKILLs itself at each step of
``positions.CRASH_POINTS`` / ``positions.EXPORT_POINTS``, and as the forked CLI SIGKILLed
blind at delays over its measured run time, on SQLite and on PostgreSQL. After every kill,
by real reads (``statetool leases --json``, ``statetool checkpoints --json``, the state's
row, the files, and the runtime's ``StateStore.run(export, "cdc").read_position()`` with
``lock_wait=0``): no lease is left held; the position a run resumes from is exactly the
original one, never none (a first run of the stream); it lives in one place, the state's
row (a file still at the checkpoint's path then holds the very same text) or the file with
no row. The re-run of the same command exits 0 and converges: after ``import`` the row
holds the file's text exactly, nothing is at the checkpoint's path and the file is kept
once as ``<name>.imported-<time>``; after ``export`` the file holds the original bytes
and the state no row; one audit row per export, no temporary file left.

With two CDC exports, ``import`` moves each in its own guarded write: a kill between them
leaves one in the state and the other in its file, and the re-run moves the second
without touching the first's row.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from support import describe, error_object, fork_cli, process_env, run_cli, run_cli_forked, write_config
from support.backends import BACKENDS
from statetool.operations.positions import CRASH_POINTS, EXPORT_POINTS
from statetool.runtime import StateStore
from support.crash_driver import run_killed_at
from test_move_crashes import _kill_when

#: A position as a binlog reader writes it: not in the canonical JSON form, so that a
#: round trip through a parse would show (the state keeps the file's text exactly).
ORIGINAL = '{"file":"mysql-bin.000042",   "pos":91234}\n'
#: The second stream's position (the two-export config).
OTHER = '{"_data": "8263A1B2C3", "ts": [1718000000, 7]}\n'
#: A second CDC export, added to the default config's exports (orders, order_lines, order_events).
SECOND_EXPORT = ("  - name: audit_events\n    mode: cdc\n    cdc:\n      engine: mongodb\n"
                 "      checkpoint: checkpoints/audit_events.json\n")
#: Blind kills per sweep: evenly over the measured run time (and one at three times it).
KILLS = 10
#: Where a kill at each step leaves the position a run resumes from.
IMPORT_LEAVES = {"leased": "file", "stored": "file", "committed": "state", "renamed": "state"}
EXPORT_LEAVES = {"leased": "state", "temp-written": "state", "file-written": "state", "removed": "state",
                 "committed": "file"}


@dataclass(frozen=True)
class Pipeline:
    """A pipeline with a state at head (``init``) and its CDC checkpoint files written:
    ``config``, ``url`` (None: SQLite beside the config; else a PostgreSQL schema's) and
    ``texts`` (``{export: the checkpoint file's original text}``)."""

    config: Path
    url: str | None
    texts: dict[str, str]

    @property
    def args(self) -> tuple[str, ...]:
        """The global options that name this pipeline's state (a forked CLI, the crash
        driver and the in-process CLI all get the same)."""
        return ("-c", str(self.config), *(("--state-url", self.url) if self.url else ()))

    def checkpoint(self, export: str) -> Path:
        """Where ``export``'s checkpoint file is (beside the config, on either backend)."""
        return self.config.parent / "checkpoints" / f"{export}.json"

    def kept(self, export: str) -> list[Path]:
        """The checkpoint files ``import`` renamed, ``<name>.imported-<time>``."""
        return sorted(self.checkpoint(export).parent.glob(f"{export}.json.imported-*"))

    def temporary(self) -> list[str]:
        """What a write of a checkpoint file may leave: temporary files beside it."""
        return sorted(p.name for p in (self.config.parent / "checkpoints").iterdir() if "tmp" in p.name)

    def cli(self, *args: str) -> Any:
        """``statetool --json ARGS`` on this pipeline, asserted to exit 0; its JSON."""
        proc = run_cli(*self.args, "--json", *args, timeout=120)
        assert proc.returncode == 0, describe(proc)
        return json.loads(proc.stdout)

    def store(self) -> StateStore:
        """The state opened as a pipeline opens it, waiting for no lease."""
        return StateStore.open(self.config, state_url=self.url, env={}, lock_wait=0)

    def row(self, export: str) -> tuple[Any, ...] | None:
        """The state's ``rivet_cdc_positions`` row of ``export``, read as it is."""
        backend = self.store().ctx.backend()
        with backend.reading() as conn:
            return conn.one("SELECT export_name, engine, position, committed_at, run_id, fencing_token "
                            "FROM rivet_cdc_positions WHERE export_name = :e", {"e": export})

    def audited(self, action: str, export: str) -> int:
        """How many ``action`` audit rows name ``export``."""
        backend = self.store().ctx.backend()
        with backend.reading() as conn:
            details = [json.loads(d) for (d,) in conn.rows("SELECT detail FROM rivet_audit WHERE action = :a",
                                                            {"a": action})]
        return sum(d["export"] == export for d in details)


@pytest.fixture(params=[pytest.param(kind, marks=[pytest.mark.postgres] if kind == "postgres" else [])
                        for kind in BACKENDS])
def pipelines(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., Pipeline]]:
    """Make fresh pipelines on one backend (ids ``sqlite``, ``postgres``): each in a
    directory of its own, its state created by ``statetool init`` (on PostgreSQL in a new
    schema, dropped afterwards), with each CDC export's checkpoint file holding its text;
    ``two``: a second CDC export, ``audit_events``."""
    schemas: list[str] = []
    base = request.getfixturevalue("pg_server")["url"] if request.param == "postgres" else ""

    def new(name: str, *, two: bool = False) -> Pipeline:
        config = write_config(tmp_path / name / "pipeline")
        if two:
            config.write_text(config.read_text() + SECOND_EXPORT)
        url = None
        if base:
            schemas.append(f"t_{uuid.uuid4().hex[:12]}")
            url = f"{base}{'&' if '?' in base else '?'}schema={schemas[-1]}"
        texts = {"order_events": ORIGINAL, **({"audit_events": OTHER} if two else {})}
        pipeline = Pipeline(config, url, texts)
        proc = run_cli(*pipeline.args, "init")
        assert proc.returncode == 0, describe(proc)
        for export, text in texts.items():
            pipeline.checkpoint(export).parent.mkdir(exist_ok=True)
            pipeline.checkpoint(export).write_text(text)
        return pipeline

    yield new
    if schemas:
        import psycopg

        with psycopg.connect(base.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
            for schema in schemas:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _imported(pipeline: Pipeline) -> Pipeline:
    """``pipeline`` after a whole ``checkpoints import``: the start of an export's sweep."""
    pipeline.cli("checkpoints", "import")
    for export in pipeline.texts:
        assert not pipeline.checkpoint(export).exists() and pipeline.row(export) is not None
    return pipeline


def _one_place(pipeline: Pipeline, export: str, where: str) -> str:
    """After a kill: no lease live, and ``export``'s position exactly its original text in
    one place; returns that place, ``state`` (its row; a file at the checkpoint's path holds
    the same text) or ``file`` (no row). The lease list is read first: a run's open of the
    state (the last read) takes over a dead holder's PostgreSQL row."""
    text = pipeline.texts[export]
    live = [lease for lease in pipeline.cli("leases")["leases"] if lease["state"] == "live"]
    assert live == [], f"{where}: a killed holder's lease reads live: {live}"
    (report,) = [c for c in pipeline.cli("checkpoints")["checkpoints"] if c["export"] == export]
    assert report["position"] == json.loads(text), f"{where}: checkpoints reports {report}"
    row = pipeline.row(export)
    path = pipeline.checkpoint(export)
    on_disk = path.read_text() if path.exists() else None
    if row is not None:
        assert row[2] == text, f"{where}: the state holds {row[2]!r}, not the file's text"
        assert on_disk in (None, text), f"{where}: the file beside the state's position holds {on_disk!r}"
        place = "state"
    else:
        assert on_disk == text, f"{where}: no row and the file holds {on_disk!r}: the position is lost"
        place = "file"
    assert report["stored_in"] == place, f"{where}: {report}"
    warned = {w["code"] for w in report["warnings"]}
    assert warned <= ({"RIVET_STATE_CHECKPOINT_RELATIVE"} if pipeline.url and place == "file" else set()), \
        f"{where}: {report['warnings']}"
    assert len(pipeline.kept(export)) <= 1, f"{where}: {pipeline.kept(export)}"
    with pipeline.store().run(export, "cdc") as run:  # lock_wait 0: refused if the lease were held
        assert run.read_position() == json.loads(text), f"{where}: a run would resume elsewhere"
    return place


def _imported_once(pipeline: Pipeline, export: str, where: str) -> None:
    """``export``'s position in the state (the file's text exactly), nothing at its
    checkpoint's path, the file kept once with its bytes, one audit row."""
    text = pipeline.texts[export]
    row = pipeline.row(export)
    assert row is not None and row[2] == text, f"{where}: {row}"
    assert not pipeline.checkpoint(export).exists(), f"{where}: a file is left at the checkpoint's path"
    kept = pipeline.kept(export)
    assert len(kept) == 1 and kept[0].read_text() == text, f"{where}: kept {kept}"
    assert pipeline.audited("checkpoints.import", export) == 1, where
    assert _one_place(pipeline, export, where) == "state"


def _exported_once(pipeline: Pipeline, export: str, where: str) -> None:
    """``export``'s file holds the original bytes, the state no row, one audit row."""
    assert pipeline.checkpoint(export).read_bytes() == pipeline.texts[export].encode(), where
    assert pipeline.row(export) is None, f"{where}: the state still holds {pipeline.row(export)}"
    assert pipeline.audited("checkpoints.export", export) == 1, where
    assert _one_place(pipeline, export, where) == "file"


def _converged(pipeline: Pipeline, direction: str, where: str) -> None:
    """The re-run of ``checkpoints DIRECTION`` after a kill exits 0 and ends where a run
    that was never killed ends, with no temporary file."""
    rerun = run_cli(*pipeline.args, "checkpoints", direction, timeout=120)
    assert rerun.returncode == 0, f"{where}: the re-run failed: {describe(rerun)}"
    for export in pipeline.texts:
        (_imported_once if direction == "import" else _exported_once)(pipeline, export, f"{where}, re-run")
    assert pipeline.temporary() == [], f"{where}: left {pipeline.temporary()}"


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_checkpoints_import_killed_at_each_step_keeps_the_position_in_one_place_and_a_rerun_converges(
        pipelines: Callable[..., Pipeline], point: str) -> None:
    pipeline = pipelines("import")
    proc = run_killed_at(point, *pipeline.args, "checkpoints", "import")
    assert proc.returncode == -signal.SIGKILL, f"not killed at {point}: {describe(proc)}"
    where = f"import killed at {point}"
    assert _one_place(pipeline, "order_events", where) == IMPORT_LEAVES[point], where
    _converged(pipeline, "import", where)


@pytest.mark.parametrize("point", EXPORT_POINTS)
def test_checkpoints_export_killed_at_each_step_keeps_the_position_in_one_place_and_a_rerun_converges(
        pipelines: Callable[..., Pipeline], point: str) -> None:
    """Killed at ``temp-written``, the export used to leave ``.<name>.<pid>.export-tmp`` for
    good (the re-run had another pid): the name is one per file now, and the re-run's write
    removes it first."""
    pipeline = _imported(pipelines("export"))
    proc = run_killed_at(point, *pipeline.args, "checkpoints", "export")
    assert proc.returncode == -signal.SIGKILL, f"not killed at {point}: {describe(proc)}"
    where = f"export killed at {point}"
    assert _one_place(pipeline, "order_events", where) == EXPORT_LEAVES[point], where
    # killed between the temporary file's fsync and its rename: the re-run removes it
    assert pipeline.temporary() == ([".order_events.json.export-tmp"] if point == "temp-written" else []), where
    _converged(pipeline, "export", where)


@pytest.mark.parametrize("direction", ["import", "export"])
def test_checkpoints_import_and_export_killed_blind_at_any_instant_keep_the_position_and_a_rerun_converges(
        pipelines: Callable[..., Pipeline], direction: str) -> None:
    """No hook: the kill lands wherever the process is, at delays evenly over the measured
    run time of the whole command (and at three times it: a run that ended is re-run too)."""

    def fresh(name: str) -> Pipeline:
        made = pipelines(name)
        return _imported(made) if direction == "export" else made

    timed = fresh("timing")
    warm = run_cli_forked(*timed.args, "checkpoints")  # the fork server started: not part of the time measured
    assert warm.returncode == 0, describe(warm)
    start = time.monotonic()
    proc = run_cli_forked(*timed.args, "checkpoints", direction, timeout=120)
    total = time.monotonic() - start
    assert proc.returncode == 0, describe(proc)
    seen: dict[str, int] = {}

    def kill_at(i: int, delay: float) -> None:
        pipeline = fresh(f"kill-{i}")
        status = _kill_when((*pipeline.args, "checkpoints", direction), lambda: True, delay)
        where = f"{direction} kill {i} ({delay * 1000:.1f} ms of {total * 1000:.1f} ms, exit {status})"
        assert status in (0, -signal.SIGKILL), where
        place = _one_place(pipeline, "order_events", where)
        seen[place] = seen.get(place, 0) + 1
        _converged(pipeline, direction, where)
        shutil.rmtree(pipeline.config.parent.parent)

    for i in range(KILLS + 1):
        kill_at(i, total * i / (KILLS - 1) if i < KILLS else 3 * total)
    late = 3 * total
    while "state" not in seen and late < 60:  # a loaded machine ran it slower than measured: later still
        late *= 2
        kill_at(sum(seen.values()), late)
    assert set(seen) == {"state", "file"}, f"the kills never fell on both sides of the commit: {seen}"


@pytest.mark.parametrize("point", ["committed", "renamed"])
def test_checkpoints_import_of_two_exports_killed_between_them_moves_the_second_and_leaves_the_first(
        pipelines: Callable[..., Pipeline], point: str) -> None:
    """Killed at the first export's ``point`` (its position committed; its file renamed or
    not yet): the first is in the state, the second still in its file, untouched; the
    re-run moves the second and leaves the first's row as it was (its commit time, its one
    audit row)."""
    pipeline = pipelines("two", two=True)
    proc = run_killed_at(point, *pipeline.args, "checkpoints", "import")
    assert proc.returncode == -signal.SIGKILL, f"not killed at {point}: {describe(proc)}"
    where = f"import of two killed at the first's {point}"
    assert _one_place(pipeline, "order_events", where) == "state"
    assert _one_place(pipeline, "audit_events", where) == "file"
    assert pipeline.kept("audit_events") == [], where
    first = pipeline.row("order_events")
    kept = [(p.name, p.read_bytes()) for p in pipeline.kept("order_events")]
    _converged(pipeline, "import", where)
    assert pipeline.row("order_events") == first, f"{where}: the re-run rewrote the first's row"
    if point == "renamed":
        assert [(p.name, p.read_bytes()) for p in pipeline.kept("order_events")] == kept, where


# --------------------------------------------------------------------------------------
# What a move decides, it decides under the run lease
# --------------------------------------------------------------------------------------

def _moved_with(pipeline: Pipeline, direction: str, step: str, meanwhile: Callable[[], None]) -> Any:
    """``checkpoints DIRECTION`` run in this process (the CLI's operation, the state of
    ``pipeline``) that calls ``meanwhile`` at its step ``step``; its result."""
    from statetool.operations.context import Context
    from statetool.operations.positions import export_positions, import_positions

    ctx = Context(pipeline.config, pipeline.url, {}, 0.0, f"statetool checkpoints {direction}",
                  on_step=lambda name: meanwhile() if name == step else None)
    return (import_positions if direction == "import" else export_positions)(ctx)


@pytest.mark.parametrize("before", ["fresh", "killed before the rename"])
def test_an_export_while_an_import_is_between_its_commit_and_its_rename_waits_and_the_position_is_never_lost(
        pipelines: Callable[..., Pipeline], before: str) -> None:
    """The rename of the imported file is the import's last step under the run lease: an
    export between the commit and the rename (which would write the file back and remove
    the row, then see the import rename it away: no position anywhere, a first run) is
    refused as a run in progress; the import ends with the position in the state."""
    pipeline = pipelines("race")
    if before != "fresh":
        proc = run_killed_at("committed", *pipeline.args, "checkpoints", "import")
        assert proc.returncode == -signal.SIGKILL, describe(proc)
    tried: list[subprocess.CompletedProcess[str]] = []

    def export_now() -> None:
        tried.append(run_cli_forked(*pipeline.args, "--lock-wait", "0", "--json-errors", "checkpoints", "export"))

    result = _moved_with(pipeline, "import", "committed", export_now)
    (refused,) = tried
    assert refused.returncode == 2 and error_object(refused)["code"] == "RIVET_STATE_RUN_IN_PROGRESS", \
        describe(refused)
    assert [m.export for m in result.moved] == ["order_events"], result
    _imported_once(pipeline, "order_events", f"{before}, an export tried before the rename")


def _commit_while_waited_for(pipeline: Pipeline, direction: str, value: object) -> subprocess.CompletedProcess[str]:
    """A run of ``order_events`` holds its lease (in this process) while ``checkpoints
    DIRECTION`` (a forked CLI, ``--lock-wait 60``) has planned and waits for it, and commits
    ``value`` before it ends; the command's outcome."""
    store = pipeline.store()
    with store.run("order_events", "cdc") as run:
        move = fork_cli(*pipeline.args, "--lock-wait", "60", "--json", "checkpoints", direction, env=process_env())
        assert move.stderr is not None
        said = []
        while not said or "waiting" not in said[-1] and said[-1]:  # its log line once it waits (or its end)
            said.append(move.stderr.readline())
        assert "chunk-run:order_events" in said[-1], said
        run.commit_position(value)
    out, err = move.communicate(120)
    return subprocess.CompletedProcess(move.args, move.wait(), out, err)


def test_a_position_a_run_commits_while_an_import_waits_for_its_lease_is_kept_and_the_file_left(
        pipelines: Callable[..., Pipeline]) -> None:
    """The import read the file and saw no position in the state, then waited for the run
    lease; the run committed a newer position meanwhile. Under the lease the import finds
    the state holding another position and skips the export: the run's position stays,
    the stale file is not renamed."""
    pipeline = pipelines("run-then-import")
    newer = {"file": "mysql-bin.000043", "pos": 4}
    proc = _commit_while_waited_for(pipeline, "import", newer)
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    assert doc["moved"] == [] and [s["export"] for s in doc["skipped"]] == ["order_events"], doc
    with pipeline.store().run("order_events", "cdc") as run:
        assert run.read_position() == newer, "the import wrote the file's older position over the run's"
    assert pipeline.checkpoint("order_events").read_text() == ORIGINAL and pipeline.kept("order_events") == []
    assert pipeline.audited("checkpoints.import", "order_events") == 0


def test_a_position_a_run_commits_while_an_export_waits_for_its_lease_is_the_one_written_to_the_file(
        pipelines: Callable[..., Pipeline]) -> None:
    """The export read the state's position, then waited for the run lease; the run
    committed a newer one meanwhile. Under the lease the export writes the state's position
    as it is then: the file holds the run's position, never the one read before."""
    pipeline = _imported(pipelines("run-then-export"))
    newer = {"file": "mysql-bin.000043", "pos": 4}
    proc = _commit_while_waited_for(pipeline, "export", newer)
    assert proc.returncode == 0, describe(proc)
    assert [m["position"] for m in json.loads(proc.stdout)["moved"]] == [newer], describe(proc)
    assert json.loads(pipeline.checkpoint("order_events").read_text()) == newer
    assert pipeline.row("order_events") is None
    with pipeline.store().run("order_events", "cdc") as run:
        assert run.read_position() == newer, "the export wrote the position it read before the run's"
