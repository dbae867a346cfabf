"""``statetool transfer --to URL``: a SQLite state moves into PostgreSQL (SPEC §1, §3, §6,
§9; issue #6).

Everything here is real: SQLite files built by ``statetool.example``, ``statetool migrate``
and the runtime API, the PostgreSQL server of ``conftest.pg_server``, the CLI in a child
process, and SIGKILL (tests/support/crash_driver.py runs the transfer in a process whose
``Context.on_step`` kills it at a named point; the mid-COPY kill comes from outside). What arrives in PostgreSQL is
compared row for row with what the SQLite file holds, read independently (psycopg and
sqlite3, not statetool).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pytest

from support import (PG_PASSWORD, CliRun, Forked, describe, error_object, fork_cli, process_env, run_cli,
                     tree_digest, write_config)
from statetool.schema import IN_FLIGHT_REVISION
from support.crash_driver import run_killed_at

pytestmark = pytest.mark.postgres

SOURCE_KEY = "postgresql://db.internal:5432/sales"
#: Tables whose ``id`` the destination assigns itself (not compared).
FRESH_IDS = {"rivet_audit", "rivet_load_ledger"}
#: The crash points of transfer.py and of relocate.py's retire_source, in order.
CRASH_POINTS = ("digested", "copied", "committed", "kept", "tombstoned", "swapped", "finished")
#: A text that needs every escape of COPY's text format, and one that looks like its NULL.
NASTY = "tab\there\nnew line\r\\back\\slash \\N ünïcødé 🚀 'quote' \"dq\" ,;|"
LITERAL_NULL_MARK = "\\N"
BIG_RUNS = 300_000

EXPORTS = """\
exports:
  - name: orders
    mode: incremental
  - name: order_lines
    mode: chunked
  - name: customers
    mode: full
  - name: order_events
    mode: cdc
    cdc:
      engine: mysql
      checkpoint: checkpoints/order_events.json
  - name: customer_changes
    mode: cdc
    cdc:
      engine: mongodb
      checkpoint: state/customer_changes.json
  - name: invoice_changes
    mode: cdc
    cdc:
      engine: oracle
      checkpoint: {absolute}
  - name: payment_changes
    mode: cdc
    cdc:
      engine: postgres
"""
RELATIVE_CHECKPOINTS = {"order_events": "checkpoints/order_events.json",
                        "customer_changes": "state/customer_changes.json"}


# -- PostgreSQL, read independently -------------------------------------------------------


def split_url(url: str) -> tuple[str, str]:
    """``(libpq URL without ?schema, schema)``."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    schemas = [v for k, v in query if k == "schema"]
    rest = urlencode([(k, v) for k, v in query if k != "schema"])
    return urlunsplit(("postgresql", parts.netloc, parts.path, rest, "")), (schemas[-1] if schemas else "rivet_state")


def with_schema(url: str, schema: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}schema={schema}"


