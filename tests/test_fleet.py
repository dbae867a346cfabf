"""Several pipelines at once (issue 16 item 1): check, info and doctor over -c given several
times and --configs GLOB, each pipeline read as alone, concurrently with a bound, in the
order given, and what no single read can see: two pipelines in one state, two CDC exports
in one checkpoint file. docs/commands.md "Several pipelines at once"."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from support import describe, error_object, run_cli, run_cli_process, tree_digest, write_config
from support.pg import PG_PASSWORD, PG_PASSWORD_USER
from support.states import build_state
from statetool.errors import worst_exit_code
from statetool.example import build_legacy_state
from statetool.operations.fleet import MAX_WORKERS, read_all, workers

SCHEMA = json.loads((Path(__file__).resolve().parent.parent / "docs" / "schemas" / "fleet.schema.json").read_text())


def valid(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` after validating it against docs/schemas/fleet.schema.json."""
    jsonschema.Draft202012Validator(SCHEMA).validate(doc)
    return doc


def source(name: str) -> str:
    """The source URL of pipeline ``name``: a database of its own."""
    return f"postgresql://reader@db.internal:5432/{name}"


@dataclass
class Fleet:
    """Pipelines built for one test: their configs (in order), the ``--state-url-env``
    pairings and the variables they name, and what each pipeline alone exits with."""

    root: Path
    configs: list[Path] = field(default_factory=list)
    pairings: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    expected: dict[str, int] = field(default_factory=dict)

    def add(self, config: Path, exit_code: int, state_url: str | None = None) -> Path:
        """Add ``config``, whose check alone exits ``exit_code``; its state at ``state_url``
        (a variable named for it) or beside it."""
        label = str(config.relative_to(self.root))
        if state_url is not None:
            name = f"STATE_{len(self.configs)}"
            self.env[name] = state_url
            self.pairings += ["--state-url-env", f"{label}={name}"]
        self.configs.append(config)
        self.expected[label] = exit_code
        return config

    def args(self) -> list[str]:
        """``-c`` for every config, relative to the root, then the pairings."""
        return [arg for c in self.configs for arg in ("-c", str(c.relative_to(self.root)))] + self.pairings

    def labels(self) -> list[str]:
        return [str(c.relative_to(self.root)) for c in self.configs]


def healthy(fleet: Fleet, name: str, state_url: str | None = None, checkpoint: Path | None = None) -> Path:
    """A pipeline whose every export resumes: a cursor, a chunked run, a CDC position in its
    own checkpoint file (absolute: a relative one under PostgreSQL warns, SPEC §6)."""
    directory = fleet.root / "pipelines" / name
    file = checkpoint or fleet.root / "checkpoints" / name / "order_events.json"
    config = write_config(directory, source_url=source(name), checkpoint=str(file))
    build_state(config, state_url, env={})
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps({"file": "mysql-bin.000042", "pos": 91234}))
    return fleet.add(config, 0, state_url)


