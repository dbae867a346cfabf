"""One nesting limit for a CDC position (issue 15, a fresh user's HIGH finding; SPEC §6, §7):
JSON nested 600, 990 or 1200 levels deep was accepted by the file reader or the runtime and
then crashed most commands with ``RIVET_INTERNAL`` (Python's recursion limit in rendering,
the audit row, redaction), or made one bad row hide where every other export's position
lives. Every entry point now applies ``MAX_POSITION_DEPTH`` (64), checked without recursion:

- a checkpoint file deeper than the limit is ``RIVET_STATE_CHECKPOINT_UNREADABLE`` (the one
  reader: ``checkpoints``, ``info``, ``doctor``, ``check``, ``checkpoints import``,
  ``transfer --with-checkpoints``, the runtime's ``read_position``), nothing written;
- the runtime's ``commit_position`` of a deeper value is ``RIVET_STATE_POSITION_TOO_DEEP``
  before its lease is taken, nothing written;
- a deeper row already in the state (an older release; inserted here with raw SQL) is
  ``RIVET_STATE_POSITION_INVALID`` for that export only, every other export keeping its
  true ``stored_in``;
- a position exactly at the limit works end to end (import, export, transfer both ways,
  ``info``, ``doctor``, ``check``, ``checkpoints --json``).

Every command runs as a real process (``python -m statetool``), at the default recursion
limit of a user's shell.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from support import describe, error_object, process_env, run_cli_process, tree_digest, write_config
from support.backends import StateBackend
from statetool.errors import StateError
from statetool.runtime import StateStore
from test_transfer import admin  # noqa: F401 - the fixture: the server's superuser URL
from test_transfer import pg_fetch, schema_exists, split_url

#: The limit the tests hold the code to (docs/decisions.md, "How deep a position may nest").
LIMIT = 64
#: The depths of the finding, and one over the limit.
OVER = (600, 990, 1200, LIMIT + 1)
#: Two CDC exports, each with a file of its own: one bad position must not hide the other's.
EXPORTS = """\
exports:
  - {name: orders, mode: incremental}
  - {name: order_events, mode: cdc, cdc: {engine: mysql, checkpoint: checkpoints/order_events.json}}
  - {name: customer_changes, mode: cdc, cdc: {engine: mongodb, checkpoint: checkpoints/customer_changes.json}}
"""
OTHER = {"resume_token": {"_data": "8263A1"}}
#: What a real engine's position looks like at its innermost level.
INNER = '{"file": "mysql-bin.000042", "pos": 91234}'


def deep_text(depth: int) -> str:
    """JSON text of a position that nests ``depth`` levels (arrays, then one object)."""
    return "[" * (depth - 1) + INNER + "]" * (depth - 1)


def deep_value(depth: int) -> object:
    """The value :func:`deep_text` holds, built without recursion."""
    value: object = json.loads(INNER)
    for _ in range(depth - 1):
        value = [value]
    return value


def _pipeline(backend: StateBackend) -> tuple[Path, StateStore]:
    """A state with the config :data:`EXPORTS`, a cursor of orders and customer_changes'
    position committed into it; the ``checkpoints`` directory made."""
    config = write_config(backend.pipeline, exports=EXPORTS)
    (config.parent / "checkpoints").mkdir()
    store = StateStore.open(config, env=process_env(backend.env), create=True)
    with store.run("orders", "incremental") as run:
        run.commit_cursor("2026-11-30T00:00:00Z")
    with store.run("customer_changes", "cdc") as run:
        run.commit_position(OTHER)
    return config, store


def _run(backend: StateBackend, config: Path, *args: str) -> Any:
    return run_cli_process("-c", str(config), "--json-errors", *args, env=backend.env)


def _ok(backend: StateBackend, config: Path, *args: str) -> dict[str, Any]:
    proc = _run(backend, config, "--json", *args)
    assert proc.returncode == 0, describe(proc)
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def _listed(backend: StateBackend, config: Path, *command: str) -> dict[str, dict[str, Any]]:
    doc = _ok(backend, config, *command)
    return {c["export"]: c for c in doc["checkpoints"]}


def _refused(backend: StateBackend, config: Path, code: str, *args: str) -> dict[str, Any]:
    proc = _run(backend, config, *args)
    assert proc.returncode != 0, describe(proc)
    err = error_object(proc)
    assert err["code"] == code, describe(proc)
    return err


def _position_row(backend: StateBackend, admin_url: str | None, text: str) -> None:  # noqa: F811
    """Insert order_events' position row ``text`` with raw SQL, as an older release wrote it."""
    values = ("order_events", "mysql", text, "2026-01-01T00:00:00Z")
    insert = "INSERT INTO {}rivet_cdc_positions (export_name, engine, position, committed_at) VALUES ({})"
    if backend.kind == "sqlite":
        assert backend.state_dir is not None
        with sqlite3.connect(backend.state_dir / ".rivet_state.db") as conn:
            conn.execute(insert.format("", "?, ?, ?, ?"), values)
        conn.close()
        return
    assert backend.url is not None and admin_url is not None
    pg_fetch(admin_url, insert.format(f'"{split_url(backend.url)[1]}".', "%s, %s, %s, %s"), values)


