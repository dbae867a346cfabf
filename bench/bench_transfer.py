"""Transfer speed: ``statetool transfer`` of a SQLite state with --runs run rows (default
5,000,000) into PostgreSQL vs ``pgloader`` loading the same SQLite file into the same
server, side by side (goals: statetool rows/s >= pgloader rows/s, statetool's peak RSS
< 200 MiB).

The state is built once at head (``statetool init``, then one ``executemany`` into
``rivet_runs`` in one transaction) and copied afresh before every run of either side.
The server is a throwaway cluster started here from the machine's PostgreSQL binaries
(as conftest.py does), or the database of ``STATETOOL_TEST_PG_URL``. pgloader is
installed from Debian's packages when missing (``apt-get install -y pgloader``); it is
given the server's Unix socket, and when it cannot connect that way the cluster is
restarted listening on 127.0.0.1 on a free port.

What each side does, timed from process start to exit:

* statetool: pre-flight, leases, WAL checkpoint and page digest of the source, one
  destination transaction (schema at head, ``COPY`` of every table, per-table row count
  and content checksum compared with the source), commit, tombstone at the old place.
* pgloader: reads the SQLite catalog, creates the tables in a fresh schema, ``COPY``
  with its default workers, then indexes, primary keys and sequences; no verification.

Each run loads into its own schema, dropped (untimed) before the next run. After the
runs the row counts of both destinations are checked against the source.

    /tmp/v/bin/python bench/bench_transfer.py                      # 5,000,000 runs, 1 run per side
    /tmp/v/bin/python bench/bench_transfer.py --runs 500000 -n 3   # quick run
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (REPO, Case, Row, Run, compile_packages, header, measure, measured_env, parse_args,  # noqa: E402
                      as_postgres, pg_bindir, print_table, run_child)

RSS_GOAL_MIB = 200


# -- the PostgreSQL server --------------------------------------------------------------------






def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """A throwaway cluster in ``root``: Unix socket always, TCP on 127.0.0.1 when asked."""

    def __init__(self, root: Path) -> None:
        self.bindir = pg_bindir()
        self.root = root
        self.data = root / "data"
        self.port = 5432
        self.tcp = False
        root.mkdir()
        root.chmod(0o755)
        if os.geteuid() == 0:
            shutil.chown(root, "postgres")
        subprocess.run(as_postgres([str(self.bindir / "initdb"), "-D", str(self.data), "-A", "trust", "-U",
                                     "postgres", "--no-sync"]), check=True, capture_output=True)
        (self.data / "pg_hba.conf").write_text("local all all trust\nhost all all 127.0.0.1/32 trust\n")

    def start(self, tcp: bool) -> None:
        self.tcp = tcp
        self.port = _free_port() if tcp else 5432
        listen = "127.0.0.1" if tcp else ""
        subprocess.run(as_postgres([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l",
                                     str(self.root / "server.log"), "-w", "-o",
                                     f"-k {self.root} -p {self.port} -c listen_addresses='{listen}' "
                                     "-c max_wal_size=4GB -c max_connections=20", "start"]),
                       check=True, capture_output=True)

    def stop(self) -> None:
        subprocess.run(as_postgres([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "fast", "stop"]),
                       capture_output=True)

    @property
    def url(self) -> str:
        """libpq / statetool URL."""
        return f"postgresql://postgres@/postgres?host={self.root}&port={self.port}"

    @property
    def pgloader_url(self) -> str:
        if self.tcp:
            return f"pgsql://postgres@127.0.0.1:{self.port}/postgres"
        return f"pgsql://postgres@unix:{self.root}:{self.port}/postgres"


def pgloader_url_of(url: str) -> str:
    """pgloader's spelling of a libpq URL (``?host=/dir`` becomes ``unix:/dir:port``)."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    user = unquote(parts.username or "postgres")
    auth = f"{user}:{unquote(parts.password)}@" if parts.password else f"{user}@"
    port = parts.port or int(query.get("port", 5432))
    db = parts.path.lstrip("/") or "postgres"
    host = query.get("host") or parts.hostname or "localhost"
    if host.startswith("/"):
        return f"pgsql://{auth}unix:{host}:{port}/{db}"
    return f"pgsql://{auth}{host}:{port}/{db}"


def with_schema(url: str, schema: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}schema={schema}"


def psql(url: str, sql: str) -> list[tuple[object, ...]]:
    import psycopg

    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        cur = conn.execute(sql)
        return [tuple(r) for r in cur.fetchall()] if cur.description else []


# -- pgloader ---------------------------------------------------------------------------------


