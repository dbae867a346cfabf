"""A stored position row that holds no position, around the other exports (a fresh user's
re-check of issue 15; SPEC §5a, §6, §7): ``RIVET_STATE_POSITION_INVALID`` (JSON ``null``,
not JSON, nested deeper than 64 levels; written by SQL or an older release) is the verdict
of that export only, never of another; ``exports reset`` of the bad export says its next
run is refused, dry and real alike; ``checkpoints import --export NAME`` is the way out its
action names (the file's valid position replaces the row, under the run lease, audited
with the row's text); ``doctor --json-errors`` reports the process's exit code.

Setup of the finding: two CDC exports (``order_events``, ``ev2``), both positions imported
with ``checkpoints import``, then ``order_events``' row set by raw SQL. Every command runs
as a real process; SQLite and the session's PostgreSQL alike.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from support import describe, error_object, process_env, tree_digest, write_config
from support.backends import StateBackend
from statetool.errors import REGISTRY
from statetool.runtime import StateStore
from test_transfer import admin  # noqa: F401 - the fixture: the server's superuser URL
from test_position_depth import _ok, _run
from test_transfer import pg_fetch, split_url

EXPORTS = """\
exports:
  - {name: order_events, mode: cdc, cdc: {engine: mysql, checkpoint: checkpoints/order_events.json}}
  - {name: ev2, mode: cdc, cdc: {engine: mysql, checkpoint: checkpoints/ev2.json}}
