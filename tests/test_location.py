"""SPEC §1: one resolver decides where the state lives, and refuses every other form."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from support import describe, error_object, run_cli, tree_digest, write_config
from statetool.errors import StateError
from statetool.location import STATE_FILE, resolve_location

ACCEPTED_FORM_MARKERS = ("unset or empty", "sqlite:/", "postgresql://")


def refused(env: str | None, flag: str | None, config: Path) -> StateError:
    with pytest.raises(StateError) as caught:
        resolve_location(env, flag, config)
    return caught.value


def listing(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


# -- beside the config -----------------------------------------------------------------


@pytest.mark.parametrize("env", [None, "", "   "])
def test_unset_or_empty_state_url_puts_the_state_beside_the_config(tmp_path: Path, env: str | None) -> None:
    config = tmp_path / "jobs" / "sales" / "rivet.yaml"
    loc = resolve_location(env, None, config)
    assert (loc.backend, loc.scope, loc.origin) == ("sqlite", "beside_config", "default")
    assert loc.directory == config.parent
    assert loc.path == config.parent / ".rivet_state.db"
    assert loc.display == str(config.parent / ".rivet_state.db")


def test_relative_config_path_gives_an_absolute_state_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    loc = resolve_location(None, None, Path("sub/rivet.yaml"))
    assert loc.path == tmp_path / "sub" / ".rivet_state.db"
    assert loc.path.is_absolute()


def test_resolver_touches_no_file(tmp_path: Path) -> None:
    declared = tmp_path / "not-yet"
    resolve_location(f"sqlite:{declared}", None, tmp_path / "rivet.yaml")
    resolve_location(None, None, tmp_path / "rivet.yaml")
    assert listing(tmp_path) == []


# -- env versus flag -------------------------------------------------------------------


def test_flag_wins_over_env_and_says_so(tmp_path: Path) -> None:
    config = tmp_path / "rivet.yaml"
    loc = resolve_location("sqlite:/srv/from-env", "sqlite:/srv/from-flag", config)
    assert (loc.directory, loc.origin) == (Path("/srv/from-flag"), "flag")


def test_env_applies_when_no_flag_is_given(tmp_path: Path) -> None:
    loc = resolve_location("sqlite:/srv/from-env", None, tmp_path / "rivet.yaml")
    assert (loc.directory, loc.scope, loc.origin) == (Path("/srv/from-env"), "declared_dir", "env")


def test_empty_flag_selects_beside_the_config_over_a_set_env(tmp_path: Path) -> None:
    config = tmp_path / "rivet.yaml"
    loc = resolve_location("sqlite:/srv/from-env", "", config)
    assert (loc.scope, loc.origin, loc.path) == ("beside_config", "flag", tmp_path / ".rivet_state.db")


def test_flag_is_validated_even_when_env_is_valid(tmp_path: Path) -> None:
    err = refused("sqlite:/srv/ok", "mysql://h/db", tmp_path / "rivet.yaml")
    assert err.code == "RIVET_STATE_URL_INVALID"


# -- declared directory ----------------------------------------------------------------


@pytest.mark.parametrize("raw, directory", [
    ("sqlite:/srv/rivet/state", "/srv/rivet/state"),
    ("sqlite:/srv/rivet/state/", "/srv/rivet/state"),
    ("sqlite:/srv/rivet/./x/../state", "/srv/rivet/state"),
    ("  sqlite:/srv/rivet/state  ", "/srv/rivet/state"),
])
def test_sqlite_absolute_directory_is_a_declared_dir(tmp_path: Path, raw: str, directory: str) -> None:
    loc = resolve_location(raw, None, tmp_path / "rivet.yaml")
    assert (loc.backend, loc.scope) == ("sqlite", "declared_dir")
    assert loc.directory == Path(directory)
    assert loc.path == Path(directory) / ".rivet_state.db"
    assert loc.state_url == f"sqlite:{directory}"


@pytest.mark.parametrize("raw", ["sqlite:state", "sqlite:./state", "sqlite:../shared/state", "sqlite:~/state"])
def test_sqlite_relative_directory_is_refused(tmp_path: Path, raw: str) -> None:
    err = refused(raw, None, tmp_path / "rivet.yaml")
    assert err.code == "RIVET_STATE_DIR_RELATIVE"
    assert err.exit_code == 1
    assert raw.split(":", 1)[1] in err.message
    assert "absolute" in err.message
    example = err.message.rsplit("sqlite:", 1)[1].rstrip(")")
    assert example == os.path.normpath(example) and os.path.isabs(example), err.message


@pytest.mark.parametrize("raw, hint", [
    ("sqlite:///x", "sqlite:/x"),
    ("sqlite:///srv/rivet/state", "sqlite:/srv/rivet/state"),
    ("sqlite:////srv/rivet/state", "sqlite:/srv/rivet/state"),
])
def test_sqlalchemy_file_url_is_refused_with_the_right_spelling(tmp_path: Path, raw: str, hint: str) -> None:
    err = refused(raw, None, tmp_path / "rivet.yaml")
    assert err.code == "RIVET_STATE_URL_INVALID"
    assert err.message.endswith(hint), err.message
    assert raw in err.message


def test_sqlite_without_a_directory_is_refused(tmp_path: Path) -> None:
    err = refused("sqlite:", None, tmp_path / "rivet.yaml")
    assert err.code == "RIVET_STATE_URL_INVALID"
    assert all(marker in err.message for marker in ACCEPTED_FORM_MARKERS), err.message


# -- unknown forms ---------------------------------------------------------------------


@pytest.mark.parametrize("raw", [
    "mysql://u@db.internal/state",
    "http://state.internal/rivet",
    "/srv/rivet/state",
    "srv/rivet/state",
    "file:/srv/rivet/state",
    "postgresql:/db.internal/state",
    "postgresql//db.internal/state",
    "redis://cache:6379/0",
])
def test_unknown_form_is_refused_listing_the_accepted_forms(tmp_path: Path, raw: str) -> None:
    err = refused(raw, None, tmp_path / "rivet.yaml")
    assert err.code == "RIVET_STATE_URL_INVALID"
    assert err.exit_code == 1
    assert all(marker in err.message for marker in ACCEPTED_FORM_MARKERS), err.message
    assert "sqlite:/absolute/dir" in err.entry.action


# -- PostgreSQL ------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["postgres", "postgresql", "postgresql+psycopg", "POSTGRESQL"])
def test_postgres_schemes_select_the_shared_scope_with_the_default_schema(tmp_path: Path, scheme: str) -> None:
    loc = resolve_location(f"{scheme}://rivet@pg.internal:5432/pipelines", None, tmp_path / "rivet.yaml")
    assert (loc.backend, loc.scope, loc.schema) == ("postgres", "shared", "rivet_state")
    assert loc.url == "postgresql://rivet@pg.internal:5432/pipelines"
    assert loc.path is None and loc.directory is None


def test_schema_parameter_is_taken_and_stripped_other_parameters_kept(tmp_path: Path) -> None:
    loc = resolve_location("postgres://rivet@pg.internal/pipelines?sslmode=require&schema=sales_state"
                           "&application_name=statetool", None, tmp_path / "rivet.yaml")
    assert loc.schema == "sales_state"
    assert loc.url == "postgresql://rivet@pg.internal/pipelines?sslmode=require&application_name=statetool"
    assert "schema=" not in loc.url


def test_schema_parameter_alone_leaves_no_query(tmp_path: Path) -> None:
    loc = resolve_location("postgresql+psycopg://rivet@pg.internal/pipelines?schema=s1", None, tmp_path / "x.yaml")
    assert (loc.url, loc.schema) == ("postgresql://rivet@pg.internal/pipelines", "s1")


@pytest.mark.parametrize("schema", ["bad-name", "1starts_with_digit", "a;drop table x", "a b", "", "x" * 64])
def test_schema_that_is_not_a_plain_identifier_is_refused(tmp_path: Path, schema: str) -> None:
    err = refused(f"postgresql://pg.internal/pipelines?schema={schema}", None, tmp_path / "rivet.yaml")
    assert err.code == "RIVET_STATE_URL_INVALID"


def test_postgres_url_with_a_non_numeric_port_is_refused(tmp_path: Path) -> None:
    err = refused("postgresql://pg.internal:fivefour/pipelines", None, tmp_path / "rivet.yaml")
    assert err.code == "RIVET_STATE_URL_INVALID"


def test_postgres_url_whose_password_has_a_raw_at_and_slash_is_refused(tmp_path: Path) -> None:
    # urlsplit would take "ss" (a piece of the password) for the host and connect there.
    err = refused("postgres://rivet:p@ss/word@pg.internal:5432/state", None, tmp_path / "rivet.yaml")
    assert err.code == "RIVET_STATE_URL_INVALID"
    assert "p@ss/word" not in err.message and "ss/word" not in err.message, err.message
    assert "percent-encoded" in err.message


def test_postgres_url_with_a_percent_encoded_password_is_accepted(tmp_path: Path) -> None:
    loc = resolve_location("postgres://rivet:p%40ss%2Fword@pg.internal:5432/state", None, tmp_path / "rivet.yaml")
    assert loc.url == "postgresql://rivet:p%40ss%2Fword@pg.internal:5432/state"
    assert "p%40ss%2Fword" not in loc.display


def test_postgres_display_masks_the_password_and_names_the_schema(tmp_path: Path) -> None:
    loc = resolve_location("postgresql://rivet:s3cr3t-pw@pg.internal/pipelines?schema=s2", None, tmp_path / "x.yaml")
    assert "s3cr3t-pw" in (loc.url or "")  # kept for connecting
    assert "s3cr3t-pw" not in loc.display and "s3cr3t-pw" not in json.dumps(loc.as_dict())
    assert "s2" in loc.display


# -- a query libpq would misread (issue 12 item 8) ----------------------------------------

#: ``(what follows postgresql://rivet@/pipelines, what the message must name)``: each one
#: would reach libpq as a wrong socket directory or database name.
MISREAD_QUERIES = [
    ("?host=/run/pg?schema=s", "second '?'"),
    ("?host=/run/pg?sslmode=require&schema=s", "second '?'"),
    ("?host=/run/pg;schema=s", "'schema', after ';'"),
    ("?host=/run/pg%3Fschema=s", "'schema', after '?'"),
    ("?schema=s&host=/run/pg%26sslmode=require", "'sslmode', after '&'"),
    ("&schema=s?host=/run/pg", "'&schema=' in its database name"),
    ("?host", "parameter 'host' without a value"),
    ("?host=/run/pg&=s", "a parameter without a name"),
]


@pytest.mark.parametrize(("suffix", "named"), MISREAD_QUERIES, ids=[s for s, _ in MISREAD_QUERIES])
def test_a_query_libpq_would_misread_is_invalid_and_says_to_join_with_an_ampersand(
        tmp_path: Path, suffix: str, named: str) -> None:
    err = refused(f"postgresql://rivet@/pipelines{suffix}", None, tmp_path / "rivet.yaml")
    assert (err.code, err.entry.retryable) == ("RIVET_STATE_URL_INVALID", False), err.message
    assert named in err.message and "'&'" in err.message, err.message
    assert "&schema=NAME" in err.entry.action


def test_the_second_question_mark_is_shown_joined_with_an_ampersand(tmp_path: Path) -> None:
    err = refused("postgresql://rivet@/pipelines?host=/run/pg?schema=s", None, tmp_path / "rivet.yaml")
    assert "('?host=/run/pg&schema=s')" in err.message, err.message


@pytest.mark.parametrize("url", ["postgresql://rivet@/pipelines?host=/run/pg&&schema=s&",
                                 "postgresql://rivet@/pipelines?&host=/run/pg&schema=s",
                                 "postgresql://rivet@/pipelines?options=-c%20search_path%3Dx&schema=s"])
def test_empty_pieces_and_an_equals_sign_inside_a_value_are_accepted(tmp_path: Path, url: str) -> None:
    assert resolve_location(url, None, tmp_path / "rivet.yaml").schema == "s"


def test_a_password_parameter_is_never_searched_nor_quoted(tmp_path: Path) -> None:
    loc = resolve_location("postgresql://rivet@/pipelines?password=a;schema=b&schema=s", None, tmp_path / "x.yaml")
    assert loc.schema == "s"
    err = refused("postgresql://rivet@/pipelines?host=/run/pg;password=hunter2", None, tmp_path / "x.yaml")
    assert "'password', after ';'" in err.message and "hunter2" not in err.message, err.message


@pytest.mark.postgres
def test_schema_joined_to_a_socket_url_of_the_server(tmp_path: Path, pg_server: dict[str, str]) -> None:
    """The suite's server, reached the way a socket URL names it (``?host=<socket dir>``):
    ``?schema=`` appended is refused as a usage error naming the second ``?``, never a
    retryable "unreachable"; ``&schema=`` opens that schema."""
    import psycopg

    base = pg_server["url"]
    with_query = base if "?" in base else f"{base}?application_name=statetool-tests"
    config = write_config(tmp_path / "pipeline")
    schema = f"t_amp_{tmp_path.name[-20:].replace('-', '_')}"
    wrong = run_cli("-c", str(config), "--json-errors", "init",
                    env={"RIVET_STATE_URL": f"{with_query}?schema={schema}"})
    assert wrong.returncode == 1, describe(wrong)
    error = error_object(wrong)
    assert (error["code"], error["retryable"]) == ("RIVET_STATE_URL_INVALID", False), describe(wrong)
    assert "second '?'" in error["message"] and f"&schema={schema}" in error["message"], describe(wrong)
    try:
        right = run_cli("-c", str(config), "init", env={"RIVET_STATE_URL": f"{with_query}&schema={schema}"})
        assert right.returncode == 0, describe(right)
        info = run_cli("-c", str(config), "--json", "info", env={"RIVET_STATE_URL": f"{with_query}&schema={schema}"})
        assert info.returncode == 0, describe(info)
        assert json.loads(info.stdout)["location"]["schema"] == schema
    finally:
        with psycopg.connect(base.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


# -- through the CLI: refused forms create nothing anywhere -----------------------------


BAD_FORMS = [
    ("sqlite:relative/state", "RIVET_STATE_DIR_RELATIVE"),
    ("sqlite://{named}", "RIVET_STATE_URL_INVALID"),
    ("sqlite:", "RIVET_STATE_URL_INVALID"),
    ("mysql://u@db.internal/{named}", "RIVET_STATE_URL_INVALID"),
    ("http://state.internal{named}", "RIVET_STATE_URL_INVALID"),
    ("{named}", "RIVET_STATE_URL_INVALID"),
    ("postgresql://pg.internal/db?schema=bad-name", "RIVET_STATE_URL_INVALID"),
]


@pytest.mark.parametrize("form, code", BAD_FORMS, ids=[c + ":" + f for f, c in BAD_FORMS])
def test_bad_state_url_fails_with_its_code_and_creates_no_file(tmp_path: Path, form: str, code: str) -> None:
    config = write_config(tmp_path / "pipeline")
    named = tmp_path / "named"
    named.mkdir()
    value = form.format(named=named)
    before = (tree_digest(tmp_path), listing(tmp_path))

    init = run_cli("-c", str(config), "--json-errors", "init", cwd=config.parent, env={"RIVET_STATE_URL": value})
    assert init.returncode == 1, describe(init)
    error = error_object(init)
    assert (error["code"], error["exit_class"]) == (code, 1), describe(init)
    assert (tree_digest(tmp_path), listing(tmp_path)) == before, describe(init)

    check = run_cli("check", "--json", "-c", str(config), cwd=config.parent, env={"RIVET_STATE_URL": value})
    assert check.returncode == 1, describe(check)
    location = json.loads(check.stdout)["checks"][0]
    assert (location["id"], location["status"], location["code"]) == ("location", "fail", code), describe(check)
    assert (tree_digest(tmp_path), listing(tmp_path)) == before, describe(check)


def test_bad_state_url_flag_overrides_a_good_env_and_fails(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    good = tmp_path / "good"
    good.mkdir()
    proc = run_cli("-c", str(config), "init", "--state-url", "sqlite:relative", "--json-errors",
                   env={"RIVET_STATE_URL": f"sqlite:{good}"})
    assert proc.returncode == 1, describe(proc)
    assert error_object(proc)["code"] == "RIVET_STATE_DIR_RELATIVE", describe(proc)
    assert listing(good) == [], describe(proc)


def test_info_names_the_origin_of_the_location(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    declared = tmp_path / "declared"
    declared.mkdir()
    init = run_cli("-c", str(config), "init", env={"RIVET_STATE_URL": f"sqlite:{declared}"})
    assert init.returncode == 0, describe(init)
    assert listing(declared) == [".rivet_state.db"], describe(init)
    assert not (config.parent / ".rivet_state.db").exists(), describe(init)
    info = run_cli("-c", str(config), "info", "--json", "--state-url", f"sqlite:{declared}")
    assert info.returncode == 0, describe(info)
    location = json.loads(info.stdout)["location"]
    assert (location["origin"], location["scope"], location["path"]) == (
        "flag", "declared_dir", str(declared / ".rivet_state.db")), describe(info)


@pytest.mark.parametrize(("env_value", "flag_value", "named"), [("mysql://x", None, "RIVET_STATE_URL value"),
                                                              (None, "mysql://x", "--state-url value"),
                                                              ("sqlite:/ok", "mysql://x", "--state-url value")])
def test_an_unknown_scheme_is_told_where_it_came_from(tmp_path: Path, env_value: str | None, flag_value: str | None,
                                                      named: str) -> None:
    """The refusal names the variable or the flag that gave the value (found by a fresh
    user: a bad --state-url was reported as RIVET_STATE_URL's)."""
    with pytest.raises(StateError) as raised:
        resolve_location(env_value, flag_value, tmp_path / "rivet.yaml")
    assert raised.value.code == "RIVET_STATE_URL_INVALID"
    assert raised.value.message.startswith(f"{named} 'mysql://x' is not a state location")


@pytest.mark.parametrize("value", ["sqlite:relative", "sqlite:///srv/x", "sqlite:", "postgresql://h/db?nosuch=1",
                                   "postgresql://h:99999/db", "postgresql://h/db?schema=a&schema=b"])
@pytest.mark.parametrize(("given_as", "named"), [("env", "RIVET_STATE_URL: "), ("flag", "--state-url: ")])
def test_every_location_refusal_names_its_setting(tmp_path: Path, value: str, given_as: str, named: str) -> None:
    """Every kind of bad location, not only an unknown scheme, says whether the flag or the
    variable gave it (found by a fresh user: 'sqlite:relative' and 'sqlite:///x' did not);
    the code and the rest of the sentence are those of the refusal itself."""
    env_value, flag_value = (value, None) if given_as == "env" else ("sqlite:/ok", value)
    with pytest.raises(StateError) as raised:
        resolve_location(env_value, flag_value, tmp_path / "rivet.yaml")
    assert raised.value.code in {"RIVET_STATE_URL_INVALID", "RIVET_STATE_DIR_RELATIVE"}
    assert raised.value.message.startswith(named), raised.value.message
    assert value.split("?")[0] in raised.value.message or "relative" in raised.value.message


COMMANDS_AT_A_DIRECTORY = [("info",), ("init",), ("leases", "run", "--export", "orders", "--", "true"), ("leases",),
                           ("doctor",), ("check",), ("exports", "list")]


def run_at(config: Path, url: str, given_as: str, command: tuple[str, ...]) -> tuple[Any, dict[str, Any], str]:
    """``statetool --json-errors COMMAND`` with the location ``url`` given as ``--state-url``
    (``given_as`` "flag") or ``RIVET_STATE_URL`` ("env"): (the run, its error object, the
    setting's name as a refusal names it)."""
    args, env = (("--state-url", url), {}) if given_as == "flag" else ((), {"RIVET_STATE_URL": url})
    proc = run_cli("-c", str(config), "--json-errors", *args, *command, env=env)
    return proc, error_object(proc), "--state-url" if given_as == "flag" else "RIVET_STATE_URL"


@pytest.mark.parametrize("command", COMMANDS_AT_A_DIRECTORY)
@pytest.mark.parametrize("given_as", ["env", "flag"])
def test_a_declared_directory_that_does_not_exist_is_named_with_its_setting(tmp_path: Path, command: tuple[str, ...],
                                                                            given_as: str) -> None:
    """The refusal of a missing declared directory names the setting that declared it, as
    every refusal of a location does (found by a fresh user: it did not), the same sentence
    from a read, from init and from the lease path; nothing is created."""
    config = write_config(tmp_path / "pipeline")
    missing = tmp_path / "not-mounted"
    url = f"sqlite:{missing}"
    proc, error, named = run_at(config, url, given_as, command)
    assert proc.returncode == 1 and error["code"] == "RIVET_STATE_DIR_MISSING", describe(proc)
    assert error["message"].startswith(f"{named}: the declared state directory {missing} does not exist"), \
        describe(proc)
    assert not missing.exists(), describe(proc)


@pytest.mark.parametrize("command", COMMANDS_AT_A_DIRECTORY)
def test_a_location_naming_the_state_file_is_refused_alike_with_the_directory_to_name(tmp_path: Path,
                                                                                      command: tuple[str, ...]) -> None:
    """``sqlite:/dir/.rivet_state.db`` names the file, not its directory. A fresh user found
    the lease commands calling it a directory that does not exist and doctor looking for
    ``.rivet_state.db/.rivet_state.db`` (exit 5): every command now gives one sentence, exit 1,
    with the spelling that names the directory, and changes no byte."""
    config = write_config(tmp_path / "pipeline")
    directory = tmp_path / "state"
    directory.mkdir()
    assert run_cli("--state-url", f"sqlite:{directory}", "-c", str(config), "init").returncode == 0
    before = tree_digest(tmp_path)
    proc = run_cli("-c", str(config), "--json-errors", "--state-url", f"sqlite:{directory / STATE_FILE}", *command)
    error = error_object(proc)
    assert proc.returncode == 1 and error["code"] == "RIVET_STATE_DIR_MISSING", describe(proc)
    assert error["message"] == (f"--state-url: {directory / STATE_FILE} is a file, not a directory; a sqlite: location "
                                f"names the directory that holds {STATE_FILE}: sqlite:{directory}"), describe(proc)
    assert tree_digest(tmp_path) == before


def _closed_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on: bound once to be handed a free one,
    then closed (a connection to it is refused at once)."""
    probe = socket.socket()
    try:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
    finally:
        probe.close()


@pytest.mark.parametrize("command", [*COMMANDS_AT_A_DIRECTORY, ("migrate",), ("leases", "release", "chunk-run:orders")])
@pytest.mark.parametrize("given_as", ["env", "flag"])
def test_a_postgres_server_that_cannot_be_reached_is_named_with_its_setting(tmp_path: Path, command: tuple[str, ...],
                                                                            given_as: str) -> None:
    """``RIVET_STATE_UNREACHABLE`` (a closed port on 127.0.0.1) names the setting that gave
    the URL, as every other refusal of a location does, from a read, init, a write and the
    lease path alike; the password is never shown, and nothing is created."""
    config = write_config(tmp_path / "pipeline")
    url = f"postgresql://ops:s3cretpw@127.0.0.1:{_closed_port()}/rivet?schema=sales"
    before = tree_digest(tmp_path)
    proc, error, named = run_at(config, url, given_as, command)
    assert proc.returncode == 2 and error["code"] == "RIVET_STATE_UNREACHABLE", describe(proc)
    assert error["message"].startswith(f"{named}: the state database at postgresql://ops:***@127.0.0.1:"), \
        describe(proc)
    assert "s3cretpw" not in proc.stdout + proc.stderr, describe(proc)
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize("given_as", ["--to", "--to-env"])
def test_a_transfer_destination_that_cannot_be_reached_is_named_with_its_own_setting(tmp_path: Path,
                                                                                    given_as: str) -> None:
    """The destination of a transfer is given by ``--to`` or ``--to-env NAME``, not by
    ``--state-url``: its refusals name that setting, and the source is left as it was."""
    config = write_config(tmp_path / "pipeline")
    assert run_cli("-c", str(config), "init").returncode == 0
    url = f"postgresql://ops@127.0.0.1:{_closed_port()}/rivet?schema=sales"
    args, env = (("--to", url), {}) if given_as == "--to" else (("--to-env", "DEST_URL"), {"DEST_URL": url})
    before = tree_digest(tmp_path)
    proc = run_cli("-c", str(config), "--json-errors", "transfer", *args, env=env)
    error = error_object(proc)
    assert proc.returncode == 2 and error["code"] == "RIVET_STATE_UNREACHABLE", describe(proc)
    named = "--to" if given_as == "--to" else "--to-env DEST_URL"
    assert error["message"].startswith(f"{named}: the state database at postgresql://ops@127.0.0.1:"), describe(proc)
    assert tree_digest(tmp_path) == before
