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
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support import PG_PASSWORD, PG_PASSWORD_USER, Cluster, as_postgres, require_pg_bindir, write_config
from support.backends import BACKENDS, StateBackend
from support.zygote import zygote

#: Tests that are a work unit of their own (each parameter too), longest first; every
#: other test runs with the rest of its file, one unit per file.
OWN_UNITS = ("test_no_two_holders_ever_overlap_and_tokens_only_grow_under_sigkill_chaos",
             "test_redaction_fuzz", "test_transfer_killed_at_any_instant", "test_sigkill_at_every_point",
             "test_relocate_killed_at_any_instant")
#: The files that take longest, after the units above.
LONGEST_FIRST = ("test_lease_contract.py", "test_guides.py", "test_leases.py", "test_fault_matrix.py",
                 "test_transfer.py", "test_relocate.py", "test_move_crashes.py", "test_url_secrets.py",
                 "test_guarded_writes.py", "test_hot_journal.py", "test_doctor.py", "test_docs.py")


def work_unit(nodeid: str) -> str:
    """The work unit of the test ``nodeid``: the test itself for :data:`OWN_UNITS`, else its file."""
    path, _, name = nodeid.partition("::")
    return nodeid if name.startswith(OWN_UNITS) else path


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the work units longest first, :data:`OWN_UNITS` then :data:`LONGEST_FIRST`,
    so that no long unit starts last and runs alone. Tests keep their order within a
    unit. Run under ``--no-loadscope-reorder`` (pyproject's addopts), xdist hands out
    the units in this order."""
    def rank(item: pytest.Item) -> int:
        unit = next((i for i, name in enumerate(OWN_UNITS) if item.name.startswith(name)), None)
        if unit is not None:
            return unit
        name = item.path.name
        return len(OWN_UNITS) + (LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST))

    items.sort(key=rank)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """xdist hands whole :func:`work_unit` units to its workers, so a file's
    module-scoped fixtures are built once. (Not ``xdist_group`` marks: ``--dist
    loadgroup`` stopped grouping on pytest 9.2, pytest-xdist issue #1386.)"""
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return WorkUnits(config, log)


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


@pytest.fixture
def pg_schemas(pg_server: dict[str, str]) -> Iterator[Callable[[], str]]:
    """A maker of state URLs on the test server, each with a fresh schema of its own (every
    one dropped afterwards): for a test that needs several, as :func:`pg_url` gives one."""
    made: list[str] = []
    base = pg_server["url"]

    def new() -> str:
        made.append(f"t_{uuid.uuid4().hex[:12]}")
        return f"{base}{'&' if '?' in base else '?'}schema={made[-1]}"

    yield new
    import psycopg

    with psycopg.connect(base.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        for schema in made:
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