"""
GOOD = {"file": "mysql-bin.000042", "pos": 91234}
EV2 = {"file": "mysql-bin.000007", "pos": 4}
#: The rows of the finding that hold no position.
BAD = ("[" * 600 + "]" * 600, "null")


def _pipeline(backend: StateBackend) -> Path:
    """Both positions written to their files and imported into the state."""
    config = write_config(backend.pipeline, exports=EXPORTS)
    (config.parent / "checkpoints").mkdir()
    StateStore.open(config, env=process_env(backend.env), create=True)
    (config.parent / "checkpoints" / "order_events.json").write_text(json.dumps(GOOD))
    (config.parent / "checkpoints" / "ev2.json").write_text(json.dumps(EV2))
    done = _ok(backend, config, "checkpoints", "import")
    assert sorted(m["export"] for m in done["moved"]) == ["ev2", "order_events"], done
    return config


def _sql(backend: StateBackend, admin_url: str | None, sql: str, params: tuple[str, ...] = ()) -> list[Any]:
    """Run ``sql`` on the state with raw SQL (``{}`` the schema's prefix, ``?`` a parameter): its rows."""
    if backend.kind == "sqlite":
        assert backend.state_dir is not None
        with sqlite3.connect(backend.state_dir / ".rivet_state.db") as conn:
            rows = conn.execute(sql.format(""), params).fetchall()
        conn.close()
        return rows
    assert backend.url is not None and admin_url is not None
    return pg_fetch(admin_url, sql.format(f'"{split_url(backend.url)[1]}".').replace("?", "%s"), params)


def _set_row(backend: StateBackend, admin_url: str | None, text: str) -> None:
    """Set order_events' position row to ``text`` with raw SQL."""
    _sql(backend, admin_url, "UPDATE {}rivet_cdc_positions SET position = ? WHERE export_name = ?",
         (text, "order_events"))
    assert _row(backend, admin_url) == text


def _row(backend: StateBackend, admin_url: str | None) -> str | None:
    rows = _sql(backend, admin_url, "SELECT position FROM {}rivet_cdc_positions WHERE export_name = 'order_events'")
    return str(rows[0][0]) if rows else None


def _last_import_audit(backend: StateBackend, admin_url: str | None) -> str:
    rows = _sql(backend, admin_url,
                "SELECT detail FROM {}rivet_audit WHERE action = 'checkpoints.import' ORDER BY id DESC LIMIT 1")
    return str(rows[0][0])


def _admin(request: pytest.FixtureRequest, backend: StateBackend) -> str | None:
    return request.getfixturevalue("admin") if backend.kind == "postgres" else None


def _bad_pipeline(backend: StateBackend, request: pytest.FixtureRequest, bad: str) -> tuple[Path, str | None]:
    """:func:`_pipeline`, then order_events' row set to ``bad``; the config and the admin URL (PostgreSQL)."""
    config = _pipeline(backend)
    admin_url = _admin(request, backend)
    _set_row(backend, admin_url, bad)
    return config, admin_url


def _read(config: Path, backend: StateBackend, export: str) -> object:
    with StateStore.open(config, env=process_env(backend.env)).run(export, "cdc") as run:
        return run.read_position()


@pytest.mark.parametrize("bad", BAD, ids=("deep", "null"))
def test_one_exports_bad_row_is_that_exports_verdict_only(bad: str, state_backend: StateBackend,
                                                            request: pytest.FixtureRequest) -> None:
    config, _admin_url = _bad_pipeline(state_backend, request, bad)
    assert _read(config, state_backend, "ev2") == EV2
    doc = _ok(state_backend, config, "doctor", "--export", "ev2")
    (ev2,) = doc["exports"]
    assert ev2["verdict"] == "resumes" and ev2["resumes_from"].startswith("CDC position"), ev2
    assert "in the state" in ev2["resumes_from"], ev2
    for args in (("--dry-run",), ()):
        change = _ok(state_backend, config, "exports", "reset", "ev2", *args)
        assert change["next_run"].startswith("resumes from CDC position") and "in the state" in change["next_run"], \
            change
    proc = _run(state_backend, config, "--json", "doctor")
    assert proc.returncode == 4, describe(proc)
    err = error_object(proc)
    assert err["code"] == "RIVET_STATE_POSITION_INVALID" and err["exit_code"] == 4, err
    assert [f["export"] for f in err["failures"]] == ["order_events"], err
    by_name = {e["name"]: e for e in json.loads(proc.stdout)["exports"]}
    assert by_name["ev2"]["verdict"] == "resumes", by_name
    bad_one = by_name["order_events"]
    assert bad_one["verdict"] == "refused" and bad_one["resumes_from"] is None, bad_one
    assert [r["code"] for r in bad_one["reasons"]] == ["RIVET_STATE_POSITION_INVALID"], bad_one
    people = _run(state_backend, config, "doctor")
    assert people.returncode == 4 and "REFUSED" in people.stdout, describe(people)
    listed = {c["export"]: c for c in _ok(state_backend, config, "checkpoints")["checkpoints"]}
    bad_listed = listed["order_events"]
    # a row is there: the file is no position to lose, so no RIVET_STATE_CHECKPOINT_RELATIVE under PostgreSQL;
    # the error names the way out
    assert [w["code"] for w in bad_listed["warnings"]] == [], bad_listed
    assert "checkpoints import --export order_events" in bad_listed["error"], bad_listed


@pytest.mark.parametrize("bad", BAD, ids=("deep", "null"))
def test_a_reset_of_the_bad_export_says_its_next_run_is_refused(bad: str, state_backend: StateBackend,
                                                                 request: pytest.FixtureRequest) -> None:
    config, admin_url = _bad_pipeline(state_backend, request, bad)
    for args in (("--dry-run",), ()):
        change = _ok(state_backend, config, "exports", "reset", "order_events", *args)
        words = change["next_run"]
        assert "FIRST RUN" not in words and words.startswith("REFUSED"), change
        assert "RIVET_STATE_POSITION_INVALID" in words and "checkpoints import --export order_events" in words, change
    assert _row(state_backend, admin_url) == bad


@pytest.mark.parametrize("bad", BAD, ids=("deep", "null"))
def test_checkpoints_import_of_the_export_named_replaces_a_bad_row(bad: str, state_backend: StateBackend,
                                                                  request: pytest.FixtureRequest) -> None:
    config, admin_url = _bad_pipeline(state_backend, request, bad)
    action = REGISTRY["RIVET_STATE_POSITION_INVALID"].action
    assert "statetool checkpoints import --export NAME" in action, action
    good = config.parent / "checkpoints" / "order_events.json"
    good.write_text(json.dumps(GOOD))
    # without --export the import leaves the row, and says how
    done = _ok(state_backend, config, "checkpoints", "import")
    (skip,) = [s for s in done["skipped"] if s["export"] == "order_events"]
    assert "checkpoints import --export order_events" in skip["why"], done
    assert _row(state_backend, admin_url) == bad and good.exists()
    before = tree_digest(config.parent)
    plan = _ok(state_backend, config, "checkpoints", "import", "--export", "order_events", "--dry-run")
    assert [m["export"] for m in plan["moved"]] == ["order_events"], plan
    assert tree_digest(config.parent) == before and _row(state_backend, admin_url) == bad
    done = _ok(state_backend, config, "checkpoints", "import", "--export", "order_events")
    assert [m["export"] for m in done["moved"]] == ["order_events"], done
    assert json.loads(_row(state_backend, admin_url) or "null") == GOOD and not good.exists()
    assert _read(config, state_backend, "order_events") == GOOD
    doc = _ok(state_backend, config, "doctor")
    assert all(e["verdict"] == "resumes" for e in doc["exports"]), doc
    detail = json.loads(_last_import_audit(state_backend, admin_url))
    assert detail["replaced"] == bad and detail["position"] == GOOD, detail


def test_doctor_json_errors_says_the_exit_code_the_process_exits_with(tmp_path: Path) -> None:
    backend = StateBackend.sqlite(tmp_path)
    config = write_config(backend.pipeline, exports=EXPORTS)
    (config.parent / "checkpoints").mkdir()
    store = StateStore.open(config, env=process_env(backend.env), create=True)
    with store.run("order_events", "cdc") as run:
        run.finish_run(run.start_run(), "succeeded")
    (config.parent / "checkpoints" / "order_events.json").write_text('{"pos": NaN}')
    proc = _run(backend, config, "doctor")
    err = error_object(proc)
    assert err["code"] == "RIVET_STATE_CHECKPOINT_UNREADABLE", describe(proc)
    assert err["exit_code"] == proc.returncode, describe(proc)


def test_read_only_names_the_place_the_message_gives_not_only_the_states_filesystem() -> None:
    """RIVET_STATE_READ_ONLY is raised for a checkpoint file's read-only directory too
    (``checkpoints import`` renaming the file, ``checkpoints export`` writing it): its
    action must be true there (as RIVET_STATE_READ_ONLY_DRY_RUN's is)."""
    action = REGISTRY["RIVET_STATE_READ_ONLY"].action
    assert not action.startswith("the state's filesystem is mounted read-only"), action
    assert "the place the message names" in action and "checkpoint" in action, action


@pytest.mark.parametrize("bad", (*BAD, "not json{"), ids=("deep", "null", "not-json"))
def test_checkpoints_export_of_a_bad_row_writes_nothing_and_still_moves_the_others(
        bad: str, state_backend: StateBackend, request: pytest.FixtureRequest) -> None:
    """A re-check's finding: ``null`` was written to the file (then refused as unreadable),
    a row that is not JSON was RIVET_INTERNAL, a deep one RIVET_STATE_POSITION_TOO_DEEP; and
    the other export could not be exported either. Named, the bad export is refused as
    what it is (POSITION_INVALID, exit 4) before a byte is written; not named, it is
    skipped saying why, and the other export moves back to its file."""
    config, admin_url = _bad_pipeline(state_backend, request, bad)
    place = config.parent / "checkpoints"
    for dry in (("--dry-run",), ()):
        before = tree_digest(config.parent)
        proc = _run(state_backend, config, "checkpoints", "export", "--export", "order_events", *dry)
        err = error_object(proc)
        assert (proc.returncode, err["code"]) == (4, "RIVET_STATE_POSITION_INVALID"), describe(proc)
        assert "checkpoints import --export order_events" in err["message"], err
        assert tree_digest(config.parent) == before and _row(state_backend, admin_url) == bad
    plan = _ok(state_backend, config, "checkpoints", "export", "--dry-run")
    assert [m["export"] for m in plan["moved"]] == ["ev2"], plan
    (skipped,) = [s for s in plan["skipped"] if s["export"] == "order_events"]
    assert "RIVET_STATE_POSITION_INVALID" in skipped["why"] and "no position to write back" in skipped["why"]
    done = _ok(state_backend, config, "checkpoints", "export")
    assert [m["export"] for m in done["moved"]] == ["ev2"], done
    assert json.loads((place / "ev2.json").read_text()) == EV2
    assert not (place / "order_events.json").exists() and _row(state_backend, admin_url) == bad
