"""The machine contract (issue 16 item 5, SPEC §10): every ``--json`` document has a JSON
Schema in docs/schemas/, and the real CLI's output on real states validates against it.

:data:`CASES` is the table: one line per run (the command's words, the state it needs, its
arguments, the exit code); adding a command's case is one line. Every command of the typer
app that prints a JSON document must have a case (a new command without a schema fails
:func:`test_every_command_with_a_json_document_has_a_case`), every emitted top-level key
must be in its schema's ``properties``, and every key a schema requires must be in the
command's JSON paragraph of docs/commands.md. A failed run's ``--json-errors`` object is
validated against ``error.schema.json`` as well.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator, FormatChecker
from referencing import Registry, Resource

from support import describe, error_object, process_env, run_cli, run_cli_as_needed, write_config
from support.states import build_state
from statetool.cli import command_tree
from statetool.errors import EXIT_CODES
from statetool.errors import REGISTRY as REGISTRY_OF_CODES
from statetool.example import build_legacy_state
from statetool.location import STATE_FILE
from test_docs import COMMANDS_MD, DOCS, ERRORS_MD, _json_paragraph, sections

SCHEMAS = DOCS / "schemas"
#: Shapes the document schemas share: no document of its own.
DEFS = "defs"
#: The key the built state records (tests/support/files.py's source).
KEY = "postgresql://db.internal:5432/sales"
#: Commands of the app that print no JSON document, with why.
NO_JSON = {
    ("leases", "run"): "exits with its command's code and prints only what the command prints",
    ("completion",): "prints a shell script (docs/commands.md, 'statetool completion')",
    ("metrics",): "prints OpenMetrics text; --json is refused (docs/commands.md, 'statetool metrics')",
}
#: Top-level keys a schema may leave out of ``required``: the command emits them only
#: sometimes, and says when in docs/commands.md.
OPTIONAL_KEYS = {"rivet-state-1": {"run_aggregates"}}
#: Where the keys of a schema that is no command's JSON paragraph are documented:
#: ``(page, section)``, whose whole body is searched.
DOCUMENTED_IN = {"error": (ERRORS_MD, "The --json-errors object"), "rivet-state-1": (COMMANDS_MD, "statetool export"),
                 "fleet": (COMMANDS_MD, "Several pipelines at once")}


# -- the states the cases need ----------------------------------------------------------


@dataclass
class Prepared:
    """What a case runs against: its config, the environment that names its state, and
    the values its arguments name as ``{placeholders}`` (``tmp`` and ``config`` always)."""

    config: Path
    env: dict[str, str] = field(default_factory=dict)
    values: dict[str, str] = field(default_factory=dict)


def _cli(prepared: Prepared, *args: str, code: int = 0) -> None:
    """Run ``statetool -c CONFIG ARGS`` to prepare a state; asserts its exit code."""
    proc = run_cli("-c", str(prepared.config), *args, cwd=prepared.config.parent, env=prepared.env)
    assert proc.returncode == code, describe(proc)


def _missing(tmp: Path, url: str | None = None) -> Prepared:
    """A config (orders, order_lines, order_events with its checkpoint) and no state."""
    config = write_config(tmp / "pipeline")
    return Prepared(config, {"RIVET_STATE_URL": url} if url else {})


def _built(tmp: Path, url: str | None = None) -> Prepared:
    """The state a pipeline leaves (tests/support/states.py): a cursor, an interrupted
    chunked run, a CDC run with its checkpoint file, leases taken and released."""
    prepared = _missing(tmp, url)
    build_state(prepared.config, url, checkpoint_dir=prepared.config.parent, env=prepared.env)
    return prepared


def _legacy(tmp: Path) -> Prepared:
    """A legacy state an old release left (no version table, no identity), 20 runs."""
    prepared = _missing(tmp)
    build_legacy_state(prepared.config.parent / STATE_FILE, [("orders", "incremental"), ("order_lines", "chunked")], 20)
    return prepared


def _with_backup(tmp: Path) -> Prepared:
    """The built state after a set-cursor: one backup beside it (``{backup}`` its name,
    ``{backup_path}`` its path)."""
    prepared = _built(tmp)
    _cli(prepared, "exports", "set-cursor", "orders", "2026-01-01T00:00:00Z")
    backup = next(prepared.config.parent.glob(f"{STATE_FILE}.backup-*"))
    prepared.values.update(backup=backup.name, backup_path=str(backup))
    return prepared


def _exported(tmp: Path, *, away: bool = False) -> Prepared:
    """The built state and its export with history at ``{file}``; ``away``: the state
    removed afterwards, so that an import creates it."""
    prepared = _built(tmp)
    file = tmp / "state.json"
    _cli(prepared, "export", "--with-history", "-o", str(file))
    if away:
        for path in prepared.config.parent.glob(f"{STATE_FILE}*"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    prepared.values["file"] = str(file)
    return prepared


def _fleet(tmp: Path) -> Prepared:
    """Two built pipelines, each with its state beside its config (``{second}``: the other config)."""
    prepared = _built(tmp)
    second = write_config(tmp / "second")
    build_state(second, checkpoint_dir=second.parent)
    prepared.values["second"] = str(second)
    return prepared


def _fleet_failing(tmp: Path) -> Prepared:
    """The two built pipelines of :func:`_fleet` and a third with no state (``{third}``):
    a fleet whose ``--json-errors`` object names a pipeline (``config``, ``export`` null)."""
    prepared = _fleet(tmp)
    prepared.values["third"] = str(write_config(tmp / "third"))
    return prepared


def _positions_in_state(tmp: Path) -> Prepared:
    """The built state after ``checkpoints import``: the CDC position lives in the state."""
    prepared = _built(tmp)
    _cli(prepared, "checkpoints", "import")
    return prepared


def _stale_lease(tmp: Path) -> Prepared:
    """The built state whose ``chunk-run:orders`` holder was SIGKILLed: a stale lease (once
    its command, which the kill takes along, is gone too: on SQLite it shares the lock)."""
    prepared = _built(tmp)
    holder = subprocess.Popen([sys.executable, "-m", "statetool", "-c", str(prepared.config), "leases", "run",
                               "--export", "orders", "--", "sleep", "60"], cwd=prepared.config.parent,
                              env=process_env(prepared.env), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_lease(prepared, "live", lambda: holder.poll() is None)
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=60)
    _wait_for_lease(prepared, "stale", lambda: True)
    return prepared


def _wait_for_lease(prepared: Prepared, state: str, going: Callable[[], bool]) -> None:
    """Wait (60 s at most, and while ``going()``) until ``chunk-run:orders`` is ``state``."""
    deadline = time.monotonic() + 60
    while _lease_states(prepared).get("chunk-run:orders") != state:
        assert going() and time.monotonic() < deadline, f"chunk-run:orders never became {state}"
        time.sleep(0.05)


def _lease_states(prepared: Prepared) -> dict[str, str]:
    proc = run_cli("-c", str(prepared.config), "--json", "leases", cwd=prepared.config.parent, env=prepared.env)
    return {row["key"]: row["state"] for row in json.loads(proc.stdout)["leases"]} if proc.returncode == 0 else {}


def _pg_target(tmp: Path, pg_url: str) -> Prepared:
    """The built SQLite state and an empty PostgreSQL schema, named by ``PG_TARGET``."""
    prepared = _built(tmp)
    prepared.env["PG_TARGET"] = pg_url
    return prepared


def _built_pg(tmp: Path, pg_url: str) -> Prepared:
    """The built state in PostgreSQL, and an empty directory ``{tmp}/declared``."""
    (tmp / "declared").mkdir()
    return _built(tmp, pg_url)


#: Each state a case can ask for: ``(tmp_path, pg_url or None) -> Prepared``; the names
#: ending in ``-pg`` (or ``pg-``) get a fresh PostgreSQL schema and the ``postgres`` mark.
SETUPS: dict[str, Callable[..., Prepared]] = {
    "missing": lambda tmp: _missing(tmp),
    "missing-pg": lambda tmp, url: _missing(tmp, url),
    "built": lambda tmp: _built(tmp),
    "built-pg": _built_pg,
    "legacy": _legacy,
    "with-backup": _with_backup,
    "exported": lambda tmp: _exported(tmp),
    "exported-away": lambda tmp: _exported(tmp, away=True),
    "positions-in-state": _positions_in_state,
    "fleet": _fleet,
    "fleet-failing": _fleet_failing,
    "stale-lease": _stale_lease,
    "pg-target": _pg_target,
}


def _on_postgres(setup: str) -> bool:
    return setup.endswith("-pg") or setup.startswith("pg-")


# -- the cases ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """``statetool -c CONFIG --json --json-errors COMMAND ARGS`` on the state ``setup``
    (:data:`SETUPS`) exits ``code``; its stdout is a document of ``schema`` (default: the
    command's words joined by ``-``) unless ``document`` is false, and when ``error`` its
    stderr ends with an error object (``error.schema.json``). ``{name}`` in ``args`` is
    the prepared state's value ``name``."""

    command: tuple[str, ...]
    setup: str
    args: tuple[str, ...] = ()
    code: int = 0
    schema: str | None = None
    document: bool = True
    error: bool = False

    @property
    def schema_name(self) -> str:
        """The schema the document is validated against."""
        return self.schema or "-".join(self.command)


CASES = [
    Case(("info",), "built"),
    Case(("info",), "missing"),
    Case(("info",), "legacy"),
    Case(("info",), "built-pg"),
    Case(("info",), "missing-pg"),
    Case(("check",), "built"),
    Case(("check",), "legacy", code=3, error=True),
    Case(("check",), "built-pg"),
    Case(("doctor",), "built"),
    Case(("doctor",), "missing", code=5, error=True),
    Case(("doctor",), "built-pg", ("--export", "orders")),
    Case(("check",), "fleet", ("-c", "{second}"), schema="fleet"),
    Case(("info",), "fleet", ("-c", "{second}"), schema="fleet"),
    Case(("doctor",), "fleet", ("-c", "{second}", "--export", "orders"), schema="fleet"),
    Case(("check",), "fleet-failing", ("-c", "{second}", "-c", "{third}"), code=5, schema="fleet", error=True),
    Case(("doctor",), "fleet-failing", ("-c", "{second}", "-c", "{third}"), code=5, schema="fleet", error=True),
    Case(("checkpoints",), "built", schema="checkpoints-list"),
    Case(("checkpoints", "list"), "positions-in-state"),
    Case(("checkpoints", "import"), "built"),
    Case(("checkpoints", "import"), "built-pg", ("--dry-run",)),
    Case(("checkpoints", "export"), "positions-in-state"),
    Case(("export",), "built", schema="rivet-state-1"),
    Case(("export",), "built-pg", ("--with-history",), schema="rivet-state-1"),
    Case(("export",), "built", ("-o", "{tmp}/state.json")),
    Case(("diff",), "exported", ("{config}", "{file}")),
    Case(("diff",), "with-backup", ("{backup_path}", "{config}"), code=1),
    Case(("import",), "exported-away", ("{file}",)),
    Case(("import",), "exported", ("{file}", "--export", "orders")),
    Case(("import",), "exported", ("{file}", "--export", "orders", "--dry-run")),
    Case(("restore",), "with-backup", ("--allow-older", "{backup}")),
    Case(("restore",), "with-backup", ("--allow-older", "--dry-run", "{backup}")),
    Case(("restore",), "with-backup", ("--if-absent", "{backup}")),
    Case(("backups", "list"), "with-backup"),
    Case(("backups", "verify"), "with-backup"),
    Case(("backups", "prune"), "with-backup", ("--keep", "1", "--dry-run")),
    Case(("prune",), "built", ("--keep-runs", "1", "--dry-run")),
    Case(("prune",), "built", ("--keep-runs", "1", "--archive", "{tmp}/pruned.jsonl.gz")),
    Case(("prune",), "built-pg", ("--before", "2030-01-01", "--vacuum")),
    Case(("init",), "missing"),
    Case(("init",), "missing-pg"),
    Case(("migrate",), "legacy"),
    Case(("migrate",), "legacy", ("--dry-run",)),
    Case(("migrate",), "built-pg", ("--dry-run",)),
    Case(("relocate",), "built", ("--to", "{tmp}/declared", "--create-dir")),
    Case(("relocate",), "built", ("--to", "{tmp}/declared", "--create-dir", "--dry-run")),
    Case(("transfer",), "pg-target", ("--to-env", "PG_TARGET", "--with-checkpoints")),
    Case(("transfer",), "pg-target", ("--to-env", "PG_TARGET", "--dry-run")),
    Case(("transfer",), "built-pg", ("--to", "sqlite:{tmp}/declared")),
    Case(("revisions",), "built"),
    Case(("revisions",), "missing"),
    Case(("identity", "show"), "built"),
    Case(("identity", "show"), "built-pg"),
    Case(("identity", "adopt"), "built"),
    Case(("identity", "adopt"), "built", ("--dry-run",)),
    Case(("identity", "rekey"), "built", ("--old", KEY, "--new", f"{KEY}_eu", "--reason", "the source moved")),
    Case(("exports", "list"), "built"),
    Case(("exports", "show"), "built", ("order_lines",)),
    Case(("exports", "set-cursor"), "built", ("orders", "2026-01-01T00:00:00Z")),
    Case(("exports", "set-cursor"), "built-pg", ("--dry-run", "orders", "2026-01-01T00:00:00Z")),
    Case(("exports", "reset"), "built", ("order_lines",)),
    Case(("leases",), "built", schema="leases-list"),
    Case(("leases", "list"), "stale-lease"),
    Case(("leases", "list"), "built-pg"),
    Case(("leases", "release"), "stale-lease", ("chunk-run:orders", "--reason", "holder was killed")),
    Case(("leases", "release"), "built", ("chunk-run:orders", "--dry-run")),
    Case(("leases",), "missing", code=5, document=False, error=True),
    Case(("exports", "show"), "built", ("nope",), code=1, document=False, error=True),
]


def _case_id(case: Case) -> str:
    return f"{' '.join((*case.command, *case.args))} @{case.setup}"


def _params() -> list[Any]:
    return [pytest.param(case, id=_case_id(case), marks=[pytest.mark.postgres] if _on_postgres(case.setup) else [])
            for case in CASES]


# -- the schemas --------------------------------------------------------------------------


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())  # type: ignore[no-any-return]


