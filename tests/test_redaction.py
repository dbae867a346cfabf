"""SPEC §7: no password of any URL appears in any output, JSON, error, traceback or audit row."""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from pathlib import Path

import pytest

from support import PG_PASSWORD, describe, error_object, run_cli, write_config
from statetool.errors import StateError
from statetool.location import resolve_location
from statetool import errors
from statetool.redact import MASK, redact_text, redact_url, remember_secrets


# -- redact_text -----------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("postgresql://rivet:s3cr3t@pg.internal:5432/state", "postgresql://rivet:***@pg.internal:5432/state"),
    ("postgresql+psycopg://rivet:s3cr3t@pg.internal/state?schema=x",
     "postgresql+psycopg://rivet:***@pg.internal/state?schema=x"),
    ("mysql://root:a%40b@mysql.internal/shop", "mysql://root:***@mysql.internal/shop"),
    ("redis://:only-a-password@cache:6379/0", "redis://:***@cache:6379/0"),
    ("connect to postgres://u:p1@h1/db failed; fell back to postgres://v:p2@h2/db",
     "connect to postgres://u:***@h1/db failed; fell back to postgres://v:***@h2/db"),
    ("host=pg.internal password=s3cr3t user=rivet", "host=pg.internal password=*** user=rivet"),
    ("PASSWORD = 's3 cr3t' dbname=x", "PASSWORD = *** dbname=x"),
    ('pwd="s3cr3t";server=x', "pwd=***;server=x"),
])
def test_redact_text_masks_url_passwords_and_password_pairs(text: str, expected: str) -> None:
    assert redact_text(text) == expected


@pytest.mark.parametrize("text", [
    "postgresql://rivet@pg.internal:5432/state",
    "postgresql:///state?host=/var/run/postgresql",
    "sqlite:/srv/rivet/state",
    "the state at /srv/rivet/state/.rivet_state.db belongs to postgresql://db.internal:5432/sales",
    "at 12:30:01 user@host ran statetool",
])
def test_redact_text_leaves_text_without_a_password_alone(text: str) -> None:
    assert redact_text(text) == text


def test_redact_text_masks_a_password_that_contains_at_and_slash() -> None:
    # Ambiguous userinfo: everything up to the last '@' is masked, the user too (which
    # part is the user is exactly what cannot be known).
    out = redact_text("postgres://user:Pa@ss/w0rd@host:5432/db")
    assert "Pa@ss/w0rd" not in out and "w0rd" not in out
    assert out == f"postgres://{MASK}@host:5432/db"


def test_remembered_secret_of_a_malformed_url_is_masked_wherever_it_appears() -> None:
    secret = f"pw-{uuid.uuid4().hex[:10]}"
    raw = f"postgresql//rivet:{secret}@pg.internal/state"
    assert secret in redact_text(raw)  # no '://': the pattern alone cannot see it
    remember_secrets(raw)
    assert secret not in redact_text(raw)
    assert secret not in redact_text(f'FATAL: password "{secret}" rejected')


def test_remembered_percent_encoded_secret_is_masked_in_both_spellings() -> None:
    plain = f"p@ss-{uuid.uuid4().hex[:8]}"
    remember_secrets(f"postgresql://rivet:{plain.replace('@', '%40')}@pg.internal/state")
    assert plain not in redact_text(f"server said: bad password {plain}")
    assert plain.replace("@", "%40") not in redact_text(f"dsn rivet:{plain.replace('@', '%40')}")


def test_redact_url_keeps_user_host_and_path() -> None:
    assert redact_url("postgresql://rivet:s3cr3t@pg.internal:6432/state") == "postgresql://rivet:***@pg.internal:6432/state"


def test_error_messages_and_the_error_object_are_redacted() -> None:
    err = StateError("RIVET_STATE_UNREACHABLE", "cannot reach postgresql://rivet:t0p-s3cret@pg.internal/state")
    assert "t0p-s3cret" not in err.message
    assert "t0p-s3cret" not in json.dumps(errors.error_object(err))


def test_resolver_refusal_of_a_malformed_url_does_not_quote_its_password(tmp_path: Path) -> None:
    secret = f"pw-{uuid.uuid4().hex[:10]}"
    with pytest.raises(StateError) as caught:
        resolve_location(f"postgresql//rivet:{secret}@pg.internal/state", None, tmp_path / "rivet.yaml")
    assert caught.value.code == "RIVET_STATE_URL_INVALID"
    assert secret not in caught.value.message


# -- through the CLI -------------------------------------------------------------------


