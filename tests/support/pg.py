"""A throwaway PostgreSQL cluster from the machine's server binaries (the ``pg_server``
fixture's, and the tests' that stop a server on purpose)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NoReturn

import pytest

#: The password role the ``pg_server`` fixture creates (scram-sha-256 over the socket).
PG_PASSWORD_USER = "statetool_pw"
PG_PASSWORD = "correct-horse-battery"


def _pg_bindir() -> Path | None:
    explicit = os.environ.get("STATETOOL_PG_BIN")
    if explicit:
        return Path(explicit)
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


def as_postgres(cmd: list[str]) -> list[str]:
    """``cmd`` run as the ``postgres`` user when the tests run as root (the server refuses root)."""
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
        subprocess.run(as_postgres([str(bindir / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                                    "--no-sync"]), check=True, capture_output=True)
        (self.data / "pg_hba.conf").write_text(
            f"local all {PG_PASSWORD_USER} scram-sha-256\nlocal all all trust\n")
        server_options = " ".join((f"-k {self.root}", "-c listen_addresses=''", "-c fsync=off", *options))
        subprocess.run(as_postgres([str(bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "server.log"),
                                    "-w", "-o", server_options, "start"]), check=True, capture_output=True)
        self.url = f"postgresql://postgres@/postgres?host={self.root}"

    def stop(self) -> None:
        """Stop the server at once (``-m immediate``, as a crash would)."""
        subprocess.run(as_postgres([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"]),
                       capture_output=True)

    def remove(self) -> None:
        """Stop the server and delete its directory."""
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def _missing(message: str) -> NoReturn:
    """FAIL under CI (``CI`` set), skip loudly elsewhere."""
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def require_pg_bindir() -> Path:
    """The server binaries; without them the PostgreSQL tests FAIL under CI (``CI`` set)
    and are skipped loudly elsewhere."""
    bindir = _pg_bindir()
    if bindir is None:
        _missing("PostgreSQL server binaries not found (apt-get install postgresql-15, or set "
                 "STATETOOL_TEST_PG_URL): the PostgreSQL half of the suite cannot run")
    return bindir


def require_psql() -> Path:
    """The ``psql`` client: the server binaries' own, else the one on PATH (a machine that
    gives ``STATETOOL_TEST_PG_URL`` may have no server); missing, as :func:`require_pg_bindir`."""
    bindir = _pg_bindir()
    found = bindir / "psql" if bindir is not None and (bindir / "psql").exists() else shutil.which("psql")
    if found is None:
        _missing("psql not found (apt-get install postgresql-client): the tests that read PostgreSQL with it "
                 "cannot run")
    return Path(found)
