"""Output for people (issue 12 items 1-5): what an operator reads at 80 and 120 columns and
in a log (no terminal, no ``COLUMNS``).

Each command runs in-process on a real state, once with ``--json`` and once per width.
The checks are general, not one string: every word of the JSON document that the human
output shows (codes, export names, lease keys, paths, modes, revisions) stands whole on
one line; every registered code shown is whole; the lines to copy (``RIVET_STATE_URL=...``,
doctor's "every task must share") are lines of their own, exactly; no line ends in
spaces; a line past the width is only a long word that no break could fit, or an action
(what to run next, never wrapped); no age is
given in raw or fractional seconds, and no time of the JSON with its microseconds; a
state-wide finding is printed once. docs/decisions.md "Output for people" has the rules.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import textwrap
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from support import CliRun, describe, fork_code, process_env, run_cli, write_config
from statetool.errors import REGISTRY, WARNINGS, StateError
from statetool.example import build_legacy_state
from statetool.location import STATE_FILE
from statetool import render
from statetool.render import ago, duration, terminal_width, timestamp
from statetool.runtime import StateStore

#: The widths every command is read at: a narrow terminal, a wide one, and a log.
WIDTHS = [pytest.param(80, id="80-columns"), pytest.param(120, id="120-columns"),
          pytest.param(None, id="no-terminal")]
#: Names long enough that a careless table breaks them at 80 columns (YAML's flow style).
EXPORTS = "exports: " + json.dumps([
    {"name": "orders", "mode": "incremental"}, {"name": "order_lines_by_warehouse_region", "mode": "chunked"},
    {"name": "customer_addresses_history", "mode": "full"},
    {"name": "order_events", "mode": "cdc", "cdc": {"engine": "mysql", "checkpoint": "checkpoints/order_events.json"}}])
CURSOR = "2026-10-31T23:59:59Z"
#: When the state's runs ran: hours ago, so every age is one a person reads in hours.
STARTED = (datetime.now(UTC) - timedelta(hours=5)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
FINISHED = (datetime.now(UTC) - timedelta(hours=4)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
#: Takes the run lease of ``orders`` and dies holding it: the lease is left stale.
DIE_HOLDING = textwrap.dedent("""\
    import os, sys
    from statetool.runtime import StateStore
    run = StateStore.open(sys.argv[1], env={}).run("orders", "incremental")
    run.__enter__()
    os._exit(0)
    """)


# -- the checks ------------------------------------------------------------------------------


def _strings(value: Any, key: str = "") -> Iterator[tuple[str, str]]:
    """Every string of a JSON ``value`` with the key it stands under ("" in a list's top)."""
    if isinstance(value, str):
        yield key, value
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from _strings(item, name)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item, key)


def words(doc: dict[str, Any]) -> set[str]:
    """Every word of every string of ``doc``, without the punctuation around it."""
    return {w.strip("'\"()[]{},;:.") for _, text in _strings(doc) for w in text.split()} - {""}


def assert_readable(human: CliRun, doc: dict[str, Any], width: int | None) -> None:
    """The rules every human output keeps, whatever the command (module docstring)."""
    text = human.stdout + human.stderr
    lines = text.splitlines()
    squashed = "".join(text.split())  # what the output says, wherever its lines broke
    codes = {code for code in (*REGISTRY, *WARNINGS) if code in squashed}
    for word in words(doc) | codes:
        if len(word) > 3 and word in squashed:
            assert any(word in line for line in lines), f"{word!r} is broken across lines:\n{describe(human)}"
    for line in lines:
        assert line == line.rstrip(), f"a line ends in spaces: {line!r}\n{describe(human)}"
    if width is not None:
        actions = tuple(text for key, text in _strings(doc) if key == "action")  # what to run next: whole
        for line in human.stdout.splitlines():
            if len(line) > width and not (actions and line.endswith(actions)):
                last = line.split()[-1]
                assert len(line) - len(last) <= width and len(last) >= 20, \
                    f"a line is wider than {width} columns without need: {line!r}\n{describe(human)}"
    assert not re.search(r"\b\d+\.\d+ ?s\b|\b\d{3,} s\b", text), f"an age in raw seconds:\n{describe(human)}"
    for key, when in _strings(doc):
        if key.endswith("_at") and re.search(r":\d\d\.\d+", when):
            assert when not in text, f"a time with microseconds: {when}\n{describe(human)}"