SCHEMA_FILES = {path.name.removesuffix(".schema.json"): path for path in sorted(SCHEMAS.glob("*.schema.json"))}
LOADED = {name: _load(path) for name, path in SCHEMA_FILES.items()}
#: Every schema by its ``$id``, so that one references another by URI.
REGISTRY = Registry().with_resources((doc["$id"], Resource.from_contents(doc)) for doc in LOADED.values())
#: jsonschema's format checker, with ``date-time`` checked by the standard library
#: (RFC 3339 as Python reads it): its own check needs a package statetool does not depend on.
FORMATS = FormatChecker()


@FORMATS.checks("date-time", raises=ValueError)
def _date_time(text: object) -> bool:
    if not isinstance(text, str):
        return True
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})", text):
        raise ValueError(f"{text!r} is not an RFC 3339 date-time")
    datetime.fromisoformat(text)
    return True


def validator(name: str) -> Draft202012Validator:
    """A draft 2020-12 validator of schema ``name``, with format checking."""
    return Draft202012Validator(LOADED[name], registry=REGISTRY, format_checker=FORMATS)


def assert_valid(name: str, doc: Any, where: str) -> None:
    """``doc`` is valid against schema ``name`` and has no top-level key it does not list."""
    errors = sorted(validator(name).iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, f"{where} does not match {name}.schema.json:\n" + "\n".join(
        f"- at {'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message[:300]}" for e in errors[:10])
    unlisted = sorted(set(doc) - set(LOADED[name]["properties"]))
    assert not unlisted, f"{where} emits top-level keys {unlisted} that {name}.schema.json does not list"


# -- the tests ----------------------------------------------------------------------------


@pytest.fixture
def prepared(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[Case], Prepared]]:
    """Prepares a case's state in ``tmp_path`` (a PostgreSQL schema of its own where it
    needs one)."""
    def prepare(case: Case) -> Prepared:
        setup = SETUPS[case.setup]
        made = setup(tmp_path, request.getfixturevalue("pg_url")) if _on_postgres(case.setup) else setup(tmp_path)
        made.values.update(tmp=str(tmp_path), config=str(made.config))
        return made

    yield prepare


