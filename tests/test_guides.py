"""The setup guides are true: each one is followed for real, and what it shows a command
printing is what that command prints.

Every page of docs/setup-guides/ runs as a reader follows it: its ```sh blocks in order,
in ONE bash session (``set -euo pipefail``; variables, exports and background jobs carry
from block to block, as in a terminal), from the pipeline's directory, with ``statetool``
on PATH (the zygote client of :mod:`support.zygote`, so that a hundred commands do not
pay a hundred interpreter start-ups).

Its sample outputs are transcripts: a ```text block is ``$ COMMAND`` lines, each followed
by what COMMAND prints, with ``# exit N`` at the end of the command line when it exits
N ≠ 0. The session runs each COMMAND where its transcript stands, and the test compares
what the transcript shows with what the command printed: the set of registered codes
(:data:`statetool.errors.REGISTRY` and ``WARNINGS``; every ``RIVET_…`` name in a
transcript must be one, or :data:`statetool.location.ENV_VAR`) and the exit code. Layout,
paths, times and wording are not compared: they differ on every machine, and the
rendering has its own tests. docs/decisions.md, "Setup guides that are run", has the
rules.

Where a guide needs what this machine cannot give, the test builds the same situation
and says so at the guide's test: a pipeline's own runs are recorded through the runtime
API (:mod:`support.states`), a Kubernetes pod is a pipeline directory laid out like the
pod's (the config and a relative checkpoint beside it, the state in PostgreSQL, the
volume a directory), an NFS mount is a mount table that says so.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Collection
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from statetool.errors import REGISTRY, WARNINGS
from statetool.example import main as build_example_state
from statetool.location import ENV_VAR
from statetool.operations.context import Context
from statetool.operations.exports import reset as reset_export
from statetool.operations.migrate import migrate
from statetool.operations.relocate import relocate
from support import describe, markdown, run_cli, write_config
from support.backends import StateBackend
from support.states import POSITION, build_state, orphan_wal_beside, rollback_journal_state, write_checkpoint

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
GUIDES = ROOT / "docs" / "setup-guides"
UPGRADING = GUIDES / "upgrading-a-state.md"
MOVING = GUIDES / "moving-state-to-postgresql.md"
LOCAL_WORKER = GUIDES / "local-worker.md"
SCHEDULER = GUIDES / "running-under-a-scheduler.md"
DIAGNOSING = GUIDES / "diagnosing-a-first-run.md"
KUBERNETES = GUIDES / "kubernetes-pods.md"
MONITORING = GUIDES / "monitoring-with-prometheus.md"

#: The registered codes a transcript may show.
CODES = frozenset(REGISTRY) | frozenset(WARNINGS)
#: Names of the ``RIVET_…`` form that are not codes.
NOT_CODES = frozenset({ENV_VAR})
_NAME = re.compile(r"\bRIVET_[A-Z0-9_]+\b")
_EXIT = re.compile(r"\s+#\s*exit\s+(\d+)\s*$")
#: The width the sessions run at: wide, so that no code is wrapped by the table it is in.
WIDTH = "200"


#: What a transcript may no longer show, because statetool no longer prints it (issue 12
#: items 1, 2 and 4): a boxed table (its vertical rules and corners; a plain table's header
#: rule ``─`` stays), an age in raw seconds past a minute, and the line every task must
#: share squeezed into a table row instead of standing whole on its own.
OLD_LAYOUT = {
    "a boxed table": re.compile(r"[│┃┏┓┗┛┡┩╇┳┻└┘┌┐├┤┼━]"),
    "an age in raw seconds past a minute": re.compile(r"\b(?:[6-9]\d|\d{3,}) s old\b"),
    "the shared line in a table row": re.compile(r"^every task must share +RIVET_STATE_URL=", re.M),
}


def old_layout(text: str) -> list[str]:
    """The old layouts of :data:`OLD_LAYOUT` that ``text`` shows, by name."""
    return [name for name, pattern in OLD_LAYOUT.items() if pattern.search(text)]


def test_no_transcript_shows_the_old_layout() -> None:
    """Every sample output in the guides is laid out as statetool prints now: no boxed
    table, no raw seconds past a minute, no shared line as a table row (issue 12 item 8)."""
    assert old_layout("┃ check ┃\n(3614 s old)\nevery task must share  RIVET_STATE_URL=x") == list(OLD_LAYOUT)
    assert old_layout("check  status\n──────\n(12 s old)\nevery task must share:\nRIVET_STATE_URL=x") == []
    found = {f"{guide.name}:{block.line}": old_layout(block.code)
             for guide in sorted(GUIDES.glob("*.md")) for block in markdown.read(guide).blocks_in("text")}
    assert not {where: names for where, names in found.items() if names}


# -- transcripts ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Shown:
    """One command of a transcript: ``command`` as the reader types it, the ``exit_code``
    the transcript gives it (``# exit N``, else 0), the registered ``codes`` its output
    shows, and the guide's ``line`` of its ``$`` line."""

    command: str
    exit_code: int
    codes: frozenset[str]
    line: int


def transcript(page: str, block: markdown.Block) -> list[Shown]:
    """The commands of the ```text block ``block`` of guide ``page``; fails when the
    block is not a transcript, or shows a ``RIVET_…`` name that is not registered."""
    lines = block.code.splitlines()
    assert lines and lines[0].startswith("$ "), \
        f"{page}:{block.line}: a ```text block of a setup guide is a transcript: it starts with '$ COMMAND'"
    found: list[tuple[str, int, set[str], int]] = []
    for number, line in enumerate(lines, start=block.line + 1):
        if line.startswith("$ "):
            end = _EXIT.search(line)
            command = line[2:end.start()] if end else line[2:]
            found.append((command.strip(), int(end.group(1)) if end else 0, set(), number))
            continue
        names = set(_NAME.findall(line)) - NOT_CODES
        assert names <= CODES, f"{page}:{number} shows {sorted(names - CODES)}, not registered codes"
        found[-1][2].update(names)
    return [Shown(command, code, frozenset(codes), number) for command, code, codes, number in found]


def printed_codes(text: str) -> frozenset[str]:
    """The registered codes that ``text`` (a command's stdout and stderr) names."""
    return frozenset(_NAME.findall(text)) & CODES


def test_a_transcript_gives_each_command_its_exit_code_and_codes() -> None:
    page = markdown.parse("## S\n\n```text\n$ statetool doctor   # exit 5\n  [RIVET_STATE_MISSING] x, "
                          "RIVET_STATE_URL=sqlite:/x\n$ statetool check\nok\n```\n")
    assert transcript("g.md", page.blocks[0]) == [Shown("statetool doctor", 5, frozenset({"RIVET_STATE_MISSING"}), 4),
                                                   Shown("statetool check", 0, frozenset(), 6)]
    with pytest.raises(AssertionError, match="is a transcript"):
        transcript("g.md", markdown.parse("```text\nRIVET_STATE_URL=sqlite:/x\n```\n").blocks[0])
    with pytest.raises(AssertionError, match=r"RIVET_STATE_MISING.*not registered"):
        transcript("g.md", markdown.parse("```text\n$ statetool doctor\n[RIVET_STATE_MISING]\n```\n").blocks[0])


# -- following a guide in one session ------------------------------------------------------


@dataclass(frozen=True)
class Followed:
    """A guide followed: the session's output, and each transcript command with what it
    printed (``(shown, exit code, stdout, stderr)``)."""

    stdout: str
    stderr: str
    commands: list[tuple[Shown, int, str, str]]


def _marker(where: str) -> str:
    text = shlex.quote(f"=== {where}")
    return f"echo {text}; echo {text} >&2"


def follow(guide: Path, cwd: Path, shell: dict[str, str], env: dict[str, str] | None = None, *,
           sections: Collection[str] | None = None, hooks: dict[str, str] | None = None,
           timeout: float = 300) -> Followed:
    """Run ``guide`` in one bash session in ``cwd``: its ```sh blocks and transcript
    commands in page order (only those under the level-2 headings ``sections``, when
    given), each hook of ``hooks`` (``{heading: shell}``, what the test does in place of
    what the machine cannot) before the first block of its section. The session's
    environment is this process's without ``RIVET_STATE_URL``, ``shell`` (statetool on
    PATH), a fixed width without colour, then ``env``. Fails naming the block that
    failed, or the transcript whose codes or exit code differ from what its command
    printed; returns the session's output otherwise."""
    page = markdown.read(guide)
    pending = dict(hooks or {})
    out = Path(tempfile.mkdtemp(prefix="guide-transcripts-"))  # each transcript command's output and exit code
    parts = ["set -euo pipefail", f"__out={shlex.quote(str(out))}",
             "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"]  # a failed block leaves no job behind
    shown: list[Shown] = []
    for block in page.blocks:
        if (sections is not None and block.section not in sections) or block.lang not in ("sh", "text"):
            continue
        if block.section in pending:
            parts += [_marker(f"the test, before section '{block.section}'"), pending.pop(block.section)]
        if block.lang == "sh":
            parts += [_marker(f"{guide.name}:{block.line} (section '{block.section}')"), block.code]
            continue
        for item in transcript(guide.name, block):
            parts += [_marker(f"{guide.name}:{item.line} $ {item.command}"), "__rc=0",
                      f'{{ {item.command}\n}} >"$__out/{len(shown)}.out" 2>"$__out/{len(shown)}.err" || __rc=$?',
                      f'echo "$__rc" >"$__out/{len(shown)}.rc"']
            shown.append(item)
    assert not pending, f"{guide.name}: hooks for sections without a block: {sorted(pending)}"
    parts.append(_marker("end"))
    full = {k: v for k, v in os.environ.items() if k != "RIVET_STATE_URL"}
    full.update({**shell, "COLUMNS": WIDTH, "NO_COLOR": "1", **(env or {})})
    try:
        proc = subprocess.run(["bash", "-c", "\n".join(parts)], cwd=cwd, env=full, text=True, capture_output=True,
                              timeout=timeout)
        if not proc.stdout.rstrip().endswith("=== end"):
            where = re.findall(r"^=== (.*)$", proc.stdout, re.M)
            pytest.fail(f"{guide.name}: the session stopped in {where[-1] if where else 'its first line'} "
                        f"(exit {proc.returncode})\n{describe(proc)}")
        commands = [(item, int((out / f"{n}.rc").read_text()), (out / f"{n}.out").read_text(),
                     (out / f"{n}.err").read_text()) for n, item in enumerate(shown)]
    finally:
        shutil.rmtree(out)
    for item, code, stdout, stderr in commands:
        printed = printed_codes(stdout + stderr)
        assert (item.exit_code, item.codes) == (code, printed), (
            f"{guide.name}:{item.line}: the transcript of `{item.command}` shows exit {item.exit_code} and "
            f"{sorted(item.codes)}; the command printed exit {code} and {sorted(printed)}:\n"
            f"--- stdout\n{stdout}\n--- stderr\n{stderr}")
    return Followed(proc.stdout, proc.stderr, commands)


def sections_of(guide: Path) -> list[str]:
    """The level-2 headings of ``guide`` that hold a ```sh block or a transcript, in order."""
    return list(dict.fromkeys(b.section for b in markdown.read(guide).blocks if b.lang in ("sh", "text")))


def info(cwd: Path, env: dict[str, str] | None = None) -> dict[str, object]:
    """``statetool --json info`` in ``cwd`` (in-process), which must succeed."""
    proc = run_cli("--json", "info", cwd=cwd, env=env)
    assert proc.returncode == 0, describe(proc)
    return json.loads(proc.stdout)


def runs_total(doc: dict[str, object]) -> int:
    exports = doc["exports"]
    assert isinstance(exports, list)
    return sum(e["runs_total"] for e in exports)


def example_pipeline(tmp_path: Path, runs: int) -> Path:
    """``tmp_path/pipeline`` with a copy of examples/rivet.yaml and the legacy state an old
    release left beside it (``runs`` runs, the CDC checkpoint); returns the directory."""
    work = tmp_path / "pipeline"
    work.mkdir()
    shutil.copy(ROOT / "examples" / "rivet.yaml", work / "rivet.yaml")
    build_example_state(["--config", str(work / "rivet.yaml"), "--runs", str(runs)])
    return work


def test_every_block_of_every_guide_is_run_or_shown_for_what_it_is() -> None:
    """A guide's blocks are runnable ```sh, transcripts (```text), or files and settings
    shown for copying (yaml, python, cron, dotenv), never a bare fence; and every guide has
    a transcript, so each one shows something the tests compare."""
    pages = sorted(GUIDES.glob("*.md"))
    assert len(pages) == 7, [p.name for p in pages]
    for guide in pages:
        page = markdown.read(guide)
        for block in page.blocks:
            assert block.lang in ("sh", "text", "yaml", "python", "cron", "dotenv"), \
                f"{guide.name}:{block.line}: a block of language '{block.info}'"
            if block.lang == "text":
                transcript(guide.name, block)
        assert page.blocks_in("text"), f"{guide.name} shows no transcript"


# -- upgrading-a-state.md ------------------------------------------------------------------


def test_upgrading_guide_followed_on_a_legacy_sqlite_state(tmp_path: Path, guide_shell: dict[str, str]) -> None:
    """Every section but the PostgreSQL one, on a copy of examples/rivet.yaml and a legacy
    state with 2,000 runs beside it; the guide ends by restoring the legacy backup."""
    work = example_pipeline(tmp_path, 2000)
    follow(UPGRADING, work, guide_shell, sections=[s for s in sections_of(UPGRADING) if "PostgreSQL" not in s])
    doc = info(work)
    assert doc["revision"]["status"] == "legacy"  # type: ignore[index]
    assert runs_total(doc) == 2000
    assert (work / "replaced" / ".rivet_state.db").is_file()


@pytest.mark.postgres
def test_upgrading_guide_followed_on_a_postgresql_state(tmp_path: Path, pg_url: str,
                                                        guide_shell: dict[str, str]) -> None:
    """The PostgreSQL section, on a shared state as the previous release left it (0002)."""
    work = tmp_path / "pipeline"
    work.mkdir()
    shutil.copy(ROOT / "examples" / "rivet.yaml", work / "rivet.yaml")
    env = {"RIVET_STATE_URL": pg_url}
    for args in (["init"], ["migrate", "--to", "0002", "--allow-data-loss"]):
        proc = run_cli(*args, cwd=work, env=env)
        assert proc.returncode == 0, describe(proc)
    follow(UPGRADING, work, guide_shell, env, sections=[s for s in sections_of(UPGRADING) if "PostgreSQL" in s])
    assert "COMMIT;" in (work / "upgrade.sql").read_text()
    proc = run_cli("--json", "revisions", cwd=work, env=env)
    assert json.loads(proc.stdout)["current"] == "0002", describe(proc)


# -- moving-state-to-postgresql.md ---------------------------------------------------------


@pytest.mark.postgres
def test_moving_guide_followed_with_the_servers_socket_url(tmp_path: Path, pg_server: dict[str, str],
                                                           guide_shell: dict[str, str]) -> None:
    """The whole guide, in order, in one pipeline directory (examples/rivet.yaml, 2,000
    runs, at head): dry run, transfer, verify, checkpoints made absolute, then the
    rollback, which leaves the SQLite state usable beside the config again and drops the
    PostgreSQL copy. ``PG_URL`` is the server's own socket URL, which already has a
    query (``?host=…``; one is added when the server is given without), so the guide's
    ``STATE_URL`` must join ``schema=`` with ``&``."""
    import psycopg

    work = example_pipeline(tmp_path, 2000)
    proc = run_cli("migrate", cwd=work)
    assert proc.returncode == 0, describe(proc)
    base = pg_server["url"]
    pg_url = base if "?" in base else f"{base}?application_name=statetool-guide"
    schema = f"t_{uuid.uuid4().hex[:12]}"
    checkpoints = tmp_path / "shared" / "checkpoints"
    env = {"PG_URL": pg_url, "PG_SCHEMA": schema, "CHECKPOINT_DIR": str(checkpoints)}
    try:
        follow(MOVING, work, guide_shell, env)
        assert runs_total(info(work)) == 2000  # rolled back: the SQLite state beside the config, complete
        assert (checkpoints / "order_events.json").is_file()
        with psycopg.connect(base, autocommit=True) as conn:
            assert not conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)).fetchall()
    finally:
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