def pg_fetch(admin: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(split_url(admin)[0], autocommit=True) as conn:
        cur = conn.execute(sql, params)
        return [tuple(r) for r in cur.fetchall()] if cur.description else []


def schema_exists(admin: str, schema: str) -> bool:
    return bool(pg_fetch(admin, "SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)))


def _ordered(table: str, rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    # append-only tables keep their order (read by id); the others are sets
    return rows if table in FRESH_IDS else sorted(rows, key=repr)


def pg_state(admin: str, schema: str) -> dict[str, tuple[list[str], list[tuple[Any, ...]]]]:
    """``{table: (columns, rows)}`` of every table of ``schema`` that holds a row (ids of
    the append-only tables left out); ``{}`` when the schema is absent or empty."""
    import psycopg

    out: dict[str, tuple[list[str], list[tuple[Any, ...]]]] = {}
    with psycopg.connect(split_url(admin)[0], autocommit=True) as conn:
        tables = [r[0] for r in conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s ORDER BY 1", (schema,))]
        for table in tables:
            columns = [r[0] for r in conn.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_schema = %s AND table_name = %s "
                "ORDER BY ordinal_position", (schema, table))]
            keep = [c for c in columns if not (table in FRESH_IDS and c == "id")]
            order = " ORDER BY id" if table in FRESH_IDS else ""
            quoted = ", ".join(f'"{c}"' for c in keep)
            rows = [tuple(r) for r in conn.execute(f'SELECT {quoted} FROM "{schema}"."{table}"{order}')]
            if rows:
                out[table] = (keep, _ordered(table, rows))
    return out


def sqlite_state(path: Path) -> dict[str, tuple[list[str], list[tuple[Any, ...]]]]:
    """The same shape as :func:`pg_state`, read from a SQLite file without changing it."""
    db = sqlite3.connect(f"file:{path}?immutable=1", uri=True)
    try:
        out: dict[str, tuple[list[str], list[tuple[Any, ...]]]] = {}
        tables = [r[0] for r in db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY 1")]
        for table in tables:
            columns = [r[1] for r in db.execute(f'PRAGMA table_info("{table}")')]
            keep = [c for c in columns if not (table in FRESH_IDS and c == "id")]
            order = " ORDER BY id" if table in FRESH_IDS else ""
            quoted = ", ".join(f'"{c}"' for c in keep)
            rows = [tuple(r) for r in db.execute(f'SELECT {quoted} FROM "{table}"{order}')]
            if rows:
                out[table] = (keep, _ordered(table, rows))
        return out
    finally:
        db.close()


def split_transfer_rows(state: dict[str, tuple[list[str], list[tuple[Any, ...]]]]
                        ) -> tuple[dict[str, tuple[list[str], list[tuple[Any, ...]]]], list[dict[str, Any]]]:
    """The destination without its ``transfer`` audit rows, and those rows (as dicts)."""
    columns, rows = state.get("rivet_audit", ([], []))
    action = columns.index("action") if columns else 0
    kept = [r for r in rows if r[action] != "transfer"]
    moved = [dict(zip(columns, r)) for r in rows if r[action] == "transfer"]
    rest = dict(state)
    if kept:
        rest["rivet_audit"] = (columns, kept)
    else:
        rest.pop("rivet_audit", None)
    return rest, moved


def assert_arrived(admin: str, schema: str, expected: dict[str, Any], source: Path,
                   before_transfer: dict[str, Any] | None = None) -> dict[str, Any]:
    """The destination holds exactly ``expected`` (every row of every table) plus what it
    held before (``before_transfer``, audit rows first) and ONE transfer audit row."""
    got, moved = split_transfer_rows(pg_state(admin, schema))
    assert len(moved) == 1, f"expected exactly one transfer audit row, got {moved}"
    want = dict(expected)
    if before_transfer:
        columns, rows = before_transfer.get("rivet_audit", ([], []))
        want["rivet_audit"] = (want["rivet_audit"][0], rows + want["rivet_audit"][1])
        want["rivet_identity"] = before_transfer["rivet_identity"]
    assert sorted(got) == sorted(want), f"tables with rows: {sorted(got)} vs {sorted(want)}"
    for table in want:
        assert got[table][0] == want[table][0], f"{table}: columns {got[table][0]} vs {want[table][0]}"
        assert got[table][1] == want[table][1], f"{table}: rows differ"
    detail = json.loads(moved[0]["detail"])
    assert detail["from"] == str(source)
    return moved[0]


# -- building SQLite states ------------------------------------------------------------------


def _cli_ok(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> CliRun:
    proc = run_cli(*args, cwd=cwd, env=env)
    assert proc.returncode == 0, describe(proc)
    return proc


def _checkpoint_wal(path: Path) -> None:
    db = sqlite3.connect(path)
    try:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        db.close()
    for suffix in ("-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def build_template(directory: Path, runs: int) -> Path:
    """A state at head with ``runs`` runs of history (example + migrate), in WAL mode (as
    ``init`` and the runtime make them), progress written through the runtime API, a
    ledger and run aggregates, and values that need every escape of COPY's text format.
    Returns the config path."""
    from statetool.runtime import StateStore

    directory.mkdir(parents=True)
    absolute = directory.parent / "shared-checkpoints" / "invoice_changes.json"
    absolute.parent.mkdir(parents=True, exist_ok=True)
    absolute.write_text('{"scn": 4711}\n')
    cfg = write_config(directory, exports=EXPORTS.format(absolute=absolute))
    subprocess.run([sys.executable, "-m", "statetool.example", "--config", str(cfg), "--runs", str(runs)],
                   check=True, capture_output=True)
    _cli_ok("-c", str(cfg), "migrate")
    db = sqlite3.connect(directory / ".rivet_state.db")
    assert db.execute("PRAGMA journal_mode = WAL").fetchone()[0] == "wal"
    db.close()
    store = StateStore.open(cfg, env={}, create=True)
    with store.transaction() as tx:
        run_id = tx.start_run("orders", "incremental", run_id="nasty-run")
        tx.finish_run(run_id, "failed", rows=0, bytes_read=2**40, error=NASTY, error_code="E_NASTY")
        tx.commit_cursor("orders", "incremental", LITERAL_NULL_MARK)
        tx.record_chunk("order_lines", run_id, 0, None, NASTY, "pending", rows=7)
        tx.commit_position("order_events", "mysql", {"file": "mysql-bin.000042", "pos": 91234, "note": NASTY})
    db = sqlite3.connect(directory / ".rivet_state.db")
    with db:
        db.executemany("INSERT INTO rivet_load_ledger (export_name, table_name, part, rows, loaded_at) "
                       "VALUES (?, ?, ?, ?, ?)",
                       [("orders", "sales.orders", f"part-{i:05d}.parquet", i * 100, "2026-03-01T00:00:00.000000Z")
                        for i in range(50)] + [("orders", "sales.orders", NASTY, 0, None)])
        db.executemany("INSERT INTO rivet_run_aggregates VALUES (?, ?, ?, ?, ?, ?)",
                       [(f"agg-{i}", str(cfg), "2026-03-01T00:00:00.000000Z", None, "running", None) for i in range(5)]
                       + [("agg-nasty", None, "2026-03-02T00:00:00.000000Z", "2026-03-02T00:01:00.000000Z",
                           "succeeded", json.dumps({"note": NASTY}, ensure_ascii=False))])
    db.close()
    _checkpoint_wal(directory / ".rivet_state.db")
    return cfg


def copy_pipeline(template: Path, directory: Path) -> Path:
    """A copy of the template's pipeline directory (config, state, checkpoints); its config."""
    shutil.copytree(template.parent, directory, ignore=shutil.ignore_patterns(".rivet_state.db.backup-*"))
    return directory / "rivet.yaml"


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The config of a state with 3,000 runs (built once; tests work on copies)."""
    return build_template(tmp_path_factory.mktemp("transfer") / "template", 3000)


@pytest.fixture(scope="module")
def expected(template: Path) -> dict[str, Any]:
    """Every row of every table of the template, as the destination must hold it."""
    state = sqlite_state(template.parent / ".rivet_state.db")
    assert len(state["rivet_runs"][1]) == 3001 and "rivet_load_ledger" in state and "rivet_audit" in state
    return state


@pytest.fixture
def cfg(template: Path, tmp_path: Path) -> Path:
    return copy_pipeline(template, tmp_path / "pipeline")


@pytest.fixture
def admin(pg_server: dict[str, str]) -> str:
    return pg_server["url"]


@pytest.fixture
def pw_url(pg_server: dict[str, str]) -> Iterator[str]:
    """A state URL WITH a password (role statetool_pw) and a fresh schema, dropped afterwards."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    yield with_schema(pg_server["password_url"] or pg_server["url"], schema)
    pg_fetch(pg_server["url"], f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture
def secret(pg_server: dict[str, str]) -> str | None:
    return PG_PASSWORD if pg_server["password_url"] else None


def no_secret(secret: str | None, *texts: str) -> None:
    if secret:
        for text in texts:
            at = text.find(secret)
            assert at < 0, f"the password appears in: ...{text[max(0, at - 300):at + 100]}..."


def tombstone(cfg: Path) -> dict[str, Any] | None:
    """The tombstone at the old place, parsed here (not by statetool), or None."""
    data = (cfg.parent / ".rivet_state.db").read_bytes()
    if not data.startswith(b"RIVET-STATE-RELOCATED\n"):
        return None
    return json.loads(data.split(b"\n", 1)[1])


def unmask(url: str, password: str | None) -> str:
    return url.replace(":***@", f":{password}@") if password else url


# -- 1. value for value ------------------------------------------------------------------------


def test_a_state_with_thousands_of_runs_arrives_value_for_value_and_the_old_place_refuses(
        cfg: Path, expected: dict[str, Any], admin: str, pw_url: str, secret: str | None) -> None:
    work = cfg.parent
    schema = split_url(pw_url)[1]
    db_before = (work / ".rivet_state.db").read_bytes()

    proc = run_cli("-c", str(cfg), "--json", "transfer", "--to", pw_url)
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    assert doc["done"] and not doc["dry_run"] and not doc["resumed"]
    # every table of the state holds rows here, so every copied table is in `expected`
    assert {t["table"]: t["rows"] for t in doc["tables"]} == {
        t: len(rows) for t, (_c, rows) in expected.items() if t != "rivet_state_version"}
    assert all(t["verified"] for t in doc["tables"])

    # every row of every table, value for value; the audit history plus ONE transfer row
    row = assert_arrived(admin, schema, expected, work / ".rivet_state.db")
    assert row["actor"] and row["at"]
    detail = json.loads(row["detail"])
    assert detail["rows"]["rivet_runs"] == 3001

    # the old place: a tombstone naming the new RIVET_STATE_URL, password masked
    tomb = tombstone(cfg)
    assert tomb is not None, "the old place must hold the tombstone"
    assert tomb["how"] == "statetool transfer"
    new_url = tomb["state_url"]
    parts = urlsplit(new_url)
    assert parts.scheme == "postgresql" and split_url(new_url)[1] == schema
    if secret:
        assert parts.password == "***", new_url
    assert Path(tomb["kept_as"]).read_bytes() == db_before, "the old bytes are kept, unchanged"

    refused = run_cli("-c", str(cfg), "info")
    assert refused.returncode == 5, describe(refused)
    assert "RIVET_STATE_RELOCATED" in refused.stderr
    assert f"RIVET_STATE_URL={new_url}" in "".join(refused.stderr.split()), describe(refused)  # across line wraps
    refused_json = run_cli("-c", str(cfg), "--json", "--json-errors", "info")
    assert refused_json.returncode == 5, describe(refused_json)
    err = error_object(refused_json)
    assert err["code"] == "RIVET_STATE_RELOCATED" and err["exit_class"] == 5
    assert f"RIVET_STATE_URL={new_url}" in err["message"]
    init_again = run_cli("-c", str(cfg), "init")
    assert init_again.returncode == 5, "init must not recreate an empty state at the old place\n" + describe(init_again)

    # the URL the tombstone names IS the new place: identity and progress are there
    there = run_cli("-c", str(cfg), "--json", "info", env={"RIVET_STATE_URL": unmask(new_url, secret)})
    assert there.returncode == 0, describe(there)
    info = json.loads(there.stdout)
    assert info["identity"]["recorded"] == SOURCE_KEY and info["identity"]["verdict"] == "ok"
    assert sum(e["runs_total"] for e in info["exports"]) == 3001

    # no password anywhere: every output, the tombstone, every file left beside the config,
    # every row of the destination (the audit row's command included)
    files = [p.read_bytes().decode("utf-8", "replace") for p in work.rglob("*")
             if p.is_file() and not p.name.startswith(".rivet_state.db.relocated")]
    dest_rows = repr(pg_state(admin, schema))
    no_secret(secret, proc.stdout, proc.stderr, refused.stdout, refused.stderr, refused_json.stdout,
              refused_json.stderr, init_again.stdout, init_again.stderr, there.stdout, there.stderr, *files, dest_rows)


def test_a_destination_initialised_for_this_source_receives_the_state_and_keeps_its_identity_row(
        cfg: Path, expected: dict[str, Any], admin: str, pg_url: str) -> None:
    _cli_ok("-c", str(cfg), "init", env={"RIVET_STATE_URL": pg_url})
    schema = split_url(pg_url)[1]
    before = pg_state(admin, schema)
    assert before["rivet_identity"][1][0][1] == SOURCE_KEY
    _cli_ok("-c", str(cfg), "transfer", "--to", pg_url)
    assert_arrived(admin, schema, expected, cfg.parent / ".rivet_state.db", before_transfer=before)


def test_a_schema_name_with_capitals_is_the_schema_that_receives_the_state(
        cfg: Path, expected: dict[str, Any], admin: str, pg_server: dict[str, str]) -> None:
    # PostgreSQL folds an unquoted name to lower case: the state must land in "Sales_State",
    # found there again by the URL the transfer names (it once failed as "unreachable")
    schema = f"Sales_{uuid.uuid4().hex[:8]}"
    url = with_schema(pg_server["url"], schema)
    try:
        _cli_ok("-c", str(cfg), "transfer", "--to", url)
        assert_arrived(admin, schema, expected, cfg.parent / ".rivet_state.db")
        assert not schema_exists(admin, schema.lower())
        there = _cli_ok("-c", str(cfg), "--json", "info", env={"RIVET_STATE_URL": url})
        assert sum(e["runs_total"] for e in json.loads(there.stdout)["exports"]) == 3001
    finally:
        pg_fetch(admin, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


# -- 2. SIGKILL at every point ----------------------------------------------------------------


def _nothing_or_everything(admin: str, schema: str, expected: dict[str, Any]) -> str:
    """``nothing``, ``everything``, or ``in flight``: every row, and the version table marked
    so that no one opens it before the source is retired (issue 10, item 8)."""
    got = pg_state(admin, schema)
    if not got:
        return "nothing"
    rest, moved = split_transfer_rows(got)
    columns, versions = rest["rivet_state_version"]
    in_flight = versions == [(IN_FLIGHT_REVISION,)]
    if in_flight:
        rest["rivet_state_version"] = (columns, expected["rivet_state_version"][1])
    assert len(moved) == 1 and rest == expected, "the destination holds part of the state"
    return "in flight" if in_flight else "everything"


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_sigkill_at_each_point_leaves_all_or_nothing_and_the_source_untouched_until_the_switch_and_a_rerun_converges(
        point: str, cfg: Path, expected: dict[str, Any], admin: str, pg_url: str) -> None:
    work = cfg.parent
    db = work / ".rivet_state.db"
    original = db.read_bytes()
    checkpoints_before = {n: (work / p).read_bytes() for n, p in RELATIVE_CHECKPOINTS.items()}
    schema = split_url(pg_url)[1]

    killed = run_killed_at(point, "-c", str(cfg), "transfer", "--to", pg_url)
    assert killed.returncode == -signal.SIGKILL, describe(killed)

    seen = _nothing_or_everything(admin, schema, expected)
    assert seen == {"digested": "nothing", "copied": "nothing", "finished": "everything"}.get(point, "in flight"), seen
    switched = tombstone(cfg) is not None
    assert switched == (point in ("swapped", "finished"))
    if not switched:
        assert db.read_bytes() == original, f"the source changed before the switch (killed at {point})"
    assert {n: (work / p).read_bytes() for n, p in RELATIVE_CHECKPOINTS.items()} == checkpoints_before

    rerun = run_cli("-c", str(cfg), "--json", "--json-errors", "transfer", "--to", pg_url)
    assert rerun.returncode == 0, describe(rerun)
    assert json.loads(rerun.stdout)["done"]  # after the switch: "already transferred", the destination made live
    assert _nothing_or_everything(admin, schema, expected) == "everything"
    assert_arrived(admin, schema, expected, db)
    tomb = tombstone(cfg)
    assert tomb is not None and split_url(tomb["state_url"])[1] == schema
    kept = sorted(work.glob(".rivet_state.db.relocated-*"))
    assert [str(p) for p in kept] == [tomb["kept_as"]], f"exactly one kept copy: {kept}"
    assert kept[0].read_bytes() == original
    leftovers = sorted(p.name for p in work.glob(".rivet_state.db*")
                       if p != db and not p.name.startswith(".rivet_state.db.relocated-"))
    assert leftovers == [], f"left behind beside the tombstone: {leftovers}"


# -- the big state: a kill in the middle of COPY, and flat memory ------------------------------


@pytest.fixture(scope="module")
def big_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The config of a state at head with 300,000 runs (init, then one executemany)."""
    directory = tmp_path_factory.mktemp("transfer-big") / "pipeline"
    cfg = write_config(directory)
    _cli_ok("-c", str(cfg), "init")
    db = sqlite3.connect(directory / ".rivet_state.db")
    with db:
        db.executemany("INSERT INTO rivet_runs VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", (
            (f"r{i:09d}", "orders", "incremental", "failed" if i % 17 == 16 else "succeeded",
             f"2026-01-01T00:00:{i % 60:02d}.{i % 1000000:06d}Z", "2026-01-01T01:00:00.000000Z", i * 3, 1,
             "connection reset by peer" if i % 17 == 16 else None, i * 4096, 30_000 + i % 977, None)
            for i in range(BIG_RUNS)))
    db.close()
    _checkpoint_wal(directory / ".rivet_state.db")
    return cfg


def _assert_runs_equal_streamed(path: Path, admin: str, schema: str) -> None:
    """rivet_runs in PostgreSQL equals the SQLite file's, row for row, read in batches."""
    import psycopg

    columns = [r[1] for r in sqlite3.connect(f"file:{path}?immutable=1", uri=True).execute(
        "PRAGMA table_info(rivet_runs)")]
    quoted = ", ".join(f'"{c}"' for c in columns)
    db = sqlite3.connect(f"file:{path}?immutable=1", uri=True)
    lite = db.execute(f"SELECT {quoted} FROM rivet_runs ORDER BY run_id")
    with psycopg.connect(split_url(admin)[0]) as conn, conn.cursor(name="runs") as pg:
        pg.execute(f'SELECT {quoted} FROM "{schema}".rivet_runs ORDER BY run_id COLLATE "C"')
        n = 0
        while True:
            a, b = lite.fetchmany(20_000), pg.fetchmany(20_000)
            assert [tuple(r) for r in a] == [tuple(r) for r in b], f"rivet_runs differs after row {n}"
            n += len(a)
            if not a:
                break
    db.close()
    assert n == BIG_RUNS


def test_sigkill_in_the_middle_of_copy_leaves_nothing_and_a_rerun_converges(
        big_template: Path, tmp_path: Path, admin: str, pg_url: str) -> None:
    cfg = copy_pipeline(big_template, tmp_path / "pipeline")
    db = cfg.parent / ".rivet_state.db"
    before = tree_digest(cfg.parent)
    assert set(before) == {"rivet.yaml", ".rivet_state.db"}
    schema = split_url(pg_url)[1]
    child = fork_cli("-c", str(cfg), "transfer", "--to", pg_url, env=process_env(), stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    copying = False
    while time.monotonic() < deadline and child.poll() is None and not copying:
        copying = bool(pg_fetch(admin, "SELECT 1 FROM pg_stat_activity WHERE state = 'active' AND query LIKE "
                                       "'COPY \"rivet_runs\"%%'"))
        time.sleep(0.01)
    assert copying, "never saw the COPY of rivet_runs"
    time.sleep(0.3)  # well inside the 300,000 rows
    child.send_signal(signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL

    assert pg_state(admin, schema) == {}, "a killed COPY must leave nothing in the destination"
    after = tree_digest(cfg.parent)
    assert {k: after[k] for k in before} == before, "the source changed"
    # besides: the lease files, and the -wal/-shm of the killed writer's connection (no frame)
    extra = {k for k in after if k not in before and not k.startswith(".rivet_state.leases/")}
    assert extra <= {".rivet_state.db-wal", ".rivet_state.db-shm"}, extra
    assert not (cfg.parent / ".rivet_state.db-wal").exists() or (cfg.parent / ".rivet_state.db-wal").stat().st_size == 0
    rerun = run_cli("-c", str(cfg), "transfer", "--to", pg_url, timeout=300)
    assert rerun.returncode == 0, describe(rerun)
    tomb = tombstone(cfg)
    assert tomb is not None
    _assert_runs_equal_streamed(Path(tomb["kept_as"]), admin, schema)
    assert len(split_transfer_rows(pg_state(admin, schema))[1]) == 1
    assert db.exists()


def catalog(admin: str, schema: str) -> list[tuple[Any, ...]]:
    """Every index and constraint of ``schema`` (definitions as PostgreSQL prints them)."""
    rows = pg_fetch(admin, "SELECT 'index', tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = %s "
                           "UNION ALL SELECT 'constraint', t.relname, c.conname, pg_get_constraintdef(c.oid) "
                           "FROM pg_constraint c JOIN pg_class t ON t.oid = c.conrelid "
                           "JOIN pg_namespace n ON n.oid = t.relnamespace WHERE n.nspname = %s",
                    (schema, schema))
    return sorted(tuple(str(v).replace(f"{schema}.", "<schema>.") for v in r) for r in rows)


def test_memory_stays_flat_transferring_300000_runs_and_every_index_and_key_is_there(
        big_template: Path, tmp_path: Path, admin: str, pg_url: str, pg_server: dict[str, str]) -> None:
    cfg = copy_pipeline(big_template, tmp_path / "pipeline")
    env = {k: v for k, v in os.environ.items() if k != "RIVET_STATE_URL"}
    probe = textwrap.dedent("""\
        import json, resource, subprocess, sys
        proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
        print(json.dumps({"rc": proc.returncode, "err": proc.stderr[-3000:],
                          "maxrss_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
        """)
    out = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "statetool", "-c", str(cfg),
                          "transfer", "--to", pg_url], env=env, capture_output=True, text=True, timeout=600)
    doc = json.loads(out.stdout)
    assert doc["rc"] == 0, doc["err"]
    schema = split_url(pg_url)[1]
    assert pg_fetch(admin, f'SELECT count(*) FROM "{schema}".rivet_runs') == [(BIG_RUNS,)]
    mib = doc["maxrss_kib"] / 1024
    assert mib < 200, f"peak RSS {mib:.0f} MiB transferring {BIG_RUNS} runs (limit 200 MiB)"

    # the big tables were loaded with their indexes and keys built after the COPY: the
    # destination has exactly those a new state has
    reference = f"t_{uuid.uuid4().hex[:12]}"
    try:
        _cli_ok("-c", str(cfg), "init", env={"RIVET_STATE_URL": with_schema(pg_server["url"], reference)})
        assert catalog(admin, schema) == catalog(admin, reference)
    finally:
        pg_fetch(admin, f'DROP SCHEMA IF EXISTS "{reference}" CASCADE')


# -- 3. refusals: each its code, nothing changed, no password ----------------------------------


def _other_source_state(cfg: Path, url: str) -> None:
    from statetool.runtime import StateStore

    other = write_config(cfg.parent.parent / "other", source_url="postgresql://reader@crm.internal:5432/crm")
    store = StateStore.open(other, state_url=url, env={}, create=True)
    with store.transaction() as tx:
        tx.commit_cursor("orders", "incremental", "2026-05-01T00:00:00Z")


def _this_config_progress(cfg: Path, url: str) -> None:
    from statetool.runtime import StateStore

    store = StateStore.open(cfg, state_url=url, env={}, create=True)
    with store.transaction() as tx:
        run_id = tx.start_run("order_lines", "chunked")
        tx.finish_run(run_id, "succeeded", rows=5)


REFUSALS = {
    # case: (exit code, error code)
    "another_identity": (5, "RIVET_STATE_FOREIGN"),
    "progress_of_this_config": (5, "RIVET_STATE_TARGET_NOT_EMPTY"),
    "unreachable": (2, "RIVET_STATE_UNREACHABLE"),
    "wrong_password": (1, "RIVET_STATE_AUTH_FAILED"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refused_destination_gets_its_code_and_nothing_changes_and_no_password_is_shown(
        case: str, cfg: Path, admin: str, pw_url: str, pg_server: dict[str, str], secret: str | None) -> None:
    exit_code, code = REFUSALS[case]
    schema = split_url(pw_url)[1]
    url, hidden = pw_url, [s for s in (secret,) if s]
    if case == "another_identity":
        _other_source_state(cfg, pw_url)
    elif case == "progress_of_this_config":
        _this_config_progress(cfg, pw_url)
    elif case == "unreachable":
        url, hidden = "postgresql://u:secretpw@127.0.0.1:1/db", ["secretpw"]
    else:
        if not secret:
            pytest.skip("the given PostgreSQL server has no password role")
        url, hidden = pw_url.replace(f":{secret}@", ":wrong-horse-staple@"), ["wrong-horse-staple", secret]
    source_before = tree_digest(cfg.parent)
    dest_before = pg_state(admin, schema)
    outputs = []
    for flags in ([], ["--json", "--json-errors"]):
        proc = run_cli("-c", str(cfg), *flags, "transfer", "--to", url)
        assert proc.returncode == exit_code, describe(proc)
        if flags:
            err = error_object(proc)
            assert err["code"] == code and err["exit_class"] == exit_code, err
            assert proc.stdout == ""
        else:
            assert code in proc.stderr, describe(proc)
        outputs += [proc.stdout, proc.stderr]
    assert tree_digest(cfg.parent) == source_before, "the source changed"
    assert pg_state(admin, schema) == dest_before, "the destination changed"
    if case in ("unreachable", "wrong_password"):
        assert not schema_exists(admin, schema)
    for word in hidden:
        no_secret(word, *outputs)


def test_the_destination_is_inspected_read_only_whether_its_schema_is_missing_or_empty(
        tmp_path: Path, admin: str, pw_url: str) -> None:
    from statetool.backends import open_backend
    from statetool.errors import StateError
    from statetool.location import resolve_location

    config = tmp_path / "rivet.yaml"
    source = open_backend(resolve_location(None, f"sqlite:{tmp_path}", config), 0)
    dest = open_backend(resolve_location(None, pw_url, config), 0)
    # both ways (issue 14 item 6): each end sends and receives; only file to file is relocate's
    assert source.sends_transfer and source.accepts_transfer and source.relocatable
    assert dest.accepts_transfer and dest.sends_transfer and not dest.relocatable
    with source.inspecting() as conn:  # no file there: nothing is created for the look
        assert source.table_names(conn) == set()
    assert list(tmp_path.iterdir()) == [], "inspecting a missing SQLite state created a file"
    schema = split_url(pw_url)[1]
    with dest.inspecting() as conn:
        assert dest.table_names(conn) == set()
        assert conn.scalar("SELECT current_setting('transaction_read_only')") == "on"
    assert not schema_exists(admin, schema), "inspecting a missing schema created it"
    pg_fetch(admin, f'CREATE SCHEMA "{schema}"')
    with dest.inspecting() as conn:
        assert dest.table_names(conn) == set()
    with pytest.raises(StateError) as refused, dest.reading():
        pass
    assert refused.value.code == "RIVET_STATE_MISSING", "reading, unlike inspecting, wants a state"


def test_a_source_not_at_head_is_refused_before_anything_is_written(tmp_path: Path, admin: str,
                                                                     pg_url: str) -> None:
    cfg = write_config(tmp_path / "legacy")
    subprocess.run([sys.executable, "-m", "statetool.example", "--config", str(cfg), "--runs", "200"],
                   check=True, capture_output=True)
    before = tree_digest(cfg.parent)
    proc = run_cli("-c", str(cfg), "--json-errors", "transfer", "--to", pg_url)
    assert proc.returncode == 3, describe(proc)
    assert error_object(proc)["code"] == "RIVET_STATE_MIGRATION_PENDING"
    assert tree_digest(cfg.parent) == before
    assert not schema_exists(admin, split_url(pg_url)[1])


LATE_RUN = """\
import pathlib, sqlite3, sys, time
go = pathlib.Path(sys.argv[2])
while not go.exists():
    time.sleep(0.05)
db = sqlite3.connect(sys.argv[1])
db.execute("INSERT INTO rivet_runs (run_id, export_name, mode, status, started_at) "
           "VALUES ('late-run', 'orders', 'incremental', 'succeeded', '2026-06-01T00:00:00.000000Z')")
db.commit()
db.close()
"""


def test_a_live_run_is_refused_at_lock_wait_0_and_otherwise_waited_for_and_its_rows_travel_too(
        cfg: Path, admin: str, pg_url: str) -> None:
    db = cfg.parent / ".rivet_state.db"
    go = cfg.parent.parent / "go"
    schema = split_url(pg_url)[1]
    holder = fork_cli("-c", str(cfg), "leases", "run", "--export", "orders", "--", sys.executable, "-c", LATE_RUN,
                      str(db), str(go), env=process_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    waiting: Forked | None = None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            listed = run_cli("-c", str(cfg), "--json", "leases")
            if any(row["state"] == "live" for row in json.loads(listed.stdout or '{"leases": []}')["leases"]):
                break
            time.sleep(0.2)
        db_before = db.read_bytes()
        refused = run_cli("-c", str(cfg), "--lock-wait", "0", "--json-errors", "transfer", "--to", pg_url)
        assert refused.returncode == 2, describe(refused)
        assert error_object(refused)["code"] == "RIVET_STATE_RUN_IN_PROGRESS"
        assert db.read_bytes() == db_before
        assert pg_state(admin, schema) == {}

        # without --lock-wait 0 the transfer waits for the run, which adds a run and ends
        waiting = fork_cli("-c", str(cfg), "--json", "transfer", "--to", pg_url, env=process_env())
        assert waiting.stderr is not None
        seen = []
        while not seen or ("waiting" not in seen[-1] and seen[-1]):
            seen.append(waiting.stderr.readline())
        assert "chunk-run:orders" in seen[-1], "".join(seen)
        go.touch()
        out, err = waiting.communicate(timeout=300)
        assert waiting.returncode == 0, f"{out}\n{err}"
        assert holder.wait(timeout=60) == 0
        assert pg_fetch(admin, f'SELECT count(*) FROM "{schema}".rivet_runs WHERE run_id = %s', ("late-run",)) == [(1,)]
        assert {t["table"]: t["rows"] for t in json.loads(out)["tables"]}["rivet_runs"] == 3002
    finally:
        for proc in (holder, waiting):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_live_run_of_an_export_known_only_to_the_state_holds_the_transfer_off_too(
        cfg: Path, admin: str, pg_url: str) -> None:
    # "retired" is in the state's history but no longer in the config: its run lease counts
    db = sqlite3.connect(cfg.parent / ".rivet_state.db")
    with db:
        db.execute("INSERT INTO rivet_runs (run_id, export_name, mode, status, started_at) "
                   "VALUES ('old-run', 'retired', 'full', 'succeeded', '2025-12-01T00:00:00.000000Z')")
    db.close()
    _checkpoint_wal(cfg.parent / ".rivet_state.db")
    # held as a DBA would, with no config (a config would refuse an export it does not declare)
    holder = fork_cli("leases", "run", "--export", "retired", "--", "sleep", "60", cwd=cfg.parent.parent,
                      env=process_env({"RIVET_STATE_URL": f"sqlite:{cfg.parent}"}),
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            listed = run_cli("-c", str(cfg), "--json", "leases")
            if any(row["state"] == "live" and row["key"] == "chunk-run:retired"
                   for row in json.loads(listed.stdout or '{"leases": []}')["leases"]):
                break
            time.sleep(0.2)
        proc = run_cli("-c", str(cfg), "--lock-wait", "0", "--json-errors", "transfer", "--to", pg_url)
        assert proc.returncode == 2, describe(proc)
        err = error_object(proc)
        assert err["code"] == "RIVET_STATE_RUN_IN_PROGRESS" and "chunk-run:retired" in err["message"], err
        assert pg_state(admin, split_url(pg_url)[1]) == {}
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.wait(timeout=30)


# -- 4. a second transfer, and a copy of the same state --------------------------------------


def test_a_second_transfer_of_the_same_state_is_already_done_and_a_copy_of_it_refuses(
        cfg: Path, template: Path, expected: dict[str, Any], tmp_path: Path, admin: str, pg_url: str) -> None:
    copy_cfg = copy_pipeline(template, tmp_path / "copy")
    schema = split_url(pg_url)[1]
    _cli_ok("-c", str(cfg), "transfer", "--to", pg_url)
    after_first = pg_state(admin, schema)
    source_after_first = tree_digest(cfg.parent)

    again = run_cli("-c", str(cfg), "--json-errors", "transfer", "--to", pg_url)
    assert again.returncode == 0, describe(again)  # the same move again: already done (issue 10)
    assert "Already transferred" in again.stdout
    assert f"RIVET_STATE_URL={shlex.quote(tombstone(cfg)['state_url'])}" in again.stdout.splitlines()  # type: ignore[index]
    assert tree_digest(cfg.parent) == source_after_first

    copy_before = tree_digest(copy_cfg.parent)
    copied = run_cli("-c", str(copy_cfg), "--json-errors", "transfer", "--to", pg_url)
    assert copied.returncode == 5, describe(copied)
    assert error_object(copied)["code"] == "RIVET_STATE_TARGET_NOT_EMPTY"
    assert tree_digest(copy_cfg.parent) == copy_before
    assert tree_digest(cfg.parent) == source_after_first
    assert pg_state(admin, schema) == after_first
    assert_arrived(admin, schema, expected, cfg.parent / ".rivet_state.db")


# -- 5. --dry-run ------------------------------------------------------------------------------


def test_dry_run_changes_nothing_and_prints_tables_rows_bytes_checkpoints_and_the_url_to_set(
        cfg: Path, expected: dict[str, Any], admin: str, pw_url: str, secret: str | None) -> None:
    work = cfg.parent
    schema = split_url(pw_url)[1]
    before = tree_digest(work)
    leases_before = sorted(p.name for p in (work / ".rivet_state.leases").iterdir())
    size = (work / ".rivet_state.db").stat().st_size
    absolute = {n: str(work / p) for n, p in RELATIVE_CHECKPOINTS.items()}

    human = run_cli("-c", str(cfg), "transfer", "--to", pw_url, "--dry-run")
    assert human.returncode == 0, describe(human)
    as_json = run_cli("-c", str(cfg), "--json", "transfer", "--to", pw_url, "--dry-run")
    assert as_json.returncode == 0, describe(as_json)
    assert tree_digest(work) == before, "a dry run changed the source directory"
    assert sorted(p.name for p in (work / ".rivet_state.leases").iterdir()) == leases_before, "a dry run took a lease"
    assert not schema_exists(admin, schema), "a dry run created the destination schema"

    doc = json.loads(as_json.stdout)
    assert doc["dry_run"] and not doc["done"]
    assert doc["size_bytes"] == size
    counts = {t: len(rows) for t, (_c, rows) in expected.items()}
    assert {t["table"]: t["rows"] for t in doc["tables"]} == {
        t["table"]: counts.get(t["table"], 0) for t in doc["tables"]}
    assert {"rivet_runs", "rivet_exports", "rivet_chunks", "rivet_audit", "rivet_identity"} <= {
        t["table"] for t in doc["tables"]}
    state_url = doc["state_url"]
    assert split_url(state_url)[1] == schema
    plan = {c["export"]: c for c in doc["checkpoints"]}
    # order_events' position is in the state (the template commits one): its file is not
    # read for it, so nothing is to change and nothing is warned (issue 15 item 5)
    assert plan["order_events"]["stored_in"] == "state"
    assert plan["order_events"]["set_to"] == plan["order_events"]["configured"]
    absolute.pop("order_events")
    for name, path in absolute.items():
        assert plan[name]["set_to"] == path and plan[name]["configured"] == RELATIVE_CHECKPOINTS[name]
        assert plan[name]["stored_in"] == "file"
    assert plan["invoice_changes"]["set_to"] == plan["invoice_changes"]["configured"]  # already absolute
    warned = {w["code"] + ":" + name for w in doc["warnings"] for name in RELATIVE_CHECKPOINTS
              if f"CDC export {name}:" in w["message"]}
    assert warned == {f"RIVET_STATE_CHECKPOINT_RELATIVE:{n}" for n in absolute}
    for w in doc["warnings"]:
        assert any(path in w["message"] for path in absolute.values())

    text = " ".join((human.stdout + human.stderr).split())
    for table, n in counts.items():
        if table != "rivet_state_version":
            assert table in text and str(n) in text
    assert str(size) in text
    assert f"RIVET_STATE_URL={shlex.quote(state_url)}" in human.stdout.splitlines()  # whole, on its own line
    for name, path in absolute.items():
        assert f"RIVET_STATE_CHECKPOINT_RELATIVE] CDC export {name}: its checkpoint resolves to {path}" in text
        assert f"set cdc.checkpoint to {path}" in text
    assert "nothing was changed" in text
    no_secret(secret, human.stdout, human.stderr, as_json.stdout, as_json.stderr)


# -- the COPY path itself: the checksum both ends compute, the read-ahead thread ---------------


def test_the_rows_checksum_in_python_is_the_one_postgresql_computes_for_the_same_texts(admin: str) -> None:
    from statetool.backends.copy_text import sum60

    texts = [NASTY, LITERAL_NULL_MARK, "", "r0000000001\torders\t\\N", "ünïcødé 🚀" * 40,
             *(f"r{i:010d}\t{i * 7919}\t{'x' * (i % 97)}" for i in range(5000))]
    rows = pg_fetch(admin, "SELECT coalesce(sum(('x' || substr(md5(t), 1, 15))::bit(60)::bigint), 0) "
                           "FROM unnest(%s::text[]) AS t", (texts,))
    assert sum60([t.encode() for t in texts]) == int(rows[0][0])
    assert sum60([]) == 0


def _receiving(pg_url: str, tmp_path: Path) -> Any:
    from statetool.backends import open_backend
    from statetool.location import resolve_location

    return open_backend(resolve_location(None, pg_url, tmp_path / "rivet.yaml"), 0)


def _blocks(n: int, fail: BaseException | None, bad: bool = False) -> Iterator[Any]:
    from statetool.backends.copy_text import Block, sum60

    for i in range(n):
        lines = [f"b{i}-{j}\t{j}".encode() for j in range(1000)]
        yield Block(b"\n".join(lines) + b"\n", len(lines), sum60(lines))
    if bad:
        yield Block(b"only one column\n", 1, 0)
    if fail is not None:
        raise fail


@pytest.mark.parametrize("where", ["source", "server"])
def test_an_error_reading_the_source_or_in_the_copy_is_raised_the_reader_stops_and_nothing_is_committed(
        where: str, admin: str, pg_url: str, tmp_path: Path) -> None:
    import threading

    from statetool.backends.postgres_copy import READ_AHEAD_BLOCKS

    dest = _receiving(pg_url, tmp_path)
    schema = split_url(pg_url)[1]
    broken = sqlite3.OperationalError("disk I/O error")
    with pytest.raises(Exception) as raised:
        with dest.receiving() as conn:
            conn.exec_driver_sql("CREATE TABLE t (k text PRIMARY KEY, v bigint)")
            # more blocks than the reader may hold ahead: it is stopped while it waits for room
            dest.copy_into(conn, "t", ["k", "v"], _blocks(READ_AHEAD_BLOCKS * 3, broken if where == "source" else None,
                                                          bad=where == "server"), 0, lambda n: None)
    if where == "source":
        assert raised.value is broken, raised.value
    else:
        assert getattr(raised.value, "code", None) == "RIVET_INTERNAL", raised.value  # a malformed COPY row: 22P04
    assert not [t for t in threading.enumerate() if t.name == "statetool-read-ahead"], "the reader thread outlived it"
    assert pg_fetch(admin, "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                           "WHERE n.nspname = %s", (schema,)) == [(0,)], "something of the failed COPY was committed"


def test_a_table_is_loaded_in_order_and_what_it_gained_is_what_was_sent(pg_url: str, tmp_path: Path,
                                                                         admin: str) -> None:
    dest = _receiving(pg_url, tmp_path)
    seen: list[int] = []
    with dest.receiving() as conn:
        conn.exec_driver_sql("CREATE TABLE t (k text PRIMARY KEY, v bigint)")
        loaded = dest.copy_into(conn, "t", ["k", "v"], _blocks(20, None), 20_000, seen.append)
    assert (loaded.sent_rows, loaded.gained_rows) == (20_000, 20_000)
    assert loaded.sent_checksum == loaded.gained_checksum
    assert seen == [1000] * 20
    schema = split_url(pg_url)[1]
    assert pg_fetch(admin, f'SELECT k FROM "{schema}".t ORDER BY ctid LIMIT 3') == [("b0-0",), ("b0-1",), ("b0-2",)]
    # the big empty table was loaded without its key, built again after the COPY
    assert pg_fetch(admin, "SELECT count(*) FROM pg_constraint c JOIN pg_class t ON t.oid = c.conrelid JOIN "
                           "pg_namespace n ON n.oid = t.relnamespace WHERE n.nspname = %s AND c.contype = 'p'",
                    (schema,)) == [(1,)]


@pytest.mark.parametrize("length_limit", [None, 4000])
def test_the_source_blocks_carry_every_row_once_as_copy_text_however_a_block_is_read(tmp_path: Path,
                                                                                     length_limit: int | None) -> None:
    """The source's blocks (SQLite joins the rows of a block with group_concat): every row
    exactly once, as its COPY line, with the checksum of its text, whether the block was
    joined by SQLite, held a value to escape (read again value by value), or was too long for
    SQLite to join (a length limit of 4,000 bytes: every block of rows, ``SQLITE_TOOBIG``).
    Rowids with gaps, NULLs, and the text COPY must escape; the lines are compared with ones
    built here, value by value."""
    import sqlalchemy as sa

    from statetool.backends.copy_text import ESCAPES, row_checksum
    from statetool.backends.sqlite_rows import BATCH_ROWS, copy_blocks

    path = tmp_path / "rows.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE t (k TEXT NOT NULL, n INTEGER, note TEXT)")
    rows = [(f"k{i:06d}", None if i % 11 == 0 else i * 7919, NASTY if i == 100 else None if i % 3 else f"n{i}")
            for i in range(3 * BATCH_ROWS + 123)]
    db.executemany("INSERT INTO t VALUES (?, ?, ?)", rows)
    db.execute("DELETE FROM t WHERE rowid % 7 = 0")
    db.commit()
    kept = [r for i, r in enumerate(rows, start=1) if i % 7]
    db.close()
    expected = {"\t".join("\\N" if v is None else str(v).translate(ESCAPES) for v in r) for r in kept}
    engine = sa.create_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            if length_limit is not None:
                conn.connection.driver_connection.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, length_limit)
            blocks = list(copy_blocks(conn, "t", ["k", "n", "note"]))
    finally:
        engine.dispose()
    lines = [line.decode() for b in blocks for line in b.data.split(b"\n")[:-1]]
    assert all(b.data.endswith(b"\n") and b.rows == b.data.count(b"\n") for b in blocks)
    assert len(lines) == len(kept) and set(lines) == expected
    assert sum(b.rows for b in blocks) == len(kept)
    assert sum(b.checksum for b in blocks) == sum(row_checksum(r) for r in kept)
    assert len(blocks) == -(-len(kept) // BATCH_ROWS)


@pytest.mark.parametrize(("column", "value", "says"), [
    ("error", b"\x00\x01binary\xff", "is not UTF-8"),
    ("error", "before\x00after", "NUL"),
    ("rows", "abc", "invalid input syntax for type bigint"),
], ids=["blob", "nul-in-text", "text-in-bigint"])
def test_a_value_postgresql_cannot_hold_is_refused_by_name_and_nothing_changes(
        cfg: Path, admin: str, pg_url: str, column: str, value: object, says: str) -> None:
    """A hand edit left a value in the source that no PostgreSQL column of its type can hold:
    the transfer is refused ``RIVET_STATE_VALUE_UNTRANSFERABLE`` (exit 5), naming the table,
    and what is wrong; the source is byte-identical and no schema is left at the
    destination (found by a fresh user: each was ``RIVET_INTERNAL``, "a bug in statetool").
    The lease records the transfer took and released change, as any run's do."""
    db = sqlite3.connect(cfg.parent / ".rivet_state.db")
    with db:
        rowid = db.execute("SELECT max(rowid) FROM rivet_runs").fetchone()[0] // 2
        db.execute(f"UPDATE rivet_runs SET {column} = ? WHERE rowid = ?", (value, rowid))
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    def files() -> dict[str, str]:
        return {k: v for k, v in tree_digest(cfg.parent).items() if not k.startswith(".rivet_state.leases")}

    before = files()
    proc = run_cli("-c", str(cfg), "--json-errors", "transfer", "--to", pg_url)
    error = error_object(proc)
    assert proc.returncode == 5 and error["code"] == "RIVET_STATE_VALUE_UNTRANSFERABLE", describe(proc)
    assert "rivet_runs" in error["message"] and says in error["message"], describe(proc)
    assert files() == before, describe(proc)
    assert pg_fetch(admin, "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                           "WHERE n.nspname = %s", (split_url(pg_url)[1],)) == [(0,)], describe(proc)
