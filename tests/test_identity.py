"""SPEC §3: the state's identity (``state_key``), the decision table in all three scopes,
read-only commands that never stamp, and the audited re-key."""

from __future__ import annotations

import json
import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import pytest

from support import describe, error_object, run_cli, tree_digest
from statetool.errors import StateError
from statetool.identity import identity_verdict, identity_warning, state_key
from statetool.operations.context import Context
from statetool.operations.create import init
from statetool.operations.identity_ops import adopt, rekey
from statetool.operations.migrate import migrate
from statetool.runtime import StateStore
from support.backends import StateBackend

SCOPES = ("declared_dir", "beside_config", "shared")

OURS = "postgresql://reader:pw-ours@db.internal:5432/sales"
OURS_KEY = "postgresql://db.internal:5432/sales"
OTHER = "postgresql://reader@db-old.internal:5432/sales"
OTHER_KEY = "postgresql://db-old.internal:5432/sales"

CONFIG = """\
source:
  url_env: SALES_DB_URL
exports:
  - name: orders
    mode: incremental
  - name: order_lines
    mode: chunked
"""


# -- state_key -------------------------------------------------------------------------


@pytest.mark.parametrize("url, key", [
    ("postgresql://reader@db.internal:5432/sales", "postgresql://db.internal:5432/sales"),
    ("postgres://reader@db.internal/sales", "postgresql://db.internal:5432/sales"),
    ("POSTGRES://reader@DB.Internal/sales", "postgresql://db.internal:5432/sales"),
    ("postgresql+psycopg://reader:secret@db.internal:6432/sales", "postgresql://db.internal:6432/sales"),
    ("postgresql+psycopg2://db.internal/sales?sslmode=require&application_name=x",
     "postgresql://db.internal:5432/sales"),
    ("mysql://root:pw@MySQL.Internal/shop", "mysql://mysql.internal:3306/shop"),
    ("mysql+pymysql://u@mysql.internal:3307/shop", "mysql://mysql.internal:3307/shop"),
    ("mongodb://u:p@mongo.internal/events", "mongodb://mongo.internal:27017/events"),
    ("oracle://u:p@ora.internal/ORCL", "oracle://ora.internal:1521/ORCL"),
    ("mssql+pyodbc://u:p@sql.internal/dw", "mssql://sql.internal:1433/dw"),
    ("postgresql://reader@[::1]/sales", "postgresql://[::1]:5432/sales"),
    ("postgresql://reader@[FE80::1]:5433/sales", "postgresql://[fe80::1]:5433/sales"),
    ("postgresql://db.internal/sales/extra", "postgresql://db.internal:5432/sales"),
])
def test_state_key_is_canonical_scheme_host_port_database(url: str, key: str) -> None:
    assert state_key(url) == key


def test_state_key_never_carries_user_password_or_query() -> None:
    key = state_key("postgres://etl_user:hunter2-secret@db.internal:5432/sales?sslmode=verify-full&password=x2")
    assert key == "postgresql://db.internal:5432/sales"
    for leaked in ("etl_user", "hunter2", "sslmode", "x2", "@", "?"):
        assert leaked not in key


@pytest.mark.parametrize("scheme, port", [("postgresql", 5432), ("postgres", 5432), ("mysql", 3306),
                                          ("mariadb", 3306), ("mongodb", 27017), ("oracle", 1521), ("mssql", 1433)])
def test_state_key_fills_each_engines_default_port(scheme: str, port: int) -> None:
    canonical = "postgresql" if scheme == "postgres" else scheme
    assert state_key(f"{scheme}://host.internal/db") == f"{canonical}://host.internal:{port}/db"


def test_same_source_spelled_differently_has_one_key() -> None:
    spellings = ["postgres://a@DB.internal/sales", "postgresql://b:pw@db.INTERNAL:5432/sales",
                 "postgresql+psycopg://db.internal/sales?sslmode=require"]
    assert {state_key(s) for s in spellings} == {"postgresql://db.internal:5432/sales"}