def ensure_pgloader() -> str:
    found = shutil.which("pgloader")
    if found:
        return found
    print("pgloader is missing: apt-get install -y pgloader")
    prefix = [] if os.geteuid() == 0 else ["sudo"]
    proc = subprocess.run([*prefix, "apt-get", "install", "-y", "pgloader"], capture_output=True, text=True)
    if proc.returncode != 0:
        subprocess.run([*prefix, "apt-get", "update"], capture_output=True)
        proc = subprocess.run([*prefix, "apt-get", "install", "-y", "pgloader"], capture_output=True, text=True)
    found = shutil.which("pgloader")
    if not found:
        raise SystemExit(f"could not install pgloader:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return found


def load_file(sqlite_path: Path, target: str, schema: str) -> str:
    """A pgloader command file: the SQLite file into ``schema`` (created before the load)."""
    return (f"LOAD DATABASE\n  FROM sqlite://{sqlite_path}\n  INTO {target}\n"
            "  WITH include drop, create tables, create indexes, reset sequences\n"
            f"  SET search_path to '{schema}'\n"
            f"  BEFORE LOAD DO $$ CREATE SCHEMA IF NOT EXISTS {schema}; $$;\n")


def pgloader_connects(pgloader: str, target: str, work: Path) -> bool:
    probe_db = work / "probe.db"
    db = sqlite3.connect(probe_db)
    db.execute("CREATE TABLE probe (id INTEGER PRIMARY KEY, v TEXT)")
    db.execute("INSERT INTO probe VALUES (1, 'x')")
    db.commit()
    db.close()
    command = work / "probe.load"
    command.write_text(load_file(probe_db, target, "pgloader_probe"))
    proc = subprocess.run([pgloader, str(command)], capture_output=True, text=True, timeout=300, cwd=work)
    ok = proc.returncode == 0 and "Total import time" in proc.stdout + proc.stderr and "FATAL" not in proc.stdout
    if not ok:
        print(f"pgloader could not load through {target}:\n{(proc.stdout + proc.stderr)[-1500:]}")
    return ok


def drop_probe(url: str) -> None:
    psql(url, "DROP SCHEMA IF EXISTS pgloader_probe CASCADE")


# -- the state --------------------------------------------------------------------------------


def build_state(python: str, statetool: str, directory: Path, runs: int, env: dict[str, str]) -> dict[str, int]:
    """``statetool init`` then ``runs`` rows into rivet_runs in one transaction; rows per table."""
    shutil.copyfile(REPO / "examples" / "rivet.yaml", directory / "rivet.yaml")
    subprocess.run([statetool, "-c", str(directory / "rivet.yaml"), "init"], check=True, capture_output=True, env=env)
    insert = (
        "import sqlite3, sys\n"
        "db = sqlite3.connect(sys.argv[1])\n"
        "exports = [('orders', 'incremental'), ('customers', 'full'), ('order_lines', 'chunked'),\n"
        "           ('invoices', 'incremental'), ('order_events', 'cdc')]\n"
        "def rows(n):\n"
        "    for i in range(n):\n"
        "        name, mode = exports[i % 5]\n"
        "        failed = i % 17 == 16\n"
        "        t = (f'2026-{1 + i // 2_500_000 % 12:02d}-01T{i // 3600 % 24:02d}:{i // 60 % 60:02d}:'\n"
        "             f'{i % 60:02d}.{i % 1000000:06d}Z')\n"
        "        yield (f'r{i:010d}', name, mode, 'failed' if failed else 'succeeded', t, t,\n"
        "               0 if failed else (i * 7919) % 50000, 0 if failed else 1,\n"
        "               'connection reset by peer' if failed else None, (i * 104729) % 10**9, 1000 + i % 60000,\n"
        "               'E_CONN' if failed else None)\n"
        "with db:\n"
        "    db.executemany('INSERT INTO rivet_runs VALUES (?,?,?,?,?,?,?,?,?,?,?,?)', rows(int(sys.argv[2])))\n"
        "db.execute('PRAGMA wal_checkpoint(TRUNCATE)')\n"
        "db.close()\n")
    subprocess.run([python, "-c", insert, str(directory / ".rivet_state.db"), str(runs)], check=True, env=env)
    db = sqlite3.connect(f"file:{directory / '.rivet_state.db'}?mode=ro", uri=True)
    try:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                           "AND name NOT LIKE 'sqlite_%'")]
        return {t: db.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in tables}
    finally:
        db.close()