# -- local-worker.md -----------------------------------------------------------------------


def test_local_worker_guide_followed_from_a_state_beside_the_config(tmp_path: Path,
                                                                  guide_shell: dict[str, str]) -> None:
    """The whole guide, in order, in the pipeline directory (the state beside the config,
    written by the runtime, with its CDC checkpoint), ``STATE_DIR`` the mounted directory
    the guide asks for; it ends rolled back: the state beside the config again, as before."""
    config = write_config(tmp_path / "pipeline")
    build_state(config, checkpoint_dir=config.parent)
    before = info(config.parent)["exports"]
    state_dir = tmp_path / "srv" / "rivet" / "state"
    state_dir.mkdir(parents=True)
    followed = follow(LOCAL_WORKER, config.parent, guide_shell, {"STATE_DIR": str(state_dir)})
    assert f"RIVET_STATE_URL=sqlite:{state_dir}" in followed.stdout  # the plan's line every task must get
    assert info(config.parent)["exports"] == before
    assert not list(config.parent.glob(".rivet_state.db.relocated-*"))
    proc = run_cli("check", cwd=config.parent)
    assert proc.returncode == 0, describe(proc)


# -- running-under-a-scheduler.md ----------------------------------------------------------

#: What the test does before "Releasing a stale lease": leave a stale lease behind, as a
#: worker that died does (its wrapper SIGKILLed, so nothing released it; its command goes
#: with it), and wait until no lease is live.
STALE_LEASE = """\
statetool leases run --export orders -- sleep 60 &
stale=$!
until statetool leases --json | grep '"state": "live"' >/dev/null; do sleep 0.1; done
kill -KILL "$stale"
wait "$stale" || true
while statetool leases --json | grep '"state": "live"' >/dev/null; do sleep 0.1; done
"""


