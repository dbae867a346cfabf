"""The docs cannot rot: every command, option, error code and JSON key is documented, the
links resolve, the layering in docs/architecture.md holds, and README's first command
runs the main job, whose story is checked. The setup guides run in tests/test_guides.py.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import textwrap
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from support import describe, error_object, run_cli, write_config
from statetool.cli import command_tree
from statetool.errors import EXIT_CODES, REGISTRY, WARNINGS
from support import markdown

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
COMMANDS_MD = DOCS / "commands.md"
ERRORS_MD = DOCS / "errors.md"
ARCHITECTURE_MD = DOCS / "architecture.md"
README = ROOT / "README.md"
PACKAGE = ROOT / "statetool"


# -- markdown helpers (the page itself is read by support.markdown) ---------------------


def sections(text: str) -> dict[str, str]:
    """``{heading text without backticks: body}``; a body runs until the next heading of
    the same or a higher level, so a section includes its subsections."""
    lines = text.splitlines()
    heads = markdown.parse(text).headings
    out: dict[str, str] = {}
    for n, head in enumerate(heads):
        end = next((h.line - 1 for h in heads[n + 1:] if h.level <= head.level), len(lines))
        out[head.title.replace("`", "")] = "\n".join(lines[head.line:end])
    return out


def slug(title: str) -> str:
    """GitHub's anchor for a heading: lower-case, punctuation dropped, spaces to hyphens."""
    text = title.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def collapse(text: str) -> str:
    """Whitespace collapsed, blockquote markers removed: prose compared across line wraps."""
    return " ".join(re.sub(r"^\s*>\s?", "", text, flags=re.M).split())


# -- (a) every command and option has help text and a section in docs/commands.md -----


def cli_commands() -> list[tuple[tuple[str, ...], Any]]:
    """Every command and group of the typer app, depth first: ``[(path, click command)]``."""
    found: list[tuple[tuple[str, ...], Any]] = []

    def walk(command: Any, path: tuple[str, ...]) -> None:
        for name, sub in (getattr(command, "commands", None) or {}).items():
            found.append(((*path, name), sub))
            walk(sub, (*path, name))

    walk(command_tree(), ())
    return found


COMMANDS = cli_commands()


def _ids(items: list[tuple[tuple[str, ...], Any]]) -> list[str]:
    return [" ".join(path) for path, _ in items]


def test_the_cli_has_the_commands_the_docs_promise() -> None:
    names = {" ".join(path) for path, _ in COMMANDS}
    for expected in ("info", "check", "init", "migrate", "revisions", "identity show", "identity adopt",
                     "identity rekey", "exports list", "exports show", "exports set-cursor", "exports reset"):
        assert expected in names, f"statetool {expected} is gone from the CLI; docs still describe it"


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=_ids(COMMANDS))
def test_every_command_and_parameter_has_help_text(path: tuple[str, ...], command: Any) -> None:
    assert (command.help or "").strip(), f"statetool {' '.join(path)} has no help text (docstring)"
    for param in command.params:
        assert (getattr(param, "help", None) or "").strip(), \
            f"statetool {' '.join(path)}: parameter {param.name} has no help text"


def test_global_options_have_help_text_and_are_documented() -> None:
    root = command_tree()
    body = sections(COMMANDS_MD.read_text())["Global options"]
    for param in root.params:
        assert (param.help or "").strip(), f"global option {param.opts} has no help text"
        for opt in param.opts:
            assert f"`{opt}" in body or f"{opt}`" in body, f"global option {opt} missing from commands.md"


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=_ids(COMMANDS))
def test_every_command_has_a_section_in_commands_md(path: tuple[str, ...], command: Any) -> None:
    title = "statetool " + " ".join(path)
    docs = sections(COMMANDS_MD.read_text())
    assert title in docs, f"docs/commands.md has no heading '{title}'"
    body = docs[title]
    for param in command.params:
        if param.param_type_name == "option":
            for opt in (o for o in param.opts if o.startswith("--")):
                assert re.search(rf"{re.escape(opt)}\b", body), f"{title}: option {opt} is not documented"
        else:
            assert param.name.upper() in body, f"{title}: argument {param.name.upper()} is not documented"


