"""Transfer speed: ``statetool transfer`` of a SQLite state with --runs run rows (default
5,000,000, about 1 GiB) into PostgreSQL vs ``pgloader`` loading the same SQLite file into the
same server, and vs the floor: a plain psycopg COPY of the same rows into unindexed tables,
then CREATE INDEX, in one transaction (goals, issue 13: statetool <= 0.6 x pgloader's time,
<= 1.25 x the floor's, statetool's peak RSS <= 200 MiB).

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
* floor (:data:`FLOOR`, a Python child on the same interpreter): in one transaction,
  every table of the SQLite file created without keys or indexes, its rows read with
  ``sqlite3`` and sent with psycopg's ``copy.write_row`` (COPY text), then the primary keys
  and the indexes of the SQLite file built, COMMIT; no verification, no lease, no tombstone.

Each run loads into its own schema, dropped (untimed) before the next run. The three sides
run in turn, the order rotated every round. After the runs the row counts of every
destination are checked against the source. ``--scaling`` adds how statetool's time grows:
one run of statetool and of the floor at 1/10 and 1/2 of --runs (0.1 and 0.5 GiB at the
default), beside the full size.

    /tmp/v/bin/python bench/bench_transfer.py                      # 5,000,000 runs, 1 run per side
    /tmp/v/bin/python bench/bench_transfer.py --scaling            # and at 500,000 and 2,500,000 runs
    /tmp/v/bin/python bench/bench_transfer.py --runs 500000 -n 3   # quick run
"""

from __future__ import annotations

import argparse
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

from _harness import (REPO, Case, Row, Run, compile_packages, header, measured_env, parse_args,  # noqa: E402
                      as_postgres, pg_bindir, print_table, ratio_row, run_child)

RSS_GOAL_MIB = 200
#: statetool's time over pgloader's, and over the floor's (issue 13).
PGLOADER_GOAL = 0.6
FLOOR_GOAL = 1.25
#: The floor: ``python -c FLOOR SQLITE_FILE URL SCHEMA``.
FLOOR = """\
import sqlite3, sys
import psycopg
path, url, schema = sys.argv[1:]
db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")]
with psycopg.connect(url) as pg, pg.cursor() as cur:
    cur.execute(f'CREATE SCHEMA "{schema}"')
    cur.execute(f'SET search_path = "{schema}"')
    keys, indexes = [], []
    for table in tables:
        info = list(db.execute(f'PRAGMA table_info("{table}")'))
        names = [r[1] for r in info]
        typed = ", ".join(f'"{r[1]}" {"bigint" if "INT" in r[2].upper() else "text"}{" NOT NULL" if r[3] else ""}'
                          for r in info)
        cur.execute(f'CREATE TABLE "{table}" ({typed})')
        pk = [r[1] for r in sorted(info, key=lambda r: r[5]) if r[5]]
        if pk:
            keys.append(f'ALTER TABLE "{table}" ADD PRIMARY KEY ({", ".join(pk)})')
        for _seq, index, unique, origin, _partial in db.execute(f'PRAGMA index_list("{table}")'):
            if origin == "pk":
                continue
            on = ", ".join(r[2] for r in db.execute(f'PRAGMA index_info("{index}")'))
            indexes.append(f'CREATE {"UNIQUE " if unique else ""}INDEX "{index}" ON "{table}" ({on})')
        quoted = ", ".join(f'"{n}"' for n in names)
        with cur.copy(f'COPY "{table}" ({quoted}) FROM STDIN') as copy:
            rows = db.execute(f'SELECT {quoted} FROM "{table}"')
            while batch := rows.fetchmany(5000):
                for row in batch:
                    copy.write_row(row)
    for statement in keys + indexes:
        cur.execute(statement)
"""


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


def _extra_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=5_000_000, help="run rows in the state (default 5,000,000)")
    parser.add_argument("--scaling", action="store_true",
                        help="also one run of statetool and of the floor at 1/10 and 1/2 of --runs")