def test_scheduler_guide_states_the_rules_of_the_run_lease() -> None:
    text = SCHEDULER.read_text().lower()
    for phrase in ("chunk-run:<export>", "--lock-wait", "rivet_state_lock_timeout", "rivet_state_run_in_progress",
                   "statetool leases release", "two hosts with two separate sqlite files", "network filesystem",
                   "rivet_state_lease_lost", "pr_set_pdeathsig", "retryable", "refusal"):
        assert phrase in text, phrase


def test_scheduler_guide_followed_on_each_backend(state_backend: StateBackend, guide_shell: dict[str, str]) -> None:
    """The whole guide, in order, on a new state at head (SQLite beside the config, or a
    PostgreSQL schema of its own); before its last section the test leaves a stale lease
    for the guide to release. The release is audited."""
    config = write_config(state_backend.pipeline)
    proc = run_cli("-c", str(config), "init", env=state_backend.env)
    assert proc.returncode == 0, describe(proc)
    follow(SCHEDULER, config.parent, guide_shell, state_backend.env, hooks={"Releasing a stale lease": STALE_LEASE})
    proc = run_cli("-c", str(config), "--json", "leases", env=state_backend.env)
    assert proc.returncode == 0, describe(proc)
    assert {row["state"] for row in json.loads(proc.stdout)["leases"]} <= {"free"}, describe(proc)