@pytest.mark.parametrize("case", _params())
def test_each_json_document_validates_against_its_schema(case: Case, prepared: Callable[[Case], Prepared]) -> None:
    state = prepared(case)
    args = [arg.format(**state.values) for arg in case.args]
    proc = run_cli_as_needed("-c", str(state.config), "--json", "--json-errors", *case.command, *args,
                             cwd=state.config.parent, env=state.env)
    assert proc.returncode == case.code, describe(proc)
    if case.document:
        assert_valid(case.schema_name, json.loads(proc.stdout), f"statetool {' '.join(case.command)}")
    else:
        assert proc.stdout == "", describe(proc)
    if case.error:
        assert_valid("error", error_object(proc), "the --json-errors object")
    else:
        assert not any(line.startswith("{") for line in proc.stderr.splitlines()), describe(proc)


def test_every_error_object_of_metrics_validates_one_pipeline_or_several(tmp_path: Path) -> None:
    """``metrics`` has no ``--json`` document, so no case above: its ``--json-errors``
    objects, of one config (a missing state; a textfile that cannot be written) and of
    several (each pipeline down named by ``config``, ``export`` null), validate too."""
    built = _built(tmp_path)
    missing = write_config(tmp_path / "third")
    (tmp_path / "afile").write_text("a file")
    runs = [run_cli("-c", str(missing), "--json-errors", "metrics"),
            run_cli("-c", str(built.config), "--json-errors", "metrics", "--textfile",
                    str(tmp_path / "afile" / "x.prom")),
            run_cli("-c", str(built.config), "-c", str(missing), "--json-errors", "metrics", env=built.env)]
    codes = []
    for proc in runs:
        obj = error_object(proc)
        assert_valid("error", obj, "the --json-errors object of metrics")
        codes.append((obj["code"], [(u.get("config"), u["export"]) for u in obj["failures"]]))
    assert codes == [("RIVET_STATE_MISSING", []), ("RIVET_METRICS_TEXTFILE_UNWRITABLE", []),
                     ("RIVET_STATE_MISSING", [(str(missing), None)])], codes


