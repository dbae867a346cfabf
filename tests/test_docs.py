"""The docs cannot rot: every command, option, error code and JSON key is documented, the
links resolve, the layering in docs/architecture.md holds, and the upgrade runbook's
shell blocks run for real and exit as the guide says.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer.main

from support import describe, error_object, run_cli, write_config
from statetool.cli import app
from statetool.errors import EXIT_CODES, REGISTRY, WARNINGS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
COMMANDS_MD = DOCS / "commands.md"
ERRORS_MD = DOCS / "errors.md"
ARCHITECTURE_MD = DOCS / "architecture.md"
GUIDE = DOCS / "setup-guides" / "upgrading-a-state.md"
README = ROOT / "README.md"
PACKAGE = ROOT / "statetool"

_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^```(\S*)\s*$")


# -- markdown helpers -----------------------------------------------------------------


def prose(text: str) -> str:
    """The text without its fenced blocks."""
    kept: list[str] = []
    inside = False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            inside = not inside
        elif not inside:
            kept.append(line)
    return "\n".join(kept)


def sections(text: str) -> dict[str, str]:
    """``{heading text without backticks: body}``; a body runs until the next heading of
    the same or a higher level, so a section includes its subsections."""
    heads: list[tuple[int, int, str]] = []
    lines = text.splitlines()
    inside = False
    for i, line in enumerate(lines):
        if line.strip().startswith("```"):
            inside = not inside
            continue
        match = None if inside else _HEADING.match(line)
        if match:
            heads.append((i, len(match.group(1)), match.group(2).replace("`", "")))
    out: dict[str, str] = {}
    for n, (start, level, title) in enumerate(heads):
        end = next((s for s, lv, _ in heads[n + 1:] if lv <= level), len(lines))
        out[title] = "\n".join(lines[start + 1:end])
    return out


def slug(title: str) -> str:
    """GitHub's anchor for a heading: lower-case, punctuation dropped, spaces to hyphens."""
    text = title.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def fenced_blocks(text: str) -> list[tuple[str, str, str]]:
    """``[(info string, h2 heading above it, code)]`` of every fenced block, in order."""
    blocks: list[tuple[str, str, str]] = []
    h2 = ""
    current: list[str] | None = None
    info = ""
    for line in text.splitlines():
        stripped = line.strip()
        if current is not None:
            if stripped == "```":
                blocks.append((info, h2, "\n".join(current)))
                current = None
            else:
                current.append(line)
            continue
        fence = _FENCE.match(stripped)
        if fence:
            info, current = fence.group(1), []
        elif line.startswith("## "):
            h2 = line[3:].strip()
    assert current is None, "an unclosed fenced block"
    return blocks


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

    walk(typer.main.get_command(app), ())
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
    root = typer.main.get_command(app)
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
    ]
    for path, args, expected in runs:
        proc = run_cli("-c", str(config), "--json", *args)
        assert proc.returncode == expected, describe(proc)
        _assert_json_keys_documented(path, proc)


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
    row = re.search(rf"^\| `{code}` \| (\w+) \| (\d) \| (yes|no) \| (yes|added) \|$", ERRORS_MD.read_text(), re.M)
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


# -- links and layering -----------------------------------------------------------------


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


@pytest.mark.parametrize("page", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(page.read_text())):
        if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        assert dest.exists(), f"{page.name}: link to {target} points at nothing"
        if anchor and dest.suffix == ".md":
            anchors = {slug(title) for title in sections(dest.read_text())}
            assert anchor in anchors, f"{page.name}: no heading in {dest.name} for #{anchor}"


LAYERS = ("facts", "storage", "operations", "faces")


def _layer_table() -> dict[str, list[str]]:
    table: dict[str, list[str]] = {}
    for line in ARCHITECTURE_MD.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0] in LAYERS:
            table[cells[0]] = re.findall(r"`([^`]+)`", cells[1])
    assert set(table) == set(LAYERS), f"docs/architecture.md's layer table lists {sorted(table)}"
    return table


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def test_every_module_sits_in_one_layer_and_imports_only_downward() -> None:
    table = _layer_table()
    files = [p for p in sorted(PACKAGE.rglob("*.py")) if "_alembic" not in p.parts]
    layer_of: dict[str, int] = {}
    for path in files:
        rel = path.relative_to(PACKAGE).as_posix()
        places = [LAYERS.index(layer) for layer, entries in table.items()
                  for entry in entries if rel == entry or (entry.endswith("/") and rel.startswith(entry))]
        assert len(places) == 1, f"statetool/{rel} is placed in {len(places)} layers of docs/architecture.md"
        layer_of[_module_of(path)] = places[0]

    def target_layer(name: str) -> int | None:
        while name and name not in layer_of:
            name = name.rpartition(".")[0]
        return layer_of.get(name)

    wrong = []
    for path in files:
        importer = _module_of(path)
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                if not name.startswith("statetool"):
                    continue
                got = target_layer(name)
                if got is not None and got > layer_of[importer]:
                    wrong.append(f"{importer} ({LAYERS[layer_of[importer]]}) imports {name} ({LAYERS[got]})")
    assert not wrong, "imports against the layering of docs/architecture.md:\n" + "\n".join(wrong)