# -- kubernetes-pods.md --------------------------------------------------------------------


def pipeline_ran(config: str) -> str:
    """The shell a test runs where a guide says the pipeline has run: every export of the
    conftest config records progress through the runtime API, as rivet's runs do (the
    state ``RIVET_STATE_URL`` names), and the CDC export's checkpoint file is written
    beside ``config`` (:mod:`support.states`)."""
    return f"PYTHONPATH={shlex.quote(str(TESTS))} {shlex.quote(sys.executable)} -m support.states {shlex.quote(config)}"


def test_kubernetes_guide_puts_cdc_positions_in_the_state_not_on_a_volume() -> None:
    """ADR-0039 D5, issue 15 item 6: the guide no longer recommends a checkpoint volume for
    CDC on pods; it puts the position in the state and gates the pod on the pod rule."""
    page = markdown.read(KUBERNETES)
    text = KUBERNETES.read_text()
    assert "persistentVolumeClaim" not in text and "CHECKPOINT_VOLUME" not in text
    run = "\n".join(b.code for b in page.blocks_in("sh"))
    assert "statetool checkpoints import --export order_events" in run and "statetool check --target pods" in run
    assert "transfer --to URL --with-checkpoints" in text
    init = next(b.code for b in page.blocks_in("yaml") if "initContainers" in b.code)
    assert '"check", "--target", "pods"' in init and "volumeMounts" not in init


