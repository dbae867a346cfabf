"""Shared fixtures: real SQLite files in tmp_path, a real PostgreSQL server, the real CLI.

PostgreSQL: ``STATETOOL_TEST_PG_URL`` (a database where the tests may create schemas) is
used when set; otherwise a throwaway cluster is started from the machine's PostgreSQL
server binaries, as the ``postgres`` user when the tests run as root (the server refuses
root), listening only on a Unix socket in a temp directory. Without either, the
PostgreSQL tests FAIL under CI (``CI`` set) and are skipped loudly elsewhere.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

PG_PASSWORD_USER = "statetool_pw"
PG_PASSWORD = "correct-horse-battery"


def _pg_bindir() -> Path | None:
    explicit = os.environ.get("STATETOOL_PG_BIN")
    if explicit:
        return Path(explicit)
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


def _as_postgres(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


class Cluster:
    """A throwaway PostgreSQL cluster in a temp directory, listening only on a Unix socket
    there, run as the ``postgres`` user when the tests run as root (the server refuses
    root). ``url`` is its superuser URL; :meth:`stop` stops it (immediately, as a crash
    would), :meth:`remove` stops it and deletes its directory."""

    def __init__(self, bindir: Path, prefix: str, *options: str) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix=prefix))
        self.root.chmod(0o755)
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
        self.data = self.root / "data"
        subprocess.run(_as_postgres([str(bindir / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                                     "--no-sync"]), check=True, capture_output=True)
        (self.data / "pg_hba.conf").write_text(
            f"local all {PG_PASSWORD_USER} scram-sha-256\nlocal all all trust\n")
        server_options = " ".join((f"-k {self.root}", "-c listen_addresses=''", "-c fsync=off", *options))
        subprocess.run(_as_postgres([str(bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "server.log"),
                                     "-w", "-o", server_options, "start"]), check=True, capture_output=True)
        self.url = f"postgresql://postgres@/postgres?host={self.root}"

    def stop(self) -> None:
        subprocess.run(_as_postgres([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"]),
                       capture_output=True)

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def require_pg_bindir() -> Path:
    """The server binaries; without them the PostgreSQL tests FAIL under CI (``CI`` set)
    and are skipped loudly elsewhere."""
    bindir = _pg_bindir()
    if bindir is None:
        message = ("PostgreSQL server binaries not found (apt-get install postgresql-15, or set "
                   "STATETOOL_TEST_PG_URL): the PostgreSQL half of the suite cannot run")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return bindir


@pytest.fixture(scope="session")
def pg_server() -> Iterator[dict[str, str]]:
    """A PostgreSQL server: ``{"url": superuser URL, "password_url": URL of a password role}``."""
    given = os.environ.get("STATETOOL_TEST_PG_URL")
    if given:
        yield {"url": given, "password_url": ""}
        return
    cluster = Cluster(require_pg_bindir(), "statetool-pg-", "-c max_connections=100")
    subprocess.run(_as_postgres([str(cluster.bindir / "psql"), "-h", str(cluster.root), "-U", "postgres", "-d",
                                 "postgres", "-c", f"CREATE ROLE {PG_PASSWORD_USER} LOGIN PASSWORD '{PG_PASSWORD}'; "
                                 f"GRANT CREATE ON DATABASE postgres TO {PG_PASSWORD_USER};"]),
                   check=True, capture_output=True)
    try:
        yield {"url": cluster.url,
               "password_url": f"postgresql://{PG_PASSWORD_USER}:{PG_PASSWORD}@/postgres?host={cluster.root}"}
    finally:
        cluster.remove()


@pytest.fixture
def pg_url(pg_server: dict[str, str]) -> Iterator[str]:
    """A state URL with a fresh schema of its own (dropped afterwards)."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    base = pg_server["url"]
    yield f"{base}{'&' if '?' in base else '?'}schema={schema}"
    import psycopg

    with psycopg.connect(base.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def write_config(directory: Path, *, source_url: str | None = "postgresql://reader@db.internal:5432/sales",
                 exports: str | None = None, name: str = "rivet.yaml") -> Path:
    """Write a pipeline config into ``directory`` and return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    source = f"source:\n  url: {source_url}\n" if source_url else ""
    body = exports or textwrap.dedent("""\
        exports:
          - name: orders
            mode: incremental
          - name: order_lines
            mode: chunked
          - name: order_events
            mode: cdc
            cdc:
              engine: mysql
              checkpoint: checkpoints/order_events.json
        """)
    path = directory / name
    path.write_text(source + body)
    return path


@pytest.fixture
def config(tmp_path: Path) -> Path:
    """A pipeline config in ``tmp_path/pipeline`` whose source is db.internal/sales."""
    return write_config(tmp_path / "pipeline")


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the real CLI (``python -m statetool``) in a subprocess, fixed width, no RIVET_STATE_URL
    unless ``env`` gives one."""
    full_env = {k: v for k, v in os.environ.items() if k != "RIVET_STATE_URL"}
    full_env.update({"COLUMNS": "200", "NO_COLOR": "1"})
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "statetool", *args], cwd=cwd, env=full_env, text=True,
                          capture_output=True, timeout=timeout)


def describe(proc: subprocess.CompletedProcess[str]) -> str:
    """The output of a CLI run, for assertion messages."""
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"


def tree_digest(directory: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file below ``directory`` (the byte-identical check)."""
    out = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(directory))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


# -- the one backend fixture: every contract test runs on SQLite and on PostgreSQL ---------

from support.backends import BACKENDS, StateBackend  # noqa: E402 - this block stands alone at the end


@pytest.fixture(params=[pytest.param(kind, marks=[pytest.mark.postgres] if kind == "postgres" else [])
                        for kind in BACKENDS])
def state_backend(request: pytest.FixtureRequest, tmp_path: Path) -> StateBackend:
    """The state location of one run of a contract test, once per backend (ids ``sqlite``,
    ``postgres``; the PostgreSQL run is marked ``postgres`` and gets a fresh schema from
    :func:`pg_url`). Nothing is created: the test writes its config into ``pipeline``."""
    if request.param == "postgres":
        return StateBackend.postgres(tmp_path, request.getfixturevalue("pg_url"))
    return StateBackend.sqlite(tmp_path)
