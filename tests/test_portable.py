"""``statetool export`` (rivet-state/1), ``diff`` and ``import``, on real states of both
backends, through the CLI: every value a state holds is in its export, the export validates
against docs/schemas/rivet-state-1.schema.json, reading changes no byte, and a round trip
export -> import -> diff finds nothing."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import jsonschema
import pytest

from support import describe, run_cli
from support.backends import StateBackend
from support.files import tree_digest, write_config
from support.states import CURSOR, build_state
from statetool import migrations

SCHEMA = json.loads((Path(__file__).parent.parent / "docs" / "schemas" / "rivet-state-1.schema.json").read_text())
KEY = "postgresql://db.internal:5432/sales"


def raw_sql(sb: StateBackend, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Run ``sql`` (``?`` placeholders) on the state of ``sb`` with its own driver, committed:
    what a pipeline (or a hand edit) writes that statetool's API does not."""
    if sb.kind == "sqlite":
        assert sb.state_dir is not None
        conn = sqlite3.connect(sb.state_dir / ".rivet_state.db")
        try:
            rows = conn.execute(sql, params).fetchall()
            conn.commit()
            return rows
        finally:
            conn.close()
    import psycopg

    assert sb.url is not None
    parts = urlsplit(sb.url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    schema = next(v for k, v in query if k == "schema")
    url = urlunsplit(("postgresql", parts.netloc, parts.path, urlencode([(k, v) for k, v in query if k != "schema"]),
                      ""))
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'SET search_path TO "{schema}"')
        cur = conn.execute(sql.replace("?", "%s"), params)
        return [tuple(r) for r in cur.fetchall()] if cur.description else []


def built(sb: StateBackend) -> Path:
    """A state with progress of every kind: a cursor, chunk checkpoints, a succeeded CDC run,
    a load-ledger row and a run aggregate; returns the config."""
    config = write_config(sb.pipeline)
    build_state(config, sb.url)
    raw_sql(sb, "INSERT INTO rivet_load_ledger (export_name, table_name, part, rows, loaded_at) VALUES "
                "('orders', 'sales.orders', 'part-0001.parquet', 120, '2026-11-01T00:00:00.000000Z')")
    raw_sql(sb, "INSERT INTO rivet_run_aggregates (run_id, config_path, started_at, finished_at, status, details_json) "
                "VALUES ('agg-1', 'rivet.yaml', '2026-11-01T00:00:00.000000Z', NULL, 'running', '{\"n\": 1}')")
    return config


def cli(sb: StateBackend, config: Path, *args: str) -> Any:
    return run_cli("-c", str(config), *args, env=sb.env)


def state_bytes(sb: StateBackend) -> dict[str, str]:
    """The digest of every file of a SQLite state's directory ({} on PostgreSQL)."""
    return tree_digest(sb.state_dir) if sb.state_dir is not None else {}


def test_an_export_carries_every_value_validates_and_changes_no_byte(state_backend: StateBackend,
                                                                     tmp_path: Path) -> None:
    config = built(state_backend)
    before = state_bytes(state_backend)
    out = tmp_path / "out" / "state.json"
    out.parent.mkdir()
    proc = cli(state_backend, config, "export", "--with-history", "-o", str(out))
    assert proc.returncode == 0, describe(proc)
    assert str(out) in proc.stdout
    assert state_bytes(state_backend) == before
    assert os.listdir(out.parent) == ["state.json"]  # no temporary file left
    assert out.stat().st_mode & 0o777 == 0o600
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, SCHEMA)
    assert doc["format"] == "rivet-state/1" and doc["with_history"] is True
    info = json.loads(cli(state_backend, config, "info", "--json").stdout)
    assert doc["state"] == {"state_key": KEY, "lineage": info["lineage"]["id"], "serial": info["lineage"]["serial"],
                            "revision": migrations.head(), "legacy": False}
    assert doc["state"]["lineage"] and doc["state"]["serial"] >= 1
    assert doc["exported_from"]["backend"] == state_backend.kind
    orders, lines, events = (doc["exports"][n] for n in ("orders", "order_lines", "order_events"))
    assert orders["cursor"]["value"] == CURSOR and orders["registered"] is True and orders["mode"] == "incremental"
    assert orders["ledger"] == [{"id": 1, "table_name": "sales.orders", "part": "part-0001.parquet", "rows": 120,
                                 "loaded_at": "2026-11-01T00:00:00.000000Z"}]
    assert orders["runs_summary"]["succeeded"] == 1 and orders["runs_summary"]["last_success"] is not None
    assert [(c["chunk_index"], c["status"], c["lower_bound"]) for c in lines["chunks"]] == \
        [(0, "done", "0"), (1, "pending", "100000")]
    assert lines["registered"] is False and lines["mode"] == "chunked"
    assert events["runs"][0]["status"] == "succeeded" and events["cdc_position"] is None
    assert doc["run_aggregates"][0]["details_json"] == '{"n": 1}'
    # without --with-history: no runs, no aggregates, and the same progress on stdout
    plain = cli(state_backend, config, "export")
    assert plain.returncode == 0, describe(plain)
    short = json.loads(plain.stdout)
    jsonschema.validate(short, SCHEMA)
    assert "run_aggregates" not in short and "runs" not in short["exports"]["orders"]
    assert short["exports"]["orders"]["ledger"] == orders["ledger"]


