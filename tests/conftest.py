"""Fixtures only: real SQLite files in tmp_path, a real PostgreSQL server (helpers: tests/support).

PostgreSQL: ``STATETOOL_TEST_PG_URL`` (a database where the tests may create schemas) is
used when set; otherwise a throwaway cluster is started from the machine's PostgreSQL
server binaries, as the ``postgres`` user when the tests run as root (the server refuses
root), listening only on a Unix socket in a temp directory. Without either, the
PostgreSQL tests FAIL under CI (``CI`` set) and are skipped loudly elsewhere.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import PG_PASSWORD, PG_PASSWORD_USER, Cluster, as_postgres, require_pg_bindir, write_config
from support.backends import BACKENDS, StateBackend
from support.zygote import zygote

#: The files that take longest, run first: xdist hands whole files to its two workers in
#: collection order, and a long file started last would run alone at the end.
LONGEST_FIRST = ("test_url_secrets.py", "test_lease_contract.py", "test_move_crashes.py", "test_leases.py",
                 "test_relocate.py", "test_docs.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the files :data:`LONGEST_FIRST`, then the rest as collected (tests within a
    file keep their order)."""
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[dict[str, str]]:
    """A PostgreSQL server: ``{"url": superuser URL, "password_url": URL of a password role}``."""
    given = os.environ.get("STATETOOL_TEST_PG_URL")
    if given:
        yield {"url": given, "password_url": ""}
        return
    cluster = Cluster(require_pg_bindir(), "statetool-pg-", "-c max_connections=100")
    subprocess.run(as_postgres([str(cluster.bindir / "psql"), "-h", str(cluster.root), "-U", "postgres", "-d",
                                 "postgres", "-c", f"CREATE ROLE {PG_PASSWORD_USER} LOGIN PASSWORD '{PG_PASSWORD}'; "
                                 f"GRANT CREATE ON DATABASE postgres TO {PG_PASSWORD_USER};"]),
                   check=True, capture_output=True)
    try:
        yield {"url": cluster.url,
               "password_url": f"postgresql://{PG_PASSWORD_USER}:{PG_PASSWORD}@/postgres?host={cluster.root}"}
    finally:
        cluster.remove()


@pytest.fixture(scope="session")
def guide_shell() -> Iterator[dict[str, str]]:
    """What a shell running a guide's commands adds to its environment: ``statetool`` on
    PATH as a client of a zygote that imported statetool once (:mod:`support.zygote`),
    then the interpreter's directory."""
    with zygote() as env:
        yield env


@pytest.fixture
def pg_url(pg_server: dict[str, str]) -> Iterator[str]:
    """A state URL with a fresh schema of its own (dropped afterwards)."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    base = pg_server["url"]
    yield f"{base}{'&' if '?' in base else '?'}schema={schema}"
    import psycopg

    with psycopg.connect(base.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture(autouse=True)
def no_remembered_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts with no remembered passwords (statetool.redact keeps those of
    the URLs this process was given), as a new process does: a password another test
    used (``pw``, even ``postgresql``) would mask unrelated text."""
    from statetool import redact

    monkeypatch.setattr(redact, "_secrets", set())


@pytest.fixture
def config(tmp_path: Path) -> Path:
    """A pipeline config in ``tmp_path/pipeline`` whose source is db.internal/sales."""
    return write_config(tmp_path / "pipeline")


# -- the one backend fixture: every contract test runs on SQLite and on PostgreSQL ---------


@pytest.fixture(params=[pytest.param(kind, marks=[pytest.mark.postgres] if kind == "postgres" else [])
                        for kind in BACKENDS])
def state_backend(request: pytest.FixtureRequest, tmp_path: Path) -> StateBackend:
    """The state location of one run of a contract test, once per backend (ids ``sqlite``,
    ``postgres``; the PostgreSQL run is marked ``postgres`` and gets a fresh schema from
    :func:`pg_url`). Nothing is created: the test writes its config into ``pipeline``."""
    if request.param == "postgres":
        return StateBackend.postgres(tmp_path, request.getfixturevalue("pg_url"))
    return StateBackend.sqlite(tmp_path)