def build_fleet(root: Path, pg: Callable[[], str]) -> tuple[Fleet, dict[str, set[tuple[str, str, str]]]]:
    """Twenty-two pipelines, SQLite and PostgreSQL: healthy ones, broken ones (missing state
    on each backend, a foreign state in a declared directory, a legacy state with revisions
    pending, a truncated file), two of one source sharing a state through a symlinked
    directory, two of different sources sharing a PostgreSQL schema, two sharing a CDC
    checkpoint file. Returns the fleet and, per pipeline, the rows that do not pass
    (``(id, status, code)``)."""
    fleet = Fleet(root)
    rows: dict[str, set[tuple[str, str, str]]] = {}
    for n in range(6):
        healthy(fleet, f"lite{n}")
    for n in range(5):
        healthy(fleet, f"pg{n}", pg())
    pipelines = root / "pipelines"
    fleet.add(write_config(pipelines / "missing", source_url=source("missing")), 5)
    rows["pipelines/missing/rivet.yaml"] = {("state", "fail", "RIVET_STATE_MISSING")}
    fleet.add(write_config(pipelines / "pg-missing", source_url=source("pgmissing")), 5, pg())
    rows["pipelines/pg-missing/rivet.yaml"] = {("state", "fail", "RIVET_STATE_MISSING")}
    declared = root / "declared"
    declared.mkdir()
    other = write_config(root / "elsewhere", source_url=source("other"))
    build_state(other, f"sqlite:{declared}", env={})
    fleet.add(write_config(pipelines / "foreign", source_url=source("foreign")), 5, f"sqlite:{declared}")
    # the other source's progress is there, and this config's checkpoint is not
    rows["pipelines/foreign/rivet.yaml"] = {("identity", "fail", "RIVET_STATE_FOREIGN"),
                                            ("doctor:order_events", "fail", "RIVET_STATE_CHECKPOINT_MISSING")}
    legacy = write_config(pipelines / "legacy", source_url=source("legacy"),
                          exports="exports:\n  - name: orders\n    mode: incremental\n")
    build_legacy_state(legacy.parent / ".rivet_state.db", [("orders", "incremental")], runs=40)
    fleet.add(legacy, 3)
    rows["pipelines/legacy/rivet.yaml"] = {("revision", "fail", "RIVET_STATE_MIGRATION_PENDING"),
                                           ("identity", "warn", "RIVET_STATE_IDENTITY_ADOPTED")}
    corrupt = healthy(fleet, "corrupt")
    fleet.expected["pipelines/corrupt/rivet.yaml"] = 4
    data = (corrupt.parent / ".rivet_state.db").read_bytes()
    page = int.from_bytes(data[16:18], "big")
    (corrupt.parent / ".rivet_state.db").write_bytes(data[: len(data) // 2 // page * page])
    rows["pipelines/corrupt/rivet.yaml"] = {("integrity", "fail", "RIVET_STATE_CORRUPT")}
    # one source, one state: the second pipeline's directory is a symlink to the first's
    healthy(fleet, "twin")
    (pipelines / "twin-link").symlink_to(pipelines / "twin")
    fleet.add(write_config(pipelines / "twin-link", source_url=source("twin"), name="second.yaml",
                           checkpoint=str(root / "checkpoints" / "twin2" / "order_events.json")), 0)
    (root / "checkpoints" / "twin2").mkdir()
    (root / "checkpoints" / "twin2" / "order_events.json").write_text(json.dumps({"pos": 1}))
    # two sources, one PostgreSQL schema: alone, each passes (a shared state reports only, SPEC §3)
    shared = pg()
    healthy(fleet, "sales", shared)
    crm = write_config(pipelines / "crm", source_url=source("crm"),
                       checkpoint=str(root / "checkpoints" / "crm" / "order_events.json"))
    fleet.add(crm, 0, shared)
    (root / "checkpoints" / "crm").mkdir()
    (root / "checkpoints" / "crm" / "order_events.json").write_text(json.dumps({"pos": 2}))
    # two pipelines, two states, one CDC checkpoint file
    one_file = root / "checkpoints" / "one" / "order_events.json"
    healthy(fleet, "left", checkpoint=one_file)
    healthy(fleet, "right", checkpoint=one_file)
    return fleet, rows


@pytest.mark.postgres
def test_a_fleet_of_22_pipelines_is_checked_in_one_command_every_row_the_worst_exit_and_the_sharing(
        tmp_path: Path, pg_schemas: Callable[[], str]) -> None:
    fleet, failing = build_fleet(tmp_path, pg_schemas)
    assert len(fleet.configs) >= 20
    before = tree_digest(tmp_path)
    proc = run_cli_process("--json", "check", *fleet.args(), cwd=tmp_path, env=fleet.env)
    doc = valid(json.loads(proc.stdout))
    # the worst of all: a truncated state (data_integrity, 4) outranks refusals and drift
    assert proc.returncode == 4 and doc["ok"] is False and doc["command"] == "check", describe(proc)
    assert [p["config"] for p in doc["pipelines"]] == fleet.labels()
    named = {config for f in doc["fleet"] if f["status"] == "fail" for config in f["configs"]}
    for p in doc["pipelines"]:
        assert p["exit_code"] == fleet.expected[p["config"]], (p["config"], p["checks"])
        # not ok: failing on its own, or named by a failing finding (its own exit code stays its command's)
        assert p["ok"] is (p["exit_code"] == 0 and p["config"] not in named), p["config"]
        rows = {(r["id"], r["status"], r["code"]) for r in p["checks"] if r["status"] in ("fail", "warn")}
        assert rows == failing.get(p["config"], set()), (p["config"], rows)
    by_label = {p["config"]: p for p in doc["pipelines"]}
    assert by_label["pipelines/pg0/rivet.yaml"]["location"]["backend"] == "postgres"
    assert by_label["pipelines/pg0/rivet.yaml"]["state_url_env"] is not None
    assert by_label["pipelines/lite0/rivet.yaml"]["location"]["scope"] == "beside_config"
    found = {(f["id"], f["status"], f["code"], tuple(f["configs"])) for f in doc["fleet"]}
    assert found == {
        ("fleet:state", "warn", "RIVET_STATE_SHARED_SAME_SOURCE",
         ("pipelines/twin/rivet.yaml", "pipelines/twin-link/second.yaml")),
        ("fleet:state", "fail", "RIVET_STATE_SHARED", ("pipelines/sales/rivet.yaml", "pipelines/crm/rivet.yaml")),
        ("fleet:checkpoint", "fail", "RIVET_STATE_CHECKPOINT_SHARED",
         ("pipelines/left/rivet.yaml", "pipelines/right/rivet.yaml")),
    }, doc["fleet"]
    same = next(f for f in doc["fleet"] if f["code"] == "RIVET_STATE_SHARED_SAME_SOURCE")
    assert same["place"] == str((tmp_path / "pipelines" / "twin" / ".rivet_state.db").resolve())
    assert "the exports order_events, order_lines, orders are declared by more than one" in same["message"], same
    different = next(f for f in doc["fleet"] if f["code"] == "RIVET_STATE_SHARED")
    assert source("sales").split("@")[1] in different["message"] and "db.internal:5432/crm" in different["message"]
    assert tree_digest(tmp_path) == before, "a fleet check changed a byte"

    # for people: one row per pipeline and check, and one under each pipeline a finding names; not ok:
    # five broken, and four named by a failing finding (the twins share one source: a warning)
    proc = run_cli("check", *fleet.args(), cwd=tmp_path, env=fleet.env)
    assert proc.returncode == 4, describe(proc)
    head, rest = proc.stdout.split("\n\n", 1)
    assert head.splitlines()[0] == f"Pre-flight of {len(fleet.configs)} pipelines", head
    assert head.splitlines()[1].split() == ["pipeline", "check", "status", "message"], head
    table = [line.split() for line in head.splitlines()[3:] if not line.startswith(" ")]  # a message may wrap
    assert len(table) == sum(len(p["checks"]) for p in doc["pipelines"]) + sum(len(f["configs"]) for f in doc["fleet"])
    assert ["pipelines/crm/rivet.yaml", "fleet:state", "fail", "see", "below"] in table
    assert f"{len(fleet.configs)} pipelines: 13 ok, 9 not ok" in proc.stdout, proc.stdout
    assert proc.stdout.rstrip().endswith("not ok")

    # doctor and info over the same fleet: each pipeline's own document, nested, in order
    proc = run_cli("--json", "doctor", *fleet.args(), cwd=tmp_path, env=fleet.env)
    doc = valid(json.loads(proc.stdout))
    assert [p["config"] for p in doc["pipelines"]] == fleet.labels()
    assert {f["code"] for f in doc["fleet"]} == {"RIVET_STATE_SHARED", "RIVET_STATE_SHARED_SAME_SOURCE",
                                                 "RIVET_STATE_CHECKPOINT_SHARED"}
    doctor_codes = {p["config"]: p["exit_code"] for p in doc["pipelines"]}
    # the worst by class: a corrupt state's doctor exits 4, the code its --json-errors reports (data_integrity)
    assert proc.returncode == worst_exit_code(list(doctor_codes.values())) == 4, describe(proc)
    assert doctor_codes["pipelines/lite0/rivet.yaml"] == 0 and doctor_codes["pipelines/missing/rivet.yaml"] == 5
    assert doctor_codes["pipelines/corrupt/rivet.yaml"] == 4
    alone = run_cli("--json", "doctor", "-c", "pipelines/missing/rivet.yaml", cwd=tmp_path)
    assert by_doctor(doc, "pipelines/missing/rivet.yaml") == json.loads(alone.stdout), describe(alone)
    proc = run_cli("--json", "info", *fleet.args(), cwd=tmp_path, env=fleet.env)
    doc = valid(json.loads(proc.stdout))
    assert proc.returncode == 4, describe(proc)  # the truncated state cannot be described
    info = {p["config"]: p for p in doc["pipelines"]}
    assert info["pipelines/corrupt/rivet.yaml"]["error"]["code"] == "RIVET_STATE_CORRUPT"
    assert info["pipelines/corrupt/rivet.yaml"]["info"] is None
    assert info["pipelines/missing/rivet.yaml"]["info"]["revision"]["status"] == "missing"
    assert info["pipelines/legacy/rivet.yaml"]["info"]["revision"]["status"] == "legacy"
    assert tree_digest(tmp_path) == before, "a fleet doctor or info changed a byte"


def by_doctor(doc: dict[str, Any], config: str) -> dict[str, Any]:
    """The doctor document of pipeline ``config`` in a fleet's document."""
    return next(p["doctor"] for p in doc["pipelines"] if p["config"] == config)


def small_fleet(root: Path, *names: str) -> list[Path]:
    """Pipelines ``names`` under ``root/p``, each with a healthy SQLite state beside it."""
    configs = []
    for name in names:
        config = write_config(root / "p" / name, source_url=source(name),
                              checkpoint=str(root / "cp" / name / "order_events.json"))
        build_state(config, env={})
        (root / "cp" / name).mkdir(parents=True)
        (root / "cp" / name / "order_events.json").write_text(json.dumps({"pos": 7}))
        configs.append(config)
    return configs


def test_configs_glob_is_expanded_by_statetool_sorted_after_the_c_configs_each_config_once(tmp_path: Path) -> None:
    small_fleet(tmp_path, "b", "c", "a")
    (tmp_path / "p" / "deep" / "er").mkdir(parents=True)
    deep = small_fleet(tmp_path / "p" / "deep" / "er", "z")[0]
    proc = run_cli("--json", "check", "-c", "p/c/rivet.yaml", "--configs", "p/*/rivet.yaml", cwd=tmp_path)
    doc = valid(json.loads(proc.stdout))
    assert proc.returncode == 0, describe(proc)
    # p/c first (-c), then the matches sorted, p/c not twice (also named ./p/c/...)
    assert [p["config"] for p in doc["pipelines"]] == ["p/c/rivet.yaml", "p/a/rivet.yaml", "p/b/rivet.yaml"]
    assert doc["fleet"] == []
    proc = run_cli("--json", "info", "-c", "./p/a/rivet.yaml", "--configs", "p/**/rivet.yaml", cwd=tmp_path)
    doc = valid(json.loads(proc.stdout))
    # a config is shown as given, normalized as a path ("./" dropped)
    assert [p["config"] for p in doc["pipelines"]] == ["p/a/rivet.yaml", "p/b/rivet.yaml", "p/c/rivet.yaml",
                                                       str(deep.relative_to(tmp_path))], describe(proc)
    assert all(p["info"]["revision"]["status"] == "head" for p in doc["pipelines"])


def test_a_glob_that_matches_one_file_still_gives_the_fleet_document_and_one_c_gives_the_command_s_own(
        tmp_path: Path) -> None:
    small_fleet(tmp_path, "a")
    alone = run_cli("--json", "check", "-c", "p/a/rivet.yaml", cwd=tmp_path)
    fleet = run_cli("--json", "check", "--configs", "p/*/rivet.yaml", cwd=tmp_path)
    assert alone.returncode == fleet.returncode == 0, describe(fleet)
    assert set(json.loads(alone.stdout)) == {"ok", "checks"}
    doc = valid(json.loads(fleet.stdout))
    assert doc["pipelines"][0]["checks"] == json.loads(alone.stdout)["checks"]
    people = run_cli("check", "-c", "p/a/rivet.yaml", cwd=tmp_path)
    assert people.stdout.startswith("Pre-flight\n") and "pipelines" not in people.stdout, people.stdout


def test_a_glob_that_matches_nothing_is_refused_with_its_code(tmp_path: Path) -> None:
    proc = run_cli("--json-errors", "doctor", "--configs", "pipelines/*/rivet.yaml", cwd=tmp_path)
    obj = error_object(proc)
    assert (obj["code"], proc.returncode, proc.stdout) == ("RIVET_CONFIGS_NO_MATCH", 1, ""), describe(proc)
    assert "'pipelines/*/rivet.yaml' matches no file" in obj["message"]


USAGE = {
    "migrate-two-configs": (["migrate", "-c", "p/a/rivet.yaml", "-c", "p/b/rivet.yaml"], {},
                            "--config/-c was given 2 times"),
    "exports-list-two-configs": (["-c", "p/a/rivet.yaml", "exports", "list", "-c", "p/b/rivet.yaml"], {},
                                 "check, info, doctor and metrics read several"),
    "leases-two-configs": (["leases", "-c", "p/a/rivet.yaml", "-c", "p/b/rivet.yaml"], {},
                           "check, info, doctor and metrics read several"),
    "state-url-with-several": (["check", "-c", "p/a/rivet.yaml", "-c", "p/b/rivet.yaml", "--state-url", "sqlite:/tmp"],
                               {}, "--state-url names one state"),
    "env-url-with-several": (["info", "--configs", "p/*/rivet.yaml"], {"RIVET_STATE_URL": "sqlite:/tmp"},
                             "RIVET_STATE_URL is set"),
    "pairing-without-name": (["check", "--configs", "p/*/rivet.yaml", "--state-url-env", "p/a/rivet.yaml"], {},
                             "is not CONFIG=NAME"),
    "pairing-of-no-pipeline": (["check", "--configs", "p/*/rivet.yaml", "--state-url-env", "p/x/rivet.yaml=X"],
                               {"X": "sqlite:/tmp"}, "is not one of the configs given"),
    "pairing-twice": (["doctor", "--configs", "p/*/rivet.yaml", "--state-url-env", "p/a/rivet.yaml=X",
                       "--state-url-env", "./p/a/rivet.yaml=Y"], {"X": "sqlite:/tmp", "Y": "sqlite:/tmp"},
                      "names ./p/a/rivet.yaml twice"),
    "pairing-variable-unset": (["check", "--configs", "p/*/rivet.yaml", "--state-url-env", "p/a/rivet.yaml=NOPE"], {},
                               "the environment variable NOPE is not set or empty"),
    "pairing-with-one-config": (["check", "-c", "p/a/rivet.yaml", "--state-url-env", "p/a/rivet.yaml=X"],
                                {"X": "sqlite:/tmp"}, "--state-url-env is for several configs"),
}


@pytest.mark.parametrize(("args", "env", "says"), USAGE.values(), ids=USAGE.keys())
def test_what_several_configs_cannot_mean_is_a_usage_refusal_that_changes_no_byte(
        tmp_path: Path, args: list[str], env: dict[str, str], says: str) -> None:
    small_fleet(tmp_path, "a", "b")
    before = tree_digest(tmp_path)
    proc = run_cli("--json-errors", *args, cwd=tmp_path, env=env)
    obj = error_object(proc)
    assert (obj["code"], proc.returncode, proc.stdout) == ("RIVET_CLI_USAGE", 1, ""), describe(proc)
    assert says in obj["message"], obj["message"]
    assert tree_digest(tmp_path) == before


def test_each_pipeline_s_state_is_where_its_own_variable_says_and_a_declared_one_shared_is_found(
        tmp_path: Path) -> None:
    _, b = small_fleet(tmp_path, "a", "b")
    proc = run_cli("--json", "check", "-c", "p/a/rivet.yaml", "-c", "p/b/rivet.yaml",
                   "--state-url-env", "p/a/rivet.yaml=A_STATE", cwd=tmp_path, env={"A_STATE": f"sqlite:{b.parent}"})
    doc = valid(json.loads(proc.stdout))
    first = doc["pipelines"][0]
    assert (first["state_url_env"], first["location"]["scope"], first["location"]["origin"]) == \
        ("A_STATE", "declared_dir", "env")
    assert first["location"]["path"] == str(b.parent / ".rivet_state.db")
    # alone, a's config refuses b's state in a declared directory; together, the sharing is found too
    assert any(r["code"] == "RIVET_STATE_FOREIGN" for r in first["checks"])
    assert [(f["code"], f["configs"]) for f in doc["fleet"] if f["id"] == "fleet:state"] == \
        [("RIVET_STATE_SHARED", ["p/a/rivet.yaml", "p/b/rivet.yaml"])]
    assert proc.returncode == 5, describe(proc)


def test_strict_fails_a_warning_finding_and_json_errors_names_each_failed_pipeline(tmp_path: Path) -> None:
    small_fleet(tmp_path, "a")
    write_config(tmp_path / "p" / "a", source_url=source("a"), name="second.yaml",
                 checkpoint=str(tmp_path / "cp" / "a2" / "order_events.json"))
    (tmp_path / "cp" / "a2").mkdir()
    (tmp_path / "cp" / "a2" / "order_events.json").write_text(json.dumps({"pos": 8}))
    args = ["check", "--configs", "p/a/*.yaml"]
    proc = run_cli("--json", *args, cwd=tmp_path)
    doc = valid(json.loads(proc.stdout))
    assert proc.returncode == 0, describe(proc)  # one source in one state: a warning
    assert [(f["status"], f["code"]) for f in doc["fleet"]] == [("warn", "RIVET_STATE_SHARED_SAME_SOURCE")]
    proc = run_cli("--json", "--json-errors", *args, "--strict", cwd=tmp_path)
    doc = valid(json.loads(proc.stdout))
    assert proc.returncode == 5 and not doc["ok"], describe(proc)
    assert [(f["status"], f["code"]) for f in doc["fleet"]] == [("fail", "RIVET_STATE_SHARED_SAME_SOURCE")]
    obj = error_object(proc)
    assert obj["code"] == "RIVET_STATE_SHARED_SAME_SOURCE" and obj["kind"] == "warning"
    assert [(u["config"], u["export"], u["code"]) for u in obj["failures"]] == [
        ("p/a/rivet.yaml", None, "RIVET_STATE_SHARED_SAME_SOURCE"),
        ("p/a/second.yaml", None, "RIVET_STATE_SHARED_SAME_SOURCE")]


def test_reads_run_at_most_eight_at_once_and_results_keep_the_input_order() -> None:
    """The pool the CLI reads a fleet with (``fleet.read_all``), with a read that records how
    many reads are in flight: never more than min(8, n), and n reads that end in reverse
    order still come back in input order."""
    for count in (20, 3):
        lock = threading.Lock()
        running, peak, ended = [0], [0], []

        def read(n: int) -> str:
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            time.sleep(0.02 * (count - n % MAX_WORKERS))  # later items of a wave end first
            with lock:
                running[0] -= 1
                ended.append(n)
            return f"pipeline {n}"

        assert read_all(list(range(count)), read) == [f"pipeline {n}" for n in range(count)]
        assert peak[0] == workers(count) == min(MAX_WORKERS, count), peak
        assert ended != sorted(ended), "the reads ended in input order: the test proves nothing about order"


def test_pipelines_are_listed_in_the_order_given_whatever_order_their_reads_end_in(tmp_path: Path) -> None:
    """Twelve pipelines through the CLI's own process (more than one wave of the pool, the
    states built in the other order): the document lists them as the command line does."""
    names = [f"n{k:02d}" for k in range(12)]
    small_fleet(tmp_path, *reversed(names))
    proc = run_cli_process("--json", "check", *[a for n in reversed(names) for a in ("-c", f"p/{n}/rivet.yaml")],
                           cwd=tmp_path)
    doc = valid(json.loads(proc.stdout))
    assert proc.returncode == 0, describe(proc)
    assert [p["config"] for p in doc["pipelines"]] == [f"p/{n}/rivet.yaml" for n in reversed(names)]


def test_under_github_actions_every_pipeline_s_rows_and_the_findings_are_annotations(tmp_path: Path) -> None:
    small_fleet(tmp_path, "a", "b")
    write_config(tmp_path / "p" / "a", source_url=source("other"), name="second.yaml",
                 checkpoint=str(tmp_path / "cp" / "b" / "order_events.json"))
    proc = run_cli("--json", "check", "--configs", "p/*/*.yaml", cwd=tmp_path, env={"GITHUB_ACTIONS": "true"})
    assert proc.returncode == 5, describe(proc)
    valid(json.loads(proc.stdout))
    lines = proc.stderr.splitlines()
    assert any(line.startswith("::warning title=statetool p/a/second.yaml identity%3A "
                               "RIVET_STATE_FOREIGN_BESIDE_CONFIG::") for line in lines), proc.stderr
    assert any(line.startswith("::error title=statetool fleet%3Astate%3A RIVET_STATE_SHARED::") for line in lines)
    assert any(line.startswith("::error title=statetool fleet%3Acheckpoint%3A RIVET_STATE_CHECKPOINT_SHARED::")
               for line in lines), proc.stderr


def test_a_fleet_checked_for_pods_gives_each_pipeline_the_pod_rule_and_an_unknown_target_reads_nothing(
        tmp_path: Path) -> None:
    """``check --target pods`` over several configs: every SQLite pipeline is refused
    ``RIVET_STATE_SQLITE_ON_POD`` (issue 15 item 6), and an unknown target is a usage error
    before any pipeline is read."""
    a = write_config(tmp_path / "a")
    b = write_config(tmp_path / "b", source_url="postgresql://reader@db.internal:5432/crm")
    for config in (a, b):
        assert run_cli("-c", str(config), "init").returncode == 0
    proc = run_cli("-c", str(a), "-c", str(b), "--json", "check", "--target", "pods")
    assert proc.returncode == 5, describe(proc)
    for pipeline in valid(json.loads(proc.stdout))["pipelines"]:
        (pods,) = [c for c in pipeline["checks"] if c["id"] == "pods"]
        assert pods["code"] == "RIVET_STATE_SQLITE_ON_POD", pipeline
    before = tree_digest(tmp_path)
    proc = run_cli("-c", str(a), "-c", str(b), "--json-errors", "check", "--target", "moon")
    assert proc.returncode == 1 and error_object(proc)["code"] == "RIVET_CLI_USAGE", describe(proc)
    assert tree_digest(tmp_path) == before


# -- one state under two names (a fresh user's findings) ---------------------------------------


def _two_sources_one_file(tmp_path: Path, reach: Callable[[Path, Path], None]) -> list[str]:
    """Pipelines ``a`` (state built beside it) and ``b`` of another source, whose directory
    ``reach(a_dir, b_dir)`` makes reach a's state file; returns their configs as given."""
    a, = small_fleet(tmp_path, "a")
    b_dir = tmp_path / "p" / "b"
    reach(a.parent, b_dir)
    write_config(b_dir, source_url=source("b"), checkpoint=str(tmp_path / "cp" / "b" / "order_events.json"))
    (tmp_path / "cp" / "b").mkdir(parents=True)
    (tmp_path / "cp" / "b" / "order_events.json").write_text(json.dumps({"pos": 9}))
    return ["p/a/rivet.yaml", "p/b/rivet.yaml"]


def _hard_link(a_dir: Path, b_dir: Path) -> None:
    b_dir.mkdir(parents=True)
    (b_dir / ".rivet_state.db").hardlink_to(a_dir / ".rivet_state.db")


def _bind_mount(a_dir: Path, b_dir: Path) -> None:
    b_dir.mkdir(parents=True)
    (b_dir / ".rivet_state.db").touch()
    mounted = subprocess.run(["mount", "--bind", str(a_dir / ".rivet_state.db"), str(b_dir / ".rivet_state.db")],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"no bind mount here (needs root): {mounted.stderr.strip()}")


def _symlinked_directory(a_dir: Path, b_dir: Path) -> None:
    b_dir.mkdir(parents=True)
    (b_dir / ".rivet_state.db").symlink_to(a_dir / ".rivet_state.db")


@pytest.mark.parametrize("reach", [_hard_link, _bind_mount, _symlinked_directory],
                         ids=["hard-link", "bind-mount", "symlinked-file"])
def test_one_sqlite_file_reached_by_two_paths_is_one_state_and_both_pipelines_are_not_ok(
        tmp_path: Path, reach: Callable[[Path, Path], None]) -> None:
    """Two configs of different sources whose state paths differ as text but are one file
    (a hard link, a bind mount, a symlink): ``RIVET_STATE_SHARED``, exit 5, and each
    pipeline's ``ok`` false though its own check passes (a foreign state beside a config
    only warns)."""
    labels = _two_sources_one_file(tmp_path, reach)
    try:
        proc = run_cli_process("--json", "--json-errors", "check", "-c", labels[0], "-c", labels[1], cwd=tmp_path)
    finally:
        if reach is _bind_mount:
            subprocess.run(["umount", str(tmp_path / "p" / "b" / ".rivet_state.db")], check=True)
    doc = valid(json.loads(proc.stdout))
    assert [(f["code"], f["configs"]) for f in doc["fleet"] if f["id"] == "fleet:state"] == \
        [("RIVET_STATE_SHARED", labels)], describe(proc)
    assert proc.returncode == 5 and doc["ok"] is False, describe(proc)
    assert [(p["exit_code"], p["ok"]) for p in doc["pipelines"]] == [(0, False), (0, False)], doc["pipelines"]
    assert [(u["config"], u["code"]) for u in error_object(proc)["failures"]] == \
        [(labels[0], "RIVET_STATE_SHARED"), (labels[1], "RIVET_STATE_SHARED")]


def test_two_sqlite_states_not_there_yet_are_one_when_their_real_paths_are_one(tmp_path: Path) -> None:
    """No file yet: the real path decides (a symlinked directory), and two directories
    that are not one are two states."""
    for name in ("a", "b"):
        write_config(tmp_path / "p" / name, source_url=source(name))
    (tmp_path / "p" / "a-link").symlink_to(tmp_path / "p" / "a")
    write_config(tmp_path / "p" / "a-link", source_url=source("other"), name="second.yaml")
    proc = run_cli("--json", "check", "-c", "p/a/rivet.yaml", "-c", "p/a-link/second.yaml", "-c", "p/b/rivet.yaml",
                   cwd=tmp_path)
    doc = valid(json.loads(proc.stdout))
    assert [(f["code"], f["configs"]) for f in doc["fleet"] if f["id"] == "fleet:state"] == \
        [("RIVET_STATE_SHARED", ["p/a/rivet.yaml", "p/a-link/second.yaml"])], describe(proc)


def _spellings(base: str, schema: str) -> list[str]:
    """Four spellings of one PostgreSQL server, database and schema, from the test server's
    ``postgresql://postgres@/postgres?host=DIR``: the user in the query, the port spelled,
    the socket directory in the authority (percent-encoded, a trailing ``/``), a password
    role's URL."""
    socket_dir = base.split("host=", 1)[1]
    encoded = socket_dir.replace("/", "%2F")
    return [f"{base}&schema={schema}",
            f"postgresql:///postgres?host={socket_dir}&user=postgres&port=5432&schema={schema}",
            f"postgresql://postgres@{encoded}%2F:5432/postgres?schema={schema}",
            f"postgresql://{PG_PASSWORD_USER}:{PG_PASSWORD}@/postgres?host={socket_dir}/&schema={schema}"]


@pytest.mark.postgres
def test_one_postgresql_schema_spelled_four_ways_is_one_state_and_no_password_is_printed(
        tmp_path: Path, pg_server: dict[str, str], pg_schemas: Callable[[], str]) -> None:
    schema = pg_schemas().rsplit("schema=", 1)[1]
    urls = _spellings(pg_server["url"], schema)
    fleet = Fleet(tmp_path)
    first = write_config(tmp_path / "pipelines" / "s0", source_url=source("s0"))
    build_state(first, urls[0], env={})
    fleet.add(first, 0, urls[0])
    for n, url in enumerate(urls[1:], 1):
        fleet.add(write_config(tmp_path / "pipelines" / f"s{n}", source_url=source(f"s{n}")), 0, url)
    other = pg_schemas()
    fleet.add(write_config(tmp_path / "pipelines" / "elsewhere", source_url=source("x")), 5, other)
    for command in ("check", "doctor", "info"):
        proc = run_cli_process("--json", "--json-errors", command, *fleet.args(), cwd=tmp_path, env=fleet.env)
        doc = valid(json.loads(proc.stdout))
        shared = [(f["code"], f["configs"]) for f in doc["fleet"] if f["id"] == "fleet:state"]
        assert shared == [("RIVET_STATE_SHARED", fleet.labels()[:4])], (command, describe(proc))
        assert PG_PASSWORD not in proc.stdout + proc.stderr, (command, describe(proc))


def test_the_server_of_a_location_is_libpq_s_parse_in_every_spelling() -> None:
    """:func:`statetool.location.canonical_server`: one canonical keyword string for every
    spelling libpq reads as one server and database (URL or keyword form, host in the
    query or the authority, port spelled or not), none of user or password."""
    from statetool.location import canonical_server, resolve_location

    one = {canonical_server(text) for text in (
        "postgresql://u@/db?host=/sock", "host=/sock dbname=db user=u", "host=/sock/ port=5432 dbname=db",
        "postgresql://%2Fsock/db?user=v&password=secret", "postgresql://u@/db?host=/sock&port=5432&sslmode=disable")}
    assert one == {"host=/sock port=5432 dbname=db"}
    assert canonical_server("postgresql://u:pw@DB.Internal/sales") == \
        canonical_server("postgresql://DB.internal:5432/sales") == "host=db.internal port=5432 dbname=sales"
    others = {canonical_server(text) for text in ("postgresql://u@/db?host=/sock&port=5433", "postgresql:///other"
                                                   "?host=/sock", "postgresql://u@/db?host=/other")}
    assert len(others) == 3 and "host=/sock port=5432 dbname=db" not in others
    location = resolve_location("postgresql://u:secret@/db?host=/sock&schema=s1", None, "rivet.yaml")
    assert location.server == "host=/sock port=5432 dbname=db" and "secret" not in location.server
    assert location.same_state_key() == resolve_location("postgresql:///db?host=/sock&user=u&schema=s1", None,
                                                         "rivet.yaml").same_state_key()
    assert location.same_state_key() != resolve_location("postgresql://u@/db?host=/sock&schema=s2", None,
                                                         "rivet.yaml").same_state_key()


# -- the fleet's verdicts ----------------------------------------------------------------------


def test_among_equally_bad_failures_the_top_level_code_is_the_first_pipeline_s(tmp_path: Path) -> None:
    """Two pipelines failing with one class (refusal, 5) for different codes: the error
    line's failure is the first pipeline's in the order given, whichever order they are
    given in."""
    write_config(tmp_path / "p" / "missing", source_url=source("missing"))
    declared = tmp_path / "declared"
    declared.mkdir()
    build_state(write_config(tmp_path / "elsewhere", source_url=source("other")), f"sqlite:{declared}", env={})
    write_config(tmp_path / "p" / "foreign", source_url=source("foreign"))
    env = {"FOREIGN": f"sqlite:{declared}"}
    configs = ["p/missing/rivet.yaml", "p/foreign/rivet.yaml"]
    for order in (configs, configs[::-1]):
        proc = run_cli("--json", "--json-errors", "check", "-c", order[0], "-c", order[1],
                       "--state-url-env", "p/foreign/rivet.yaml=FOREIGN", cwd=tmp_path, env=env)
        obj = error_object(proc)
        assert proc.returncode == 5 and [u["config"] for u in obj["failures"]] == order, describe(proc)
        assert {u["code"] for u in obj["failures"]} & {"RIVET_STATE_MISSING"}, obj["failures"]
        first = {k: v for k, v in obj["failures"][0].items() if k not in ("config", "export")}
        assert {k: v for k, v in obj.items() if k != "failures"} == first, describe(proc)


def test_a_config_that_does_not_parse_fails_its_pipeline_with_the_config_s_class(tmp_path: Path) -> None:
    """A fleet pipeline whose config exists but is bad YAML, or of the wrong types, and
    has no state: its exit code is ``RIVET_CONFIG_INVALID``'s (1), not the missing state's
    (5); the fleet exits with the worst, a healthy pipeline's 0 aside."""
    small_fleet(tmp_path, "good")
    (tmp_path / "p" / "yaml").mkdir()
    (tmp_path / "p" / "yaml" / "rivet.yaml").write_text("source: [unclosed\n")
    (tmp_path / "p" / "types").mkdir()
    (tmp_path / "p" / "types" / "rivet.yaml").write_text("exports: 5\n")
    proc = run_cli("--json", "--json-errors", "check", "--configs", "p/*/rivet.yaml", cwd=tmp_path)
    doc = valid(json.loads(proc.stdout))
    assert {p["config"]: p["exit_code"] for p in doc["pipelines"]} == \
        {"p/good/rivet.yaml": 0, "p/types/rivet.yaml": 1, "p/yaml/rivet.yaml": 1}, describe(proc)
    obj = error_object(proc)
    assert proc.returncode == 1 and obj["code"] == "RIVET_CONFIG_INVALID", describe(proc)
    assert [u["code"] for u in obj["failures"]] == ["RIVET_CONFIG_INVALID", "RIVET_CONFIG_INVALID"]


@pytest.mark.postgres
def test_a_transfer_into_its_own_schema_spelled_another_way_is_refused_by_the_same_rule(
        tmp_path: Path, pg_server: dict[str, str], pg_schemas: Callable[[], str]) -> None:
    """``transfer --to`` names the source's own server, database and schema in another
    spelling: refused before anything is written (``Location.same_state_key``, the fleet's
    rule), as the same spelling is."""
    schema = pg_schemas().rsplit("schema=", 1)[1]
    source_url, *others = _spellings(pg_server["url"], schema)
    config = write_config(tmp_path / "p", source_url=source("p"))
    build_state(config, source_url, env={})
    for other in [source_url, *others[:2]]:
        before = run_cli("-c", str(config), "--json", "exports", "list", env={"RIVET_STATE_URL": source_url}).stdout
        proc = run_cli("-c", str(config), "--json-errors", "transfer", "--to", other,
                       env={"RIVET_STATE_URL": source_url})
        obj = error_object(proc)
        assert (proc.returncode, obj["code"]) == (1, "RIVET_STATE_BACKEND_UNSUPPORTED"), (other, describe(proc))
        assert "is where the state already is" in obj["message"], describe(proc)
        assert run_cli("-c", str(config), "--json", "exports", "list",
                       env={"RIVET_STATE_URL": source_url}).stdout == before