def test_an_export_reads_lineage_and_serial_where_the_state_holds_them(tmp_path: Path) -> None:
    sb = StateBackend.sqlite(tmp_path)
    config = built(sb)
    raw_sql(sb, "UPDATE rivet_lineage SET lineage = '6f1c8a52-0d5e-4d7e-9d43-2b8f0c1e9a11', serial = 17")
    proc = cli(sb, config, "export", "--export", "orders")
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert (doc["state"]["lineage"], doc["state"]["serial"]) == ("6f1c8a52-0d5e-4d7e-9d43-2b8f0c1e9a11", 17)
    assert list(doc["exports"]) == ["orders"]


def test_export_output_never_overwrites_without_force_nor_follows_a_link(tmp_path: Path) -> None:
    sb = StateBackend.sqlite(tmp_path)
    config = built(sb)
    out = tmp_path / "state.json"
    out.write_text("keep me")
    proc = cli(sb, config, "export", "-o", str(out))
    assert proc.returncode == 5 and "RIVET_STATE_TARGET_NOT_EMPTY" in proc.stderr, describe(proc)
    assert out.read_text() == "keep me"
    victim = tmp_path / "victim"
    victim.write_text("not yours")
    link = tmp_path / "link.json"
    link.symlink_to(victim)
    proc = cli(sb, config, "export", "-o", str(link), "--force")
    assert proc.returncode == 5 and "RIVET_STATE_UNSAFE_FILE" in proc.stderr, describe(proc)
    assert victim.read_text() == "not yours" and link.is_symlink()
    proc = cli(sb, config, "--json", "export", "-o", str(out), "--force")
    assert proc.returncode == 0, describe(proc)
    assert json.loads(proc.stdout)["output"] == str(out)
    assert json.loads(out.read_text())["format"] == "rivet-state/1"
    assert sorted(os.listdir(tmp_path)) == ["link.json", "pipeline", "state.json", "victim"]


def test_export_removes_the_temporary_file_a_killed_export_left_and_no_live_ones(tmp_path: Path) -> None:
    """A SIGKILLed ``export -o FILE`` leaves ``.FILE.<pid>.export-tmp``; the next export
    there removes it (its process is gone), never one of a live export, never a link."""
    import signal
    import subprocess

    sb = StateBackend.sqlite(tmp_path)
    config = built(sb)
    out = tmp_path / "state.json"
    dead = subprocess.Popen(["sleep", "30"])
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    live = subprocess.Popen(["sleep", "30"])
    try:
        left = tmp_path / f".state.json.{dead.pid}.export-tmp"
        left.write_text('{"format": "rivet-state/1", "half')
        busy = tmp_path / f".state.json.{live.pid}.export-tmp"
        busy.write_text("being written")
        link = tmp_path / f".state.json.{dead.pid + 1_000_000}.export-tmp"
        link.symlink_to(tmp_path / "victim")
        proc = cli(sb, config, "export", "-o", str(out))
        assert proc.returncode == 0, describe(proc)
        assert not left.exists(), "a dead export's temporary file is left for good"
        assert busy.read_text() == "being written" and link.is_symlink()
    finally:
        live.kill()
        live.wait()