def _read(store: StateStore, export: str = "order_events") -> object:
    with store.run(export, "cdc") as run:
        return run.read_position()


def _admin(request: pytest.FixtureRequest, backend: StateBackend) -> str | None:
    return request.getfixturevalue("admin") if backend.kind == "postgres" else None


def test_the_limit_is_one_named_constant_of_the_one_reader() -> None:
    from statetool.operations import checkpoint_file

    assert checkpoint_file.MAX_POSITION_DEPTH == LIMIT


# -- a checkpoint file ---------------------------------------------------------------------


@pytest.mark.parametrize("depth", OVER)
def test_a_file_nested_deeper_than_the_limit_is_unreadable_everywhere_and_nothing_is_written(
        depth: int, state_backend: StateBackend) -> None:
    config, store = _pipeline(state_backend)
    checkpoint = config.parent / "checkpoints" / "order_events.json"
    checkpoint.write_text(deep_text(depth) + "\n")
    listed = _listed(state_backend, config, "checkpoints")
    error = listed["order_events"]["error"]
    assert error.startswith("RIVET_STATE_CHECKPOINT_UNREADABLE") and f"{depth} levels" in error, listed
    assert str(LIMIT) in error and listed["order_events"]["position"] is None, listed
    assert listed["customer_changes"]["stored_in"] == "state" and listed["customer_changes"]["position"] == OTHER
    assert _listed(state_backend, config, "info")["order_events"]["error"] == error
    for human in (("checkpoints",), ("info",)):
        proc = _run(state_backend, config, *human)
        assert proc.returncode == 0, describe(proc)
    before = tree_digest(config.parent)
    _refused(state_backend, config, "RIVET_STATE_CHECKPOINT_UNREADABLE", "checkpoints", "import", "--dry-run")
    _refused(state_backend, config, "RIVET_STATE_CHECKPOINT_UNREADABLE", "checkpoints", "import")
    doctor = _run(state_backend, config, "--json", "doctor")
    assert doctor.returncode not in (0, 6) and "RIVET_STATE_CHECKPOINT_UNREADABLE" in doctor.stdout, describe(doctor)
    check = _run(state_backend, config, "--json", "check")
    assert check.returncode == 4 and "RIVET_STATE_CHECKPOINT_UNREADABLE" in check.stdout, describe(check)
    assert tree_digest(config.parent) == before
    with pytest.raises(StateError) as caught:
        _read(store)
    assert caught.value.code == "RIVET_STATE_CHECKPOINT_UNREADABLE" and f"{depth} levels" in caught.value.message
    assert store.stored_position("order_events") is None


def test_a_file_at_the_limit_is_imported_read_and_exported_back_byte_for_byte(state_backend: StateBackend) -> None:
    config, store = _pipeline(state_backend)
    checkpoint = config.parent / "checkpoints" / "order_events.json"
    data = (deep_text(LIMIT) + "\n").encode()
    checkpoint.write_bytes(data)
    assert _listed(state_backend, config, "checkpoints")["order_events"]["position"] == deep_value(LIMIT)
    _ok(state_backend, config, "checkpoints", "import", "--dry-run")
    moved = _ok(state_backend, config, "checkpoints", "import")
    assert [m["export"] for m in moved["moved"]] == ["order_events"]
    assert _read(store) == deep_value(LIMIT) and not checkpoint.exists()
    for command in (("checkpoints",), ("info",), ("doctor",), ("check",), ("export",)):
        _ok(state_backend, config, *command)
        proc = _run(state_backend, config, *command)
        assert proc.returncode == 0, describe(proc)
    assert _listed(state_backend, config, "checkpoints")["order_events"]["stored_in"] == "state"
    _ok(state_backend, config, "checkpoints", "export", "--export", "order_events")
    assert checkpoint.read_bytes() == data and store.stored_position("order_events") is None


# -- the runtime ---------------------------------------------------------------------------