@pytest.mark.parametrize("url", [None, "", "   ", "not a url", "db.internal:5432/sales",
                                 "postgresql://db.internal:notaport/sales", "postgresql://db.internal:99999/sales",
                                 "postgresql://reader@/sales", "postgresql:///sales", "sqlite:///x.db"])
def test_state_key_is_empty_when_it_cannot_be_computed(url: str | None) -> None:
    assert state_key(url) == ""


@pytest.mark.parametrize("url", ["postgres://u:p@DB.Internal/sales", "mysql+pymysql://u@h:3307/shop",
                                 "mongodb+srv://u:p@cluster.example/events", "postgresql://[FE80::1]/x",
                                 "oracle://ora.internal/ORCL", "postgresql://h"])
def test_state_key_of_a_state_key_is_itself(url: str) -> None:
    key = state_key(url)
    assert key and state_key(key) == key


# -- the decision table as a pure function ---------------------------------------------


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("recorded", [None, "", OTHER_KEY, OURS_KEY])
@pytest.mark.parametrize("progress", [False, True])
def test_empty_computed_key_skips_in_every_scope(scope: str, recorded: str | None, progress: bool) -> None:
    verdict = identity_verdict(recorded, "", scope, progress)
    assert (verdict.action, verdict.code, verdict.writes) == ("skip", None, False)


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("recorded", [None, ""])
def test_no_recorded_key_and_no_progress_stamps_in_every_scope(scope: str, recorded: str | None) -> None:
    verdict = identity_verdict(recorded, OURS_KEY, scope, False)
    assert (verdict.action, verdict.code, verdict.writes, verdict.recorded) == ("stamp", None, True, None)


@pytest.mark.parametrize("scope", SCOPES)
def test_no_recorded_key_with_progress_adopts_with_a_warning_in_every_scope(scope: str) -> None:
    verdict = identity_verdict(None, OURS_KEY, scope, True)
    assert (verdict.action, verdict.code, verdict.writes) == ("adopt", "RIVET_STATE_IDENTITY_ADOPTED", True)


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("progress", [False, True])
def test_equal_keys_are_ok_in_every_scope(scope: str, progress: bool) -> None:
    verdict = identity_verdict(OURS_KEY, OURS_KEY, scope, progress)
    assert (verdict.action, verdict.code, verdict.writes) == ("ok", None, False)


@pytest.mark.parametrize("progress", [False, True])
@pytest.mark.parametrize("scope, action, code", [
    ("declared_dir", "refuse", "RIVET_STATE_FOREIGN"),
    ("beside_config", "warn", "RIVET_STATE_FOREIGN_BESIDE_CONFIG"),
    ("shared", "report", None),
])
def test_different_keys_depend_on_the_scope(scope: str, action: str, code: str | None, progress: bool) -> None:
    verdict = identity_verdict(OTHER_KEY, OURS_KEY, scope, progress)
    assert (verdict.action, verdict.code, verdict.writes) == (action, code, False)
    assert (verdict.recorded, verdict.computed) == (OTHER_KEY, OURS_KEY)


# -- real states in the three scopes ---------------------------------------------------