def test_export_of_an_unknown_export_or_a_missing_state_is_refused(tmp_path: Path) -> None:
    sb = StateBackend.sqlite(tmp_path)
    config = write_config(sb.pipeline)
    proc = cli(sb, config, "export")
    assert proc.returncode == 5 and "RIVET_STATE_MISSING" in proc.stderr, describe(proc)
    assert os.listdir(sb.pipeline) == ["rivet.yaml"]
    build_state(config)
    proc = cli(sb, config, "export", "--export", "nope")
    assert proc.returncode == 1 and "RIVET_EXPORT_UNKNOWN" in proc.stderr, describe(proc)


# -- diff -------------------------------------------------------------------------------


def test_diff_of_a_state_and_its_export_is_equal_then_names_each_change(state_backend: StateBackend,
                                                                        tmp_path: Path) -> None:
    config = built(state_backend)
    out = tmp_path / "state.json"
    assert cli(state_backend, config, "export", "-o", str(out)).returncode == 0
    location = state_backend.url or str(config)
    proc = cli(state_backend, config, "diff", str(out), location)
    assert proc.returncode == 0, describe(proc)
    assert "No difference" in proc.stdout
    assert cli(state_backend, config, "exports", "reset", "order_lines").returncode == 0
    assert cli(state_backend, config, "exports", "set-cursor", "orders", "2027-01-01T00:00:00Z").returncode == 0
    proc = cli(state_backend, config, "--json", "diff", str(out), location)
    assert proc.returncode == 1, describe(proc)
    doc = json.loads(proc.stdout)
    assert doc["equal"] is False and doc["a"]["kind"] == "export_file" and doc["b"]["kind"] == "state"
    found = {(d["export"], d["field"]): d for d in doc["differences"]}
    assert found[("orders", "cursor.value")]["a"] == CURSOR
    assert found[("orders", "cursor.value")]["b"] == "2027-01-01T00:00:00Z"
    chunks = found[("order_lines", "chunks")]
    assert (chunks["a"], chunks["b"], chunks["only_b"]) == (2, 0, [])
    assert len(chunks["only_a"]) == 2
    human = cli(state_backend, config, "diff", str(out), location)
    assert human.returncode == 1 and "export orders: cursor.value:" in human.stdout, describe(human)


def test_diff_of_a_backup_file_names_the_change_and_leaves_every_byte(tmp_path: Path) -> None:
    sb = StateBackend.sqlite(tmp_path)
    config = built(sb)
    assert cli(sb, config, "exports", "set-cursor", "orders", "2027-01-01T00:00:00Z").returncode == 0
    backup = next(sb.pipeline.glob(".rivet_state.db.backup-set-cursor-orders-*"))
    before = tree_digest(sb.pipeline)
    proc = cli(sb, config, "--json", "diff", str(backup), f"sqlite:{sb.pipeline}")
    assert proc.returncode == 1, describe(proc)
    doc = json.loads(proc.stdout)
    assert doc["a"]["kind"] == "state_file"
    # the backup holds the serial before the change, the state the one after it (SPEC §9)
    assert [(d["export"], d["field"]) for d in doc["differences"]] == [(None, "serial"), ("orders", "cursor.value"),
                                                                       ("orders", "cursor.updated_at")]
    assert tree_digest(sb.pipeline) == before
    assert sorted(p.name for p in sb.pipeline.iterdir()) == sorted(
        [".rivet_state.db", ".rivet_state.leases", backup.name, "rivet.yaml"])
    same = cli(sb, config, "diff", str(backup), str(backup))
    assert same.returncode == 0, describe(same)
    assert tree_digest(sb.pipeline) == before