def read(config: Path, *args: str, width: int | None, env: dict[str, str] | None = None
         ) -> tuple[CliRun, dict[str, Any]]:
    """``statetool ARGS`` with ``--json`` and for people at ``width``; the same exit code."""
    machine = run_cli("-c", str(config), "--json", *args, env=env)
    doc = json.loads(machine.stdout)
    human = run_cli("-c", str(config), *args, env=env, columns=width)
    assert human.returncode == machine.returncode, describe(human)
    return human, doc


# -- the states ----------------------------------------------------------------------------


def record_progress(store: StateStore) -> None:
    """A cursor, an interrupted chunked run, a full run and a CDC run, hours ago."""
    with store.transaction() as tx:
        run = tx.start_run("orders", "incremental", started_at=STARTED)
        tx.commit_cursor("orders", "incremental", CURSOR, at=FINISHED)
        tx.finish_run(run, "succeeded", rows=120, files=1, finished_at=FINISHED)
        run = tx.start_run("order_lines_by_warehouse_region", "chunked", started_at=STARTED)
        tx.record_chunk("order_lines_by_warehouse_region", run, 0, "0", "100000", "done", rows=100000)
        tx.record_chunk("order_lines_by_warehouse_region", run, 1, "100000", "200000", "pending")
        run = tx.start_run("customer_addresses_history", "full", started_at=STARTED)
        tx.finish_run(run, "failed", error="the source closed the connection while reading a large page of "
                      "customer_addresses_history (server closed the connection unexpectedly)", finished_at=FINISHED)
        run = tx.start_run("order_events", "cdc", started_at=STARTED)
        tx.finish_run(run, "succeeded", rows=7, finished_at=FINISHED)


def checkpoint_file(directory: Path) -> None:
    path = directory / "checkpoints" / "order_events.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"file": "mysql-bin.000042", "pos": 91234}))