@pytest.mark.parametrize("depth", OVER)
def test_committing_a_position_deeper_than_the_limit_is_refused_before_anything_is_written(
        depth: int, state_backend: StateBackend) -> None:
    config, store = _pipeline(state_backend)
    before = _ok(state_backend, config, "export", "--with-history")
    verdicts = {c: _run(state_backend, config, "--json", c).returncode for c in ("doctor", "check")}
    with store.run("order_events", "cdc") as run:
        digest = tree_digest(config.parent)  # the run's lease held
        with pytest.raises(StateError) as caught:
            run.commit_position(deep_value(depth))
        assert tree_digest(config.parent) == digest
    err = caught.value
    assert err.code == "RIVET_STATE_POSITION_TOO_DEEP", err
    assert err.details == {"export": "order_events", "depth": depth, "limit": LIMIT}, err
    assert "nothing was written" in err.message, err
    assert store.stored_position("order_events") is None
    after = _ok(state_backend, config, "export", "--with-history")
    assert after["exports"] == before["exports"] and after["state"] == before["state"]
    for command in ("checkpoints", "info"):
        _ok(state_backend, config, command)
    assert {c: _run(state_backend, config, "--json", c).returncode for c in ("doctor", "check")} == verdicts


def test_a_position_that_refers_to_itself_is_no_json(state_backend: StateBackend) -> None:
    _config, store = _pipeline(state_backend)
    loop: list[object] = []
    loop.append(loop)
    with store.run("order_events", "cdc") as run:
        with pytest.raises(ValueError, match="refers to itself"):
            run.commit_position({"file": "mysql-bin.000042", "pos": loop})
    assert store.stored_position("order_events") is None


def test_a_committed_position_at_the_limit_works_with_every_command(state_backend: StateBackend) -> None:
    config, store = _pipeline(state_backend)
    with store.run("order_events", "cdc") as run:
        run.commit_position(deep_value(LIMIT))
    assert _read(store) == deep_value(LIMIT)
    listed = _listed(state_backend, config, "checkpoints")
    assert listed["order_events"]["position"] == deep_value(LIMIT) and listed["order_events"]["stored_in"] == "state"
    for command in (("checkpoints",), ("info",), ("doctor",), ("check",)):
        _ok(state_backend, config, *command)
    for command in (("checkpoints",), ("info",), ("doctor",), ("check",), ("metrics",)):
        proc = _run(state_backend, config, *command)
        assert proc.returncode == 0, describe(proc)
    document = _ok(state_backend, config, "export", "--with-history")
    assert document["exports"]["order_events"]["cdc_position"]["position"] == deep_value(LIMIT)


# -- a row an older release wrote -----------------------------------------------------------


@pytest.mark.parametrize("depth", OVER)
def test_a_stored_row_deeper_than_the_limit_is_invalid_for_its_export_only(
        depth: int, state_backend: StateBackend, request: pytest.FixtureRequest) -> None:
    config, store = _pipeline(state_backend)
    stale = config.parent / "checkpoints" / "order_events.json"
    stale.write_text(json.dumps({"file": "mysql-bin.000001", "pos": 4}))  # never read while the row is there
    _position_row(state_backend, _admin(request, state_backend), deep_text(depth))
    for command in ("checkpoints", "info"):
        listed = _listed(state_backend, config, command)
        bad = listed["order_events"]
        assert bad["stored_in"] == "unknown" and bad["position"] is None, bad
        assert bad["error"].startswith("RIVET_STATE_POSITION_INVALID") and f"{depth} levels" in bad["error"], bad
        assert str(LIMIT) in bad["error"], bad
        assert listed["customer_changes"]["stored_in"] == "state", listed
        assert listed["customer_changes"]["position"] == OTHER, listed
        proc = _run(state_backend, config, command)
        assert proc.returncode == 0, describe(proc)
    with pytest.raises(StateError) as caught:
        _read(store)
    assert caught.value.code == "RIVET_STATE_POSITION_INVALID" and f"{depth} levels" in caught.value.message
    assert _read(store, "customer_changes") == OTHER
    err = _refused(state_backend, config, "RIVET_STATE_POSITION_INVALID", "doctor")
    assert f"{depth} levels" in err["message"], err
    check = _run(state_backend, config, "--json", "check")
    assert check.returncode == 4 and "RIVET_STATE_POSITION_INVALID" in check.stdout, describe(check)
    before = tree_digest(config.parent)
    # an older release's row is no position, nor a position too deep for a file: named, the
    # export of it is refused as what it is (a re-check's finding; not named, it is skipped:
    # tests/test_bad_position_row.py)
    for dry in ((), ("--dry-run",)):
        err = _refused(state_backend, config, "RIVET_STATE_POSITION_INVALID", "checkpoints", "export", "--export",
                       "order_events", *dry)
        assert f"{depth} levels" in err["message"] and "checkpoints import --export" in err["message"], err
    _refused(state_backend, config, "RIVET_STATE_POSITION_INVALID", "export")
    assert tree_digest(config.parent) == before