def _json_paragraph(title: str) -> str:
    body = sections(COMMANDS_MD.read_text())[title]
    start = body.find("JSON:")
    assert start >= 0, f"{title}: no 'JSON:' paragraph in docs/commands.md"
    return body[start:].split("\n\n", 1)[0]


def _assert_json_keys_documented(path: tuple[str, ...], proc: subprocess.CompletedProcess[str]) -> None:
    doc = json.loads(proc.stdout)
    paragraph = _json_paragraph("statetool " + " ".join(path))
    for name in doc:
        assert re.search(rf"\b{re.escape(name)}\b", paragraph), \
            f"statetool {' '.join(path)} --json: key '{name}' is not in its JSON paragraph:\n{paragraph}"


def test_every_json_top_level_key_is_documented(tmp_path: Path) -> None:
    """Run each command with --json on a real state; its top-level keys are in its section."""
    config = write_config(tmp_path / "pipeline")
    target = tmp_path / "declared"
    target.mkdir()
    key = "postgresql://db.internal:5432/sales"
    runs: list[tuple[tuple[str, ...], list[str], int]] = [
        (("init",), ["init"], 0),
        (("info",), ["info"], 0),
        (("check",), ["check"], 0),
        (("doctor",), ["doctor"], 5),  # a new state: every export's next run is a first run
        (("checkpoints",), ["checkpoints"], 0),
        (("revisions",), ["revisions"], 0),
        (("migrate",), ["migrate", "--dry-run"], 0),
        (("identity", "show"), ["identity", "show"], 0),
        (("identity", "adopt"), ["identity", "adopt"], 0),
        (("identity", "rekey"), ["identity", "rekey", "--old", key, "--new", key, "--reason", "docs test"], 0),
        (("exports", "list"), ["exports", "list"], 0),
        (("exports", "show"), ["exports", "show", "orders"], 0),
        (("exports", "set-cursor"), ["exports", "set-cursor", "orders", "2026-01-01T00:00:00Z"], 0),
        (("exports", "reset"), ["exports", "reset", "orders"], 0),
        (("leases", "list"), ["leases", "list"], 0),
        (("leases", "release"), ["leases", "release", "chunk-run:orders"], 0),
        (("relocate",), ["relocate", "--dry-run", "--to", str(target)], 0),
        (("export",), ["export", "-o", str(tmp_path / "export.json")], 0),
        (("backups", "list"), ["backups", "list"], 0),
        (("backups", "verify"), ["backups", "verify"], 0),
        (("backups", "prune"), ["backups", "prune", "--keep", "1", "--dry-run"], 0),
        (("prune",), ["prune", "--keep-runs", "1", "--dry-run"], 0),
    ]
    for path, args, expected in runs:
        proc = run_cli("-c", str(config), "--json", *args)
        assert proc.returncode == expected, describe(proc)
        _assert_json_keys_documented(path, proc)
    backup = next(config.parent.glob(".rivet_state.db.backup-set-cursor-orders-*"))
    proc = run_cli("-c", str(config), "--json", "restore", "--allow-older", "--dry-run", backup.name)
    assert proc.returncode == 0, describe(proc)
    _assert_json_keys_documented(("restore",), proc)


@pytest.mark.postgres
def test_transfer_json_keys_are_documented(tmp_path: Path, pg_url: str) -> None:
    config = write_config(tmp_path / "pipeline")
    proc = run_cli("-c", str(config), "init")
    assert proc.returncode == 0, describe(proc)
    proc = run_cli("-c", str(config), "--json", "transfer", "--dry-run", "--to", pg_url)
    assert proc.returncode == 0, describe(proc)
    _assert_json_keys_documented(("transfer",), proc)