@dataclass
class Scope:
    """One state location of the table's three columns, with a config whose source URL
    comes from ``SALES_DB_URL`` (so each command chooses the computed key by its env)."""

    name: str
    config: Path
    state_url: str | None
    state_dir: Path | None

    def env(self, source: str | None) -> dict[str, str]:
        env = {"RIVET_STATE_URL": self.state_url} if self.state_url else {}
        if source:
            env["SALES_DB_URL"] = source
        return env

    def ctx(self, source: str | None) -> Context:
        return Context(self.config, None, self.env(source), 30.0, command="test")

    def fingerprint(self) -> object:
        """Every byte of a SQLite state's folder; the state's rows on PostgreSQL."""
        if self.state_dir is not None:
            listing = sorted(str(p.relative_to(self.state_dir)) for p in self.state_dir.rglob("*"))
            return tree_digest(self.state_dir), listing
        return [self.rows(f"SELECT * FROM {t} ORDER BY 1")
                for t in ("rivet_identity", "rivet_audit", "rivet_exports", "rivet_runs", "rivet_chunks")]

    def rows(self, sql: str) -> list[tuple[object, ...]]:
        if self.state_dir is not None:
            db = self.state_dir / ".rivet_state.db"
            assert not Path(f"{db}-wal").exists(), "a writer left its -wal behind"
            conn = sqlite3.connect(f"file:{db}?immutable=1", uri=True)
            try:
                return [tuple(r) for r in conn.execute(sql).fetchall()]
            finally:
                conn.close()
        import psycopg

        assert self.state_url is not None
        schema = re.search(r"[?&]schema=([^&]+)", self.state_url)[1]
        base = re.sub(r"[?&]schema=[^&]+", "", self.state_url)
        with psycopg.connect(base, options=f"-c search_path={schema}") as conn:
            return [tuple(r) for r in conn.execute(sql).fetchall()]

    def recorded(self) -> list[str]:
        return [r[0] for r in self.rows("SELECT state_key FROM rivet_identity")]

    def audit(self) -> list[tuple[object, ...]]:
        return self.rows("SELECT actor, command, action, detail FROM rivet_audit ORDER BY id")


def test_each_identity_warning_has_one_text_for_reads_and_writes() -> None:
    adopted = identity_verdict(None, OURS_KEY, "declared_dir", True)
    beside = identity_verdict(OTHER_KEY, OURS_KEY, "beside_config", False)
    for verdict in (adopted, beside):
        for for_write in (False, True):
            warning = identity_warning(verdict, "/srv/rivet", for_write)
            assert warning is not None and warning.code == verdict.code
            assert OURS_KEY in warning.message and ("would adopt" in warning.message) == (  # a read says what a write would do
                verdict.code == "RIVET_STATE_IDENTITY_ADOPTED" and not for_write), warning.message
    assert identity_warning(identity_verdict(OTHER_KEY, OURS_KEY, "declared_dir", False), "/srv/rivet", False) is None
    assert identity_warning(identity_verdict(OURS_KEY, OURS_KEY, "shared", True), "/srv/rivet", False) is None


def _backend_of(name: str, tmp_path: Path, request: pytest.FixtureRequest) -> StateBackend:
    """The backend of scope ``name``: a declared SQLite directory, SQLite beside the config,
    or a PostgreSQL schema (the shared store)."""
    if name == "declared_dir":
        (tmp_path / "state").mkdir()
        return StateBackend.sqlite(tmp_path, declared=tmp_path / "state")
    if name == "beside_config":
        return StateBackend.sqlite(tmp_path)
    return StateBackend.postgres(tmp_path, request.getfixturevalue("pg_url"))


def make_scope(name: str, tmp_path: Path, request: pytest.FixtureRequest) -> Scope:
    backend = _backend_of(name, tmp_path, request)
    backend.pipeline.mkdir()
    config = backend.pipeline / "rivet.yaml"
    config.write_text(CONFIG)
    return Scope(name, config, backend.url, backend.state_dir)


@pytest.fixture(params=[pytest.param(name, marks=[pytest.mark.postgres] if name == "shared" else [])
                        for name in SCOPES])
def scope(request: pytest.FixtureRequest, tmp_path: Path) -> Scope:
    return make_scope(request.param, tmp_path, request)


def add_progress(scope: Scope, source: str | None) -> None:
    """What a pipeline run leaves: a finished run, a cursor, chunk checkpoints."""
    store = StateStore.open(scope.config, env=scope.env(source), lock_wait=30, create=True)
    with store.transaction() as tx:
        run_id = tx.start_run("orders", "incremental")
        tx.commit_cursor("orders", "incremental", "2026-11-29T00:00:00.000000Z")
        tx.finish_run(run_id, "succeeded", rows=42, files=1)
        lines = tx.start_run("order_lines", "chunked")
        for index in range(3):
            tx.record_chunk("order_lines", lines, index, str(index * 10), str(index * 10 + 10), "done", rows=10)


def foreign_state(scope: Scope) -> None:
    """A state stamped with OTHER's key, with progress."""
    init(scope.ctx(OTHER))
    add_progress(scope, OTHER)
    assert scope.recorded() == [OTHER_KEY]