@pytest.mark.postgres
def test_kubernetes_guide_followed_in_a_directory_laid_out_like_the_pod(tmp_path: Path, pg_url: str,
                                                                        guide_shell: dict[str, str]) -> None:
    """The whole guide, in order, in one shell. No pod here: the pipeline directory is laid
    out like the pod's (the config with its relative checkpoint), the state is in a
    PostgreSQL schema of its own as in the pod, and where the guide says the pipeline ran
    the test records those runs (:func:`pipeline_ran`). It ends with the position in the
    state and no checkpoint file on disk: order_events resumes from the state, with no
    warning left, and the pod's pre-flight passes."""
    config = write_config(tmp_path / "pipeline")
    env = {"RIVET_STATE_URL": pg_url}
    follow(KUBERNETES, config.parent, guide_shell, env,
           hooks={"Why a checkpoint on the pod's disk loses data": pipeline_ran("rivet.yaml")})
    assert not (config.parent / "checkpoints").exists()
    proc = run_cli("-c", str(config), "--json", "doctor", env=env)
    assert proc.returncode == 0, describe(proc)
    events = {e["name"]: e for e in json.loads(proc.stdout)["exports"]}["order_events"]
    assert events["verdict"] == "resumes" and events["reasons"] == [], describe(proc)
    assert "in the state" in events["resumes_from"], describe(proc)
    proc = run_cli("-c", str(config), "--json", "check", "--target", "pods", "--strict", env=env)
    assert proc.returncode == 0, describe(proc)