# -- transfer --with-checkpoints -------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.parametrize("depth", (600, LIMIT + 1))
def test_a_transfer_of_a_file_deeper_than_the_limit_is_refused_before_anything_is_written(
        depth: int, tmp_path: Path, admin: str, pg_url: str) -> None:  # noqa: F811
    backend = StateBackend.sqlite(tmp_path)
    config, _store = _pipeline(backend)
    (config.parent / "checkpoints" / "order_events.json").write_text(deep_text(depth))
    before = tree_digest(config.parent)
    err = _refused(backend, config, "RIVET_STATE_CHECKPOINT_UNREADABLE", "transfer", "--to", pg_url,
                   "--with-checkpoints")
    assert f"{depth} levels" in err["message"], err
    assert tree_digest(config.parent) == before and not schema_exists(admin, split_url(pg_url)[1])


@pytest.mark.postgres
def test_a_transfer_of_a_source_row_deeper_than_the_limit_is_refused_before_anything_is_written(
        tmp_path: Path, admin: str, pg_url: str) -> None:  # noqa: F811
    backend = StateBackend.sqlite(tmp_path)
    config, _store = _pipeline(backend)
    _position_row(backend, None, deep_text(LIMIT + 1))
    before = tree_digest(config.parent)
    for flags in ((), ("--with-checkpoints",)):
        _refused(backend, config, "RIVET_STATE_POSITION_INVALID", "transfer", "--to", pg_url, *flags)
    assert tree_digest(config.parent) == before and not schema_exists(admin, split_url(pg_url)[1])


@pytest.mark.postgres
def test_a_position_at_the_limit_transfers_into_postgresql_and_back(tmp_path: Path, admin: str,
                                                                    pg_url: str) -> None:  # noqa: F811
    backend = StateBackend.sqlite(tmp_path)
    config, _store = _pipeline(backend)
    checkpoint = config.parent / "checkpoints" / "order_events.json"
    checkpoint.write_text(deep_text(LIMIT))
    _ok(backend, config, "transfer", "--to", pg_url, "--with-checkpoints", "--dry-run")
    proc = _run(backend, config, "transfer", "--to", pg_url, "--with-checkpoints")
    assert proc.returncode == 0, describe(proc)
    schema = split_url(pg_url)[1]
    rows = dict(pg_fetch(admin, f'SELECT export_name, position FROM "{schema}".rivet_cdc_positions'))
    assert rows["order_events"] == deep_text(LIMIT) and not checkpoint.exists()
    pg = StateBackend.postgres(tmp_path, pg_url)
    for command in (("checkpoints",), ("info",), ("doctor",), ("check",)):
        _ok(pg, config, *command)
    assert _listed(pg, config, "checkpoints")["order_events"]["stored_in"] == "state"
    back = tmp_path / "back"
    back.mkdir()
    proc = _run(pg, config, "transfer", "--to", f"sqlite:{back}", "--with-checkpoints")
    assert proc.returncode == 0, describe(proc)
    home = StateBackend.sqlite(tmp_path, back)
    listed = _listed(home, config, "checkpoints")
    assert listed["order_events"]["position"] == deep_value(LIMIT) and listed["order_events"]["stored_in"] == "state"
    for command in (("info",), ("doctor",), ("check",)):
        _ok(home, config, *command)
    (back / "checkpoints").mkdir()
    _ok(home, config, "checkpoints", "export", "--export", "order_events")
    assert Path(listed["order_events"]["path"]).read_text() == deep_text(LIMIT)


# -- a rivet-state/1 document ----------------------------------------------------------------


@pytest.mark.parametrize("depth", (LIMIT, LIMIT + 1, 600))
def test_a_document_whose_position_nests_deeper_than_the_limit_is_no_document_for_diff_nor_import(
        depth: int, tmp_path: Path) -> None:
    backend = StateBackend.sqlite(tmp_path)
    config, _store = _pipeline(backend)
    document = tmp_path / "state.json"
    _run(backend, config, "export", "--with-history", "-o", str(document))
    doc = json.loads(document.read_text())
    doc["exports"]["customer_changes"]["cdc_position"]["position"] = {"held": "X"}
    deep = tmp_path / "deep.json"
    deep.write_text(json.dumps(doc).replace('{"held": "X"}', deep_text(depth)))
    into = tmp_path / "into"
    into.mkdir()
    fresh = StateBackend.sqlite(tmp_path, into)
    if depth <= LIMIT:
        assert _run(backend, config, "diff", str(document), str(deep)).returncode == 1  # one difference
        _ok(fresh, config, "import", str(deep))
        assert _listed(fresh, config, "checkpoints")["customer_changes"]["position"] == deep_value(depth)
        return
    for args in (("diff", str(document), str(deep)), ("import", str(deep))):
        err = _refused(fresh, config, "RIVET_STATE_EXPORT_FORMAT", *args)
        assert f"cdc_position.position nests {depth} levels" in err["message"], err
    assert list(into.iterdir()) == []