# -- (b) every registered code is in docs/errors.md, with its registry entry ---------


@pytest.mark.parametrize("code", sorted(REGISTRY))
def test_every_error_code_is_documented_with_its_entry(code: str) -> None:
    docs = sections(ERRORS_MD.read_text())
    assert code in docs, f"docs/errors.md has no heading for {code}"
    body = collapse(docs[code])
    entry = REGISTRY[code]
    for fact in (f"kind `{entry.kind}`", f"class `{entry.exit_class}`", f"exit {entry.exit_code}",
                 f"retryable {'yes' if entry.retryable else 'no'}"):
        assert fact in body, f"{code}: docs/errors.md should say '{fact}'"
    assert collapse(entry.action) in body, f"{code}: docs/errors.md does not quote the registered action"
    row = re.search(rf"^\| `{code}` \| (\w+) \| (\d+) \| (yes|no) \| (yes|added) \|$", ERRORS_MD.read_text(), re.M)
    assert row, f"{code}: no row in the 'Codes at a glance' table"
    assert (row.group(1), int(row.group(2))) == (entry.exit_class, entry.exit_code), f"{code}: glance row is stale"
    if row.group(4) == "added":
        assert "Added beyond SPEC" in body, f"{code}: added beyond SPEC, but the section does not say why"


@pytest.mark.parametrize("code", sorted(WARNINGS))
def test_every_warning_code_is_documented_with_its_action(code: str) -> None:
    docs = sections(ERRORS_MD.read_text())
    assert code in docs, f"docs/errors.md has no heading for warning {code}"
    assert collapse(WARNINGS[code]) in collapse(docs[code]), f"{code}: the registered action is not quoted"


def test_exit_classes_table_matches_the_registry() -> None:
    body = sections(ERRORS_MD.read_text())["Exit classes"]
    for name, code in EXIT_CODES.items():
        assert re.search(rf"^\| {name} \| {code} \|", body, re.M), f"exit class {name} ({code}) missing or wrong"


def test_json_errors_object_keys_are_documented(tmp_path: Path) -> None:
    proc = run_cli("--json-errors", "--state-url", "nowhere://x", "info", cwd=tmp_path)
    assert proc.returncode == 1, describe(proc)
    obj = error_object(proc)
    body = sections(ERRORS_MD.read_text())["The --json-errors object"]
    documented = set(re.findall(r"^\| `(\w+)` \|", body, re.M))
    assert documented == set(obj), f"documented keys {sorted(documented)} vs emitted {sorted(obj)}"


# -- the markdown reader every docs test uses ---------------------------------------------


def test_the_markdown_reader_refuses_an_unclosed_fence() -> None:
    with pytest.raises(markdown.UnclosedFence, match=r"guide\.md: the ``` fence opened on line 3"):
        markdown.parse("# Guide\n\n```sh\necho never closed\n", "guide.md")
    with pytest.raises(markdown.UnclosedFence, match="line 1"):
        markdown.parse("````text\n```\n", "guide.md")  # a shorter fence does not close a longer one


def test_the_markdown_reader_keeps_each_block_with_the_headings_above_it() -> None:
    page = markdown.parse(textwrap.dedent("""\
        # Guide
        ## First ##
        ~~~sh
        ```
        not a close
        ~~~
        ### Deeper
          ```text title
          indented
          ```
        ## Second
        ``` `not a fence`
        ```python
        ```
        """))
    got = [(b.lang, b.info, b.section, b.under(3), b.line, b.code) for b in page.blocks]
    assert got == [("sh", "sh", "First", "", 3, "```\nnot a close"),
                   ("text", "text title", "First", "Deeper", 8, "indented"),
                   ("python", "python", "Second", "", 13, "")], got
    assert [(h.line, h.level, h.title) for h in page.headings] == [(1, 1, "Guide"), (2, 2, "First"),
                                                                    (7, 3, "Deeper"), (11, 2, "Second")]
    assert page.prose.splitlines() == ["# Guide", "## First ##", "### Deeper", "## Second", "``` `not a fence`"]
    assert [b.code for b in page.sh_blocks()] == ["```\nnot a close"]