def _json_commands() -> list[tuple[str, ...]]:
    """Every command of the typer app that can print a JSON document: each command, and
    each group that runs without a command (``statetool leases``), but :data:`NO_JSON`."""
    found: list[tuple[str, ...]] = []

    def walk(command: Any, path: tuple[str, ...]) -> None:
        subcommands = getattr(command, "commands", None)
        if path and (subcommands is None or command.invoke_without_command):
            found.append(path)
        for name, sub in (subcommands or {}).items():
            walk(sub, (*path, name))

    walk(command_tree(), ())
    return found


def test_every_command_with_a_json_document_has_a_case() -> None:
    commands = _json_commands()
    assert ("info",) in commands and ("leases",) in commands and ("leases", "release") in commands, commands
    stale = sorted(" ".join(path) for path in NO_JSON if path not in commands)
    assert not stale, f"NO_JSON names commands the CLI does not have: {stale}"
    covered = {case.command for case in CASES if case.document}
    missing = sorted(" ".join(path) for path in commands if path not in NO_JSON and path not in covered)
    assert not missing, (f"commands with a --json document but no case in CASES (nor a reason in NO_JSON): "
                         f"{missing}; write docs/schemas/<command words>.schema.json and add a Case line")


def test_every_schema_is_used_by_a_case_and_every_case_has_its_schema() -> None:
    used = {case.schema_name for case in CASES if case.document} | {"error"}
    assert used <= set(SCHEMA_FILES), f"cases without a schema file: {sorted(used - set(SCHEMA_FILES))}"
    assert set(SCHEMA_FILES) - {DEFS} == used, f"schemas no case validates: {sorted(set(SCHEMA_FILES) - {DEFS} - used)}"