def mib(kib: float) -> str:
    return f"{kib / 1024:.0f} MiB"


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], repeat=1, extra=lambda p: p.add_argument(
        "--runs", type=int, default=5_000_000, help="run rows in the state (default 5,000,000)"))
    compiled = compile_packages(args.python)
    header(f"bench_transfer: statetool transfer vs pgloader, a SQLite state with {args.runs:,} runs", args, compiled)
    pgloader = ensure_pgloader()
    version = subprocess.run([pgloader, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    env = measured_env()
    statetool = str(args.bin / "statetool")
    tmp_obj = tempfile.TemporaryDirectory(prefix="statetool-bench-transfer-")
    tmp = Path(tmp_obj.name)
    tmp.chmod(0o755)
    cluster: Cluster | None = None
    try:
        given = os.environ.get("STATETOOL_TEST_PG_URL")
        if given:
            base_url, target = given, pgloader_url_of(given)
        else:
            cluster = Cluster(tmp / "pg")
            cluster.start(tcp=False)
            base_url, target = cluster.url, cluster.pgloader_url
        if not pgloader_connects(pgloader, target, tmp):
            if cluster is None:
                raise SystemExit(f"pgloader cannot connect to {target} (from STATETOOL_TEST_PG_URL)")
            print("restarting the cluster listening on 127.0.0.1")
            cluster.stop()
            cluster.start(tcp=True)
            base_url, target = cluster.url, cluster.pgloader_url
            if not pgloader_connects(pgloader, target, tmp):
                raise SystemExit(f"pgloader cannot connect to {target} either")
        drop_probe(base_url)
        server = psql(base_url, "SHOW server_version")[0][0]
        print(f"pgloader: {version}; PostgreSQL {server}; pgloader connects through {target}")

        golden_dir = tmp / "golden"
        golden_dir.mkdir()
        started = time.perf_counter()
        counts = build_state(args.python, statetool, golden_dir, args.runs, env)
        golden = golden_dir / ".rivet_state.db"
        total_rows = sum(counts.values())
        print(f"built the state in {time.perf_counter() - started:.1f} s (not measured): "
              f"{golden.stat().st_size / 2**20:.0f} MiB, {total_rows:,} rows in {len(counts)} tables "
              f"(rivet_runs {counts['rivet_runs']:,})")

        st_dir, peer_dir = tmp / "statetool", tmp / "peer"
        st_dir.mkdir()
        peer_dir.mkdir()
        shutil.copyfile(golden_dir / "rivet.yaml", st_dir / "rivet.yaml")
        peer_db = peer_dir / "state.db"
        schemas: dict[str, list[str]] = {"statetool": [], "peer": []}

        def drop_schemas() -> None:
            for names in schemas.values():
                for name in names:
                    psql(base_url, f'DROP SCHEMA IF EXISTS "{name}" CASCADE')

        def fresh_statetool() -> None:
            drop_schemas()
            for p in st_dir.glob(".rivet_state.*"):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            shutil.copyfile(golden, st_dir / ".rivet_state.db")
            schemas["statetool"].append(f"bench_st_{len(schemas['statetool'])}")

        def fresh_peer() -> None:
            drop_schemas()
            peer_db.unlink(missing_ok=True)
            shutil.copyfile(golden, peer_db)
            schemas["peer"].append(f"bench_pgl_{len(schemas['peer'])}")
            (peer_dir / "load.pgl").write_text(load_file(peer_db, target, schemas["peer"][-1]))

        def run_statetool() -> Run:
            return run_child([statetool, "-c", str(st_dir / "rivet.yaml"), "--json", "transfer", "--to",
                              with_schema(base_url, schemas["statetool"][-1])], cwd=st_dir, env=env)

        def run_peer() -> Run:
            return run_child([pgloader, str(peer_dir / "load.pgl")], cwd=peer_dir, env=env)

        def check(side: str, run: Run) -> None:
            schema = schemas[side][-1]
            got = psql(base_url, f'SELECT count(*) FROM "{schema}".rivet_runs')[0][0]
            if got != counts["rivet_runs"]:
                raise SystemExit(f"{side} left {got} rows in {schema}.rivet_runs, not {counts['rivet_runs']}:\n"
                                 f"{run.stdout[-1500:]}\n{run.stderr[-1500:]}")
            if side == "statetool":
                doc = json.loads(run.stdout)
                if not (doc["done"] and all(t["verified"] for t in doc["tables"])):
                    raise SystemExit(f"statetool transfer did not complete: {doc.get('message')}")

        case = Case("transfer", run_statetool, run_peer, 1.0, "statetool rows/s >= pgloader rows/s",
                    prepare_statetool=fresh_statetool, prepare_peer=fresh_peer, check=check)
        measure([case], args.repeat, warmup=0)
        drop_schemas()
    finally:
        if cluster is not None:
            cluster.stop()
        if args.keep:
            print(f"kept {tmp}")
        else:
            tmp_obj.cleanup()

    st_s, peer_s = case.median("statetool"), case.median("peer")
    st_rate, peer_rate = total_rows / st_s, total_rows / peer_s
    rss_st, rss_peer = max(case.rss["statetool"]), max(case.rss["peer"])
    speed_ok = st_rate >= peer_rate
    rss_ok = rss_st < RSS_GOAL_MIB * 1024
    rows = [
        Row("wall time (median)", f"{st_s:.1f} s", f"{peer_s:.1f} s", f"{st_s / peer_s:.2f}", "-", "-"),
        Row(f"rows/s ({total_rows:,} rows)", f"{st_rate:,.0f}", f"{peer_rate:,.0f}", f"{st_rate / peer_rate:.2f}",
            "statetool >= pgloader", "PASS" if speed_ok else "FAIL"),
        Row("peak RSS (max of runs)", mib(rss_st), mib(rss_peer), "-", f"statetool < {RSS_GOAL_MIB} MiB",
            "PASS" if rss_ok else "FAIL"),
    ]
    print_table(rows, f"transfer SQLite -> PostgreSQL, {args.runs:,} runs ({args.repeat} run(s) per side, "
                      "alternated; peer = pgloader, same file, same server)")
    print(f"statetool runs: {', '.join(f'{t:.1f} s' for t in case.times['statetool'])}; "
          f"pgloader runs: {', '.join(f'{t:.1f} s' for t in case.times['peer'])}")
    return 0 if speed_ok and rss_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