@pytest.fixture(scope="module")
def sqlite_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A state beside its config with progress for every export, a stale run lease, and a
    stray ``-shm`` beside it (``RIVET_STATE_ORPHAN_WAL``: about the state, not an export)."""
    config = write_config(tmp_path_factory.mktemp("rendering") / "pipeline", exports=EXPORTS)
    record_progress(StateStore.open(config, env={}, create=True))
    checkpoint_file(config.parent)
    holder = fork_code(DIE_HOLDING, str(config), env=process_env())
    assert holder.wait(timeout=60) == 0
    Path(f"{config.parent / STATE_FILE}-shm").write_bytes(b"\0" * 32768)
    return config


READS = {"info": ("info",), "check": ("check",), "doctor": ("doctor",), "leases": ("leases",),
         "checkpoints": ("checkpoints",), "exports list": ("exports", "list"),
         "exports show": ("exports", "show", "order_lines_by_warehouse_region")}


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("command", READS)
def test_read_commands_keep_every_word_whole(sqlite_state: Path, command: str, width: int | None) -> None:
    human, doc = read(sqlite_state, *READS[command], width=width)
    assert_readable(human, doc, width)
    shown = human.stdout + human.stderr
    for name in ("orders", "order_lines_by_warehouse_region", "customer_addresses_history", "order_events"):
        if command in ("info", "doctor", "exports list"):
            assert name in shown, describe(human)
    if command == "doctor":
        assert doc["state"]["every_task_must_share"] in human.stdout.splitlines(), describe(human)


@pytest.mark.parametrize("width", WIDTHS)
def test_a_state_wide_finding_is_printed_once(sqlite_state: Path, width: int | None) -> None:
    human, doc = read(sqlite_state, "doctor", width=width)
    assert "RIVET_STATE_ORPHAN_WAL" in [r["code"] for r in doc["state"]["reasons"]]
    for reason in doc["state"]["reasons"]:  # every export carries it in --json; people read it once
        assert all(reason in e["reasons"] for e in doc["exports"])
        assert human.stdout.count(reason["code"]) == 1, describe(human)
    human, doc = read(sqlite_state, "check", width=width)
    assert human.stdout.count("RIVET_STATE_ORPHAN_WAL") == 1, describe(human)


def test_sqlite_leases_have_no_heartbeat_or_ttl_column(sqlite_state: Path) -> None:
    human, doc = read(sqlite_state, "leases", width=120)
    rows = {row["key"]: row for row in doc["leases"]}
    assert rows["chunk-run:orders"]["state"] == "stale"
    assert all(row["heartbeat_age"] is None and row["ttl_left"] is None for row in rows.values())
    header = next(line for line in human.stdout.splitlines() if line.startswith("key "))
    assert "heartbeat" not in header and "TTL" not in header, describe(human)
    assert re.search(r"^chunk-run:orders +stale ", human.stdout, re.MULTILINE), describe(human)


def test_ages_and_times_are_what_a_person_reads(sqlite_state: Path) -> None:
    human, _ = read(sqlite_state, "exports", "show", "orders", width=200)
    assert re.search(r"^orders .* 5 h ago ", human.stdout, re.MULTILINE), describe(human)  # the last run
    assert timestamp(STARTED) in human.stdout and STARTED not in human.stdout, describe(human)
    human, _ = read(sqlite_state, "doctor", width=200)
    assert f"resumes from cursor '{CURSOR}' (4 h old)" in human.stdout, describe(human)
    human, _ = read(sqlite_state, "checkpoints", width=200)
    assert re.search(r"\b\d+ s ago\b", human.stdout), describe(human)


#: A time as the state keeps it (microseconds, ``T``, ``Z`` or ``+00:00``): never in prose.
RAW_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+")
#: A time as people read it in a sentence: UTC to the second, one word.
MOMENT = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def test_a_busy_lease_names_its_holders_time_to_the_second(tmp_path: Path, backend: str,
                                                            request: pytest.FixtureRequest) -> None:
    """Issue 12 item 4: the lease-held message gives the holder's start in one format on
    both backends (SQLite kept ``…448002Z``, PostgreSQL ``…570659+00:00``)."""
    config = write_config(tmp_path / "pipeline", exports=EXPORTS)
    url = request.getfixturevalue("pg_url") if backend == "postgresql" else None
    env = {"RIVET_STATE_URL": url} if url else None
    store = StateStore.open(config, state_url=url, env={}, create=True)
    with store.run("orders", "incremental"):
        busy = run_cli("-c", str(config), "--lock-wait", "0", "exports", "set-cursor", "orders", "x", env=env)
    assert busy.returncode == 2 and "RIVET_STATE_RUN_IN_PROGRESS" in busy.stderr, describe(busy)
    assert re.search(rf"as \S+ since {MOMENT}: ", busy.stderr), describe(busy)
    assert not RAW_TIME.search(busy.stderr) and "+00:00" not in busy.stderr, describe(busy)


def test_moves_and_finished_runs_are_said_to_the_second(tmp_path: Path) -> None:
    """Issue 12 item 4: ``RIVET_STATE_RELOCATED``'s "on …" and doctor's "resumes from the
    run finished at …" give the time to the second (--json keeps the exact value)."""
    config = write_config(tmp_path / "pipeline", exports=EXPORTS)
    store = StateStore.open(config, env={}, create=True)
    with store.transaction() as tx:  # a finished run and no cursor: doctor resumes from the run
        tx.finish_run(tx.start_run("orders", "incremental", started_at=STARTED), "succeeded", rows=1,
                      finished_at=FINISHED)
    human = run_cli("-c", str(config), "doctor", "--export", "orders")
    assert re.search(rf"^orders \(incremental\): resumes from the run finished at {MOMENT} \(4 h old\)$",
                     human.stdout, re.M), describe(human)
    orders = json.loads(run_cli("-c", str(config), "--json", "doctor", "--export", "orders").stdout)["exports"][0]
    assert orders["resumes_from"] == f"the run finished at {orders['resumes_from_at']}", orders  # exact in JSON
    assert orders["resumes_from_at"] == FINISHED, orders
    target = tmp_path / "declared"
    target.mkdir()
    assert run_cli("-c", str(config), "relocate", "--to", str(target)).returncode == 0
    refused = run_cli("-c", str(config), "info")
    assert refused.returncode == 5 and "RIVET_STATE_RELOCATED" in refused.stderr, describe(refused)
    assert re.search(rf" on {MOMENT} by ", refused.stderr) and not RAW_TIME.search(refused.stderr), describe(refused)


# -- the writes' dry runs: the plan, and the line to copy ------------------------------------


@pytest.mark.parametrize("width", WIDTHS)
def test_migrate_dry_run_plan(tmp_path: Path, width: int | None) -> None:
    config = write_config(tmp_path / "pipeline", exports=EXPORTS)
    build_legacy_state(config.parent / STATE_FILE, [("orders", "incremental"), ("order_events", "cdc")], 40)
    human, doc = read(config, "migrate", "--dry-run", width=width)
    assert human.returncode == 0, describe(human)
    assert_readable(human, doc, width)
    assert all(step["id"] in human.stdout for step in doc["steps"])
    assert "Dry run: nothing was changed" in human.stdout, describe(human)