# -- monitoring-with-prometheus.md ---------------------------------------------------------


def _run_as_scheduled(command: str, cwd: Path, env: dict[str, str], shell: dict[str, str]) -> None:
    """``command`` run by bash in ``cwd`` as cron or systemd would run it, with ``env`` and
    ``statetool`` on PATH (:func:`follow`'s environment); it must exit 0."""
    full = {k: v for k, v in os.environ.items() if k != "RIVET_STATE_URL"}
    full.update({**shell, **env})
    proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=full, text=True, capture_output=True, timeout=120)
    assert proc.returncode == 0, f"{command}\n{describe(proc)}"


def test_monitoring_guide_followed_on_each_backend(state_backend: StateBackend, tmp_path: Path,
                                                   guide_shell: dict[str, str]) -> None:
    """The whole guide, in order, on a state as a pipeline's runs leave it, ``TEXTFILE_DIR``
    standing for node-exporter's textfile directory and ``UNIT_DIR`` for
    /etc/systemd/system. No cron and no systemd here: the test runs the guide's cron line
    (its command, with the crontab's two directories set to the test's) and the service's
    ``ExecStart`` in its ``WorkingDirectory`` as they would, and each leaves a textfile
    that the OpenMetrics parser reads with the state up. Every metric the alerting rules
    name is one that metrics gives."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families
    import yaml

    from statetool.operations.metrics import FAMILIES

    config = write_config(state_backend.pipeline)
    build_state(config, state_backend.url, checkpoint_dir=config.parent, env=state_backend.env)
    textfiles, units = tmp_path / "textfile_collector", tmp_path / "units"
    textfiles.mkdir()
    units.mkdir()
    env = {**state_backend.env, "TEXTFILE_DIR": str(textfiles), "PIPELINE_DIR": str(config.parent),
           "UNIT_DIR": str(units)}
    follow(MONITORING, config.parent, guide_shell, env)
    target = textfiles / "rivet-sales.prom"

    def up() -> float:
        samples = {s.name: s.value for f in text_string_to_metric_families(target.read_text()) for s in f.samples}
        return samples["statetool_state_up"]

    assert up() == 1
    page = markdown.read(MONITORING)
    (crontab,) = page.blocks_in("cron")
    (job,) = [line for line in crontab.code.splitlines() if not re.match(r"^[A-Z_]+=", line)]
    target.unlink()
    _run_as_scheduled(job.split(None, 5)[5], tmp_path, env, guide_shell)
    assert up() == 1
    service = dict(line.split("=", 1) for line in (units / "rivet-metrics-sales.service").read_text().splitlines()
                   if "=" in line)
    assert (units / "rivet-metrics-sales.timer").read_text().count("OnCalendar=minutely") == 1
    target.unlink()
    _run_as_scheduled(service["ExecStart"], Path(service["WorkingDirectory"]), state_backend.env, guide_shell)
    assert up() == 1
    (rules,) = page.blocks_in("yaml")
    named = {name for group in yaml.safe_load(rules.code)["groups"] for rule in group["rules"]
             for name in re.findall(r"\bstatetool_\w+", rule["expr"])}
    given = {f"{f.name}_total" if f.kind == "counter" else f.name for f in FAMILIES}
    assert named and named <= given, sorted(named - given)


# -- diagnosing-a-first-run.md -------------------------------------------------------------
#
# Each section describes one situation: it runs in a pipeline directory of its own
# (tmp/pipeline, the conftest config), on a state built to be in that situation, in a
# session of its own. A section with blocks and no scenario here fails the test: the
# guide and its test move together.


def _volume(tmp: Path) -> Path:
    volume = tmp / "volume"
    volume.mkdir()
    return volume


def _healthy(work: Path, tmp: Path, _stack: ExitStack) -> dict[str, str]:
    build_state(work / "rivet.yaml", checkpoint_dir=work)
    return {}


def _state_beside_config_dir_declared(work: Path, tmp: Path, _stack: ExitStack) -> dict[str, str]:
    build_state(work / "rivet.yaml", checkpoint_dir=work)
    return {"RIVET_STATE_URL": f"sqlite:{_volume(tmp)}"}


def _relocated(work: Path, tmp: Path, _stack: ExitStack) -> dict[str, str]:
    build_state(work / "rivet.yaml", checkpoint_dir=work)
    relocate(Context(work / "rivet.yaml", None, env={}), str(_volume(tmp)))
    return {}


def _not_mounted(work: Path, tmp: Path, _stack: ExitStack) -> dict[str, str]:
    return {"RIVET_STATE_URL": f"sqlite:{tmp / 'volume'}"}


def _on_tmpfs(work: Path, tmp: Path, stack: ExitStack) -> dict[str, str]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    volume = _volume(tmp)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(volume)], check=True, capture_output=True)
    stack.callback(subprocess.run, ["umount", str(volume)], check=True, capture_output=True)
    build_state(work / "rivet.yaml", f"sqlite:{volume}", checkpoint_dir=volume)
    return {"RIVET_STATE_URL": f"sqlite:{volume}"}


def _on_nfs(work: Path, tmp: Path, _stack: ExitStack) -> dict[str, str]:
    volume = _volume(tmp)
    build_state(work / "rivet.yaml", f"sqlite:{volume}", checkpoint_dir=volume)
    table = Path("/proc/mounts").read_text() + f"filer.internal:/exports/rivet {volume} nfs4 rw,vers=4.2,hard 0 0\n"
    (tmp / "mounts").write_text(table)
    return {"RIVET_STATE_URL": f"sqlite:{volume}", "TEST_MOUNT_TABLE": str(tmp / "mounts")}


#: What the test runs before "The directory is on a network filesystem", since this machine
#: cannot mount NFS: ``statetool`` becomes the same CLI reading the mount table
#: ``TEST_MOUNT_TABLE`` (/proc/mounts and one nfs4 mount at the declared directory).
NFS_MOUNT = (f"statetool() {{ PYTHONPATH={shlex.quote(str(TESTS))} {shlex.quote(sys.executable)} -c "
             "'import sys; from pathlib import Path; from statetool import mounts; "
             "mounts.PROC_MOUNTS = Path(sys.argv[1]); from statetool.cli import main; main(sys.argv[2:])' "
             '"$TEST_MOUNT_TABLE" "$@"; }')


def _source_moved_host(work: Path, tmp: Path, _stack: ExitStack) -> dict[str, str]:
    volume = _volume(tmp)
    old = write_config(tmp / "before-the-move", source_url="postgresql://reader@db-old.internal:5432/sales")
    build_state(old, f"sqlite:{volume}", checkpoint_dir=volume)
    return {"RIVET_STATE_URL": f"sqlite:{volume}"}


def _reset(work: Path, tmp: Path, _stack: ExitStack) -> dict[str, str]:
    build_state(work / "rivet.yaml", checkpoint_dir=work)
    reset_export(Context(work / "rivet.yaml", None, env={}), "orders")
    return {}


def _checkpoint_lost(work: Path, tmp: Path, _stack: ExitStack) -> dict[str, str]:
    build_state(work / "rivet.yaml", checkpoint_dir=None)
    write_checkpoint(work / "backup" / "order_events.json", json.dumps(POSITION))
    return {}


def _orphan_wal(work: Path, tmp: Path, _stack: ExitStack) -> dict[str, str]:
    path = rollback_journal_state(work / "rivet.yaml")
    migrate(Context(work / "rivet.yaml", None, env={}))
    orphan_wal_beside(path, tmp / "elsewhere")
    return {}


def _legacy(work: Path, tmp: Path, _stack: ExitStack) -> dict[str, str]:
    rollback_journal_state(work / "rivet.yaml")
    return {}


def _declared(work: Path, tmp: Path, _stack: ExitStack) -> dict[str, str]:
    volume = _volume(tmp)
    build_state(work / "rivet.yaml", f"sqlite:{volume}", checkpoint_dir=volume)
    return {"RIVET_STATE_URL": f"sqlite:{volume}"}


Scenario = Callable[[Path, Path, ExitStack], dict[str, str]]
#: ``{section: the scenario that builds its situation}``, in page order.
DIAGNOSING_SCENARIOS: dict[str, Scenario] = {
    "Ask doctor": _healthy,
    "Gate a deploy on it": _healthy,
    "No state where the settings point": _state_beside_config_dir_declared,
    "The state was moved away": _relocated,
    "The declared directory is not mounted": _not_mounted,
    "The directory dies with the container": _on_tmpfs,
    "The directory is on a network filesystem": _on_nfs,
    "The state belongs to another source": _source_moved_host,
    "An export with no progress": _reset,
    "A lost or unreadable CDC checkpoint": _checkpoint_lost,
    "Leftover -wal and -shm files": _orphan_wal,
    "A state written by an older release": _legacy,
    "Where the setting came from": _declared,
}
#: What the test runs before a section, where the machine cannot give its situation.
DIAGNOSING_HOOKS = {"The directory is on a network filesystem": NFS_MOUNT}


def test_every_section_of_the_diagnosing_guide_has_its_situation() -> None:
    assert sections_of(DIAGNOSING) == list(DIAGNOSING_SCENARIOS)


@pytest.mark.parametrize("section", list(DIAGNOSING_SCENARIOS))
def test_diagnosing_guide_section_followed_in_its_situation(section: str, tmp_path: Path,
                                                            guide_shell: dict[str, str]) -> None:
    work = tmp_path / "pipeline"
    write_config(work)
    hooks = {section: DIAGNOSING_HOOKS[section]} if section in DIAGNOSING_HOOKS else {}
    with ExitStack() as stack:
        env = DIAGNOSING_SCENARIOS[section](work, tmp_path, stack)
        follow(DIAGNOSING, work, guide_shell, env, sections=[section], hooks=hooks)