class Bench:
    """The three sides at one size: a state of ``runs`` runs built in ``tmp/<runs>``, the
    schemas each run loads into (dropped before the next run) and the commands."""

    def __init__(self, args: argparse.Namespace, tmp: Path, base_url: str, target: str, pgloader: str,
                 env: dict[str, str], runs: int) -> None:
        self.args, self.base_url, self.target, self.pgloader, self.env = args, base_url, target, pgloader, env
        self.statetool = str(args.bin / "statetool")
        self.work = tmp / str(runs)
        golden_dir = self.work / "golden"
        golden_dir.mkdir(parents=True)
        started = time.perf_counter()
        self.counts = build_state(args.python, self.statetool, golden_dir, runs, env)
        self.golden = golden_dir / ".rivet_state.db"
        self.size = self.golden.stat().st_size
        self.total_rows = sum(self.counts.values())
        print(f"built the state in {time.perf_counter() - started:.1f} s (not measured): "
              f"{self.size / 2**20:.0f} MiB, {self.total_rows:,} rows in {len(self.counts)} tables "
              f"(rivet_runs {self.counts['rivet_runs']:,})")
        self.st_dir, self.peer_dir = self.work / "statetool", self.work / "peer"
        self.st_dir.mkdir()
        self.peer_dir.mkdir()
        shutil.copyfile(golden_dir / "rivet.yaml", self.st_dir / "rivet.yaml")
        self.peer_db = self.peer_dir / "state.db"
        self.schemas: dict[str, list[str]] = {"statetool": [], "pgloader": [], "floor": []}
        self.pgloader_case = Case("transfer vs pgloader", self.run_statetool, self.run_pgloader, PGLOADER_GOAL,
                                  f"ratio <= {PGLOADER_GOAL:g}", prepare_statetool=self.fresh_statetool,
                                  prepare_peer=self.fresh_pgloader, check=self.check)
        self.floor_case = Case("transfer vs COPY-then-index floor", self.run_statetool, self.run_floor, FLOOR_GOAL,
                               f"ratio <= {FLOOR_GOAL:g}", prepare_peer=self.fresh_floor, check=self.check_floor)

    def drop_schemas(self) -> None:
        for names in self.schemas.values():
            for name in names:
                psql(self.base_url, f'DROP SCHEMA IF EXISTS "{name}" CASCADE')

    def _next(self, side: str) -> str:
        self.drop_schemas()
        self.schemas[side].append(f"bench_{side}_{len(self.schemas[side])}")
        return self.schemas[side][-1]

    def fresh_statetool(self) -> None:
        self._next("statetool")
        for p in self.st_dir.glob(".rivet_state.*"):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        shutil.copyfile(self.golden, self.st_dir / ".rivet_state.db")

    def fresh_pgloader(self) -> None:
        schema = self._next("pgloader")
        self.peer_db.unlink(missing_ok=True)
        shutil.copyfile(self.golden, self.peer_db)
        (self.peer_dir / "load.pgl").write_text(load_file(self.peer_db, self.target, schema))

    def fresh_floor(self) -> None:
        self._next("floor")

    def run_statetool(self) -> Run:
        return run_child([self.statetool, "-c", str(self.st_dir / "rivet.yaml"), "--json", "transfer", "--to",
                          with_schema(self.base_url, self.schemas["statetool"][-1])], cwd=self.st_dir, env=self.env)

    def run_pgloader(self) -> Run:
        return run_child([self.pgloader, str(self.peer_dir / "load.pgl")], cwd=self.peer_dir, env=self.env)

    def run_floor(self) -> Run:
        return run_child([self.args.python, "-c", FLOOR, str(self.golden), self.base_url, self.schemas["floor"][-1]],
                         cwd=self.peer_dir, env=self.env)

    def check(self, side: str, run: Run) -> None:
        name = {"peer": "pgloader"}.get(side, side)
        schema = self.schemas[name][-1]
        got = psql(self.base_url, f'SELECT count(*) FROM "{schema}".rivet_runs')[0][0]
        if got != self.counts["rivet_runs"]:
            raise SystemExit(f"{name} left {got} rows in {schema}.rivet_runs, not {self.counts['rivet_runs']}:\n"
                             f"{run.stdout[-1500:]}\n{run.stderr[-1500:]}")
        if side == "statetool":
            doc = json.loads(run.stdout)
            if not (doc["done"] and all(t["verified"] for t in doc["tables"])):
                raise SystemExit(f"statetool transfer did not complete: {doc.get('message')}")

    def check_floor(self, side: str, run: Run) -> None:
        self.check("floor", run)

    def measure(self, repeat: int, pgloader: bool) -> None:
        """``repeat`` rounds of the sides in turn (statetool, pgloader, floor; the order
        rotated each round), no warm-up: one run is minutes long."""
        sides = [(self.pgloader_case, "statetool"), (self.floor_case, "peer")]
        if pgloader:
            sides.insert(1, (self.pgloader_case, "peer"))
        for i in range(repeat):
            for case, side in sides[i % len(sides):] + sides[:i % len(sides)]:
                case.once(side, record=True)
            print(f"  round {i + 1}/{repeat}: statetool {self.pgloader_case.times['statetool'][-1]:.1f} s"
                  + (f", pgloader {self.pgloader_case.times['peer'][-1]:.1f} s" if pgloader else "")
                  + f", floor {self.floor_case.times['peer'][-1]:.1f} s")
        self.floor_case.times["statetool"] = self.pgloader_case.times["statetool"]
        self.floor_case.rss["statetool"] = self.pgloader_case.rss["statetool"]
        self.drop_schemas()


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], repeat=1, extra=_extra_options)
    compiled = compile_packages(args.python)
    header(f"bench_transfer: statetool transfer vs pgloader and vs a COPY-then-index floor, a SQLite state with "
           f"{args.runs:,} runs", args, compiled)
    pgloader = ensure_pgloader()
    version = subprocess.run([pgloader, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    env = measured_env()
    tmp_obj = tempfile.TemporaryDirectory(prefix="statetool-bench-transfer-")
    tmp = Path(tmp_obj.name)
    tmp.chmod(0o755)
    cluster: Cluster | None = None
    scaled: list[Bench] = []
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

        bench = Bench(args, tmp, base_url, target, pgloader, env, args.runs)
        bench.measure(args.repeat, pgloader=True)
        if args.scaling:
            for runs in (args.runs // 10, args.runs // 2):
                print(f"scaling: {runs:,} runs")
                scaled.append(Bench(args, tmp, base_url, target, pgloader, env, runs))
                scaled[-1].measure(1, pgloader=False)
    finally:
        if cluster is not None:
            cluster.stop()
        if args.keep:
            print(f"kept {tmp}")
        else:
            tmp_obj.cleanup()

    case, floor = bench.pgloader_case, bench.floor_case
    st_s, peer_s = case.median("statetool"), case.median("peer")
    rss_st, rss_peer, rss_floor = max(case.rss["statetool"]), max(case.rss["peer"]), max(floor.rss["peer"])
    rss_ok = rss_st <= RSS_GOAL_MIB * 1024
    rows = [
        ratio_row(case),
        ratio_row(floor),
        Row(f"rows/s ({bench.total_rows:,} rows)", f"{bench.total_rows / st_s:,.0f}", f"{bench.total_rows / peer_s:,.0f}",
            f"{peer_s / st_s:.2f}", "- (pgloader)", "-"),
        Row("peak RSS (max of runs)", mib(rss_st), f"{mib(rss_peer)} / floor {mib(rss_floor)}", "-",
            f"statetool <= {RSS_GOAL_MIB} MiB", "PASS" if rss_ok else "FAIL"),
    ]
    print_table(rows, f"transfer SQLite -> PostgreSQL, {args.runs:,} runs, {bench.size / 2**30:.2f} GiB "
                      f"({args.repeat} run(s) per side, order rotated; peers = pgloader and the floor, same file, "
                      "same server)")
    print(f"statetool runs: {', '.join(f'{t:.1f} s' for t in case.times['statetool'])}; "
          f"pgloader runs: {', '.join(f'{t:.1f} s' for t in case.times['peer'])}; "
          f"floor runs: {', '.join(f'{t:.1f} s' for t in floor.times['peer'])}")
    if scaled:
        print("\nhow the cost grows (one run per side at the smaller sizes; linear: s/GiB about constant)")
        print(f"{'runs':>10}  {'GiB':>5}  {'statetool':>9}  {'s/GiB':>6}  {'floor':>7}  {'s/GiB':>6}  ratio")
        for b in [*scaled, bench]:
            st, fl = b.pgloader_case.median("statetool"), b.floor_case.median("peer")
            gib = b.size / 2**30
            print(f"{b.counts['rivet_runs']:>10,}  {gib:>5.2f}  {st:>8.1f}s  {st / gib:>6.1f}  {fl:>6.1f}s  "
                  f"{fl / gib:>6.1f}  {st / fl:.2f}")
    return 0 if case.passed and floor.passed and rss_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