def outputs(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout + proc.stderr


def assert_no_secret(proc: subprocess.CompletedProcess[str], *secrets: str) -> None:
    for secret in secrets:
        assert secret not in outputs(proc), f"password {secret!r} leaked\n{describe(proc)}"


# Every output form: human, --json, --json-errors, --debug (tracebacks).
OUTPUT_FORMS = [("info",), ("check", "--json"), ("info", "--json-errors"), ("migrate", "--debug")]


@pytest.mark.parametrize("url, secrets", [
    ("postgresql//rivet:Mal-f0rmed-pw@pg.internal/state", ("Mal-f0rmed-pw",)),
    ("postgres://rivet:Pa@ss/w0rdX@pg.internal:notaport/state", ("Pa@ss/w0rdX", "ss/w0rdX")),
    ("postgresql://rivet:Bad-schema-pw@pg.internal/state?schema=no-dashes", ("Bad-schema-pw",)),
], ids=["no-colon", "at-and-slash-in-password", "bad-schema"])
def test_malformed_state_url_with_a_password_never_shows_it(config: Path, url: str, secrets: tuple[str, ...]) -> None:
    for form in OUTPUT_FORMS:
        proc = run_cli("-c", str(config), *form, env={"RIVET_STATE_URL": url})
        assert proc.returncode == 1, describe(proc)
        assert_no_secret(proc, *secrets)
        if "--json-errors" in form:
            assert error_object(proc)["code"] == "RIVET_STATE_URL_INVALID", describe(proc)
    flag = run_cli("-c", str(config), "--json-errors", "--debug", "check", "--state-url", url)
    assert flag.returncode == 1, describe(flag)
    assert_no_secret(flag, *secrets)


def test_unreachable_server_fails_retryable_without_showing_the_password(config: Path) -> None:
    url = "postgresql://rivet:secretpw-unreach@127.0.0.1:1/state"
    for form in OUTPUT_FORMS:
        proc = run_cli("-c", str(config), *form, env={"RIVET_STATE_URL": url})
        assert_no_secret(proc, "secretpw-unreach")
        if "--json-errors" in form:
            error = error_object(proc)
            assert (proc.returncode, error["code"], error["retryable"]) == (2, "RIVET_STATE_UNREACHABLE", True), \
                describe(proc)
            assert "127.0.0.1" in error["message"], describe(proc)
        elif form[0] == "check":
            assert proc.returncode == 2, describe(proc)
            row = next(c for c in json.loads(proc.stdout)["checks"] if c["id"] == "state")
            assert row["code"] == "RIVET_STATE_UNREACHABLE", describe(proc)


def password_state_url(pg_server: dict[str, str], pg_url: str, password: str = PG_PASSWORD) -> str:
    """The password role's URL on the fresh schema of ``pg_url`` (dropped by that fixture)."""
    if not pg_server["password_url"]:
        pytest.skip("STATETOOL_TEST_PG_URL is set: no password role to test with")
    schema = re.search(r"[?&]schema=([^&]+)", pg_url)[1]
    url = pg_server["password_url"].replace(f":{PG_PASSWORD}@", f":{password}@")
    return f"{url}{'&' if '?' in url else '?'}schema={schema}"


def test_wrong_password_fails_auth_without_showing_either_password(config: Path, pg_server: dict[str, str],
                                                                   pg_url: str) -> None:
    url = password_state_url(pg_server, pg_url, password="Wr0ng-horse-pw")
    for form in OUTPUT_FORMS:
        proc = run_cli("-c", str(config), *form, env={"RIVET_STATE_URL": url})
        assert proc.returncode == 1, describe(proc)
        assert_no_secret(proc, "Wr0ng-horse-pw", PG_PASSWORD)
        if "--json-errors" in form:
            assert error_object(proc)["code"] == "RIVET_STATE_AUTH_FAILED", describe(proc)


def test_valid_password_url_never_shows_the_password_in_any_output_or_audit_row(
        config: Path, pg_server: dict[str, str], pg_url: str) -> None:
    url = password_state_url(pg_server, pg_url)
    env = {"RIVET_STATE_URL": url}
    init = run_cli("-c", str(config), "init", "--json", env=env)
    assert init.returncode == 0, describe(init)
    assert_no_secret(init, PG_PASSWORD)
    assert json.loads(init.stdout)["location"]["url"].count(MASK) == 1, describe(init)
    for form in [*OUTPUT_FORMS, ("info", "--json"), ("exports", "show", "nope", "--debug"),
                 ("exports", "show", "nope", "--json-errors")]:
        proc = run_cli("-c", str(config), *form, env=env)
        assert_no_secret(proc, PG_PASSWORD)
    # A write given the URL on the command line: the audit row records the command without it.
    reset = run_cli("-c", str(config), "exports", "reset", "orders", "--state-url", url, "--debug")
    assert reset.returncode == 0, describe(reset)
    assert_no_secret(reset, PG_PASSWORD)
    import psycopg

    schema = re.search(r"[?&]schema=([^&]+)", pg_url)[1]
    base = re.sub(r"[?&]schema=[^&]+", "", pg_url)
    with psycopg.connect(base, options=f"-c search_path={schema}") as conn:
        rows = conn.execute("SELECT actor, command, action, detail FROM rivet_audit ORDER BY id").fetchall()
    assert [r[2] for r in rows][-1] == "exports.reset", rows
    assert PG_PASSWORD not in json.dumps([list(r) for r in rows]), rows


def test_config_source_password_never_shows_in_outputs(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline", source_url="postgresql://reader:Src-s3cret-pw@db.internal:5432/sales")
    for form in (("init", "--json"), ("info",), ("info", "--json"), ("check", "--json"), ("identity", "show", "--json")):
        proc = run_cli("-c", str(config), *form)
        assert proc.returncode == 0, describe(proc)
        assert_no_secret(proc, "Src-s3cret-pw")