@pytest.mark.parametrize("name", sorted(SCHEMA_FILES))
def test_every_schema_is_a_valid_draft_2020_12_schema_that_requires_what_it_lists(name: str) -> None:
    schema = LOADED[name]
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema", name
    assert schema["$id"].endswith(f"/schemas/{name}.schema.json"), schema["$id"]
    if name == DEFS:
        assert set(schema) == {"$schema", "$id", "title", "description", "$defs"}, "defs holds shapes only"
        return
    assert schema["type"] == "object" and schema.get("additionalProperties", True) is not False, \
        f"{name}: a document's schema stays open, so that a key added later (SPEC §10) validates against it"
    listed, required = set(schema["properties"]), set(schema["required"])
    assert required <= listed and listed - required == OPTIONAL_KEYS.get(name, set()), \
        f"{name}: every top-level key must be required (optional: {sorted(listed - required)})"


def _command_path(name: str) -> tuple[str, ...]:
    """The command whose document schema ``name`` describes."""
    paths = {"-".join(path): path for path in _json_commands()}
    assert name in paths, f"{name}.schema.json names no command of the CLI"
    return paths[name]


@pytest.mark.parametrize("name", sorted(set(SCHEMA_FILES) - {DEFS}))
def test_every_required_key_is_documented(name: str) -> None:
    if name in DOCUMENTED_IN:
        page, title = DOCUMENTED_IN[name]
        text, where = sections(page.read_text())[title], f"{page.name}, section '{title}'"
        missing = [key for key in LOADED[name]["required"] if f"`{key}`" not in text]
    else:
        title = "statetool " + " ".join(_command_path(name))
        text, where = _json_paragraph(title), f"the JSON paragraph of '{title}' in docs/commands.md"
        missing = [key for key in LOADED[name]["required"] if not re.search(rf"\b{re.escape(key)}\b", text)]
    assert not missing, f"{name}.schema.json requires {missing}, which {where} does not name"


