"""``statetool transfer`` out of PostgreSQL: into a SQLite file (``--to sqlite:/dir``) and into
another schema (SPEC §9; issue 14 item 6).

Real throughout: the PostgreSQL state is made by the SQLite -> PostgreSQL transfer of a
state built by ``statetool.example``, ``migrate`` and the runtime API (tests/test_transfer.py's
template, with values that need every escape of COPY's text format); the transfers run in the
CLI, the refusals of the old place in a child process (``python -m statetool``), the kills
with SIGKILL at the operation's named steps (tests/support/crash_driver.py). What arrives is
compared row for row with the original file, read independently (sqlite3 and psycopg).
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest

from statetool.errors import StateError
from statetool.runtime import StateStore
from statetool.tables import IN_FLIGHT_REVISION, LEASE_TABLES, RELOCATED_REVISION
from support import describe, error_object, run_cli, run_cli_process, tree_digest
from support.crash_driver import run_killed_at
from test_transfer import admin  # noqa: F401 - the fixture: the server's superuser URL
from test_transfer import (build_template, copy_pipeline, pg_fetch, pg_state, split_transfer_rows, split_url,
                           sqlite_state, with_schema)

pytestmark = pytest.mark.postgres

#: The steps of a transfer out of PostgreSQL, in order (``marked``: the source's marker
#: written, not committed yet; ``retired``: committed).
PG_SOURCE_POINTS = ("digested", "copied", "committed", "marked", "retired", "finished")


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The config of a SQLite state with 400 runs of history (built once; tests copy it)."""
    return build_template(tmp_path_factory.mktemp("both-ways") / "template", 400)


@pytest.fixture(scope="module")
def expected(template: Path) -> dict[str, Any]:
    """Every row of every table of the template (append-only tables' ids left out)."""
    return sqlite_state(template.parent / ".rivet_state.db")


@pytest.fixture
def other_url(admin: str, pg_url: str) -> Iterator[str]:
    """A second fresh schema on the same server, named after ``pg_url``'s (dropped afterwards)."""
    second = f"{split_url(pg_url)[1]}_moved"
    try:
        yield with_schema(admin, second)
    finally:
        pg_fetch(admin, f'DROP SCHEMA IF EXISTS "{second}" CASCADE')


@pytest.fixture
def pg_source(template: Path, tmp_path: Path, pg_url: str) -> Path:
    """A PostgreSQL state at ``pg_url`` holding the template's rows (moved there by the
    SQLite -> PostgreSQL transfer); returns the config (beside the retired file)."""
    cfg = copy_pipeline(template, tmp_path / "pipeline")
    moved = run_cli("-c", str(cfg), "transfer", "--to", pg_url)
    assert moved.returncode == 0, describe(moved)
    return cfg


def _without_transfers(state: dict[str, Any]) -> dict[str, Any]:
    return split_transfer_rows(state)[0]


def _state_rows(admin: str, url: str) -> dict[str, Any]:
    """:func:`pg_state` of the schema of ``url`` without its lease tables (a transfer takes
    its leases there: their fencing tokens stay, a killed holder's rows too)."""
    return {t: rows for t, rows in pg_state(admin, split_url(url)[1]).items() if t not in LEASE_TABLES}


def _retired(admin: str, url: str, expected: dict[str, Any]) -> dict[str, Any]:
    """The old PostgreSQL place after its transfer: every row kept, the version marked, one
    ``retired`` audit row; returns that row's detail."""
    got = _without_transfers(_state_rows(admin, url))
    columns, rows = got.pop("rivet_audit")
    action = columns.index("action")
    retired = [dict(zip(columns, r)) for r in rows if r[action] == "retired"]
    assert len(retired) == 1, retired
    kept = [r for r in rows if r[action] != "retired"]
    assert got.pop("rivet_state_version")[1] == [(RELOCATED_REVISION,)]
    want = {k: v for k, v in expected.items() if k not in ("rivet_audit", "rivet_state_version")}
    assert got == want and kept == expected["rivet_audit"][1], "the old place lost rows"
    return json.loads(retired[0]["detail"])


