"""Moves with one live place (issue 10, items 1, 7 and 8; SPEC §8a, §9).

The real CLI runs ``relocate`` / ``transfer`` in a subprocess and is SIGKILLed after a sweep
of delays from 0 to past its whole run time (no hook in the code: the kill lands wherever
the process is). After each kill, every place is opened the way a pipeline opens it
(``StateStore.open``): at most one may open. The re-run must then converge: exactly one
place opens (the target), no ``.relocating``, temporary or in-flight file or mark is left.
Plus: the re-run of a completed transfer is "already done"; a symlinked state file is
retired where it really is; a dry run refuses what the real run refuses, and no refusal
leaves a file.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from support import describe, error_object, fork_cli, process_env, run_cli, run_cli_forked, tree_digest, write_config
from statetool.backends.tombstone import read_tombstone
from statetool.backends.tombstone import MAGIC as TOMBSTONE_MAGIC
from statetool.errors import StateError
from statetool.runtime import StateStore
from statetool.schema import IN_FLIGHT_REVISION
from support.states import add_runs

STATE = ".rivet_state.db"
CHECKPOINT = Path("checkpoints") / "order_events.json"
RUNS = 30_000
TRANSFER_RUNS = 10_000
#: Blind kills per sweep: evenly over the measured run time (one more at three times it).
KILLS = 10
#: Seconds between two looks at a trigger or a kill time (well under the shortest phase
#: of a move, a few milliseconds of fsyncs).
POLL = 0.0002


def _open(config: Path, state_url: str | None) -> str:
    """``"live"`` when a pipeline can open the state there, else the refusal's code."""
    try:
        StateStore.open(config, state_url=state_url, env={}, lock_wait=0)
    except StateError as err:
        return err.code
    return "live"


def _build_template(directory: Path, rows: int) -> Path:
    """A pipeline in ``directory`` whose state (init: identity recorded, WAL) holds
    ``rows`` runs and ``rows`` chunks, with a relative CDC checkpoint."""
    config = write_config(directory)
    proc = run_cli("-c", str(config), "init")
    assert proc.returncode == 0, describe(proc)
    add_runs(directory / STATE, rows)
    db = sqlite3.connect(directory / STATE)
    with db:
        db.executemany("INSERT INTO rivet_chunks VALUES ('order_lines', 'r0000001', ?, ?, ?, 'done', 1000, ?)",
                       ((k, str(k * 1000), str((k + 1) * 1000), "2026-01-01T00:00:00Z") for k in range(rows)))
        db.execute("UPDATE rivet_exports SET cursor_value = '2026-06-01' WHERE export_name = 'orders'")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    (directory / CHECKPOINT).parent.mkdir(parents=True)
    (directory / CHECKPOINT).write_text('{"file": "mysql-bin.000042", "pos": 91234}\n')
    return config


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pipeline whose state holds :data:`RUNS` runs and as many chunks: big enough that
    a relocation (a copy of its pages) takes a while."""
    return _build_template(tmp_path_factory.mktemp("moves") / "pipeline", RUNS)


@pytest.fixture(scope="module")
def transfer_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same with :data:`TRANSFER_RUNS` runs and chunks, for the transfer sweep: a
    transfer copies rows, far slower per row than a relocation copies pages, so a third of
    the rows keeps it busy for as many kill points (the sweep's delays follow its measured
    time, and each phase has a trigger of its own)."""
    return _build_template(tmp_path_factory.mktemp("transfers") / "pipeline", TRANSFER_RUNS)


def _copy(template: Path, base: Path) -> Path:
    shutil.copytree(template.parent, base / "pipeline")
    return base / "pipeline" / "rivet.yaml"


def _leftovers(*directories: Path) -> list[str]:
    """Files a move must never leave once it has ended: copies in flight, temporary
    tombstones, a hot journal."""
    return sorted(str(p) for d in directories if d.exists() for p in d.rglob("*")
                  if ".relocating" in p.name or ".tombstone-" in p.name or p.name.endswith((".tmp", "-journal")))