def test_the_validator_checks_formats_references_and_types() -> None:
    """The checks above can fail: a lineage that is no UUID, a backup time that is no
    RFC 3339 time, a warning without its action (a referenced shape), a count as text."""
    copy = {"name": "b", "path": "/b", "kind": "backup", "label": None, "taken_at": "2026-12-01T12:00:00Z",
            "size": 1, "revision": "0006", "state_key": None, "lineage": None, "serial": 1, "problem": None,
            "code": None, "checked": False, "write_id": None}
    location = {"backend": "sqlite", "scope": "beside_config", "origin": "default", "path": "/p", "directory": "/",
                "url": None, "schema": None, "display": "/p"}
    good = {"location": location, "copies": [copy], "live": {"lineage": None, "serial": None}, "verified": False}
    assert not list(validator("backups-list").iter_errors(good))
    for change in ({"live": {"lineage": "not-a-uuid", "serial": 1}}, {"copies": [{**copy, "taken_at": "yesterday"}]},
                   {"copies": [{**copy, "size": "1"}]}, {"location": {**location, "backend": "oracle"}}):
        assert list(validator("backups-list").iter_errors({**good, **change})), f"{change} validated"
    broken = {"location": location, "removed": [], "kept": [], "dry_run": True,
              "warnings": [{"code": "RIVET_STATE_READ_ONLY_DRY_RUN", "message": "m"}]}
    assert list(validator("backups-prune").iter_errors(broken)), "a warning without action validated"


def test_the_error_schema_names_every_kind_and_class_of_the_registry() -> None:
    props = LOADED["error"]["properties"]
    assert set(props["kind"]["enum"]) == {entry.kind for entry in REGISTRY_OF_CODES.values()} | {"warning"}
    assert set(props["class"]["enum"]) == set(EXIT_CODES)