# -- links ------------------------------------------------------------------------------


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


@pytest.mark.parametrize("page", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    for target in re.findall(r"\]\(([^)\s]+)\)", markdown.read(page).prose):
        if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        assert dest.exists(), f"{page.name}: link to {target} points at nothing"
        if anchor and dest.suffix == ".md":
            anchors = {slug(title) for title in sections(dest.read_text())}
            assert anchor in anchors, f"{page.name}: no heading in {dest.name} for #{anchor}"


# -- layering: docs/architecture.md's table, and the import graph it promises -----------

LAYERS = ("facts", "storage", "operations", "faces")

#: What code above the storage layer may import from ``statetool/backends/``, each with its
#: reason. Every other module there speaks SQLite or PostgreSQL (a driver, a file format,
#: catalog SQL, a lease mechanism, the tombstone and the other files of a move), and the
#: layers above never see which backend they have (STYLE §4, issue 11 item 1): a step that
#: only one backend has is reached through an object the interface hands out
#: (``file_move(backend)``, typed by the ``FileMoves`` protocol). docs/architecture.md
#: ("storage") states the same rule.
STORAGE_INTERFACE = {
    "statetool.backends": "the entry points: open_backend / open_leases (the one place a backend is chosen), "
                          "file_move (the move of a state file), orphan_companions and tombstone_at (what is "
                          "beside or at a location, None where the backend has no files)",
    "statetool.backends.base": "the protocols (Backend, LeaseStore, the transfer's two ends, FileMoves) and the "
                               "value types they return",
    "statetool.backends.faults": "an OSError (read-only mount, denied permission, full disk) as its registered "
                                 "code: a fault of the filesystem under any file an operation touches",
    "statetool.backends.processes": "is a lease holder alive, by pid and start time: one rule for both lease "
                                    "mechanisms",
    "statetool.backends.durable": "fsync and the verified copy of a plain file: a move carries the CDC "
                                  "checkpoints, plain files under either backend; no database in it (the SQLite "
                                  "backend writes its own files through it too, which is why it sits here)",
}


#: Database drivers and SQLAlchemy's dialect packages: only backend modules import them.
DRIVERS = ("sqlite3", "psycopg", "psycopg2", "psycopg_pool", "sqlalchemy.dialects")

#: Modules above storage that may name a backend anyway, each with its reason.
BACKEND_AWARE = {
    "statetool.example": "builds a legacy SQLite file byte for byte as revision 0001's release wrote it: "
                         "SQLite is what it makes, not a state it guards",
}


def _layer_table() -> dict[str, list[str]]:
    """``{layer: the entries of its row}`` from the one layer table of docs/architecture.md;
    fails when a layer has no row or more than one."""
    rows: dict[str, list[list[str]]] = {}
    for line in ARCHITECTURE_MD.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0] in LAYERS:
            rows.setdefault(cells[0], []).append(re.findall(r"`([^`]+)`", cells[1]))
    assert set(rows) == set(LAYERS), f"docs/architecture.md's layer table lists {sorted(rows)}"
    twice = sorted(layer for layer, found in rows.items() if len(found) > 1)
    assert not twice, f"docs/architecture.md places modules in more than one row of layer(s) {twice}"
    return {layer: found[0] for layer, found in rows.items()}


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_files() -> dict[str, Path]:
    """``{dotted module name: file}`` of every statetool module (the alembic scripts excluded)."""
    return {_module_of(p): p for p in sorted(PACKAGE.rglob("*.py")) if "_alembic" not in p.parts}