def check_row(proc, check_id: str) -> dict:
    return next(c for c in json.loads(proc.stdout)["checks"] if c["id"] == check_id)


def test_empty_computed_key_stamps_nothing_and_compares_nothing(scope: Scope) -> None:
    created = run_cli("-c", str(scope.config), "init", "--json", env=scope.env(None))
    assert created.returncode == 0, describe(created)
    assert json.loads(created.stdout)["state_key"] is None, describe(created)
    add_progress(scope, None)
    assert scope.recorded() == []
    # Any recorded key, empty computed key: a write compares nothing, even in a declared dir.
    adopt(scope.ctx(OTHER))
    assert scope.recorded() == [OTHER_KEY]
    reset = run_cli("-c", str(scope.config), "exports", "reset", "orders", "--json", env=scope.env(None))
    assert reset.returncode == 0, describe(reset)
    assert json.loads(reset.stdout)["warnings"] == [], describe(reset)
    assert scope.recorded() == [OTHER_KEY]


def test_first_write_stamps_a_state_without_identity_or_progress(scope: Scope) -> None:
    init(scope.ctx(None))
    assert scope.recorded() == []
    proc = run_cli("-c", str(scope.config), "identity", "adopt", "--json", env=scope.env(OURS))
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    assert (doc["recorded"], doc["changed"], doc["warnings"]) == (OURS_KEY, True, []), describe(proc)
    assert scope.recorded() == [OURS_KEY]
    actor, command, action, detail = scope.audit()[-1]
    assert action == "identity.stamp" and "identity" in command
    assert json.loads(detail)["new"] == OURS_KEY


def test_runtime_open_stamps_a_state_without_identity_or_progress(scope: Scope) -> None:
    init(scope.ctx(None))
    store = StateStore.open(scope.config, env=scope.env(OURS), lock_wait=30, create=True)
    assert store.warnings == []
    assert scope.recorded() == [OURS_KEY]


def test_runtime_creating_a_state_stamps_it(scope: Scope) -> None:
    store = StateStore.open(scope.config, env=scope.env(OURS), lock_wait=30, create=True)
    assert [w.code for w in store.warnings] == ["RIVET_STATE_CREATED"]
    assert scope.recorded() == [OURS_KEY]


def test_migrating_an_older_revision_stamps_a_state_without_progress(scope: Scope) -> None:
    init(scope.ctx(None))
    migrate(scope.ctx(None), to="0002", allow_data_loss=True)
    proc = run_cli("-c", str(scope.config), "migrate", "--json", env=scope.env(OURS))
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    assert (doc["applied"], doc["from_revision"], doc["warnings"]) == (True, "0002", []), describe(proc)
    assert scope.recorded() == [OURS_KEY]


def test_state_with_progress_and_no_identity_is_adopted_with_a_warning(scope: Scope) -> None:
    init(scope.ctx(None))
    add_progress(scope, None)
    before = scope.fingerprint()
    check = run_cli("-c", str(scope.config), "check", "--json", env=scope.env(OURS))
    assert check.returncode == 0, describe(check)
    row = check_row(check, "identity")
    assert (row["status"], row["code"]) == ("warn", "RIVET_STATE_IDENTITY_ADOPTED"), describe(check)
    assert scope.fingerprint() == before, describe(check)

    proc = run_cli("-c", str(scope.config), "identity", "adopt", "--json", env=scope.env(OURS))
    assert proc.returncode == 0, describe(proc)
    assert [w["code"] for w in json.loads(proc.stdout)["warnings"]] == ["RIVET_STATE_IDENTITY_ADOPTED"], describe(proc)
    assert scope.recorded() == [OURS_KEY]
    assert scope.audit()[-1][2] == "identity.adopt"


def test_runtime_open_adopts_a_state_with_progress_with_a_warning(scope: Scope) -> None:
    init(scope.ctx(None))
    add_progress(scope, None)
    store = StateStore.open(scope.config, env=scope.env(OURS), lock_wait=30, create=True)
    assert [w.code for w in store.warnings] == ["RIVET_STATE_IDENTITY_ADOPTED"]
    assert OURS_KEY in store.warnings[0].message
    assert scope.recorded() == [OURS_KEY]