def _timed_run(args: tuple[str, ...]) -> float:
    start = time.monotonic()
    proc = run_cli_forked(*args, timeout=300)
    assert proc.returncode == 0, describe(proc)
    return time.monotonic() - start


Trigger = Callable[[], bool]


def _kill_when(args: tuple[str, ...], trigger: Trigger, delay: float) -> int:
    """Start the CLI (a forked process: :mod:`support.forked`); as soon as ``trigger()``
    holds (polled every :data:`POLL` seconds: a file of the move appeared, a mark was
    committed), wait ``delay`` seconds and SIGKILL it, unless it ended first. Returns its
    exit status.

    The waits sleep rather than spin: a spinning test takes one of the machine's two cores
    from the command it is about to kill and from the other workers of the suite."""
    proc = fork_cli(*args, env=process_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while proc.poll() is None and not trigger() and time.monotonic() < deadline:
        time.sleep(POLL)
    end = time.monotonic() + delay
    while proc.poll() is None and (left := end - time.monotonic()) > 0:
        time.sleep(min(left, POLL))
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    return proc.wait(timeout=120)


def _started() -> bool:
    return True


def _exists(path: Path) -> Trigger:
    return lambda: os.path.lexists(path)


def _any(directory: Path, pattern: str) -> Trigger:
    return lambda: any(True for _ in directory.glob(pattern))


def _tombstoned(path: Path) -> Trigger:
    def check() -> bool:
        try:
            with open(path, "rb") as fh:
                return fh.read(len(TOMBSTONE_MAGIC)) == TOMBSTONE_MAGIC
        except OSError:
            return False
    return check


def _marked(url: str) -> Trigger:
    """The in-flight mark committed in the destination ``url`` (read on the test's own connection)."""
    import psycopg

    libpq, schema = url.rsplit("schema=", 1)
    conn = psycopg.connect(libpq.rstrip("?&"), autocommit=True)

    def check() -> bool:
        try:
            row = conn.execute(f'SELECT version_num FROM "{schema}".rivet_state_version').fetchone()
        except psycopg.errors.UndefinedTable:
            return False
        return row is not None and row[0] == IN_FLIGHT_REVISION
    return check


def _sweep(total: float, events: list[tuple[Callable[[Path], Trigger], tuple[float, ...]]]
           ) -> list[tuple[Callable[[Path], Trigger], float]]:
    """Blind delays evenly over the measured run time, and one at three times it (a run
    that ends first is not killed: the re-run of a completed move), then each step the move
    shows from outside (``events``: a trigger of the pipeline directory's base, and the
    delays after it)."""
    blind = [(lambda _base: _started, total * i / (KILLS - 1)) for i in range(KILLS)] + [
        (lambda _base: _started, 3 * total)]
    return blind + [(event, delay) for event, delays in events for delay in delays]


Make = Callable[[int], tuple[tuple[str, ...], Path, Callable[[], dict[str, str]], Callable[[str], None]]]


def _run_sweep(make: Make, kills: list[tuple[Callable[[Path], Trigger], float]]) -> set[tuple[tuple[str, str], ...]]:
    """For each kill: a fresh copy (``make(i)`` gives the CLI args, the base directory the
    triggers look in, the opener of every place, and the final check), the kill, at most
    one live place, a re-run that converges. Returns the distinct situations the kills left
    (how each place answered an open)."""
    seen: set[tuple[tuple[str, str], ...]] = set()
    failures: list[str] = []
    for i, (event, delay) in enumerate(kills):
        args, base, places, converged = make(i)
        status = _kill_when(args, event(base), delay)
        after_kill = places()
        seen.add(tuple(sorted(after_kill.items())))
        when = f"kill {i} ({delay * 1000:.1f} ms after its trigger, exit {status})"
        if sum(v == "live" for v in after_kill.values()) > 1:
            failures.append(f"{when}: two live places {after_kill}")
        rerun = run_cli(*args, timeout=300)
        if rerun.returncode != 0:
            failures.append(f"{when}: the re-run failed: {describe(rerun)}")
            continue
        try:
            converged(f"{when}, places then {after_kill}")
        except AssertionError as err:
            failures.append(str(err))
    assert not failures, "\n".join(failures)
    return seen


# --------------------------------------------------------------------------------------
# SIGKILL at every instant
# --------------------------------------------------------------------------------------

def test_relocate_killed_at_any_instant_never_has_two_live_places_and_a_rerun_converges(
        tmp_path: Path, template: Path) -> None:
    first = _copy(template, tmp_path / "timing")
    total = _timed_run(("-c", str(first), "relocate", "--to", str(tmp_path / "timing" / "volume"),
                        "--create-dir"))

    def make(i: int) -> tuple[tuple[str, ...], Callable[[], dict[str, str]], Callable[[str], None]]:
        config = _copy(template, tmp_path / f"k{i:02d}")
        target = tmp_path / f"k{i:02d}" / "volume"
        target.mkdir()

        def places() -> dict[str, str]:
            return {"source": _open(config, None), "target": _open(config, f"sqlite:{target}")}

        def converged(when: str) -> None:
            assert places() == {"source": "RIVET_STATE_RELOCATED", "target": "live"}, f"{when}: {places()}"
            tomb = read_tombstone(config.parent / STATE)
            assert tomb is not None and tomb["to"] == str(target / STATE), when
            assert len(list(config.parent.glob(f"{STATE}.relocated-*"))) == 1, f"{when}: kept files"
            assert (target / CHECKPOINT).read_bytes() == (template.parent / CHECKPOINT).read_bytes(), when
            assert _leftovers(config.parent, target) == [], f"{when}: left {_leftovers(config.parent, target)}"
            db = sqlite3.connect(f"file:{target / STATE}?mode=ro", uri=True)
            try:
                assert db.execute("SELECT version_num FROM rivet_state_version").fetchone()[0] != IN_FLIGHT_REVISION
                assert db.execute("SELECT count(*) FROM rivet_runs").fetchone()[0] == RUNS, when
            finally:
                db.close()
            shutil.rmtree(config.parent.parent)

        return ("-c", str(config), "relocate", "--to", str(target)), config.parent.parent, places, converged

    events: list[tuple[Callable[[Path], Trigger], tuple[float, ...]]] = [
        (lambda b: _exists(b / "volume" / f"{STATE}.relocating"), (0.0, 0.05, 0.2)),  # copying
        (lambda b: _exists(b / "volume" / STATE), (0.0, 0.0005, 0.002)),  # linked, in flight
        (lambda b: _any(b / "pipeline", f"{STATE}.relocated-*"), (0.0, 0.0005)),  # kept
        (lambda b: _any(b / "pipeline", f"{STATE}.tombstone-*.tmp"), (0.0,)),  # tombstone written
        (lambda b: _tombstoned(b / "pipeline" / STATE), (0.0, 0.0005, 0.002)),  # swapped, not yet live
    ]
    seen = _run_sweep(make, _sweep(total, events))
    # the kills landed in every phase: before the copy, in flight, retired, and after the end
    assert (("source", "live"), ("target", "RIVET_STATE_MISSING")) in seen, seen
    assert (("source", "live"), ("target", "RIVET_STATE_MOVE_IN_FLIGHT")) in seen, seen
    assert (("source", "RIVET_STATE_RELOCATED"), ("target", "live")) in seen, seen


def test_transfer_killed_at_any_instant_never_has_two_live_places_and_a_rerun_converges(
        tmp_path: Path, transfer_template: Path, pg_schemas: Callable[[], str]) -> None:
    template = transfer_template
    first = _copy(template, tmp_path / "timing")
    total = _timed_run(("-c", str(first), "transfer", "--to", pg_schemas()))

    def make(i: int) -> tuple[tuple[str, ...], Callable[[], dict[str, str]], Callable[[str], None]]:
        config = _copy(template, tmp_path / f"k{i:02d}")
        url = pg_schemas()

        def places() -> dict[str, str]:
            return {"source": _open(config, None), "destination": _open(config, url)}

        def converged(when: str) -> None:
            assert places() == {"source": "RIVET_STATE_RELOCATED", "destination": "live"}, f"{when}: {places()}"
            assert _leftovers(config.parent) == [], f"{when}: left {_leftovers(config.parent)}"
            assert sorted(p.name for p in config.parent.glob(f"{STATE}*") if "relocated-" not in p.name) == [STATE]
            store = StateStore.open(config, state_url=url, env={}, lock_wait=0)
            with store.ctx.backend().reading() as conn:
                assert conn.scalar("SELECT count(*) FROM rivet_runs") == TRANSFER_RUNS, when
                assert conn.scalar("SELECT count(*) FROM rivet_audit WHERE action = 'transfer'") == 1, when
            shutil.rmtree(config.parent.parent)

        urls.append(url)
        return ("-c", str(config), "transfer", "--to", url), config.parent.parent, places, converged

    urls: list[str] = []

    events: list[tuple[Callable[[Path], Trigger], tuple[float, ...]]] = [
        (lambda _b: _marked(urls[-1]), (0.0, 0.0005, 0.002)),  # committed, in flight
        (lambda b: _any(b / "pipeline", f"{STATE}.relocated-*"), (0.0,)),  # kept
        (lambda b: _tombstoned(b / "pipeline" / STATE), (0.0, 0.0005, 0.002)),  # swapped, not yet live
    ]
    seen = _run_sweep(make, _sweep(total, events))
    assert (("destination", "RIVET_STATE_MISSING"), ("source", "live")) in seen, seen
    assert (("destination", "RIVET_STATE_MOVE_IN_FLIGHT"), ("source", "live")) in seen, seen
    assert (("destination", "live"), ("source", "RIVET_STATE_RELOCATED")) in seen, seen


# --------------------------------------------------------------------------------------
# The target of a move refuses every open while it is in flight
# --------------------------------------------------------------------------------------

def test_a_target_in_flight_refuses_statetool_and_the_runtime_naming_the_command_that_finishes(
        tmp_path: Path, template: Path) -> None:
    """A holder of the source file makes relocate wait at its last instant before the
    switch (--lock-wait): the target is then in flight, and refuses; the source is live."""
    config = _copy(template, tmp_path)
    target = tmp_path / "volume"
    target.mkdir()
    move = fork_cli("-c", str(config), "--lock-wait", "60", "relocate", "--to", str(target), "--full-verify",
                    env=process_env())
    holder = None
    try:
        deadline = time.monotonic() + 120
        while not (target / f"{STATE}.relocating").exists() and time.monotonic() < deadline and move.poll() is None:
            time.sleep(0.005)
        assert move.poll() is None, "relocate ended before it began its copy"
        # a reader holding the source open (a POSIX lock, as every SQLite connection),
        # from the copy on: relocate waits for it at its last instant before the switch
        holder = subprocess.Popen([sys.executable, "-c", (
            "import sqlite3, sys, time\n"
            f"db = sqlite3.connect({str(config.parent / STATE)!r})\n"
            "db.execute('BEGIN'); db.execute('SELECT count(*) FROM rivet_exports').fetchone()\n"
            "print('holding', flush=True); time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        while not (target / STATE).exists() and time.monotonic() < deadline and move.poll() is None:
            time.sleep(0.01)
        assert move.poll() is None and (target / STATE).exists(), "relocate did not wait with its copy in place"
        with pytest.raises(StateError) as refused:
            StateStore.open(config, state_url=f"sqlite:{target}", env={}, lock_wait=0)
        assert refused.value.code == "RIVET_STATE_MOVE_IN_FLIGHT"
        assert f"relocate --to {target}" in refused.value.message
        check = run_cli("-c", str(config), "--state-url", f"sqlite:{target}", "--json-errors", "info")
        assert check.returncode == 5, describe(check)
        assert error_object(check)["code"] == "RIVET_STATE_MOVE_IN_FLIGHT"
        assert _open(config, None) == "live"
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    out, err = move.communicate(timeout=120)
    assert move.returncode == 0, f"{out}\n{err}"
    assert _open(config, f"sqlite:{target}") == "live" and _open(config, None) == "RIVET_STATE_RELOCATED"


# --------------------------------------------------------------------------------------
# Re-runs of completed moves
# --------------------------------------------------------------------------------------

def test_the_rerun_of_a_completed_transfer_is_already_done_and_changes_nothing(
        tmp_path: Path, template: Path, pg_schemas: Callable[[], str]) -> None:
    config = _copy(template, tmp_path)
    url = pg_schemas()
    proc = run_cli("-c", str(config), "transfer", "--to", url, timeout=300)
    assert proc.returncode == 0, describe(proc)
    before = tree_digest(config.parent)
    for extra in ((), ("--dry-run",)):
        again = run_cli("-c", str(config), "--json", "transfer", "--to", url, *extra)
        assert again.returncode == 0, describe(again)
        doc = json.loads(again.stdout)
        assert doc["done"] and "already transferred" in doc["message"], doc
        assert tree_digest(config.parent) == before
    human = run_cli("-c", str(config), "relocate", "--to", str(tmp_path / "elsewhere"), "--create-dir")
    assert human.returncode == 5 and "RIVET_STATE_RELOCATED" in human.stderr, describe(human)


# --------------------------------------------------------------------------------------
# A symlinked state file
# --------------------------------------------------------------------------------------

def test_a_symlinked_state_is_relocated_by_retiring_its_real_file(tmp_path: Path, template: Path) -> None:
    config = _copy(template, tmp_path)
    real_dir = tmp_path / "disk"
    real_dir.mkdir()
    real = real_dir / "state.db"
    shutil.move(config.parent / STATE, real)
    (config.parent / STATE).symlink_to(real)
    info = run_cli("-c", str(config), "--json", "info")
    assert info.returncode == 0, describe(info)
    location = json.loads(info.stdout)["location"]
    assert location["path"] == str(config.parent / STATE) and location["real_path"] == str(real)
    human = run_cli("-c", str(config), "info")
    assert str(real) in human.stdout, describe(human)

    target = tmp_path / "volume"
    proc = run_cli("-c", str(config), "relocate", "--to", str(target), "--create-dir", timeout=300)
    assert proc.returncode == 0, describe(proc)
    assert (config.parent / STATE).is_symlink(), "the link is left as it was"
    tomb = read_tombstone(real)
    assert tomb is not None and tomb["to"] == str(target / STATE), "the real file was not tombstoned"
    kept = list(real_dir.glob(f"{STATE}.relocated-*"))
    assert len(kept) == 1 and tomb["kept_as"] == str(kept[0])
    with pytest.raises(sqlite3.DatabaseError):  # every release: not a database, at either name
        sqlite3.connect(real).execute("SELECT * FROM rivet_runs").fetchone()
    assert _open(config, None) == "RIVET_STATE_RELOCATED"
    assert _open(config, f"sqlite:{target}") == "live"
    again = run_cli("-c", str(config), "relocate", "--to", str(target))
    assert again.returncode == 0 and "Already relocated" in again.stdout, describe(again)


@pytest.mark.parametrize("where", ["target copy", "target copy -wal", "source tombstone"])
def test_a_symlink_where_a_file_of_the_move_belongs_is_refused_and_nothing_is_written(
        tmp_path: Path, template: Path, where: str) -> None:
    config = _copy(template, tmp_path)
    target = tmp_path / "volume"
    target.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link = {"target copy": target / f"{STATE}.relocating", "target copy -wal": target / f"{STATE}.relocating-wal",
            "source tombstone": config.parent / f"{STATE}.tombstone-1.tmp"}[where]
    link.symlink_to(victim)
    before = {d: tree_digest(d) for d in (config.parent, target)}
    for extra in (("--dry-run",), ()):
        proc = run_cli("-c", str(config), "--json-errors", "relocate", "--to", str(target), *extra)
        assert proc.returncode == 5, describe(proc)
        err = error_object(proc)
        assert err["code"] == "RIVET_STATE_UNSAFE_FILE" and str(link) in err["message"], err
        assert {d: tree_digest(d) for d in before} == before and link.is_symlink()
        assert victim.read_text() == "precious\n"


def test_a_symlinked_state_whose_real_directory_is_read_only_is_refused_before_any_write(
        tmp_path: Path, template: Path) -> None:
    """The real run is refused ``RIVET_STATE_READ_ONLY`` naming the real file; the dry run,
    which writes nothing, gives its plan with warning ``RIVET_STATE_READ_ONLY_DRY_RUN``
    naming it (docs/decisions.md, "Dry runs on a read-only mount"); neither writes."""
    config = _copy(template, tmp_path)
    real_dir = tmp_path / "disk"
    real_dir.mkdir()
    shutil.move(config.parent / STATE, real_dir / STATE)
    (config.parent / STATE).symlink_to(real_dir / STATE)
    mounted = subprocess.run(["mount", "--bind", "-o", "ro", str(real_dir), str(real_dir)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"SKIPPED LOUDLY: needs mount --bind -o ro (root): {mounted.stderr.strip()}")
    try:
        target = tmp_path / "volume"
        target.mkdir()
        before = {d: tree_digest(d) for d in (config.parent, real_dir, target)}
        plan = run_cli("-c", str(config), "--json", "relocate", "--to", str(target), "--dry-run")
        assert plan.returncode == 0, describe(plan)
        warned = json.loads(plan.stdout)["warnings"]
        assert [w["code"] for w in warned] == ["RIVET_STATE_READ_ONLY_DRY_RUN"], describe(plan)
        assert str(real_dir / STATE) in warned[0]["message"], describe(plan)
        assert {d: tree_digest(d) for d in before} == before
        proc = run_cli("-c", str(config), "--json-errors", "relocate", "--to", str(target))
        assert proc.returncode == 1, describe(proc)
        err = error_object(proc)
        assert err["code"] == "RIVET_STATE_READ_ONLY" and str(real_dir / STATE) in err["message"], err
        assert {d: tree_digest(d) for d in before} == before
    finally:
        subprocess.run(["umount", "-l", str(real_dir)], check=False)


# --------------------------------------------------------------------------------------
# Dry-run parity
# --------------------------------------------------------------------------------------

def test_relocate_dry_run_refuses_a_checkpoint_conflict_as_the_real_run_does_and_neither_leaves_a_file(
        tmp_path: Path, template: Path) -> None:
    config = _copy(template, tmp_path)
    target = tmp_path / "volume"
    (target / CHECKPOINT).parent.mkdir(parents=True)
    (target / CHECKPOINT).write_text('{"file": "mysql-bin.000001", "pos": 4}\n')  # another stream's position
    before = {d: tree_digest(d) for d in (config.parent, target)}
    codes = []
    for extra in (("--dry-run",), ()):
        proc = run_cli("-c", str(config), "--json-errors", "relocate", "--to", str(target), *extra)
        assert proc.returncode == 5, describe(proc)
        err = error_object(proc)
        codes.append((err["code"], err["message"]))
        assert {d: tree_digest(d) for d in before} == before, f"{extra}: a file changed or appeared"
    assert codes[0] == codes[1] and codes[0][0] == "RIVET_STATE_TARGET_NOT_EMPTY", codes
    assert str(target / CHECKPOINT) in codes[0][1]


# --------------------------------------------------------------------------------------
# Killed in flight, then the source is written: the re-run makes the copy again
# --------------------------------------------------------------------------------------

def _kill_in_flight(args: tuple[str, ...], trigger: Callable[[], Trigger], places: Callable[[], dict[str, str]],
                    fresh: Callable[[], None]) -> None:
    """Kill the move right after ``trigger`` fires until a kill leaves the target in flight
    and the source live (a kill may land after the switch: then a fresh copy again)."""
    for _attempt in range(5):
        _kill_when(args, trigger(), 0.0)
        if sorted(places().values()) == ["RIVET_STATE_MOVE_IN_FLIGHT", "live"]:
            return
        fresh()
    pytest.fail(f"no kill left the target in flight: {places()}")


def _write_source(config: Path) -> None:
    store = StateStore.open(config, env={}, lock_wait=0)
    with store.transaction() as tx:
        tx.commit_cursor("orders", "incremental", "2026-12-01-after-the-kill")


def test_relocate_killed_in_flight_then_the_source_written_makes_the_copy_again(
        tmp_path: Path, template: Path) -> None:
    base = tmp_path / "m"
    config, target = base / "pipeline" / "rivet.yaml", base / "volume"

    def fresh() -> None:
        shutil.rmtree(base, ignore_errors=True)
        _copy(template, base)
        target.mkdir()

    def places() -> dict[str, str]:
        return {"source": _open(config, None), "target": _open(config, f"sqlite:{target}")}

    fresh()
    args = ("-c", str(config), "relocate", "--to", str(target))
    _kill_in_flight(args, lambda: _exists(target / STATE), places, fresh)
    _write_source(config)
    proc = run_cli(*args, "--json", timeout=300)
    assert proc.returncode == 0, describe(proc)
    assert places() == {"source": "RIVET_STATE_RELOCATED", "target": "live"}
    db = sqlite3.connect(f"file:{target / STATE}?mode=ro", uri=True)
    try:
        assert db.execute("SELECT cursor_value FROM rivet_exports WHERE export_name = 'orders'").fetchone() == (
            "2026-12-01-after-the-kill",)
        assert db.execute("SELECT count(*) FROM rivet_audit WHERE action = 'relocate'").fetchone() == (1,)
    finally:
        db.close()
    assert _leftovers(config.parent, target) == []


def test_transfer_killed_in_flight_then_the_source_written_makes_the_copy_again(
        tmp_path: Path, template: Path, pg_schemas: Callable[[], str]) -> None:
    base = tmp_path / "m"
    config = base / "pipeline" / "rivet.yaml"
    urls: list[str] = []

    def fresh() -> None:
        shutil.rmtree(base, ignore_errors=True)
        _copy(template, base)
        urls.append(pg_schemas())

    def places() -> dict[str, str]:
        return {"source": _open(config, None), "destination": _open(config, urls[-1])}

    fresh()
    _kill_in_flight(("-c", str(config), "transfer", "--to", urls[-1]), lambda: _marked(urls[-1]), places, fresh)
    _write_source(config)
    proc = run_cli("-c", str(config), "transfer", "--to", urls[-1], timeout=300)
    assert proc.returncode == 0, describe(proc)
    assert places() == {"source": "RIVET_STATE_RELOCATED", "destination": "live"}
    store = StateStore.open(config, state_url=urls[-1], env={}, lock_wait=0)
    with store.ctx.backend().reading() as conn:
        assert conn.scalar("SELECT cursor_value FROM rivet_exports WHERE export_name = 'orders'"
                           ) == "2026-12-01-after-the-kill"
        assert conn.scalar("SELECT count(*) FROM rivet_audit WHERE action = 'transfer'") == 1
    assert _leftovers(config.parent) == []


def test_a_symlinked_state_is_transferred_by_retiring_its_real_file(
        tmp_path: Path, template: Path, pg_schemas: Callable[[], str]) -> None:
    config = _copy(template, tmp_path)
    real_dir = tmp_path / "disk"
    real_dir.mkdir()
    shutil.move(config.parent / STATE, real_dir / STATE)
    (config.parent / STATE).symlink_to(real_dir / STATE)
    url = pg_schemas()
    proc = run_cli("-c", str(config), "transfer", "--to", url, timeout=300)
    assert proc.returncode == 0, describe(proc)
    assert (config.parent / STATE).is_symlink()
    assert read_tombstone(real_dir / STATE) is not None, "the real file was not tombstoned"
    assert len(list(real_dir.glob(f"{STATE}.relocated-*"))) == 1
    assert _open(config, None) == "RIVET_STATE_RELOCATED" and _open(config, url) == "live"
    again = run_cli("-c", str(config), "transfer", "--to", url)
    assert again.returncode == 0 and "Already transferred" in again.stdout, describe(again)