@dataclass(frozen=True)
class Imported:
    """One imported name: ``name`` is dotted and absolute (``from a import b`` gives ``a.b``,
    whether ``b`` is a module or not), ``line`` is 1-based, ``type_only`` is true under
    ``if TYPE_CHECKING:``."""

    line: int
    name: str
    type_only: bool


def imports_of(source: str, module: str, *, package: bool) -> list[Imported]:
    """Every import statement anywhere in ``source``: at the top, inside functions and
    classes, under ``try`` and ``if`` (``TYPE_CHECKING`` included, flagged). ``module`` is
    the source's dotted name and ``package`` whether it is a package's ``__init__``, so that
    relative imports resolve."""
    base = module.split(".") if package else module.split(".")[:-1]
    found: list[Imported] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_only)
            return
        if isinstance(node, ast.Import):
            found.extend(Imported(node.lineno, alias.name, type_only) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            origin = ".".join([*base[:len(base) - node.level + 1], *([node.module] if node.module else [])]) \
                if node.level else node.module or ""
            found.extend(Imported(node.lineno, f"{origin}.{alias.name}", type_only) for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(ast.parse(source), False)
    return found


def _package_imports() -> dict[str, list[Imported]]:
    """``{module: its imports}`` for every statetool module."""
    return {module: imports_of(path.read_text(), module, package=path.name == "__init__.py")
            for module, path in _package_files().items()}


def _owner(name: str, known: Container[str]) -> str | None:
    """The longest module of ``known`` that ``name`` lies in (``a.b.c`` -> ``a.b`` when only
    that exists), or None when it names none of them."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _where(files: dict[str, Path], module: str, item: Imported) -> str:
    """``statetool/x.py:LINE`` of ``item`` in ``module``, flagged when under TYPE_CHECKING."""
    return f"{files[module].relative_to(ROOT)}:{item.line}" + (" (under TYPE_CHECKING)" if item.type_only else "")


def test_the_import_reader_sees_function_local_type_checking_and_relative_imports() -> None:
    source = textwrap.dedent("""\
        import sqlite3
        from typing import TYPE_CHECKING
        from . import sibling
        from ..errors import StateError
        if TYPE_CHECKING:
            from statetool.backends.sqlite import SqliteBackend
        else:
            import json
        def later():
            from statetool.backends.postgres import PostgresBackend
        class Holder:
            def method(self):
                try:
                    import psycopg
                except ImportError:
                    pass
        """)
    got = [(i.line, i.name, i.type_only) for i in imports_of(source, "statetool.operations.thing", package=False)]
    assert got == [(1, "sqlite3", False), (2, "typing.TYPE_CHECKING", False),
                   (3, "statetool.operations.sibling", False), (4, "statetool.errors.StateError", False),
                   (6, "statetool.backends.sqlite.SqliteBackend", True), (8, "json", False),
                   (10, "statetool.backends.postgres.PostgresBackend", False), (14, "psycopg", False)], got
    assert [i.name for i in imports_of("from . import x\n", "statetool.backends", package=True)] == \
        ["statetool.backends.x"]


def test_the_layer_table_of_docs_architecture_md_is_the_only_place_modules_are_placed() -> None:
    _layer_table()  # one row per layer there
    for page in _markdown_files():
        if page == ARCHITECTURE_MD:
            continue
        for number, line in enumerate(markdown.read(page).prose.splitlines(), 1):
            first = line.strip().strip("|").split("|")[0].strip()
            assert not (line.lstrip().startswith("|") and first in LAYERS), \
                f"{page.relative_to(ROOT)} places modules in layer '{first}' (prose line {number}): " \
                "only docs/architecture.md's table does"


def test_every_module_sits_in_one_layer_and_imports_only_downward() -> None:
    table = _layer_table()
    files = _package_files()
    layer_of: dict[str, int] = {}
    for module, path in files.items():
        rel = path.relative_to(PACKAGE).as_posix()
        places = [LAYERS.index(layer) for layer, entries in table.items()
                  for entry in entries if rel == entry or (entry.endswith("/") and rel.startswith(entry))]
        assert len(places) == 1, f"statetool/{rel} is placed in {len(places)} layers of docs/architecture.md"
        layer_of[module] = places[0]

    wrong = []
    for importer, items in _package_imports().items():
        for item in items:
            target = _owner(item.name, files)
            if target is not None and layer_of[target] > layer_of[importer]:
                wrong.append(f"{_where(files, importer, item)}: {importer} ({LAYERS[layer_of[importer]]}) imports "
                             f"{item.name} ({LAYERS[layer_of[target]]})")
    assert not wrong, "imports against the layering of docs/architecture.md:\n" + "\n".join(wrong)


def test_the_package_has_no_import_cycle_not_even_through_function_local_imports() -> None:
    """Every import is an edge: one inside a function hides a cycle from the interpreter,
    not from the design, and so does one under ``TYPE_CHECKING``: a type named there is
    still a module the importer cannot be read or moved without. An annotation that needs
    a backend's shape names the protocol in ``backends/base.py`` instead. (Importing
    ``a.b`` also runs package ``a``; that parent edge is not counted: Python always
    finishes a package's ``__init__`` first, so it never forms a cycle by itself.)"""
    files = _package_files()
    graph: dict[str, dict[str, Imported]] = {}
    for importer, items in _package_imports().items():
        graph[importer] = {}
        for item in items:
            target = _owner(item.name, files)
            if target and target != importer:
                graph[importer].setdefault(target, item)
    assert "statetool.operations.leasing" in graph and graph["statetool.operations.writes"], "graph not read"

    cycles: list[str] = []
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                loop = path[path.index(target):] + [target]
                steps = (f"{a} -> {b}  ({_where(files, a, graph[a][b])})" for a, b in zip(loop, loop[1:]))
                cycles.append("\n  ".join(steps))
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles in statetool:\n" + "\n".join(f"- {c}" for c in cycles)


def test_no_operation_imports_a_database_driver_or_a_concrete_backend() -> None:
    """Above the storage layer (operations and faces), the only storage modules imported
    are :data:`STORAGE_INTERFACE`, and no database driver is imported at all; imports
    under ``TYPE_CHECKING`` count too (naming ``SqliteBackend`` in an annotation is
    knowing which backend one has). :data:`BACKEND_AWARE` lists the exceptions."""
    table = _layer_table()
    above = tuple(entry for layer in ("operations", "faces") for entry in table[layer])
    files = _package_files()
    offenders = []
    for importer, items in _package_imports().items():
        rel = files[importer].relative_to(PACKAGE).as_posix()
        if importer in BACKEND_AWARE or not any(rel == e or (e.endswith("/") and rel.startswith(e)) for e in above):
            continue
        for item in items:
            target = _owner(item.name, files)
            if any(item.name == d or item.name.startswith(f"{d}.") for d in DRIVERS):
                offenders.append(f"{_where(files, importer, item)}: {importer} imports {item.name} (a database driver)")
            elif target and target.startswith("statetool.backends") and target not in STORAGE_INTERFACE:
                offenders.append(f"{_where(files, importer, item)}: {importer} imports {item.name} "
                                 f"(concrete backend module {target})")
    assert not offenders, ("code above storage sees a backend (allowed from statetool/backends/: "
                           f"{', '.join(sorted(STORAGE_INTERFACE))}):\n" + "\n".join(offenders))


# -- (d) README's first block ----------------------------------------------------------


def test_readme_first_block_installs_and_runs_the_main_job_then_the_tests() -> None:
    text = README.read_text()
    assert text.startswith("# statetool\n")
    first = markdown.parse(text, README.name).blocks[0]
    lines = [line for line in first.code.splitlines() if line.strip()]
    assert first.info == "sh"
    assert len(lines) == 2, f"README's first block should hold exactly two commands, has {len(lines)}"
    installs = re.compile(r"pip (--python \S+ )?install ")
    assert installs.search(lines[0]) and "examples/main-job.sh" in lines[0], lines[0]
    assert installs.search(lines[1]) and "pytest" in lines[1], lines[1]


def _main_job_steps(stdout: str) -> dict[int, str]:
    """``{step number: the step's output}`` of the main job: each step opens with its
    comment line ``# N. what you are looking at``, then its command line ``$ …``."""
    parts = re.split(r"^# (\d+)\. .*$", stdout, flags=re.M)
    steps = {int(number): body for number, body in zip(parts[1::2], parts[2::2])}
    for number, body in steps.items():
        assert body.lstrip("\n").startswith("$ "), f"step {number} does not show its command first:\n{body}"
    return steps


def _gone(pid: int) -> bool:
    """True when process ``pid`` has ended (reaped, or a zombie waiting to be)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_main_job_tells_the_story_and_leaves_nothing_running(tmp_path: Path, guide_shell: dict[str, str]) -> None:
    """examples/main-job.sh as README's first command runs it (bash, with statetool and
    the package's python on PATH), on a copy of examples/: it exits 0, each step shows
    its comment and its command, and the story's facts are what statetool printed: the
    upgrade is pending, then done; doctor's FIRST RUN for the export whose checkpoint
    was lost, with its code; the live lease of the background run and its holder, the
    same holder the refused second run names; the lease free once the run ended; after
    the fix every export resumes. Neither the holder nor its command is left running."""
    examples = tmp_path / "examples"
    examples.mkdir()
    for name in ("main-job.sh", "rivet.yaml"):
        shutil.copy(ROOT / "examples" / name, examples / name)
    env = {k: v for k, v in os.environ.items() if k != "RIVET_STATE_URL"}
    env.update({**guide_shell, "COLUMNS": "200", "NO_COLOR": "1"})
    # stderr into stdout, as on the operator's terminal: errors and warnings stay in their step
    proc = subprocess.run(["bash", str(examples / "main-job.sh")], cwd=tmp_path, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode == 0, describe(proc)
    steps = _main_job_steps(proc.stdout)
    assert sorted(steps) == list(range(1, 10)), describe(proc)

    assert "RIVET_STATE_MIGRATION_PENDING" in steps[2] and "(exit 3)" in steps[2], steps[2]
    assert "from legacy to" in steps[3] and ".rivet_state.db.backup-legacy-" in steps[3], steps[3]
    first_runs = re.findall(r"^(\S+) \(\w+\): FIRST RUN$", steps[5], re.M)
    assert first_runs == ["order_events"], steps[5]
    assert "[RIVET_STATE_CHECKPOINT_MISSING]" in steps[5] and "(exit 5)" in steps[5], steps[5]

    refused = re.search(r"RIVET_STATE_RUN_IN_PROGRESS\]: lease chunk-run:orders is held by pid (\d+) "
                        r"\(command pid (\d+)\)", steps[7])
    assert refused and "(exit 2)" in steps[7], steps[7]
    holder, command = (int(pid) for pid in refused.groups())
    live = [line for line in steps[6].splitlines() if re.search(r"\blive\b", line)]
    assert live and "chunk-run:orders" in live[0] and str(holder) in live[0] and "sleep 30" in live[0], steps[6]
    assert "(the run ended with exit 143)" in steps[8] and not re.search(r"\blive\b", steps[8]), steps[8]

    assert "FIRST RUN" not in steps[9] and "order_events (cdc): resumes from CDC position" in steps[9], steps[9]
    assert _gone(holder) and _gone(command), f"left running: holder {holder}, command {command}"
    leases = run_cli("--json", "leases", cwd=examples)
    assert {row["state"] for row in json.loads(leases.stdout)["leases"]} == {"free"}, describe(leases)