def test_diff_counts_identity_and_lineage_as_differences(tmp_path: Path) -> None:
    sb = StateBackend.sqlite(tmp_path)
    config = built(sb)
    out = tmp_path / "state.json"
    assert cli(sb, config, "export", "-o", str(out)).returncode == 0
    doc = json.loads(out.read_text())
    doc["state"].update(state_key="postgresql://elsewhere:5432/sales", lineage="0a1b", serial=3)
    other = tmp_path / "other.json"
    other.write_text(json.dumps(doc))
    proc = cli(sb, config, "--json", "diff", str(other), str(out))
    assert proc.returncode == 1, describe(proc)
    assert [(d["scope"], d["field"], d["b"]) for d in json.loads(proc.stdout)["differences"]] == [
        ("state", "state_key", KEY), ("state", "lineage", json.loads(out.read_text())["state"]["lineage"]),
        ("state", "serial", json.loads(out.read_text())["state"]["serial"])]


@pytest.mark.parametrize(("body", "says"), [
    ('{"format": "rivet-state/2", "state": {}, "exports": {}}', "'rivet-state/2'"),
    ("{not json", "is not JSON"),
    ('{"format": "rivet-state/1", "state": {"state_key": null}, "exports": {}}', "lacks"),
])
def test_diff_refuses_a_file_that_is_not_a_rivet_state_1_document(tmp_path: Path, body: str, says: str) -> None:
    sb = StateBackend.sqlite(tmp_path)
    config = built(sb)
    bad = tmp_path / "bad.json"
    bad.write_text(body)
    proc = cli(sb, config, "--json-errors", "diff", str(bad), str(config))
    assert proc.returncode == 3, describe(proc)
    err = json.loads(proc.stderr.strip().splitlines()[-1])
    assert err["code"] == "RIVET_STATE_EXPORT_FORMAT" and says in err["message"]


# -- import -----------------------------------------------------------------------------


def _second_place(sb: StateBackend, tmp_path: Path) -> StateBackend:
    """Another, empty place of the same backend: a declared directory, or a fresh schema."""
    if sb.kind == "sqlite":
        (tmp_path / "elsewhere").mkdir()
        return StateBackend("sqlite", sb.pipeline, f"sqlite:{tmp_path / 'elsewhere'}")
    assert sb.url is not None
    return StateBackend("postgres", sb.pipeline, sb.url.replace("schema=t_", "schema=u_"))