def _refuses(cfg: Path, url: str, new_url: str) -> None:
    """Every open of the old place refuses RIVET_STATE_RELOCATED naming ``new_url``, in a
    child process; ``init`` there refuses the same; so does the runtime API."""
    for verb in (["info"], ["check"], ["init"], ["leases", "run", "--export", "orders", "--", "true"]):
        proc = run_cli_process("-c", str(cfg), "--state-url", url, "--json-errors", *verb)
        assert proc.returncode == 5, f"{verb}: {describe(proc)}"
        err = error_object(proc)
        assert err["code"] == "RIVET_STATE_RELOCATED", f"{verb}: {err}"
        assert f"RIVET_STATE_URL={new_url}" in unquote(err["message"]), err["message"]
    with pytest.raises(StateError) as raised:
        StateStore.open(cfg, state_url=url, env={}, create=True)
    assert raised.value.code == "RIVET_STATE_RELOCATED"


def test_a_postgresql_state_moves_into_a_sqlite_file_value_for_value_and_the_schema_refuses(
        pg_source: Path, expected: dict[str, Any], admin: str, pg_url: str, tmp_path: Path) -> None:
    target = tmp_path / "back-home"
    target.mkdir()
    proc = run_cli("-c", str(pg_source), "--state-url", pg_url, "--json", "transfer", "--to", f"sqlite:{target}")
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    assert doc["done"] and all(t["verified"] for t in doc["tables"])
    assert {t["table"]: t["rows"] for t in doc["tables"]}["rivet_runs"] == len(expected["rivet_runs"][1])

    arrived = sqlite_state(target / ".rivet_state.db")
    assert len(split_transfer_rows(arrived)[1]) == 2  # SQLite -> PostgreSQL, then back
    assert _without_transfers(arrived) == expected, "the file differs from the original state"
    detail = _retired(admin, pg_url, expected)
    assert detail["state_url"] == f"sqlite:{target}" and detail["how"] == "statetool transfer"

    _refuses(pg_source, pg_url, f"sqlite:{target}")
    there = run_cli_process("-c", str(pg_source), "--json", "info", env={"RIVET_STATE_URL": f"sqlite:{target}"})
    assert there.returncode == 0, describe(there)
    assert sum(e["runs_total"] for e in json.loads(there.stdout)["exports"]) == len(expected["rivet_runs"][1])
    again = run_cli("-c", str(pg_source), "--state-url", pg_url, "--json", "transfer", "--to", f"sqlite:{target}")
    assert again.returncode == 0 and json.loads(again.stdout)["already"], describe(again)


def test_a_postgresql_state_moves_into_another_schema_value_for_value_and_the_old_one_refuses(
        pg_source: Path, expected: dict[str, Any], admin: str, pg_url: str, other_url: str) -> None:
    proc = run_cli("-c", str(pg_source), "--state-url", pg_url, "transfer", "--to", other_url)
    assert proc.returncode == 0, describe(proc)
    arrived = pg_state(admin, split_url(other_url)[1])
    assert len(split_transfer_rows(arrived)[1]) == 2
    assert _without_transfers(arrived) == expected, "the new schema differs from the original state"
    _retired(admin, pg_url, expected)
    _refuses(pg_source, pg_url, other_url)
    # the old place cannot be a transfer's destination either: it is no empty schema
    back = run_cli("-c", str(pg_source), "--state-url", other_url, "--json-errors", "transfer", "--to", pg_url)
    assert error_object(back)["code"] == "RIVET_STATE_RELOCATED", describe(back)


def test_a_transfer_to_where_the_state_is_or_between_two_files_is_refused(
        pg_source: Path, pg_url: str, tmp_path: Path) -> None:
    same = run_cli("-c", str(pg_source), "--state-url", pg_url, "--json-errors", "transfer", "--to", pg_url)
    assert error_object(same)["code"] == "RIVET_STATE_BACKEND_UNSUPPORTED", describe(same)
    files = run_cli("-c", str(pg_source), "--state-url", f"sqlite:{tmp_path}", "--json-errors", "transfer",
                    "--to", f"sqlite:{tmp_path / 'pipeline'}")
    assert error_object(files)["code"] == "RIVET_STATE_BACKEND_UNSUPPORTED", describe(files)
    assert "relocate" in error_object(files)["message"]