@pytest.mark.parametrize("width", WIDTHS)
def test_relocate_dry_run_prints_the_url_to_set_whole(tmp_path: Path, width: int | None) -> None:
    config = write_config(tmp_path / "pipeline", exports=EXPORTS)
    record_progress(StateStore.open(config, env={}, create=True))
    checkpoint_file(config.parent)
    target = tmp_path / "a-declared-state-directory-whose-name-is-long-enough-to-pass-80-columns"
    target.mkdir()
    human, doc = read(config, "relocate", "--dry-run", "--to", str(target), width=width)
    assert human.returncode == 0, describe(human)
    assert_readable(human, doc, width)
    assert f"RIVET_STATE_URL=sqlite:{target}" in human.stdout.splitlines(), describe(human)


def pasted(line: str) -> str:
    """What ``RIVET_STATE_URL`` holds in bash after ``export LINE`` is pasted there."""
    proc = subprocess.run(["bash", "-c", f'export {line}\nprintf %s "$RIVET_STATE_URL"'], capture_output=True,
                          text=True, timeout=30, env={"PATH": os.environ["PATH"]})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_setting_to_copy_pastes_into_a_shell(tmp_path: Path, pg_url: str) -> None:
    """Issue 12 item 4: the ``RIVET_STATE_URL=`` lines of ``relocate``, ``transfer`` and
    ``doctor`` are shell-quoted when the value needs it (a space, a ``$``, the ``&`` of a
    socket URL's ``&schema=``) and bare when not, so ``export LINE`` sets exactly the URL."""
    config = write_config(tmp_path / "pipeline", exports=EXPORTS)
    record_progress(StateStore.open(config, env={}, create=True))
    awkward, plain = tmp_path / "state dir $HOME", tmp_path / "state"
    awkward.mkdir()
    plain.mkdir()
    doctor_env = {"RIVET_STATE_URL": f"sqlite:{awkward}"}
    for args, env in ((("relocate", "--dry-run", "--to", str(awkward)), None),
                      (("relocate", "--dry-run", "--to", str(plain)), None),
                      (("transfer", "--dry-run", "--to", pg_url), None), (("doctor",), doctor_env)):
        human, doc = read(config, *args, width=80, env=env)
        url = doc["state_url"] if "state_url" in doc else doc["state"]["every_task_must_share"].partition("=")[2]
        line = next(line for line in human.stdout.splitlines() if line.startswith("RIVET_STATE_URL="))
        assert pasted(line) == url, describe(human)
        assert (line == f"RIVET_STATE_URL={url}") == (url == f"sqlite:{plain}"), describe(human)  # quoted if needed


@pytest.mark.postgres
@pytest.mark.parametrize("width", WIDTHS)
def test_transfer_dry_run_prints_the_url_to_set_whole(tmp_path: Path, pg_url: str, width: int | None) -> None:
    config = write_config(tmp_path / "pipeline", exports=EXPORTS)
    record_progress(StateStore.open(config, env={}, create=True))
    checkpoint_file(config.parent)
    human, doc = read(config, "transfer", "--dry-run", "--to", pg_url, width=width)
    assert human.returncode == 0, describe(human)
    assert_readable(human, doc, width)
    assert f"RIVET_STATE_URL={shlex.quote(doc['state_url'])}" in human.stdout.splitlines(), describe(human)
    # the relative checkpoint's finding once: its paragraph on stdout, not again on stderr
    assert (human.stdout + human.stderr).count("RIVET_STATE_CHECKPOINT_RELATIVE") == 1, describe(human)
    assert "RIVET_STATE_CHECKPOINT_RELATIVE" in human.stdout, describe(human)


@pytest.mark.postgres
def test_postgres_reads_show_heartbeat_and_ttl_as_ages(tmp_path: Path, pg_url: str) -> None:
    config = write_config(tmp_path / "pipeline", exports=EXPORTS)
    env = {"RIVET_STATE_URL": pg_url}
    store = StateStore.open(config, state_url=pg_url, env={}, create=True)
    record_progress(store)
    checkpoint_file(config.parent)
    with store.run("orders", "incremental"):
        for args in (("leases",), ("doctor",), ("check",), ("checkpoints",), ("info",)):
            machine = run_cli("-c", str(config), "--json", *args, env=env)
            doc = json.loads(machine.stdout)
            for width in (80, 120, None):
                human = run_cli("-c", str(config), *args, env=env, columns=width)
                assert human.returncode == machine.returncode, describe(human)
                assert_readable(human, doc, width)
                if args == ("leases",):
                    assert doc["leases"][0]["heartbeat_age"] is not None
                    assert "heartbeat" in human.stdout and "TTL left" in human.stdout, describe(human)
                    assert re.search(r"\b\d+ s ago\b", human.stdout), describe(human)
                else:  # the long warning of a relative checkpoint under PostgreSQL: a paragraph, once
                    assert (human.stdout + human.stderr).count("RIVET_STATE_CHECKPOINT_RELATIVE") == 1, \
                        describe(human)