def test_matching_identity_is_ok(scope: Scope) -> None:
    init(scope.ctx(OURS))
    add_progress(scope, OURS)
    proc = run_cli("-c", str(scope.config), "check", "--json", "--strict", env=scope.env(OURS))
    assert proc.returncode == 0, describe(proc)
    row = check_row(proc, "identity")
    assert (row["status"], row["code"]) == ("ok", None), describe(proc)
    assert scope.recorded() == [OURS_KEY]


def test_read_only_commands_never_stamp(scope: Scope) -> None:
    init(scope.ctx(None))
    before = scope.fingerprint()
    for command in (("info",), ("check",), ("identity", "show")):
        proc = run_cli("-c", str(scope.config), *command, "--json", env=scope.env(OURS))
        assert proc.returncode == 0, describe(proc)
        assert scope.fingerprint() == before, describe(proc)
        doc = json.loads(proc.stdout)
        if command == ("info",):
            assert (doc["identity"]["recorded"], doc["identity"]["verdict"]) == (None, "stamp"), describe(proc)
        if command == ("identity", "show"):
            assert (doc["recorded"], doc["computed"], doc["verdict"]) == (None, OURS_KEY, "stamp"), describe(proc)
    assert scope.recorded() == []


def test_foreign_state_in_declared_dir_is_refused_byte_identical(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    scope = make_scope("declared_dir", tmp_path, request)
    foreign_state(scope)
    assert scope.state_dir is not None
    before, config_before = scope.fingerprint(), tree_digest(scope.config.parent)
    for command in (("exports", "reset", "orders"),):  # every other write: test_refusals.py
        proc = run_cli("-c", str(scope.config), *command, "--json-errors", env=scope.env(OURS))
        assert proc.returncode == 5, describe(proc)
        error = error_object(proc)
        assert error["code"] == "RIVET_STATE_FOREIGN", describe(proc)
        assert str(scope.state_dir) in error["message"] and OTHER_KEY in error["message"], describe(proc)
        assert "choose another state directory" in error["action"], describe(proc)
        assert scope.fingerprint() == before, describe(proc)
        assert tree_digest(scope.config.parent) == config_before, describe(proc)
    with pytest.raises(StateError) as caught:
        StateStore.open(scope.config, env=scope.env(OURS), lock_wait=30, create=True)
    assert caught.value.code == "RIVET_STATE_FOREIGN"
    assert scope.fingerprint() == before


def test_foreign_state_beside_config_warns_and_goes_on(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    scope = make_scope("beside_config", tmp_path, request)
    foreign_state(scope)
    check = run_cli("-c", str(scope.config), "check", "--json", env=scope.env(OURS))
    assert check.returncode == 0, describe(check)
    row = check_row(check, "identity")
    assert (row["status"], row["code"]) == ("warn", "RIVET_STATE_FOREIGN_BESIDE_CONFIG"), describe(check)
    strict = run_cli("-c", str(scope.config), "check", "--strict", env=scope.env(OURS))
    assert strict.returncode == 5, describe(strict)

    # doctor reports it with the same one text (identity.identity_warning) as check's row.
    doctor = run_cli("-c", str(scope.config), "--json", "doctor", env=scope.env(OURS))
    found = [r for r in json.loads(doctor.stdout)["state"]["reasons"] if r["code"] == row["code"]]
    assert [r["message"] for r in found] == [row["message"]], describe(doctor)

    reset = run_cli("-c", str(scope.config), "exports", "reset", "orders", env=scope.env(OURS))
    assert reset.returncode == 0, describe(reset)
    assert "RIVET_STATE_FOREIGN_BESIDE_CONFIG" in reset.stderr and OTHER_KEY in reset.stderr, describe(reset)
    assert scope.rows("SELECT cursor_value FROM rivet_exports WHERE export_name = 'orders'") == [(None,)]
    assert scope.recorded() == [OTHER_KEY]


def test_foreign_state_in_postgres_is_reported_only(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    scope = make_scope("shared", tmp_path, request)
    foreign_state(scope)
    show = run_cli("-c", str(scope.config), "identity", "show", "--json", env=scope.env(OURS))
    assert show.returncode == 0, describe(show)
    doc = json.loads(show.stdout)
    assert (doc["verdict"], doc["code"]) == ("report", None), describe(show)
    assert OTHER_KEY in doc["message"] and OURS_KEY in doc["message"], describe(show)

    reset = run_cli("-c", str(scope.config), "exports", "reset", "orders", "--json", env=scope.env(OURS))
    assert reset.returncode == 0, describe(reset)
    assert json.loads(reset.stdout)["warnings"] == [], describe(reset)
    assert scope.rows("SELECT cursor_value FROM rivet_exports WHERE export_name = 'orders'") == [(None,)]
    assert scope.recorded() == [OTHER_KEY]


def test_rekey_refuses_a_wrong_old_key_and_changes_nothing(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    scope = make_scope("declared_dir", tmp_path, request)
    foreign_state(scope)
    before = scope.fingerprint()
    proc = run_cli("-c", str(scope.config), "identity", "rekey", "--old", "postgresql://elsewhere:5432/sales",
                   "--new", OURS_KEY, "--json-errors", env=scope.env(OURS))
    assert proc.returncode == 5, describe(proc)
    error = error_object(proc)
    assert error["code"] == "RIVET_STATE_IDENTITY_MISMATCH", describe(proc)
    assert OTHER_KEY in error["message"], describe(proc)
    assert scope.fingerprint() == before, describe(proc)


def test_rekey_with_the_recorded_key_changes_it_and_leaves_an_audit_row(scope: Scope) -> None:
    foreign_state(scope)
    audit_before = scope.audit()
    proc = run_cli("-c", str(scope.config), "identity", "rekey", "--old", OTHER_KEY, "--new", OURS_KEY,
                   "--reason", "sales database moved to db.internal", "--json", env=scope.env(OURS))
    assert proc.returncode == 0, describe(proc)
    assert json.loads(proc.stdout)["recorded"] == OURS_KEY, describe(proc)
    assert scope.recorded() == [OURS_KEY]
    audit = scope.audit()
    assert audit[:len(audit_before)] == audit_before
    assert len(audit) == len(audit_before) + 1
    actor, command, action, detail = audit[-1]
    assert action == "identity.rekey"
    assert command.startswith("statetool") and "identity rekey" in command
    assert "@" in actor
    assert json.loads(detail) == {"old": OTHER_KEY, "new": OURS_KEY, "reason": "sales database moved to db.internal"}
    check = run_cli("-c", str(scope.config), "check", "--json", "--strict", env=scope.env(OURS))
    assert check.returncode == 0, describe(check)


def test_rekey_stores_the_canonical_key_of_a_url_and_never_its_password(tmp_path: Path,
                                                                        request: pytest.FixtureRequest) -> None:
    scope = make_scope("declared_dir", tmp_path, request)
    foreign_state(scope)
    proc = run_cli("-c", str(scope.config), "identity", "rekey", "--old", OTHER_KEY,
                   "--new", "postgres://admin:hunter2-rekey@DB.Internal/sales", env=scope.env(OURS))
    assert proc.returncode == 0, describe(proc)
    assert "hunter2-rekey" not in proc.stdout + proc.stderr, describe(proc)
    assert scope.recorded() == [OURS_KEY]
    assert "hunter2-rekey" not in json.dumps(scope.audit())


def test_rekey_to_something_that_is_not_a_key_is_refused(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    scope = make_scope("declared_dir", tmp_path, request)
    foreign_state(scope)
    before = scope.fingerprint()
    with pytest.raises(StateError) as caught:
        rekey(scope.ctx(OURS), OTHER_KEY, "db.internal/sales")
    assert caught.value.code == "RIVET_STATE_KEY_UNCOMPUTABLE"
    assert scope.fingerprint() == before