@pytest.mark.parametrize("into", ["sqlite", "postgres"])
def test_dry_run_out_of_postgresql_prints_the_plan_and_changes_nothing(
        into: str, pg_source: Path, admin: str, pg_url: str, other_url: str, tmp_path: Path) -> None:
    target = tmp_path / "dry"
    target.mkdir()
    to = f"sqlite:{target}" if into == "sqlite" else other_url
    before = pg_state(admin, split_url(pg_url)[1])
    proc = run_cli("-c", str(pg_source), "--state-url", pg_url, "--json", "transfer", "--to", to, "--dry-run")
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    assert doc["dry_run"] and not doc["done"] and unquote(doc["state_url"]) == to and doc["size_bytes"] > 0
    assert {t["table"] for t in doc["tables"]} >= {"rivet_runs", "rivet_exports", "rivet_audit"}
    assert pg_state(admin, split_url(pg_url)[1]) == before
    assert tree_digest(target) == {} and list(target.iterdir()) == []
    assert not pg_fetch(admin, "SELECT 1 FROM pg_namespace WHERE nspname = %s", (split_url(other_url)[1],))
    human = run_cli("-c", str(pg_source), "--state-url", pg_url, "transfer", "--to", to, "--dry-run")
    assert human.returncode == 0 and "dry run" in human.stdout, describe(human)


def _destination(admin: str, into: str, to: str, target: Path) -> dict[str, Any]:
    if into == "sqlite":
        path = target / ".rivet_state.db"
        return sqlite_state(path) if path.exists() else {}
    return pg_state(admin, split_url(to)[1])


@pytest.mark.parametrize("point", PG_SOURCE_POINTS)
@pytest.mark.parametrize("into", ["sqlite", "postgres"])
def test_sigkill_out_of_postgresql_leaves_the_source_usable_until_the_switch_and_a_rerun_converges(
        into: str, point: str, pg_source: Path, expected: dict[str, Any], admin: str, pg_url: str, other_url: str,
        tmp_path: Path) -> None:
    target = tmp_path / "killed"
    target.mkdir()
    to = f"sqlite:{target}" if into == "sqlite" else other_url
    source_before = _state_rows(admin, pg_url)

    killed = run_killed_at(point, "-c", str(pg_source), "--state-url", pg_url, "transfer", "--to", to)
    assert killed.returncode == -signal.SIGKILL, describe(killed)

    switched = point in ("retired", "finished")
    got = _destination(admin, into, to, target)
    if point in ("digested", "copied"):
        assert got == {}, "a kill before the commit left rows at the destination"
    else:
        columns, versions = got["rivet_state_version"]
        assert versions == ([(IN_FLIGHT_REVISION,)] if point != "finished" else expected["rivet_state_version"][1])
    if not switched:
        assert _state_rows(admin, pg_url) == source_before, f"the source changed (killed at {point})"
        usable = run_cli_process("-c", str(pg_source), "--state-url", pg_url, "--json", "info")
        assert usable.returncode == 0, describe(usable)
        assert sum(e["runs_total"] for e in json.loads(usable.stdout)["exports"]) == len(expected["rivet_runs"][1])

    rerun = run_cli("-c", str(pg_source), "--state-url", pg_url, "--json", "--json-errors", "transfer", "--to", to)
    assert rerun.returncode == 0, describe(rerun)
    assert json.loads(rerun.stdout)["done"]
    arrived = _destination(admin, into, to, target)
    assert _without_transfers(arrived) == expected
    assert len(split_transfer_rows(arrived)[1]) == 2
    _retired(admin, pg_url, expected)
    refused = run_cli_process("-c", str(pg_source), "--state-url", pg_url, "--json-errors", "info")
    assert error_object(refused)["code"] == "RIVET_STATE_RELOCATED", describe(refused)
    if into == "sqlite":
        assert sorted(p.name for p in target.iterdir() if not p.name.endswith(".tmp")) == [".rivet_state.db"]