def _drop_schema(sb: StateBackend) -> None:
    if sb.kind == "postgres":
        schema = sb.url.rsplit("schema=", 1)[1]  # type: ignore[union-attr]
        raw_sql(StateBackend("postgres", sb.pipeline, sb.url), f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _same_document(a: dict[str, Any], b: dict[str, Any]) -> None:
    for doc in (a, b):
        doc.pop("exported_at")
        doc.pop("exported_from")
    assert a == b


def test_export_then_import_where_no_state_is_makes_the_same_state(state_backend: StateBackend,
                                                                   tmp_path: Path) -> None:
    config = built(state_backend)
    out = tmp_path / "state.json"
    assert cli(state_backend, config, "export", "--with-history", "-o", str(out)).returncode == 0
    target = _second_place(state_backend, tmp_path)
    try:
        plan = run_cli("-c", str(config), "--state-url", target.url, "import", str(out), "--dry-run")
        assert plan.returncode == 0 and "Would create the state" in plan.stdout, describe(plan)
        if target.state_dir is not None:
            assert os.listdir(target.state_dir) == []
        done = run_cli("-c", str(config), "--state-url", target.url, "--json", "import", str(out))
        assert done.returncode == 0, describe(done)
        assert json.loads(done.stdout)["action"] == "create"
        same = run_cli("-c", str(config), "diff", str(out), target.url)
        assert same.returncode == 0, describe(same)
        both = run_cli("-c", str(config), "diff", state_backend.url or str(config), target.url)
        assert both.returncode == 0, describe(both)
        again = run_cli("-c", str(config), "--state-url", target.url, "export", "--with-history")
        _same_document(json.loads(out.read_text()), json.loads(again.stdout))
        audit = raw_sql(target, "SELECT action FROM rivet_audit")
        assert audit == [("identity.stamp",), ("import",)]
    finally:
        _drop_schema(target)


def test_import_into_a_live_state_puts_one_exports_progress_back(state_backend: StateBackend,
                                                                 tmp_path: Path) -> None:
    config = built(state_backend)
    out = tmp_path / "state.json"
    assert cli(state_backend, config, "export", "-o", str(out)).returncode == 0
    assert cli(state_backend, config, "exports", "reset", "order_lines").returncode == 0
    assert cli(state_backend, config, "exports", "set-cursor", "orders", "2027-01-01T00:00:00Z").returncode == 0
    before = state_bytes(state_backend)
    plan = cli(state_backend, config, "import", str(out), "--export", "order_lines", "--dry-run")
    assert plan.returncode == 0 and "0 chunks" in plan.stdout and "-> no cursor, 2 chunks" in plan.stdout, \
        describe(plan)
    assert state_bytes(state_backend) == before
    refused = cli(state_backend, config, "import", str(out))
    assert refused.returncode == 5 and "RIVET_STATE_TARGET_NOT_EMPTY" in refused.stderr, describe(refused)
    done = cli(state_backend, config, "import", str(out), "--export", "order_lines")
    assert done.returncode == 0, describe(done)
    proc = cli(state_backend, config, "--json", "diff", str(out), state_backend.url or str(config))
    assert proc.returncode == 1, describe(proc)
    # order_lines is back; orders is as set, and the state has advanced past the file's serial
    assert {d["export"] for d in json.loads(proc.stdout)["differences"]} == {"orders", None}
    assert raw_sql(state_backend, "SELECT action FROM rivet_audit ORDER BY id DESC LIMIT 1") == [("import",)]


def test_import_refuses_a_file_of_another_identity_or_lineage_or_format(tmp_path: Path) -> None:
    sb = StateBackend.sqlite(tmp_path)
    config = built(sb)
    out = tmp_path / "state.json"
    assert cli(sb, config, "export", "--with-history", "-o", str(out)).returncode == 0
    doc = json.loads(out.read_text())
    doc["state"]["state_key"] = "postgresql://elsewhere:5432/sales"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(doc))
    before = tree_digest(sb.pipeline)
    proc = cli(sb, config, "import", str(other), "--export", "orders")
    assert proc.returncode == 5 and "RIVET_STATE_FOREIGN" in proc.stderr, describe(proc)
    # where no state is, beside a config too, as restore refuses it (a fresh user imported
    # another source's file there, exit 0, and the next check failed)
    beside = write_config(tmp_path / "fresh")
    proc = run_cli("-c", str(beside), "--json-errors", "import", str(other), env={})
    assert proc.returncode == 5 and "RIVET_STATE_FOREIGN" in proc.stderr, describe(proc)
    assert sorted(os.listdir(beside.parent)) == ["rivet.yaml"]
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_cli("-c", str(config), "--state-url", f"sqlite:{empty}", "import", str(other))
    assert proc.returncode == 5 and "RIVET_STATE_FOREIGN" in proc.stderr, describe(proc)
    assert os.listdir(empty) == []
    raw_sql(sb, "UPDATE rivet_lineage SET lineage = 'live-lineage', serial = 4")
    before = tree_digest(sb.pipeline)
    doc["state"].update(state_key=KEY, lineage="another-lineage")
    other.write_text(json.dumps(doc))
    proc = cli(sb, config, "import", str(other), "--export", "orders")
    assert proc.returncode == 5 and "another-lineage" in proc.stderr, describe(proc)
    doc["format"] = "rivet-state/2"
    other.write_text(json.dumps(doc))
    proc = cli(sb, config, "import", str(other), "--export", "orders")
    assert proc.returncode == 3 and "RIVET_STATE_EXPORT_FORMAT" in proc.stderr, describe(proc)
    assert tree_digest(sb.pipeline) == before