# -- the writes: what happened, in a sentence --------------------------------------------------


def test_writes_say_what_they_did_in_sentences(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline", exports=EXPORTS)
    lines: dict[str, list[str]] = {}
    for name, args in (("init", ["init"]), ("set-cursor", ["exports", "set-cursor", "orders", "2026-11-01"]),
                       ("reset", ["exports", "reset", "orders"]), ("at head", ["migrate"]),
                       ("adopt", ["identity", "adopt"]),
                       ("rekey", ["identity", "rekey", "--old", "postgresql://db.internal:5432/sales", "--new",
                                  "postgresql://db2.internal:5432/sales", "--reason", "the source moved"])):
        human = run_cli("-c", str(config), *args, columns=80)
        assert human.returncode == 0, describe(human)
        assert_readable(human, {}, 80)
        lines[name] = human.stdout.splitlines()
        assert not any(re.fullmatch(r"\S+ +-", line) for line in lines[name]), describe(human)  # no raw "-" rows
    state = str(config.parent / STATE_FILE)
    assert lines["init"][0].startswith("Created a new, empty state at") and state in " ".join(lines["init"])
    assert lines["at head"] == ["Already at 0006; nothing to do."]
    said = " ".join(lines["set-cursor"])
    assert "from none to '2026-11-01'" in said and "Next run of orders: resumes from cursor '2026-11-01'" in said
    said = " ".join(lines["reset"])
    assert "cursor '2026-11-01' cleared" in said and "Next run of orders: FIRST RUN" in said
    for name in ("set-cursor", "reset"):  # the backup's path, whole on a line, to copy
        assert any(line.startswith(f"{state}.backup-{name}-orders-") for line in lines[name]), lines[name]
    assert " ".join(lines["adopt"]) == "Nothing was changed: the state already records " \
                                       "postgresql://db.internal:5432/sales."
    assert "re-keyed from postgresql://db.internal:5432/sales to" in " ".join(lines["rekey"]).lower()


def _doctor_says(config: Path, name: str) -> str:
    """The words ``doctor`` gives export ``name``'s next run, after ``name (mode): ``."""
    proc = run_cli("-c", str(config), "doctor", "--export", name, columns=None)
    line = next(line for line in proc.stdout.splitlines() if line.startswith(f"{name} ("))
    return line.split("): ", 1)[1]


#: An age in seconds as doctor says it of what a run resumes from: ``(0 s old)``.
_AGE = re.compile(r"\(\d+ s old\)")


def test_a_cursor_change_says_of_the_next_run_what_doctor_says(tmp_path: Path) -> None:
    """Issue 12 item 3: the next run after ``set-cursor``/``reset`` in doctor's words for
    the export's mode: a CDC export reset resumes from its stream position, a full export
    reads everything whatever its cursor, a chunked export with only a cursor resumes
    from it (not a bare "resumes")."""
    config = write_config(tmp_path / "pipeline", exports=EXPORTS)
    record_progress(StateStore.open(config, env={}, create=True))
    checkpoint_file(config.parent)
    fresh = write_config(tmp_path / "fresh", exports=EXPORTS)
    assert run_cli("-c", str(fresh), "init").returncode == 0
    for where, args, expected in (
            (config, ("reset", "order_events"), "resumes from CDC position"),
            (config, ("set-cursor", "customer_addresses_history", "bar"), "resumes from a full read"),
            (fresh, ("set-cursor", "order_lines_by_warehouse_region", "5"), "resumes from cursor '5'")):
        human = run_cli("-c", str(where), "exports", *args, columns=None)
        assert human.returncode == 0, describe(human)
        said = next(line for line in human.stdout.splitlines() if line.startswith("Next run of "))
        # the age of what it resumes from may have ticked a second between the two commands
        assert _AGE.sub("(old)", said) == _AGE.sub("(old)", f"Next run of {args[1]}: {_doctor_says(where, args[1])}."), \
            describe(human)
        assert expected in said, describe(human)
        doc = json.loads(run_cli("-c", str(where), "--json", "exports", *args).stdout)
        assert doc["diagnosis"]["name"] == args[1] and doc["diagnosis"]["verdict"] == "resumes", doc


def test_a_rekey_to_the_same_key_says_nothing_changed_and_writes_nothing(tmp_path: Path) -> None:
    """Issue 12: ``identity rekey --old X --new X`` is no change: it says so, exits 0, and
    writes no byte (no audit row, no backup); a wrong ``--old`` is still refused."""
    config = write_config(tmp_path / "pipeline", exports=EXPORTS)
    assert run_cli("-c", str(config), "init").returncode == 0
    key = "postgresql://db.internal:5432/sales"
    state = config.parent / STATE_FILE
    before = sorted(p.name for p in config.parent.iterdir()), state.read_bytes()
    same = run_cli("-c", str(config), "identity", "rekey", "--old", key, "--new", key)
    assert same.returncode == 0, describe(same)
    assert same.stdout.splitlines() == [f"Nothing was changed: the state already records {key}."], describe(same)
    assert (sorted(p.name for p in config.parent.iterdir()), state.read_bytes()) == before
    doc = json.loads(run_cli("-c", str(config), "--json", "identity", "rekey", "--old", key, "--new", key).stdout)
    assert doc["changed"] is False and doc["recorded"] == key, doc
    wrong = run_cli("-c", str(config), "identity", "rekey", "--old", "mysql://x:3306/y", "--new", "mysql://x:3306/y")
    assert wrong.returncode != 0 and "RIVET_STATE_IDENTITY_MISMATCH" in wrong.stderr, describe(wrong)


@pytest.mark.postgres
def test_init_and_check_on_postgresql_say_it_in_plain_sentences(tmp_path: Path, pg_url: str) -> None:
    """Issue 12: ``init`` on PostgreSQL names the schema and the revision without doubled
    parentheses, and ``check`` after a transfer no longer says "no relocation or transfer
    recorded" (false there): it says what the open proved."""
    fresh = write_config(tmp_path / "fresh", exports=EXPORTS)
    init = run_cli("-c", str(fresh), "init", env={"RIVET_STATE_URL": pg_url})
    assert init.returncode == 0, describe(init)
    assert ") (" not in init.stdout and ", at revision 0006." in init.stdout, describe(init)
    config = write_config(tmp_path / "pipeline", exports=EXPORTS)
    record_progress(StateStore.open(config, env={}, create=True))
    target = pg_url.replace(pg_url.rsplit("schema=", 1)[1], pg_url.rsplit("schema=", 1)[1] + "_moved")
    assert run_cli("-c", str(config), "transfer", "--to", target).returncode == 0
    check = run_cli("-c", str(config), "check", env={"RIVET_STATE_URL": target}, columns=None)
    row = next(line for line in check.stdout.splitlines() if line.startswith("relocated "))
    assert "no relocation or transfer recorded" not in row, describe(check)
    assert row.endswith("in use at this place (not moved away)"), describe(check)


def test_leases_release_names_the_holder_it_removed(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline", exports=EXPORTS)
    record_progress(StateStore.open(config, env={}, create=True))
    holder = fork_code(DIE_HOLDING, str(config), env=process_env())
    assert holder.wait(timeout=60) == 0
    human = run_cli("-c", str(config), "leases", "release", "chunk-run:orders", "--reason", "worker rebooted",
                    columns=80)
    assert human.returncode == 0, describe(human)
    assert_readable(human, {}, 80)
    said = " ".join(human.stdout.split())
    assert f"Released lease chunk-run:orders, last held by pid {holder.pid}" in said, describe(human)
    assert "(reason: worker rebooted)" in said and "Released: released" not in said
    again = run_cli("-c", str(config), "leases", "release", "chunk-run:orders")
    assert again.stdout == "Lease chunk-run:orders was already free: nothing was changed.\n", describe(again)


def test_relocate_says_where_the_old_bytes_are_and_what_to_set(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline", exports=EXPORTS)
    record_progress(StateStore.open(config, env={}, create=True))
    checkpoint_file(config.parent)
    target = tmp_path / "declared"
    human = run_cli("-c", str(config), "relocate", "--to", str(target), "--create-dir", columns=80)
    assert human.returncode == 0, describe(human)
    assert_readable(human, {}, 80)
    out = human.stdout.splitlines()
    assert f"RIVET_STATE_URL=sqlite:{target}" in out and out[0].startswith("Relocated"), describe(human)
    assert any(line.startswith(f"{config.parent / STATE_FILE}.relocated-") for line in out), describe(human)
    again = run_cli("-c", str(config), "relocate", "--to", str(target), columns=80)
    assert " ".join(again.stdout.split()).startswith(f"Already relocated to {target / STATE_FILE}: nothing to move.")
    assert f"RIVET_STATE_URL=sqlite:{target}" in again.stdout.splitlines(), describe(again)


# -- the pieces ------------------------------------------------------------------------------


@pytest.mark.parametrize(("seconds", "said"), [
    (0, "0 s"), (0.4, "0 s"), (59.9, "59 s"), (60, "1 min"), (3599, "59 min"), (3600, "1 h"), (86399, "23 h"),
    (86400, "1 day"), (2 * 86400, "2 days"), (45 * 86400 - 1, "44 days"), (45 * 86400, "1 month"),
    (364 * 86400, "12 months"), (365 * 86400, "1 year"), (3 * 365 * 86400, "3 years"), (28761265, "11 months"),
    (-90, "1 min")])
def test_duration_at_its_boundaries(seconds: float, said: str) -> None:
    assert duration(seconds) == said


def test_ago_and_timestamp() -> None:
    assert (ago(23.25), ago(-5), ago(None)) == ("23 s ago", "in 5 s", "-")
    assert timestamp("2026-01-04T11:15:00.123456Z") == "2026-01-04 11:15:00Z"
    assert timestamp("2026-01-04T12:15:00.5+01:00") == "2026-01-04 11:15:00Z"
    assert (timestamp(None), timestamp("not a time")) == ("-", "not a time")


def test_wrap_gives_textwraps_lines_also_where_it_skips_textwrap() -> None:
    """A line that fits is taken as it is, without textwrap (issue 13): on any text, width
    and indent, :func:`render.wrap` gives what textwrap gives, tabs, carriage returns, a
    trailing space or a Unicode space at the end included."""
    import random

    def reference(text: str, width: int, first: str, rest: str) -> list[str]:
        lines: list[str] = []
        for n, part in enumerate(text.split("\n")):
            lead = first if n == 0 else rest
            lines += textwrap.wrap(part, max(width, len(lead) + 20, len(rest) + 20), initial_indent=lead,
                                   subsequent_indent=rest, break_long_words=False, break_on_hyphens=False) or [lead]
        return lines

    pieces = ["word", "a", "export_0001", "-", " ", "  ", "\t", "\r", "\x0b", "\x0c", "\xa0", "\u3000", "\n", "é", "漢字"]
    rng = random.Random(13)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 40)))
        width, first, rest = rng.choice([20, 30, 60, 100]), rng.choice(["", "  ", "- x: "]), rng.choice(["", "    "])
        assert render.wrap(text, width, first, rest) == reference(text, width, first, rest), (text, width, first)


