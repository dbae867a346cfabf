"""Issue 10, "Secrets" and malformed URLs (SPEC §7; docs/decisions.md, "URLs and secrets").

* Each URL of the issue's findings as its own regression case, through the real CLI
  (a subprocess): refused with its code before any connection (a listening socket on
  127.0.0.1 proves nothing connected), no piece of its password anywhere.
* Passwords on the command line warn; ``transfer --to-env``; PGPASSFILE and PGPASSWORD
  honoured for a URL without a password (the password role of ``pg_server``).
* The redaction fuzz: 1,000+ seeded URLs (see :func:`test_redaction_fuzz` for which path
  each goes through).
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, unquote

import pytest

from support import (PG_PASSWORD, PG_PASSWORD_USER, describe, error_object, require_psql, run_cli, run_cli_forked,
                     run_cli_process, tree_digest, write_config)
from statetool import redact
from statetool.backends.tombstone import MAGIC
from statetool.errors import StateError
from statetool.identity import state_key
from statetool.location import resolve_location

FRAGMENT = 4


def fragments(secret: str) -> set[str]:
    """Every substring of ``secret`` of :data:`FRAGMENT` characters (the whole when shorter)."""
    if len(secret) <= FRAGMENT:
        return {secret}
    return {secret[i:i + FRAGMENT] for i in range(len(secret) - FRAGMENT + 1)}


def views(text: str) -> str:
    """``text`` as written, percent-decoded (GitHub annotations, URLs) and with JSON's
    ``\\uXXXX`` escapes decoded, so a leak in any spelling is seen."""
    unescaped = re.sub(r"\\u([0-9a-fA-F]{4})", lambda m: chr(int(m[1], 16)), text)
    return "\n".join((text, unquote(text), unescaped))


def leaked(text: str, *secrets: str) -> set[str]:
    """The fragments of ``secrets`` found in ``text`` (any spelling)."""
    seen = views(text)
    return {f for s in secrets for f in fragments(s) if f in seen}


def assert_clean(text: str, *secrets: str, what: str = "") -> None:
    """No 4-character fragment of any of ``secrets`` in ``text`` (the fuzz's random passwords)."""
    found = leaked(text, *secrets)
    assert not found, f"password fragments {sorted(found)} leaked {what}\n{text[-3000:]}"


def assert_absent(text: str, *pieces: str, what: str = "") -> None:
    """None of ``pieces`` (the findings' passwords and their parts, which are English
    enough for a 4-character fragment such as "ter " to occur in any message) in ``text``."""
    seen = views(text)
    found = [p for p in pieces if p in seen]
    assert not found, f"password pieces {found} leaked {what}\n{text[-3000:]}"


@pytest.fixture
def closed_listener() -> Iterator[socket.socket]:
    """A listening TCP socket on 127.0.0.1 that never accepts on its own: after a run,
    ``accept`` tells whether anything connected."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.settimeout(0.2)
    yield sock
    sock.close()


def nothing_connected(sock: socket.socket) -> bool:
    try:
        conn, _ = sock.accept()
    except TimeoutError:
        return True
    conn.close()
    return False


# -- the findings, one by one --------------------------------------------------------------

STATE_URL_FINDINGS = [
    # (URL with {port} of the listener, password pieces that must not appear)
    ("postgresql://app:hunter2/x@127.0.0.1:{port}/st", ("hunter2/x", "hunter2")),
    ("postgresql://u:hunter 2:xyz@127.0.0.1:{port}/db", ("hunter 2:xyz", "hunter", "2:xyz")),
    ("postgresql://reader:abc@sec#ret@127.0.0.1:{port}/db", ("abc@sec#ret", "abc@sec", "sec#ret", "#ret")),
    ("postgresql://app:/Sup3rSecret@127.0.0.1:{port}/sales", ("/Sup3rSecret", "Sup3rSecret")),
    # ("secret" alone would match this worktree's own path in --debug tracebacks)
    ("postgresql://u:?secret@/db?host=/tmp", ("?secret", "secret@", "'secret", "\"secret")),
]


@pytest.mark.parametrize("url, secrets", STATE_URL_FINDINGS, ids=[u for u, _ in STATE_URL_FINDINGS])
def test_ambiguous_state_url_is_refused_before_any_connection_and_never_echoed(
        tmp_path: Path, closed_listener: socket.socket, url: str, secrets: tuple[str, ...]) -> None:
    config = write_config(tmp_path / "pipeline")
    value = url.format(port=closed_listener.getsockname()[1])
    before = tree_digest(tmp_path)
    for form, env in [(("info",), {}), (("--json-errors", "info"), {}), (("check", "--json"), {}),
                      (("--debug", "migrate"), {}), (("check",), {"GITHUB_ACTIONS": "true"}),
                      (("check", "--json"), {"GITHUB_ACTIONS": "true"})]:
        proc = run_cli("-c", str(config), *form, env={"RIVET_STATE_URL": value, **env})
        assert proc.returncode == 1, describe(proc)
        assert_absent(proc.stdout + proc.stderr, *secrets, what=f"by {form}")
        if "--json-errors" in form:
            error = error_object(proc)
            assert (error["code"], error["retryable"]) == ("RIVET_STATE_URL_INVALID", False), describe(proc)
            assert "***@" in error["message"], describe(proc)
        if form == ("check", "--json"):
            row = json.loads(proc.stdout)["checks"][0]
            assert (row["id"], row["code"]) == ("location", "RIVET_STATE_URL_INVALID"), describe(proc)
        if env:
            assert "::error" in proc.stdout + proc.stderr, describe(proc)
    flag = run_cli("-c", str(config), "--json-errors", "--state-url", value, "exports", "reset", "orders")
    assert flag.returncode == 1 and error_object(flag)["code"] == "RIVET_STATE_URL_INVALID", describe(flag)
    assert_absent(flag.stdout + flag.stderr, *secrets)
    assert nothing_connected(closed_listener)
    assert tree_digest(tmp_path) == before


def test_the_resolver_refuses_an_ambiguous_host_before_any_lookup(tmp_path: Path) -> None:
    # "sec" would be the host to urllib and libpq (looked up in DNS): the resolver is pure
    # (opens nothing) and refuses, so no backend, connection or lookup ever exists.
    with pytest.raises(StateError) as caught:
        resolve_location("postgresql://reader:abc@sec#ret@127.0.0.1/db", None, tmp_path / "rivet.yaml")
    assert caught.value.code == "RIVET_STATE_URL_INVALID"
    assert "sec" not in caught.value.message.replace("second", "").replace("percent", "")


MALFORMED = [
    "postgresql://db.internal/state?sslmode=bogus",
    "postgresql://",
    "postgresql:///",
    "postgresql://db.internal/state?host=/d?schema=x",
    "postgresql://db.internal/state?schema=a&schema=b",
    "postgresql://u:?secret@/db?host=/tmp",
    "postgresql://db.internal/state?connect_timeout=1&connect_timeout=2",
    "postgresql://db.internal/state?no_such_parameter=1",
    "postgresql://u:p%zz@db.internal/state",
    "postgresql://db.internal:0/state",
    "postgresql://db.internal/a/b",
]


@pytest.mark.parametrize("url", MALFORMED)
def test_malformed_postgres_url_is_invalid_not_retryable(tmp_path: Path, url: str) -> None:
    config = write_config(tmp_path / "pipeline")
    proc = run_cli("-c", str(config), "--json-errors", "info", env={"RIVET_STATE_URL": url})
    assert proc.returncode == 1, describe(proc)
    error = error_object(proc)
    assert (error["code"], error["retryable"], error["exit_class"]) == ("RIVET_STATE_URL_INVALID", False, 1), \
        describe(proc)
    assert "?secret" not in proc.stderr and "secret@" not in proc.stderr and "p%zz" not in proc.stderr, describe(proc)


def test_a_repeated_schema_is_refused_never_chosen(tmp_path: Path) -> None:
    for url in ("postgresql://h/db?schema=a&schema=b", "postgresql://h/db?schema=a&schema=a"):
        with pytest.raises(StateError) as caught:
            resolve_location(url, None, tmp_path / "rivet.yaml")
        assert caught.value.code == "RIVET_STATE_URL_INVALID" and "schema" in caught.value.message


@pytest.mark.parametrize("url", ["postgresql://rivet:p%40ss%2Fw%3Fo%23r%20d@pg.internal:5432/state",
                                 "postgresql://rivet:a&b=c+d:e@pg.internal/state",
                                 "postgresql:///state?host=/run/postgresql",
                                 "postgresql://rivet:%C3%A9t%C3%A9@[::1]:5433/state?sslmode=verify-full"])
def test_percent_encoded_and_plain_userinfo_stay_valid(tmp_path: Path, url: str) -> None:
    loc = resolve_location(url, None, tmp_path / "rivet.yaml")
    assert loc.backend == "postgres" and loc.url is not None
    assert "***" in loc.display or "@" not in url


SOURCE_FINDINGS = [("postgresql://app:/Sup3rSecret@db.internal/sales", ("Sup3rSecret",)),
                   ("postgresql://reader:abc@sec#ret@db.internal/sales", ("abc@sec", "sec#ret", "#ret")),
                   ("postgresql://u:hunter 2:xyz@db.internal/sales", ("hunter", "2:xyz"))]


@pytest.mark.parametrize("url, pieces", SOURCE_FINDINGS, ids=[u for u, _ in SOURCE_FINDINGS])
def test_ambiguous_source_url_gives_no_state_key(tmp_path: Path, url: str, pieces: tuple[str, ...]) -> None:
    with pytest.raises(StateError) as caught:
        state_key(url)
    assert caught.value.code == "RIVET_SOURCE_URL_INVALID"
    config = tmp_path / "pipeline" / "rivet.yaml"
    config.parent.mkdir()
    config.write_text(f"source:\n  url: {json.dumps(url)}\nexports:\n  - name: orders\n    mode: full\n")
    before = tree_digest(tmp_path)
    init = run_cli("-c", str(config), "--json-errors", "init")
    assert init.returncode == 1 and error_object(init)["code"] == "RIVET_SOURCE_URL_INVALID", describe(init)
    assert tree_digest(tmp_path) == before, "a refused init created a file"
    assert_absent(init.stdout + init.stderr, *pieces)
    # A state made without the source, then checked with it: the config row fails, nothing is keyed.
    config.write_text("exports:\n  - name: orders\n    mode: full\n")
    assert run_cli("-c", str(config), "init").returncode == 0
    config.write_text(f"source:\n  url: {json.dumps(url)}\nexports:\n  - name: orders\n    mode: full\n")
    check = run_cli("-c", str(config), "check", "--json")
    assert check.returncode == 1, describe(check)
    row = next(c for c in json.loads(check.stdout)["checks"] if c["id"] == "config")
    assert (row["status"], row["code"]) == ("fail", "RIVET_SOURCE_URL_INVALID"), describe(check)
    reset = run_cli("-c", str(config), "exports", "reset", "orders")
    assert reset.returncode == 1, describe(reset)
    with sqlite3.connect(config.parent / ".rivet_state.db") as db:
        assert db.execute("SELECT count(*) FROM rivet_identity").fetchone()[0] == 0
        assert_absent(json.dumps(db.execute("SELECT * FROM rivet_audit").fetchall(), ensure_ascii=False), *pieces)
    assert_absent(check.stdout + check.stderr + reset.stdout + reset.stderr, *pieces)


def test_rekey_with_a_password_in_new_stores_no_piece_of_it(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pipeline")
    assert run_cli("-c", str(config), "init").returncode == 0
    old = "postgresql://db.internal:5432/sales"
    # The finding's exact URL: ambiguous (a raw space), refused, nothing written.
    refused = run_cli("-c", str(config), "--json-errors", "identity", "rekey", "--old", old,
                      "--new", "postgresql://u:p4ss w0rd@newhost/db")
    assert refused.returncode == 1 and error_object(refused)["code"] == "RIVET_SOURCE_URL_INVALID", describe(refused)
    # Its encoded spelling is valid: the key and the audit row hold no piece of the password.
    done = run_cli("-c", str(config), "identity", "rekey", "--old", old, "--new",
                   "postgresql://u:p4ss%20w0rd@newhost/db", "--reason", "moved; was postgresql://u:p4ss w0rd@h")
    assert done.returncode == 0, describe(done)
    with sqlite3.connect(config.parent / ".rivet_state.db") as db:
        rows = db.execute("SELECT command, detail FROM rivet_audit").fetchall()
        key = db.execute("SELECT state_key FROM rivet_identity").fetchone()[0]
    assert key == "postgresql://newhost:5432/db"
    assert any("identity rekey" in r[0] for r in rows), rows
    assert_absent(json.dumps(rows, ensure_ascii=False) + refused.stderr + done.stdout + done.stderr,
                  "p4ss", "w0rd")


@pytest.mark.parametrize("param", ["password", "sslpassword"])
def test_a_password_given_as_a_url_parameter_is_masked_everywhere_and_warned(
        tmp_path: Path, param: str, closed_listener: socket.socket) -> None:
    """libpq's ``password=`` and ``sslpassword=`` parameters are secrets like the userinfo's
    password (found by an operator: ``sslpassword`` was printed and stored whole)."""
    config = write_config(tmp_path / "pipeline")
    assert run_cli("-c", str(config), "init").returncode == 0
    secret = "Pv3XRt5Y"
    url = f"postgresql://u@127.0.0.1:{closed_listener.getsockname()[1]}/db?{param}={secret}&connect_timeout=2"
    for args in (("--json-errors", "info"), ("--json", "check"), ("--debug", "info")):
        proc = run_cli("-c", str(config), "--state-url", url, *args, timeout=60)
        assert proc.returncode != 0, describe(proc)
        assert_absent(proc.stdout + proc.stderr, secret, what=str(args))
        assert "RIVET_STATE_PASSWORD_IN_ARGV" in proc.stderr, describe(proc)
    done = run_cli("-c", str(config), "identity", "rekey", "--old", "postgresql://db.internal:5432/sales", "--new",
                   f"postgresql://db.internal:5432/sales?{param}={secret}")
    assert done.returncode == 0, describe(done)
    with sqlite3.connect(config.parent / ".rivet_state.db") as db:
        rows = db.execute("SELECT command, detail FROM rivet_audit").fetchall()
    assert_absent(json.dumps(rows) + done.stdout + done.stderr, secret, what="audit")


# -- passwords on the command line, --to-env, PGPASSFILE / PGPASSWORD ------------------------


def password_url(pg_server: dict[str, str], schema: str, *, with_password: bool = True) -> str:
    if not pg_server["password_url"]:
        pytest.skip("STATETOOL_TEST_PG_URL is set: no password role to test with")
    url = pg_server["password_url"]
    if not with_password:
        url = url.replace(f":{PG_PASSWORD}@", "@")
    return f"{url}&schema={schema}"


def unique_schema(prefix: str) -> str:
    return f"{prefix}_{os.getpid()}_{random.randrange(1 << 30)}"


@pytest.fixture
def dropped_schemas(pg_server: dict[str, str]) -> Iterator[list[str]]:
    """Schemas a test names; dropped afterwards."""
    names: list[str] = []
    yield names
    import psycopg

    with psycopg.connect(pg_server["url"], autocommit=True) as conn:
        for name in names:
            conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


@pytest.mark.postgres
def test_a_password_in_state_url_works_and_warns_keeping_json_stdout(
        config: Path, pg_server: dict[str, str], dropped_schemas: list[str]) -> None:
    schema = unique_schema("argvpw")
    dropped_schemas.append(schema)
    url = password_url(pg_server, schema)
    proc = run_cli("-c", str(config), "--state-url", url, "init", "--json")
    assert proc.returncode == 0, describe(proc)
    json.loads(proc.stdout)  # stdout is still one JSON document
    assert "Warning [RIVET_STATE_PASSWORD_IN_ARGV]" in proc.stderr and "process list" in proc.stderr, describe(proc)
    assert "RIVET_STATE_URL" in proc.stderr and PG_PASSWORD not in proc.stdout + proc.stderr
    quiet = run_cli("-c", str(config), "info", "--json", env={"RIVET_STATE_URL": url})
    assert quiet.returncode == 0 and "RIVET_STATE_PASSWORD_IN_ARGV" not in quiet.stderr, describe(quiet)


@pytest.mark.postgres
@pytest.mark.parametrize("how", ["PGPASSFILE", "PGPASSWORD"])
def test_libpq_password_sources_are_honoured_for_a_url_without_password(
        tmp_path: Path, config: Path, pg_server: dict[str, str], dropped_schemas: list[str], how: str) -> None:
    schema = unique_schema("pgpass")
    dropped_schemas.append(schema)
    url = password_url(pg_server, schema, with_password=False)
    assert f"{PG_PASSWORD_USER}@" in url
    denied = run_cli("-c", str(config), "--json-errors", "init", env={"RIVET_STATE_URL": url,
                                                                     "PGPASSFILE": str(tmp_path / "none")})
    # libpq's own "fe_sendauth: no password supplied" (no SQLSTATE) is a login refusal, not a retry.
    assert denied.returncode == 1 and error_object(denied)["code"] == "RIVET_STATE_AUTH_FAILED", describe(denied)
    if how == "PGPASSFILE":
        passfile = tmp_path / "pgpass"
        passfile.write_text(f"*:*:*:{PG_PASSWORD_USER}:{PG_PASSWORD}\n")
        passfile.chmod(0o600)
        env = {"PGPASSFILE": str(passfile)}
    else:
        env = {"PGPASSWORD": PG_PASSWORD, "PGPASSFILE": str(tmp_path / "none")}
    ok = run_cli("-c", str(config), "--state-url", url, "init", "--json", env=env)
    assert ok.returncode == 0, describe(ok)
    assert "RIVET_STATE_PASSWORD_IN_ARGV" not in ok.stderr, describe(ok)
    assert json.loads(ok.stdout)["location"]["schema"] == schema
    assert PG_PASSWORD not in ok.stdout + ok.stderr


@pytest.mark.postgres
def test_transfer_to_env_reads_the_url_from_the_variable(tmp_path: Path, pg_server: dict[str, str],
                                                          dropped_schemas: list[str]) -> None:
    config = write_config(tmp_path / "pipeline")
    assert run_cli("-c", str(config), "init").returncode == 0
    schema = unique_schema("toenv")
    dropped_schemas.append(schema)
    url = password_url(pg_server, schema)
    before = tree_digest(tmp_path)
    for args, env, why in [(("--to", url, "--to-env", "DEST"), {"DEST": url}, "both"),
                           ((), {}, "neither"),
                           (("--to-env", "DEST"), {}, "unset"),
                           (("--to-env", "DEST"), {"DEST": "  "}, "empty")]:
        proc = run_cli("-c", str(config), "--json-errors", "transfer", *args, env=env)
        assert proc.returncode == 1 and error_object(proc)["code"] == "RIVET_CLI_USAGE", (why, describe(proc))
        assert PG_PASSWORD not in proc.stdout + proc.stderr
    assert tree_digest(tmp_path) == before
    dry = run_cli("-c", str(config), "transfer", "--to", url, "--dry-run", "--json")
    assert dry.returncode == 0 and "RIVET_STATE_PASSWORD_IN_ARGV" in dry.stderr, describe(dry)
    proc = run_cli("-c", str(config), "transfer", "--to-env", "DEST", "--json", env={"DEST": url})
    assert proc.returncode == 0, describe(proc)
    assert "RIVET_STATE_PASSWORD_IN_ARGV" not in proc.stderr and PG_PASSWORD not in proc.stdout + proc.stderr
    tomb = (config.parent / ".rivet_state.db").read_bytes()
    assert tomb.startswith(MAGIC) and PG_PASSWORD.encode() not in tomb
    after = run_cli("-c", str(config), "info", "--json", env={"RIVET_STATE_URL": url})
    assert after.returncode == 0, describe(after)


# -- the fuzz -------------------------------------------------------------------------------

SEED = 20261201
LETTERS = "qxzjkvwQXZJKVWéßλЖ漢"  # no digits, no a-f: nothing of a password can match a hex id
SPECIALS = "@:/%#?&=+ "
FUZZ_URLS = 1040
SUBPROCESS_SAMPLE = 30
#: Every this-th run of the sample starts a new interpreter (``python -m statetool``);
#: the others are forked from one that imported statetool (:func:`support.run_cli_forked`).
STARTED_EVERY = 3
#: The fuzz runs as this many tests (each takes every FUZZ_SHARDS-th round of the channels),
#: so that several workers share it; every shard draws the whole seeded sequence and judges
#: its state against every password of it.
FUZZ_SHARDS = 4


def fuzz_password(rng: random.Random) -> str:
    """8-16 characters, every special at most twice in a row, so each 4-character fragment
    holds one of :data:`LETTERS` (no fragment can occur in output by chance)."""
    chars: list[str] = [rng.choice(LETTERS)]
    while len(chars) < rng.randint(8, 16):
        run = "".join(chars[-2:])
        special = rng.random() < 0.4 and not all(c in SPECIALS for c in run)
        chars.append(rng.choice(SPECIALS) if special else rng.choice(LETTERS))
    return "".join(chars)


MALFORMATIONS = [
    lambda base: base.replace("/{db}", ":notaport/{db}", 1),
    lambda base: base.replace("/{db}", ":99999/{db}", 1),
    lambda base: base + "?sslmode=bogus",
    lambda base: base + "?schema=a&schema=b",
    lambda base: base.replace("/{db}", "/", 1),
    lambda base: base + "?host=/d?schema=x",
    lambda base: base + "?frobnicate=1",
    lambda base: base.replace("://", "//", 1),
    lambda base: base.replace("://", ":/", 1),
    lambda base: base + "#frag",
]


def fuzz_url(rng: random.Random, password: str, target: str) -> tuple[str, str]:
    """A URL carrying ``password`` and its kind: ``raw`` (as typed: ambiguous when it holds
    ``/ ? # @`` or a space), ``encoded`` (valid) or ``malformed``. ``target`` is
    ``host:port`` or ``@socket:<dir>`` (the test server's socket, trusted for user postgres)."""
    kind = rng.choice(["raw", "encoded", "encoded", "malformed"])
    spelled = password if kind == "raw" or (kind == "malformed" and rng.random() < 0.5) else quote(password, safe="")
    if target.startswith("@socket:"):
        base = f"postgresql://postgres:{spelled}@/{{db}}"
        suffix = f"host={target[len('@socket:'):]}"
    else:
        base = f"{rng.choice(['postgresql', 'postgres', 'postgresql+psycopg'])}://rivet:{spelled}@{target}/{{db}}"
        suffix = ""
    if kind == "malformed":
        base = rng.choice(MALFORMATIONS)(base)
    url = base.replace("{db}", "postgres")
    if suffix:
        url += ("&" if "?" in url.split("@")[-1] else "?") + suffix
    return url, kind


def cli_in_process(args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """The real entry point (:func:`statetool.cli.main`, what ``python -m statetool``
    runs) in this process, stdout and stderr captured, with a fresh memory of secrets as
    a new process has (``leases run`` too: only the text of its record is judged here)."""
    proc = run_cli(*args, env={"GITHUB_ACTIONS": "", **env})
    return proc.returncode, proc.stdout, proc.stderr


def cli_subprocess(args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """The real CLI as a subprocess (``python -m statetool``)."""
    proc = run_cli_process(*args, env={"GITHUB_ACTIONS": "", **env})
    return proc.returncode, proc.stdout, proc.stderr


def cli_forked(args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """The real CLI in a process of its own, forked without the interpreter's start-up."""
    proc = run_cli_forked(*args, env={"GITHUB_ACTIONS": "", **env})
    return proc.returncode, proc.stdout, proc.stderr


LEASE_DUMP = ("import glob, shutil, sys\n"
              "for i, f in enumerate(sorted(glob.glob(sys.argv[2] + '/*'))):\n"
              "    shutil.copy(f, sys.argv[1] + '.' + str(i))\n")
#: A shell that has ``psql`` ($1) copy every row of ``rivet_leases`` of schema $4 of the
#: server $3 into file $2; what follows ($5 on) is in its argv only. psql, not a Python
#: child: importing psycopg in a new interpreter costs half a CPU second a run.
PG_LEASE_DUMP = 'exec "$1" -X -q -A -t -o "$2" -d "$3" -c "SELECT * FROM \\"$4\\".rivet_leases"'


def sqlite_dump(path: Path) -> str:
    """Every row of every table of the SQLite state at ``path`` (or the tombstone's text)."""
    data = path.read_bytes()
    if data.startswith(MAGIC):
        return data.decode("utf-8", "replace")
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return json.dumps({t: db.execute(f'SELECT * FROM "{t}"').fetchall() for t in tables}, ensure_ascii=False,
                          default=str)


def pg_dump(base_url: str, schemas: list[str]) -> str:
    import psycopg

    out: dict[str, object] = {}
    with psycopg.connect(base_url, autocommit=True) as conn:
        for schema in schemas:
            for (table,) in conn.execute("SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                                         (schema,)).fetchall():
                out[f"{schema}.{table}"] = conn.execute(f'SELECT * FROM "{schema}"."{table}"').fetchall()
    return json.dumps(out, ensure_ascii=False, default=str)


@pytest.mark.postgres
@pytest.mark.parametrize("shard", range(FUZZ_SHARDS))
def test_redaction_fuzz(tmp_path: Path, pg_server: dict[str, str], dropped_schemas: list[str], shard: int) -> None:
    """1,040 seeded URLs with passwords of letters (ASCII and not) and ``@ : / % # ? & = +``
    and space, raw, percent-encoded and malformed, each through one channel:

    * a state URL (``RIVET_STATE_URL`` or ``--state-url``) for ``info``, ``info
      --json-errors``, ``check --json``, ``check`` under ``GITHUB_ACTIONS=true`` (annotations),
      ``--debug migrate``; valid ones reach a closed port on 127.0.0.1 or the test server's
      socket (user postgres is trusted there, so any password logs in and ``init``/``exports
      reset`` write into its schema: audit rows and identity);
    * the config's ``source.url`` for ``init`` (identity and audit written) and ``check --json``;
    * ``identity rekey --new URL --reason URL`` on a SQLite state (audit rows);
    * a child's argument under ``leases run`` (the holder record, SQLite sidecar and
      PostgreSQL ``rivet_leases``, copied by the child while it holds the lease);
    * ``transfer --to URL`` (tombstone, PostgreSQL audit rows).

    All but :data:`SUBPROCESS_SAMPLE` go through :func:`statetool.cli.main` in this process
    (the same function ``python -m statetool`` runs, stdout/stderr captured; a subprocess
    each would take minutes); the sample, spread over every channel, in a process of its
    own: every :data:`STARTED_EVERY`-th a new interpreter (``python -m statetool``), the
    others forked from one that imported statetool. Each run's stdout and stderr, and at the end every table of every
    state, every lease record and every tombstone, hold no 4-character fragment of any
    password, in any spelling (as written, percent-decoded, JSON-unescaped).

    Each of the :data:`FUZZ_SHARDS` shards draws the same seeded sequence and runs its own
    rounds of the channels (every channel in each); the floors of runs that succeeded hold per shard (a quarter
    of the whole fuzz's, rounded up), so all four together hold at least the whole one's.
    """
    rng = random.Random(SEED)
    psql = require_psql()
    socket_dir = pg_server["url"].split("host=")[1]
    trusted_base = pg_server["url"]
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]  # bound, never listening: connections are refused
    channels = ["state"] * 12 + ["source"] * 3 + ["rekey"] * 3 + ["lease", "lease_pg"]
    passwords: list[str] = []
    dumps: list[str] = []
    config = write_config(tmp_path / "rekey")
    assert cli_in_process(["-c", str(config), "init"], {})[0] == 0
    lease_config = write_config(tmp_path / "lease")
    assert cli_in_process(["-c", str(lease_config), "init"], {})[0] == 0
    lease_schema = unique_schema("fuzzlease")
    dropped_schemas.append(lease_schema)
    lease_pg_url = f"{trusted_base}&schema={lease_schema}"
    assert cli_in_process(["-c", str(lease_config), "init"], {"RIVET_STATE_URL": lease_pg_url})[0] == 0
    sample = set(rng.sample(range(FUZZ_URLS), SUBPROCESS_SAMPLE))
    transfers = set(rng.sample(sorted(set(range(FUZZ_URLS)) - sample), 12)) | set(sorted(sample)[:3])
    started = set(sorted(sample)[::STARTED_EVERY])
    kinds: dict[str, int] = {}
    succeeded: dict[str, int] = {}  # channel -> runs that exit 0: the fuzz reached the writes, not only refusals
    for i in range(FUZZ_URLS):
        password = fuzz_password(rng)
        passwords.append(password)
        target = rng.choice([f"127.0.0.1:{closed_port}", f"@socket:{socket_dir}"])
        url, kind = fuzz_url(rng, password, target)
        kinds[kind] = kinds.get(kind, 0) + 1
        by_argument = rng.random() < 0.5  # the state channel's: --state-url, else RIVET_STATE_URL
        if (i // len(channels)) % FUZZ_SHARDS != shard:  # whole rounds of the channels per shard
            continue
        run = cli_in_process if i not in sample else cli_subprocess if i in started else cli_forked
        channel = "transfer" if i in transfers else channels[i % len(channels)] if i not in sample \
            else ["state", "source", "rekey", "lease", "lease_pg"][i % 5]
        secrets = (password, quote(password, safe=""))
        outputs: list[str] = []
        if channel == "state":
            schema = unique_schema("fuzz")
            if target.startswith("@socket:"):
                dropped_schemas.append(schema)
                url += f"&schema={schema}"
            forms = [["info"], ["--json-errors", "info"], ["check", "--json"], ["check"], ["--debug", "migrate"],
                     ["init", "--json"], ["exports", "reset", "orders"]]
            form = forms[i % len(forms)]
            env = {"GITHUB_ACTIONS": "true"} if form[0] == "check" else {}
            if by_argument:
                args, env["RIVET_STATE_URL"] = ["-c", str(config), *form], url
            else:
                args = ["-c", str(config), "--state-url", url, *form]
            if form[0] == "exports":  # a state to write into, made with the same URL
                outputs.extend(run(["-c", str(config), "init"], {"RIVET_STATE_URL": url})[1:])
            code, *streams = run(args, env)
            outputs.extend(streams)
            succeeded[f"state {form[0]}"] = succeeded.get(f"state {form[0]}", 0) + (code == 0)
            if form[0] == "exports":
                outputs.extend(run(["-c", str(config), "--state-url", url, "--json", "info"], {})[1:])
        elif channel == "source":
            directory = tmp_path / f"source-{i}"
            directory.mkdir()
            (directory / "rivet.yaml").write_text(f"source:\n  url: {json.dumps(url)}\nexports:\n"
                                                  "  - name: orders\n    mode: full\n")
            for form in (["init", "--json"], ["check", "--json"], ["identity", "show", "--json"]):
                code, *streams = run(["-c", str(directory / "rivet.yaml"), *form], {"GITHUB_ACTIONS": "true"})
                outputs.extend(streams)
                succeeded[f"source {form[0]}"] = succeeded.get(f"source {form[0]}", 0) + (code == 0)
            if (directory / ".rivet_state.db").exists():
                dumps.append(sqlite_dump(directory / ".rivet_state.db"))
        elif channel == "rekey":
            with sqlite3.connect(config.parent / ".rivet_state.db") as db:
                old = db.execute("SELECT state_key FROM rivet_identity").fetchone()[0]
            code, *streams = run(["-c", str(config), "--debug", "identity", "rekey", "--old", old, "--new", url,
                                  "--reason", f"moved from {url}"], {})
            outputs.extend(streams)
            succeeded["rekey"] = succeeded.get("rekey", 0) + (code == 0)
        elif channel in ("lease", "lease_pg"):
            copy = tmp_path / f"lease-{i}"
            if channel == "lease":
                child = [sys.executable, "-c", LEASE_DUMP, str(copy), str(lease_config.parent / ".rivet_state.leases"),
                         url, f"--password={password}"]
                env = {}
            else:
                child = ["/bin/sh", "-c", PG_LEASE_DUMP, "sh", str(psql), str(copy), trusted_base, lease_schema, url,
                         f"--password={password}"]
                env = {"RIVET_STATE_URL": lease_pg_url}
            code, *streams = run(["-c", str(lease_config), "leases", "run", "--export", "orders", "--", *child], env)
            assert code == 0, streams
            copies = sorted(tmp_path.glob(f"lease-{i}*"))
            assert copies, f"the child copied no lease record ({channel})"
            # The child's own argv holds the password on purpose: only the holder's command is judged.
            outputs.extend(streams)
            dumps.extend(c.read_text(encoding="utf-8", errors="replace") for c in copies)
        else:  # transfer
            directory = tmp_path / f"transfer-{i}"
            source_config = write_config(directory)
            assert cli_in_process(["-c", str(source_config), "init"], {})[0] == 0
            schema = unique_schema("fuzzxfer")
            dropped_schemas.append(schema)
            to = f"postgresql://postgres:{quote(password, safe='')}@/postgres?host={socket_dir}&schema={schema}"
            if kind == "raw":
                to = f"postgresql://postgres:{password}@/postgres?host={socket_dir}&schema={schema}"
            code, *streams = run(["-c", str(source_config), "--json", "transfer", "--to", to], {})
            outputs.extend(streams)
            succeeded["transfer"] = succeeded.get("transfer", 0) + (code == 0)
            dumps.append(sqlite_dump(directory / ".rivet_state.db"))
        how = "in-process" if i not in sample else "subprocess" if i in started else "forked process"
        assert_clean("\n".join(outputs), *secrets, what=f"(#{i}, {channel}, {kind}, {how}: {url!r})")
    closed.close()
    dumps.append(sqlite_dump(config.parent / ".rivet_state.db"))
    dumps.append(sqlite_dump(lease_config.parent / ".rivet_state.db"))
    dumps.append(pg_dump(trusted_base, dropped_schemas))
    everything = {f for p in passwords for s in (p, quote(p, safe="")) for f in fragments(s)}
    for text in dumps:
        seen = views(text)
        grams = {seen[j:j + FRAGMENT] for j in range(len(seen) - FRAGMENT + 1)}
        assert not grams & everything, f"password fragments in the state: {sorted(grams & everything)[:10]}"
    assert len(set(passwords)) >= 1000 and min(kinds.values()) >= 150, kinds
    floors = {k: -(-n // FUZZ_SHARDS) for k, n in
              {"state init": 10, "state exports": 5, "source init": 40, "rekey": 40, "transfer": 5}.items()}
    print(f"fuzz shard {shard}: kinds {kinds}, runs that succeeded {succeeded}")
    assert all(succeeded.get(k, 0) >= n for k, n in floors.items()), succeeded
    assert leaked(f"x{passwords[0]}x", passwords[0]) and leaked(quote(passwords[1]), passwords[1]), \
        "the leak detector itself must see a password"


# -- the redaction helpers the records go through -------------------------------------------


def test_command_lines_are_redacted_one_argument_at_a_time() -> None:
    line = redact.command_line(["statetool", "identity", "rekey", "--new", "postgresql://u:p4ss w0rd@newhost/db",
                                "--state-url=postgresql//u:Zq9 x@h/db", "--password", "Kx z7", "--pwd=Vq w3",
                                "root@host"])
    assert_absent(line, "p4ss", "w0rd", "Zq9", "Kx z7", "Vq w3")
    assert "newhost/db" in line and "root@host" in line, line


def test_documents_written_into_the_state_stay_valid_json_when_redacted() -> None:
    doc = {"to": "postgresql://h/db?password=Qz9x&sslmode=require", "url": "postgresql://u:Wk3q@h/db",
           "n": 3, "nested": [{"k": "password=Jx7v"}]}
    text = json.dumps(redact.redact_values(doc))
    assert json.loads(text)["n"] == 3
    assert_absent(text, "Qz9x", "Wk3q", "Jx7v")


def test_error_details_are_redacted_like_the_message() -> None:
    redact.remember_secrets("mysql://u:Pq 7x@h/x")
    err = StateError("RIVET_STATE_URL_INVALID", "bad mysql://u:Pq 7x@h/x", {"value": "mysql://u:Pq 7x@h/x"})
    assert_absent(err.message + json.dumps(err.details), "Pq 7x", "7x@")