def _edited(doc: dict[str, Any], edit: str) -> dict[str, Any]:
    """``doc`` with one hand edit of the kinds a fresh user tried (each made import fail
    half way as RIVET_INTERNAL, or write a value the state cannot hold)."""
    doc = json.loads(json.dumps(doc))
    orders = doc["exports"]["orders"]
    chunk = {"run_id": "r1", "chunk_index": 0, "lower_bound": None, "upper_bound": None, "status": "done",
             "rows": 1, "updated_at": "2026-01-01T00:00:00Z"}
    if edit == "chunk of the wrong types":
        orders["chunks"] = [{**chunk, "run_id": 1, "chunk_index": "abc"}]
    elif edit == "a chunk twice":
        orders["chunks"] = [chunk, dict(chunk)]
    elif edit == "no cursor":
        del orders["cursor"]
    elif edit == "exports a list":
        doc["exports"] = [1, 2]
    elif edit == "a NUL in a cursor":
        orders["cursor"]["value"] = "a\x00b"
    elif edit == "a serial beyond 64 bits":
        doc["state"]["serial"] = 10 ** 30
    elif edit == "a negative serial":
        doc["state"]["serial"] = -3
    elif edit == "a run id twice":
        orders["runs"] = orders["runs"] * 2
    elif edit == "a lone surrogate":
        orders["runs"][0]["run_id"] = "\ud800"
    return doc


@pytest.mark.parametrize("edit", ["chunk of the wrong types", "a chunk twice", "no cursor", "exports a list",
                                  "a NUL in a cursor", "a serial beyond 64 bits", "a negative serial",
                                  "a run id twice", "a lone surrogate", "a key given twice"])
def test_import_of_a_hand_edited_file_is_refused_naming_the_field_and_writes_nothing(tmp_path: Path,
                                                                                       edit: str) -> None:
    sb = StateBackend.sqlite(tmp_path)
    config = built(sb)
    out = tmp_path / "state.json"
    assert cli(sb, config, "export", "--with-history", "-o", str(out)).returncode == 0
    assert json.loads(out.read_text())["exports"]["orders"]["runs"], "the run-id case needs a run to repeat"
    bad = tmp_path / "bad.json"
    text = json.dumps(_edited(json.loads(out.read_text()), edit))
    bad.write_text(text[:-1] + ', "exports": {}}' if edit == "a key given twice" else text)
    empty = tmp_path / "empty"
    empty.mkdir()
    before = tree_digest(sb.pipeline)
    for args in ((f"--state-url=sqlite:{empty}", "import", str(bad)), ("import", str(bad), "--export", "orders")):
        proc = run_cli("-c", str(config), "--json-errors", *args, env=sb.env)
        assert proc.returncode == 3 and "RIVET_STATE_EXPORT_FORMAT" in proc.stderr, describe(proc)
        assert "RIVET_INTERNAL" not in proc.stderr
    assert os.listdir(empty) == [] and tree_digest(sb.pipeline) == before
    missing = cli(sb, config, "import", str(tmp_path / "nosuch.json"))
    assert missing.returncode == 1 and "RIVET_CLI_USAGE" in missing.stderr, describe(missing)


def test_diff_import_and_export_refuse_odd_paths_by_a_registered_code_and_never_block(tmp_path: Path) -> None:
    """A fresh user's findings: a FIFO blocked diff and import for ever; a symlink to
    nothing, a missing -o directory and 100,000 nested brackets were RIVET_INTERNAL."""
    sb = StateBackend.sqlite(tmp_path)
    config = built(sb)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    dangling = tmp_path / "dangling.db"
    dangling.symlink_to(tmp_path / "nothing.db")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    cases = [(("diff", str(fifo), f"sqlite:{sb.pipeline}"), 5, "RIVET_STATE_UNSAFE_FILE"),
             (("import", str(fifo), "--export", "orders"), 5, "RIVET_STATE_UNSAFE_FILE"),
             (("diff", str(dangling), f"sqlite:{sb.pipeline}"), 1, "RIVET_CLI_USAGE"),
             (("import", str(tmp_path)), 1, "RIVET_CLI_USAGE"),
             (("import", str(deep), "--export", "orders"), 3, "RIVET_STATE_EXPORT_FORMAT"),
             (("export", "-o", str(tmp_path / "nodir" / "x.json")), 1, "RIVET_CLI_USAGE")]
    before = tree_digest(sb.pipeline)
    for args, code, name in cases:
        proc = run_cli("-c", str(config), "--json-errors", *args, env=sb.env, timeout=30)
        assert proc.returncode == code and name in proc.stderr, describe(proc)
    assert tree_digest(sb.pipeline) == before and not (tmp_path / "nodir").exists()