def test_no_line_of_a_page_ends_in_spaces_whether_or_not_colour_codes_close_it() -> None:
    """A page without colour codes is stripped line by line, not by the pattern (issue
    13): both give the same text, trailing spaces and tabs gone, closing codes kept."""
    import random

    rng = random.Random(13)
    pieces = ["a", "b c", " ", "\t", "\n", "\r", "\x1b[1m", "\x1b[0m", "\x1b[31;1m", "[1m"]
    for _ in range(5000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 24)))
        for page in (text, text.replace("\x1b", "")):
            expected = render._TRAILING.sub(lambda m: "".join(render._SGR.findall(m.group())), page)
            assert render._unpadded(page) == expected, repr(page)
    assert render._unpadded("a  \n\tb\t\n c \x1b[0m \n") == "a\n\tb\n c\x1b[0m\n"


def test_visible_escapes_exactly_the_control_and_invisible_characters() -> None:
    """Printable text is returned as it is, without a translation (issue 13); every other
    text has each control and invisible format character escaped, in dicts and lists too."""
    import random

    alphabet = ["a", " ", "\n", "\t", "\x1b", "\x7f", "\x85", "\xa0", "\xad", "\u200b", "\u202e", "\ufeff", "é", "\r"]
    rng = random.Random(13)
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12)))
        assert render.visible(text) == text.translate(render._ESCAPES), repr(text)
        assert render.visible({"k": [text, None, 3]}) == {"k": [text.translate(render._ESCAPES), None, 3]}
    assert render.visible("order_events \u2014 é") == "order_events \u2014 é"
    assert render.visible("a\x1b[2Jb\u202e") == "a\\x1b[2Jb\\u202e"


