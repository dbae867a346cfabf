"""PostgreSQL faults (issue 10, items 3 and 4; SPEC §7, §8a): a role without rights gets a
non-retryable permission code before anything changes, never "missing" or "first run";
a read-only session gets RIVET_STATE_READ_ONLY; statetool's own SQL failing is
RIVET_INTERNAL in one line, never retryable; a server that stops under `leases run`
ends it with a registered code and no traceback.

Real server (conftest ``pg_server``), real roles made as superuser inside each test and
dropped after; the server-stop test runs a throwaway cluster of its own.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa

from support import (Cluster, Forked, Output, describe, error_object, fork_cli, require_pg_bindir, run_cli,
                     run_cli_as_needed, tree_digest, write_config)
from statetool.backends.postgres_faults import driver_error

Role = Callable[..., str]


def _plain(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def _sql(admin: str, *statements: str) -> None:
    with psycopg.connect(_plain(admin), autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)  # type: ignore[arg-type]


def _url_as(base: str, role: str, schema: str) -> str:
    url = sa.engine.make_url(_plain(base)).set(username=role, password=None)
    query = {k: v for k, v in url.query.items() if k != "schema"}
    return url.set(query={**query, "schema": schema}).render_as_string(hide_password=False)


def _contents(admin: str, schema: str) -> dict[str, list[str]]:
    """Every row of every table of ``schema``, as text, read as superuser."""
    out: dict[str, list[str]] = {}
    with psycopg.connect(_plain(admin), autocommit=True) as conn:
        tables = [r[0] for r in conn.execute("SELECT table_name FROM information_schema.tables "
                                             "WHERE table_schema = %s ORDER BY 1", (schema,))]
        for table in tables:
            out[table] = sorted(r[0] for r in conn.execute(
                f'SELECT row_to_json(t)::text FROM "{schema}"."{table}" t'))  # type: ignore[arg-type]
    return out


def _schema_exists(admin: str, schema: str) -> bool:
    with psycopg.connect(_plain(admin), autocommit=True) as conn:
        return conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)).fetchone() is not None


def _assert_refused(proc: subprocess.CompletedProcess[str], code: str, *words: str) -> dict[str, object]:
    """The registered non-retryable ``code``, its documented exit class (generic, 1), no
    traceback, and ``words`` in the message."""
    assert "Traceback" not in proc.stderr, describe(proc)
    err = error_object(proc)
    assert (proc.returncode, err["code"], err["exit_code"], err["retryable"]) == (1, code, 1, False), describe(proc)
    message = str(err["message"])
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)
    assert "FIRST RUN" not in proc.stdout + proc.stderr and "RIVET_STATE_MISSING" not in proc.stderr, describe(proc)
    return err


@pytest.fixture
def admin(pg_server: dict[str, str]) -> str:
    return pg_server["url"]


@pytest.fixture
def role(admin: str) -> Iterator[Role]:
    """``role(*grants)``: a new LOGIN role (its name), dropped with everything it owns afterwards."""
    made: list[str] = []

    def make(*statements: str) -> str:
        name = f"r_{uuid.uuid4().hex[:10]}"
        made.append(name)
        _sql(admin, f"CREATE ROLE {name} LOGIN", *(s.format(role=name) for s in statements))
        return name

    yield make
    for name in reversed(made):
        _sql(admin, f"DROP OWNED BY {name} CASCADE", f"DROP ROLE {name}")


@pytest.fixture
def schema(admin: str) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    _sql(admin, f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def _cli(cfg: Path, url: str, *args: str) -> Output:
    return run_cli_as_needed("-c", str(cfg), "--json-errors", *args, env={"RIVET_STATE_URL": url})


@pytest.fixture
def cfg(tmp_path: Path) -> Path:
    return write_config(tmp_path / "pipeline")


@pytest.fixture
def state(cfg: Path, admin: str, schema: str) -> str:
    """A state at head in ``schema``, made by the superuser, with a cursor and a stale lease row."""
    url = _url_as(admin, sa.engine.make_url(_plain(admin)).username or "postgres", schema)
    for args in (("init",), ("exports", "set-cursor", "orders", "2026-01-01")):
        proc = _cli(cfg, url, *args)
        assert proc.returncode == 0, describe(proc)
    return url


# -- a role without CREATE on the database -------------------------------------------------


def test_init_by_a_role_without_create_on_the_database_is_refused_before_the_schema_exists(
        cfg: Path, admin: str, schema: str, role: Role) -> None:
    name = role()
    proc = _cli(cfg, _url_as(admin, name, schema), "init")
    _assert_refused(proc, "RIVET_STATE_PERMISSION_DENIED", name, schema, "GRANT CREATE ON DATABASE")
    assert not _schema_exists(admin, schema)


def _sqlite_source(tmp_path: Path) -> Path:
    cfg = write_config(tmp_path / "src")
    for args in (("init",), ("exports", "set-cursor", "orders", "2026-01-01")):
        proc = run_cli("-c", str(cfg), *args)
        assert proc.returncode == 0, describe(proc)
    return cfg


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "real"])
def test_transfer_by_a_role_without_create_is_refused_the_same_with_and_without_dry_run(
        tmp_path: Path, admin: str, schema: str, role: Role, dry_run: bool) -> None:
    cfg = _sqlite_source(tmp_path)
    before = tree_digest(cfg.parent)
    name = role()
    proc = run_cli("-c", str(cfg), "--json-errors", "transfer", "--to", _url_as(admin, name, schema),
                   *(["--dry-run"] if dry_run else []))
    _assert_refused(proc, "RIVET_STATE_PERMISSION_DENIED", name, "GRANT CREATE ON DATABASE")
    assert tree_digest(cfg.parent) == before, "the source changed"
    assert not _schema_exists(admin, schema)


# -- a schema owned by another role --------------------------------------------------------


@pytest.mark.parametrize("command", ["init", "transfer --dry-run", "transfer"])
def test_a_schema_owned_by_another_role_is_refused_naming_its_owner_and_the_grant(
        tmp_path: Path, admin: str, schema: str, role: Role, command: str) -> None:
    owner = role()
    app = role("GRANT CREATE ON DATABASE postgres TO {role}")
    _sql(admin, f'CREATE SCHEMA "{schema}" AUTHORIZATION {owner}')
    url = _url_as(admin, app, schema)
    cfg = write_config(tmp_path / "pipeline") if command == "init" else _sqlite_source(tmp_path)
    before = tree_digest(cfg.parent)
    if command == "init":
        proc = _cli(cfg, url, "init")
    else:
        proc = run_cli("-c", str(cfg), "--json-errors", "transfer", "--to", url, *command.split()[1:])
    _assert_refused(proc, "RIVET_STATE_PERMISSION_DENIED", app, owner, schema, "GRANT USAGE, CREATE ON SCHEMA")
    assert tree_digest(cfg.parent) == before
    assert _contents(admin, schema) == {}


def test_a_migration_by_a_role_that_does_not_own_the_tables_is_refused_before_any_lease(
        cfg: Path, admin: str, schema: str, state: str, role: Role) -> None:
    proc = _cli(cfg, state, "migrate", "--to", "0003", "--allow-data-loss")
    assert proc.returncode == 0, describe(proc)
    app = role(f'GRANT USAGE ON SCHEMA "{schema}" TO {{role}}',
               f'GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "{schema}" TO {{role}}',
               f'GRANT USAGE ON ALL SEQUENCES IN SCHEMA "{schema}" TO {{role}}')
    before = _contents(admin, schema)
    proc = _cli(cfg, _url_as(admin, app, schema), "migrate")
    _assert_refused(proc, "RIVET_STATE_PERMISSION_DENIED", app, "ownership of", "CREATE on schema")
    assert _contents(admin, schema) == before


# -- a SELECT-only role writing ------------------------------------------------------------

WRITES = {
    "set-cursor": ("exports", "set-cursor", "orders", "2026-02-02"),
    "migrate": ("migrate",),
    "identity rekey": ("identity", "rekey", "--old", "postgresql://db.internal:5432/sales", "--new",
                       "postgresql://db.other:5432/sales", "--reason", "test"),
    "leases release": ("leases", "release", "chunk-run:orders", "--reason", "test"),
    "leases run": ("leases", "run", "--export", "orders", "--", "true"),
}


@pytest.mark.parametrize("command", list(WRITES))
def test_a_select_only_role_writing_is_refused_as_permanent_and_nothing_changes(
        cfg: Path, admin: str, schema: str, state: str, role: Role, command: str) -> None:
    if command == "migrate":  # a migration with something to do
        proc = _cli(cfg, state, "migrate", "--to", "0003", "--allow-data-loss")
        assert proc.returncode == 0, describe(proc)
    reader = role(f'GRANT USAGE ON SCHEMA "{schema}" TO {{role}}',
                  f'GRANT SELECT ON ALL TABLES IN SCHEMA "{schema}" TO {{role}}')
    url = _url_as(admin, reader, schema)
    proc = _cli(cfg, url, "info")
    assert proc.returncode == 0, describe(proc)  # it may read
    before = _contents(admin, schema)
    proc = _cli(cfg, url, *WRITES[command])
    _assert_refused(proc, "RIVET_STATE_PERMISSION_DENIED", reader, schema, "GRANT ")
    assert _contents(admin, schema) == before


# -- a role without USAGE: never missing, never a first run --------------------------------


@pytest.mark.parametrize("command", ["check", "info", "doctor"])
@pytest.mark.parametrize("grants", ["none", "select-without-usage"])
def test_a_role_that_may_not_read_the_schema_is_told_so_never_missing_nor_first_run(
        cfg: Path, admin: str, schema: str, state: str, role: Role, command: str, grants: str) -> None:
    statements = [f'GRANT SELECT ON ALL TABLES IN SCHEMA "{schema}" TO {{role}}'] if grants != "none" else []
    name = role(*statements)
    before = _contents(admin, schema)
    proc = _cli(cfg, _url_as(admin, name, schema), command)
    assert "Traceback" not in proc.stderr, describe(proc)
    assert "FIRST RUN" not in proc.stdout + proc.stderr, describe(proc)
    assert "RIVET_STATE_MISSING" not in proc.stdout + proc.stderr, describe(proc)
    err = error_object(proc)
    assert (err["code"], err["retryable"]) == ("RIVET_STATE_PERMISSION_DENIED", False), describe(proc)
    assert proc.returncode == 1 and f'GRANT USAGE ON SCHEMA "{schema}"' in str(err["message"]), describe(proc)
    assert _contents(admin, schema) == before


# -- a read-only session -------------------------------------------------------------------


def test_a_role_whose_sessions_are_read_only_gets_read_only_not_retryable(
        cfg: Path, admin: str, schema: str, state: str, role: Role) -> None:
    name = role(f'GRANT USAGE ON SCHEMA "{schema}" TO {{role}}',
                f'GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "{schema}" TO {{role}}',
                f'GRANT USAGE ON ALL SEQUENCES IN SCHEMA "{schema}" TO {{role}}',
                "ALTER ROLE {role} SET default_transaction_read_only = on")
    before = _contents(admin, schema)
    proc = _cli(cfg, _url_as(admin, name, schema), "exports", "set-cursor", "orders", "2026-03-03")
    _assert_refused(proc, "RIVET_STATE_READ_ONLY", "default_transaction_read_only")
    assert _contents(admin, schema) == before


# -- the operator's connection parameters are kept -------------------------------------------


def test_the_urls_options_reach_the_server_beside_statetools_own(cfg: Path, admin: str, schema: str,
                                                                  state: str) -> None:
    """``options=`` in the URL (a session setting of the operator's) was replaced by
    statetool's own: here it makes the session read-only, so the write is refused."""
    before = _contents(admin, schema)
    proc = _cli(cfg, f"{state}&options=-c%20default_transaction_read_only%3Don", "exports", "set-cursor",
                "orders", "2026-03-03")
    _assert_refused(proc, "RIVET_STATE_READ_ONLY", "default_transaction_read_only")
    assert _contents(admin, schema) == before
    proc = _cli(cfg, f"{state}&options=-c%20application_name%3Dops", "exports", "set-cursor", "orders", "2026-03-03")
    assert proc.returncode == 0, describe(proc)  # statetool's search_path still holds beside the operator's


@pytest.mark.parametrize("how", ["url", "PGCONNECT_TIMEOUT"])
def test_the_operators_connect_timeout_is_kept_not_replaced_by_statetools_default(
        cfg: Path, how: str) -> None:
    """A server that accepts no session (a listening socket nobody answers): with
    ``connect_timeout=1`` (in the URL, or libpq's PGCONNECT_TIMEOUT) the run gives up after
    about a second, not after statetool's default of CONNECT_TIMEOUT seconds."""
    from statetool.backends.postgres import CONNECT_TIMEOUT

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    url = f"postgresql://u@127.0.0.1:{listener.getsockname()[1]}/db"
    env = {"RIVET_STATE_URL": f"{url}?connect_timeout=1"} if how == "url" else \
        {"RIVET_STATE_URL": url, "PGCONNECT_TIMEOUT": "1"}
    try:
        started = time.monotonic()
        proc = run_cli("-c", str(cfg), "--json-errors", "info", env=env, timeout=60)
        took = time.monotonic() - started
    finally:
        listener.close()
    assert error_object(proc)["code"] == "RIVET_STATE_UNREACHABLE", describe(proc)
    assert took < CONNECT_TIMEOUT - 3, f"gave up after {took:.1f} s: the operator's 1 s was replaced"


def test_a_connect_timeout_that_is_not_a_number_is_an_invalid_url_and_an_unusable_env_value_is_ignored(
        cfg: Path, state: str) -> None:
    proc = _cli(cfg, f"{state}&connect_timeout=abc", "info")
    _assert_refused(proc, "RIVET_STATE_URL_INVALID", "connect_timeout=abc")
    proc = run_cli("-c", str(cfg), "--json", "info", env={"RIVET_STATE_URL": state, "PGCONNECT_TIMEOUT": "abc"})
    assert proc.returncode == 0, describe(proc)


# -- one error boundary: statetool's own SQL is internal, environment faults keep their code --


def test_a_sql_error_in_an_operation_body_is_internal_in_one_line_not_retryable(
        cfg: Path, admin: str, schema: str, state: str) -> None:
    """The audit row of a write lacks its column (dropped by the superuser): the write's own
    INSERT fails with 42703 inside the transaction, after every check passed."""
    _sql(admin, f'ALTER TABLE "{schema}".rivet_audit DROP COLUMN detail')
    before = _contents(admin, schema)
    proc = _cli(cfg, state, "exports", "set-cursor", "orders", "2026-04-04")
    assert "Traceback" not in proc.stderr, describe(proc)
    err = error_object(proc)
    assert (proc.returncode, err["code"], err["retryable"]) == (6, "RIVET_INTERNAL", False), describe(proc)
    assert "42703" in str(err["message"]) and "\n" not in str(err["message"]), describe(proc)
    after = _contents(admin, schema)
    # the write got as far as its run lease (a token was drawn, the lease given back); its
    # transaction, cursor and audit row included, was rolled back
    assert after.pop("rivet_lease_tokens") != before.pop("rivet_lease_tokens")
    assert after == before


BODY_FAULTS = {
    # what the trigger on the write's audit row does: (exit code, error code)
    "RAISE EXCEPTION 'no' USING ERRCODE = 'insufficient_privilege'": (1, "RIVET_STATE_PERMISSION_DENIED"),
    "RAISE EXCEPTION 'no' USING ERRCODE = 'disk_full'": (1, "RIVET_STATE_DISK_FULL"),
    "RAISE EXCEPTION 'no' USING ERRCODE = 'read_only_sql_transaction'": (1, "RIVET_STATE_READ_ONLY"),
    "PERFORM pg_terminate_backend(pg_backend_pid())": (2, "RIVET_STATE_UNREACHABLE"),
    "RAISE EXCEPTION 'no' USING ERRCODE = 'undefined_column'": (6, "RIVET_INTERNAL"),
}


@pytest.mark.parametrize("action", list(BODY_FAULTS))
def test_a_fault_met_inside_an_operation_body_keeps_its_code(
        cfg: Path, admin: str, schema: str, state: str, action: str) -> None:
    """One classifier wherever the error happens: a trigger on rivet_audit makes the write's
    own INSERT fail, after every check passed, inside the transaction."""
    exit_code, code = BODY_FAULTS[action]
    _sql(admin, f'CREATE FUNCTION "{schema}".refuse() RETURNS trigger LANGUAGE plpgsql AS '
                f"$$ BEGIN {action}; RETURN NEW; END $$",
         f'CREATE TRIGGER refuse BEFORE INSERT ON "{schema}".rivet_audit FOR EACH ROW EXECUTE FUNCTION '
         f'"{schema}".refuse()')
    before = _contents(admin, schema)
    proc = _cli(cfg, state, "exports", "set-cursor", "orders", "2026-05-05")
    assert "Traceback" not in proc.stderr, describe(proc)
    err = error_object(proc)
    assert (proc.returncode, err["code"], err["retryable"]) == (exit_code, code, exit_code == 2), describe(proc)
    after = _contents(admin, schema)
    after.pop("rivet_lease_tokens"), before.pop("rivet_lease_tokens")  # the run lease was taken and given back
    assert after == before


def _driver_failure(url: str, statement: str, *, setup: str | None = None) -> sa.exc.DBAPIError:
    engine = sa.create_engine("postgresql+psycopg://" + _plain(url).split("://", 1)[1].split("&schema=")[0]
                              .split("?schema=")[0], poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            if setup:
                conn.exec_driver_sql(setup)
            conn.exec_driver_sql(statement)
    except sa.exc.DBAPIError as err:
        return err
    finally:
        engine.dispose()
    raise AssertionError(f"{statement} did not fail")


CLASSIFIED = {
    "undefined column (42703)": ("SELECT no_such_column FROM pg_class", None, "RIVET_INTERNAL"),
    "syntax (42601)": ("SELEKT 1", None, "RIVET_INTERNAL"),
    "undefined table (42P01)": ("SELECT * FROM no_such_table_here", None, "RIVET_INTERNAL"),
    "division by zero (22012)": ("SELECT 1 / 0", None, "RIVET_INTERNAL"),
    "read-only transaction (25006)": ("CREATE TABLE public.never_made (a int)", "SET TRANSACTION READ ONLY",
                                      "RIVET_STATE_READ_ONLY"),
    "constraint (23505)": ("INSERT INTO u VALUES (1), (1)", "CREATE TEMP TABLE u (a int PRIMARY KEY)",
                           "RIVET_STATE_WRITE_REFUSED"),
    "trigger RAISE (P0001)": ("DO $$ BEGIN RAISE EXCEPTION 'no'; END $$", None, "RIVET_STATE_WRITE_REFUSED"),
    "statement timeout (57014)": ("SELECT pg_sleep(5)", "SET statement_timeout = 50", "RIVET_STATE_UNREACHABLE"),
    "connection lost": ("SELECT pg_terminate_backend(pg_backend_pid())", None, "RIVET_STATE_UNREACHABLE"),
}
#: SQLSTATEs the server itself raises (RAISE ... USING ERRCODE), for the faults a test cannot
#: provoke for real (a full disk, a deadlock at a given instant): the code each one gets.
RAISED = {"53100": "RIVET_STATE_DISK_FULL", "53300": "RIVET_STATE_UNREACHABLE", "53200": "RIVET_STATE_UNREACHABLE",
          "40001": "RIVET_STATE_UNREACHABLE", "40P01": "RIVET_STATE_UNREACHABLE", "55P03": "RIVET_STATE_UNREACHABLE",
          "57P01": "RIVET_STATE_UNREACHABLE", "08006": "RIVET_STATE_UNREACHABLE", "42501": "RIVET_STATE_PERMISSION_DENIED",
          "25006": "RIVET_STATE_READ_ONLY", "28P01": "RIVET_STATE_AUTH_FAILED", "3D000": "RIVET_STATE_URL_INVALID",
          "23503": "RIVET_STATE_WRITE_REFUSED", "42703": "RIVET_INTERNAL", "0A000": "RIVET_INTERNAL",
          "XX000": "RIVET_INTERNAL"}
CLASSIFIED.update({f"raised {state}": (f"DO $$ BEGIN RAISE EXCEPTION 'raised' USING ERRCODE = '{state}'; END $$",
                                       None, code) for state, code in RAISED.items()})


@pytest.mark.parametrize("case", list(CLASSIFIED))
def test_driver_errors_are_classified_by_sqlstate_wherever_they_happen(admin: str, case: str) -> None:
    statement, setup, code = CLASSIFIED[case]
    error = driver_error(_driver_failure(admin, statement, setup=setup), "the test server")
    assert error.code == code, (case, error.code, error.message)
    assert "\n" not in error.message
    assert error.entry.retryable is (code == "RIVET_STATE_UNREACHABLE")
    assert error.code != "RIVET_INTERNAL" or "SQLSTATE" in error.message


def test_insufficient_privilege_is_permission_denied_with_the_grant(admin: str, role: Role) -> None:
    name = role()
    url = _url_as(admin, name, "public")
    error = driver_error(_driver_failure(url, "CREATE SCHEMA nope_never"), "the test server")
    assert (error.code, error.entry.retryable) == ("RIVET_STATE_PERMISSION_DENIED", False), error.message
    assert "GRANT CREATE ON DATABASE postgres" in error.message, error.message


# -- `leases run` when the server stops ----------------------------------------------------


@pytest.fixture
def own_server() -> Iterator[dict[str, object]]:
    """A throwaway cluster of this test's own (the shared one must never be stopped);
    ``{"url", "stop"}``."""
    cluster = Cluster(require_pg_bindir(), "statetool-pgstop-")
    try:
        yield {"url": f"{cluster.url}&schema=rivet_state", "stop": cluster.stop}
    finally:
        cluster.remove()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:  # a zombie is dead
        return fh.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_leases_run_waiting_or_holding_when_the_server_stops_ends_with_a_registered_code(
        cfg: Path, own_server: dict[str, object]) -> None:
    url = str(own_server["url"])
    env = {k: v for k, v in os.environ.items() if k != "RIVET_STATE_URL"}
    env.update({"RIVET_STATE_URL": url, "COLUMNS": "200", "NO_COLOR": "1"})
    proc = run_cli("-c", str(cfg), "init", env={"RIVET_STATE_URL": url})
    assert proc.returncode == 0, describe(proc)
    base = ["-c", str(cfg), "--json-errors"]
    holder = fork_cli(*base, "leases", "run", "--lease-ttl", "2", "--export", "orders", "--", "sleep", "120", env=env)
    waiter: Forked | None = None
    try:
        child_pid = None
        for _ in range(200):
            listed = run_cli("-c", str(cfg), "--json", "leases", env={"RIVET_STATE_URL": url})
            rows = json.loads(listed.stdout)["leases"] if listed.returncode == 0 else []
            child_pid = next((r["child_pid"] for r in rows if r["state"] == "live" and r["child_pid"]), None)
            if child_pid:
                break
            time.sleep(0.1)
        assert child_pid, "the holder never recorded its command"
        waiter = fork_cli(*base, "--lock-wait", "120", "leases", "run", "--export", "orders", "--", "true", env=env)
        time.sleep(2)  # the waiter is polling the held lease
        assert waiter.poll() is None
        own_server["stop"]()  # type: ignore[operator]
        outcomes = {}
        for name, process in (("waiter", waiter), ("holder", holder)):
            _, err = process.communicate(timeout=60)
            assert "Traceback" not in err, (name, err)
            obj = json.loads(err.strip().splitlines()[-1])
            outcomes[name] = (process.returncode, obj["code"], obj["retryable"])
        assert outcomes["waiter"] == (2, "RIVET_STATE_UNREACHABLE", True), outcomes
        assert outcomes["holder"] == (2, "RIVET_STATE_LEASE_LOST", True), outcomes
        assert not _alive(child_pid), "the command under the lost lease still runs"
    finally:
        for process in (holder, waiter):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGKILL)
                process.wait()


# -- a refused login is permanent (issue 12 fixB item 4) ------------------------------------


@pytest.mark.parametrize("who", ["a role that does not exist", "a role that may not log in"])
def test_a_login_the_server_refuses_for_its_role_is_auth_failed_not_retryable(
        cfg: Path, admin: str, role: Role, schema: str, who: str) -> None:
    """SQLSTATE 28000 (invalid_authorization_specification: no such role, NOLOGIN, no
    pg_hba.conf entry) refuses the same login every time: RIVET_STATE_AUTH_FAILED (exit 1),
    never RIVET_STATE_UNREACHABLE (exit 2, retried by a scheduler for ever)."""
    name = f"nobody_{uuid.uuid4().hex[:8]}" if who.startswith("a role that does") else role()
    if who.endswith("may not log in"):
        _sql(admin, f"ALTER ROLE {name} NOLOGIN")
    for args in (("info",), ("leases",), ("init",)):
        proc = _cli(cfg, _url_as(admin, name, schema), *args)
        _assert_refused(proc, "RIVET_STATE_AUTH_FAILED", name)
    assert not _schema_exists(admin, schema)


@pytest.mark.parametrize("fatal", ['no pg_hba.conf entry for host "[local]", user "etl", database "postgres", no encryption',
                                   'pg_hba.conf rejects connection for host "[local]", user "etl", database "postgres"',
                                   'Peer authentication failed for user "etl"'])
def test_the_other_refused_logins_the_server_names_are_auth_failed(fatal: str) -> None:
    """What libpq raises for a login refused by pg_hba.conf (its text, no SQLSTATE): the
    suite's one server accepts every local login, so the driver's own exception is built
    here with the text the server sends. Never unreachable, never "no such database"."""
    orig = psycopg.OperationalError('connection failed: connection to server on socket "/tmp/.s.PGSQL.5432" '
                                    f"failed: FATAL:  {fatal}")
    error = driver_error(sa.exc.OperationalError(None, None, orig), "the test server")
    assert (error.code, error.entry.retryable) == ("RIVET_STATE_AUTH_FAILED", False), error.message