# -- (c) the upgrade runbook runs for real ---------------------------------------------


def _guide_blocks(postgres: bool) -> list[str]:
    blocks = fenced_blocks(GUIDE.read_text())
    assert blocks, "the upgrade guide has no command blocks"
    assert {info for info, _, _ in blocks} == {"sh"}, "every block of the upgrade guide is a runnable ```sh block"
    return [code for _, h2, code in blocks if ("PostgreSQL" in h2) == postgres]


def _guide_env(state_url: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RIVET_STATE_URL"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update({"COLUMNS": "120", "NO_COLOR": "1"})
    if state_url is not None:
        env["RIVET_STATE_URL"] = state_url
    return env


def _run_blocks(blocks: list[str], cwd: Path, env: dict[str, str]) -> None:
    for n, code in enumerate(blocks, 1):
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=env, text=True,
                              capture_output=True, timeout=300)
        assert proc.returncode == 0, f"block {n} of {GUIDE.name} failed:\n{code}\n{describe(proc)}"


def _pipeline_dir(tmp_path: Path) -> Path:
    work = tmp_path / "pipeline"
    work.mkdir()
    shutil.copy(ROOT / "examples" / "rivet.yaml", work / "rivet.yaml")
    return work


def test_upgrade_guide_sqlite_blocks_run_in_order(tmp_path: Path) -> None:
    work = _pipeline_dir(tmp_path)
    subprocess.run([sys.executable, "-m", "statetool.example", "--config", "rivet.yaml", "--runs", "2000"],
                   cwd=work, check=True, capture_output=True)
    env = _guide_env(None)
    _run_blocks(_guide_blocks(postgres=False), work, env)
    # The guide ends by restoring the legacy backup: the state is legacy again, complete.
    proc = run_cli("--json", "info", cwd=work)
    assert proc.returncode == 0, describe(proc)
    doc = json.loads(proc.stdout)
    assert doc["revision"]["status"] == "legacy"
    assert sum(e["runs_total"] for e in doc["exports"]) == 2000
    assert (work / "replaced" / ".rivet_state.db").is_file()


@pytest.mark.postgres
def test_upgrade_guide_postgres_blocks_run_in_order(tmp_path: Path, pg_url: str) -> None:
    work = _pipeline_dir(tmp_path)
    env = {"RIVET_STATE_URL": pg_url}
    # A shared state as the previous release left it: revision 0002.
    for args in (["init"], ["migrate", "--to", "0002", "--allow-data-loss"]):
        proc = run_cli(*args, cwd=work, env=env)
        assert proc.returncode == 0, describe(proc)
    _run_blocks(_guide_blocks(postgres=True), work, _guide_env(pg_url))
    assert "COMMIT;" in (work / "upgrade.sql").read_text()
    proc = run_cli("--json", "revisions", cwd=work, env=env)
    assert json.loads(proc.stdout)["current"] == "0002", describe(proc)


# -- (d) README's first block ----------------------------------------------------------


def test_readme_first_block_installs_and_runs_the_main_job_then_the_tests() -> None:
    text = README.read_text()
    assert text.startswith("# statetool\n")
    info, _, code = fenced_blocks(text)[0]
    lines = [line for line in code.splitlines() if line.strip()]
    assert info == "sh"
    assert len(lines) == 2, f"README's first block should hold exactly two commands, has {len(lines)}"
    assert "pip install" in lines[0] and "examples/main-job.sh" in lines[0]
    assert "pip install" in lines[1] and "pytest" in lines[1]


def _import_graph() -> dict[str, set[str]]:
    """Module -> the statetool modules it imports anywhere: at the top, inside functions,
    under ``TYPE_CHECKING``. A function-local import is still an edge: moving an import
    into a function hides a cycle from the interpreter, not from the design."""
    files = {_module_of(p): p for p in sorted(PACKAGE.rglob("*.py")) if "_alembic" not in p.parts}

    def owner(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            edges |= {t for t in map(owner, (n for n in names if n.startswith("statetool"))) if t and t != module}
        graph[module] = edges
    return graph


def test_the_package_has_no_import_cycle_not_even_through_function_local_imports() -> None:
    graph = _import_graph()
    assert "statetool.operations.leasing" in graph and graph["statetool.operations.writes"], "graph not read"
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)