def test_the_width_is_columns_else_the_terminal_else_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "97")
    assert terminal_width() == 97
    for unusable in ("", "0", "wide"):
        monkeypatch.setenv("COLUMNS", unusable)
        assert terminal_width() is None  # pytest's stdout is captured: no terminal
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as tty:
            monkeypatch.setattr("sys.stdout", tty)
            monkeypatch.delenv("COLUMNS")
            subprocess.run(["stty", "cols", "101"], stdin=slave, check=True)
            assert terminal_width() == 101
    finally:
        os.close(master)
        os.close(slave)


@pytest.mark.parametrize(("where", "no_color"), [("terminal", False), ("terminal", True), ("pipe", False)])
def test_colour_only_on_a_terminal_unless_no_color(monkeypatch: pytest.MonkeyPatch, where: str, no_color: bool
                                                   ) -> None:
    doc = {"ok": False, "checks": [{"id": "integrity", "status": "fail", "code": "RIVET_STATE_CORRUPT",
                                    "message": "quick_check: page 3 is never used", "action": "restore a backup"}]}
    for name, value in (("TERM", "xterm-256color"), ("COLUMNS", "80"), ("NO_COLOR", "1" if no_color else None),
                        ("FORCE_COLOR", None), ("COLORTERM", None), ("TTY_COMPATIBLE", None)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    reader, writer = os.openpty() if where == "terminal" else os.pipe()
    try:
        with open(writer, "w", closefd=False) as stdout:
            monkeypatch.setattr("sys.stdout", stdout)
            render.check(doc)
            stdout.flush()
        shown = os.read(reader, 1 << 16).decode()
    finally:
        os.close(reader)
        os.close(writer)
    colours = [p for codes in re.findall(r"\x1b\[([0-9;]*)m", shown) for p in codes.split(";")
               if p and (30 <= int(p) <= 49 or 90 <= int(p) <= 107)]  # NO_COLOR keeps bold, drops colour
    assert bool(colours) is (where == "terminal" and not no_color), repr(shown)
    assert where == "terminal" or "\x1b" not in shown, repr(shown)
    plain = re.sub(r"\x1b\[[0-9;]*m", "", shown)
    assert "RIVET_STATE_CORRUPT" in plain and "Try (integrity): restore a backup" in plain, repr(shown)
    for line in shown.replace("\r\n", "\n").splitlines():  # not even before the codes that end a line
        assert not re.sub(r"(\x1b\[[0-9;]*m)+$", "", line).endswith(" "), repr(line)


@pytest.mark.parametrize("where", ["terminal", "pipe"])
def test_errors_and_warnings_on_a_narrow_terminal_wrap_at_spaces_and_keep_the_try_line_whole(
        monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """At 80 columns a long message is wrapped at spaces under its first line (the terminal
    would break it mid-word), the code stays whole on the first line and the ``Try:`` line,
    which often holds a command to copy, is never wrapped; not on a terminal each is one line."""
    message = ("the checkpoint file /srv/pipelines/sales/checkpoints/order_events.json named by the "
               "state is missing, so the next run of order_events would re-anchor its stream " * 3).strip()
    error = StateError("RIVET_STATE_CHECKPOINT_MISSING", message)
    warning = {"code": "RIVET_STATE_ORPHAN_WAL", "message": message, "action": "x " * 60 + "end"}
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
    reader, writer = os.openpty() if where == "terminal" else os.pipe()
    try:
        if where == "terminal":
            subprocess.run(["stty", "cols", "80"], stdin=writer, check=True)
        with open(writer, "w", closefd=False) as stderr:
            monkeypatch.setattr("sys.stderr", stderr)
            render.print_error(error)
            render.print_warnings([warning])
            stderr.flush()
        os.close(writer)
        writer = -1
        shown = re.sub(r"\x1b\[[0-9;]*m", "", _read_all(reader).replace("\r\n", "\n"))
    finally:
        os.close(reader)
        if writer >= 0:
            os.close(writer)
    lines = shown.splitlines()
    tries = [n for n, line in enumerate(lines) if line.lstrip().startswith("Try: ")]
    assert len(tries) == 2 and lines[tries[1]] == f"  Try: {warning['action']}", shown
    assert lines[tries[0]] == f"Try: {error.entry.action}", shown
    for label, body in (("Error", lines[:tries[0]]), ("Warning", lines[tries[0] + 1:tries[1]])):
        code = error.code if label == "Error" else warning["code"]
        assert body[0].startswith(f"{label} [{code}]: "), shown
        assert " ".join(line.strip() for line in body) == f"{label} [{code}]: {message}", shown
        if where == "terminal":
            assert len(body) > 1 and all(len(line) <= 80 for line in body), shown
            assert all(line.startswith("  ") for line in body[1:]), shown
        else:
            assert len(body) == 1, shown


def _read_all(reader: int) -> str:
    """Everything written to the pipe or pty ``reader`` reads from, its writer closed: a pty
    hands it over in pieces, and ends with EIO instead of an empty read."""
    chunks = []
    while True:
        try:
            chunk = os.read(reader, 1 << 16)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()
