"""Help that helps, and usage errors that say what was expected (issue 12 item 6).

Every rule is checked over the whole command tree (walked from the typer app), not
command by command: whole summaries in an 80-column terminal, the global options in
every subcommand's help, a named value (``SECONDS``) for every parameter instead of a
raw type, examples where the issue asks for them, the ``--`` hint for a value that
starts with ``-``, and a bare group as ``RIVET_CLI_USAGE`` with its commands on stderr.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import typer
import typer.main

from support import describe, error_object, run_cli, run_cli_forked, tree_digest, write_config
from statetool.cli import app, command_tree, global_options

#: An 80-column terminal, as the issue's operator has.
NARROW = {"COLUMNS": "80"}


def _tree(root: Any) -> list[tuple[tuple[str, ...], Any]]:
    """``root`` and every command and group below it, depth first: ``[(path, click command)]``."""
    found: list[tuple[tuple[str, ...], Any]] = []

    def walk(command: Any, path: tuple[str, ...]) -> None:
        found.append((path, command))
        for name, sub in (getattr(command, "commands", None) or {}).items():
            walk(sub, (*path, name))

    walk(root, ())
    return found


#: The tree as the CLI runs it (:func:`statetool.cli.command_tree`, lazy: walking it builds
#: every command).
TREE = _tree(command_tree())
SUBCOMMANDS = [(path, command) for path, command in TREE if path]


def _ids(items: list[tuple[tuple[str, ...], Any]]) -> list[str]:
    return [" ".join(path) or "statetool" for path, _ in items]


@functools.cache
def _help(*path: str) -> str:
    """``statetool PATH --help`` in an 80-column terminal, read once per command. In a
    process of its own (forked, no start-up): typer's in-process test isolation forces help
    to 80 columns, where a real terminal of 80 gets 78."""
    proc = run_cli_forked(*path, "--help", env=NARROW)
    assert proc.returncode == 0 and not proc.stderr, describe(proc)
    return proc.stdout


def _summary(command: Any) -> str:
    """A command's one-line summary: the first paragraph of its help, on one line."""
    return " ".join(command.help.split("\n\n", 1)[0].split())


def _section(text: str, heading: str) -> str:
    """The lines of help section ``heading`` (up to the next blank line)."""
    start = text.index(f"\n{heading}:\n") + len(heading) + 3
    return text[start:].split("\n\n", 1)[0]


def _shape(command: Any) -> tuple[Any, ...]:
    """What parsing, help and invoking read of a click command: its class, its settings and
    each parameter's (everything but the callback, a wrapper made anew by each build)."""
    params = [(type(p).__name__, p.name, p.opts, p.secondary_opts, p.metavar, getattr(p, "help", None), p.required,
               repr(p.default), p.nargs, p.multiple, p.is_eager, getattr(p, "is_flag", None),
               type(p.type).__name__, repr(sorted(vars(p.type).items())),
               p.callback is None, p.expose_value, p.hidden if hasattr(p, "hidden") else None) for p in command.params]
    return (type(command).__name__, command.name, command.help, command.short_help, command.epilog, command.hidden,
            command.deprecated, command.no_args_is_help, command.add_help_option, command.options_metavar,
            command.context_settings, getattr(command, "invoke_without_command", None),
            getattr(command, "subcommand_metavar", None), getattr(command, "suggest_commands", None), params)


def test_the_lazy_tree_the_cli_runs_is_the_tree_typer_builds() -> None:
    """issue 13 item 5: the CLI converts a command when it is looked up
    (``cli_help.lazy_command_tree``), and what it converts is what typer's own
    ``get_command`` makes of the app, command for command, parameter for parameter."""
    eager = _tree(typer.main.get_command(app))
    assert [path for path, _ in TREE] == [path for path, _ in eager]
    for (path, lazy), (_, built) in zip(TREE, eager):
        assert _shape(lazy) == _shape(built), f"statetool {' '.join(path)} differs from typer's own build"


@pytest.mark.parametrize(("path", "group"), [(p, c) for p, c in TREE if getattr(c, "commands", None)],
                         ids=_ids([(p, c) for p, c in TREE if getattr(c, "commands", None)]))
def test_every_commands_summary_shows_whole_in_an_80_column_terminal(path: tuple[str, ...], group: Any) -> None:
    text = _help(*path)
    listing = _section(text, "Commands")
    for name, command in group.commands.items():
        summary = _summary(command)
        assert re.search(rf"^  {re.escape(name)} +{re.escape(summary)}$", listing, re.M), \
            f"statetool {' '.join(path)} --help cuts or wraps the summary of {name!r} ({summary!r}):\n{listing}"
    assert "..." not in listing, listing
    assert all(len(line) <= 80 for line in text.splitlines()), text


GROUPS = [(p, c) for p, c in TREE if getattr(c, "commands", None)]


@pytest.mark.parametrize("columns", [52, 80])
@pytest.mark.parametrize(("path", "group"), GROUPS, ids=_ids(GROUPS))
def test_a_groups_listing_is_the_one_clicks_write_dl_makes(path: tuple[str, ...], group: Any, columns: int) -> None:
    """``Group.format_commands`` writes a listing whose rows all fit one line without click's
    wrapping (issue 13 item 5): the ``statetool GROUP --help`` printed is, line for line,
    what typer's listing written by click's ``write_dl`` would be."""
    proc = run_cli_forked(*path, "--help", env={"COLUMNS": str(columns)})
    assert proc.returncode == 0, describe(proc)
    formatter = typer.Context(group, terminal_width=max(min(columns, 80) - 2, 50)).make_formatter()
    limit = formatter.width - 6 - max(len(name) for name in group.commands)
    with formatter.section("Commands"):
        formatter.write_dl([(name, sub.get_short_help_str(limit)) for name, sub in group.commands.items()])
    assert f"\n{formatter.getvalue()}" in proc.stdout, describe(proc)


@pytest.mark.parametrize(("path", "command"), SUBCOMMANDS, ids=_ids(SUBCOMMANDS))
def test_every_subcommands_help_lists_every_global_option_and_fits_80_columns(path: tuple[str, ...],
                                                                              command: Any) -> None:
    text = _help(*path)
    listed = _section(text, "Global options (before or after the command name)")
    for option in global_options():
        assert re.search(rf"(^|[ ,]){re.escape(option)}\b", listed, re.M), \
            f"statetool {' '.join(path)} --help does not list the global option {option}:\n{listed}"
    assert all(len(line) <= 80 for line in text.splitlines()), text


def test_the_global_options_are_the_ones_main_options_declares_and_hoisting_moves() -> None:
    assert global_options() == {"--config": True, "-c": True, "--state-url": True, "--json": False,
                                "--json-errors": False, "--lock-wait": True, "--debug": False, "--version": False}


@pytest.mark.parametrize(("path", "command"), TREE, ids=_ids(TREE))
def test_every_value_is_named_and_no_help_shows_a_raw_type(path: tuple[str, ...], command: Any) -> None:
    for param in command.params:
        if getattr(param, "is_flag", False):
            continue
        assert param.metavar and param.metavar.isupper(), \
            f"statetool {' '.join(path)}: {param.name} takes a value but names it by its type, not a metavar"
    text = _help(*path)
    raw = re.findall(r"<[a-z][a-z ]*>|\b(?:TEXT|INTEGER|FLOAT|BOOLEAN)\b|\{[a-z_]+\}", text)
    assert not raw, f"statetool {' '.join(path)} --help shows raw types {raw}:\n{text}"


EXAMPLES = {
    ("migrate",): ["statetool migrate --dry-run", "statetool migrate"],
    ("relocate",): ["statetool relocate --to /srv/rivet/state --dry-run", "RIVET_STATE_URL=sqlite:/srv/rivet/state"],
    ("transfer",): ["statetool transfer --to-env PG_URL --dry-run"],
    ("leases", "run"): ["statetool leases run --export orders -- rivet run orders"],
    ("exports", "set-cursor"): ["statetool exports set-cursor orders 2026-01-01T00:00:00Z",
                                "statetool exports set-cursor orders -- -5"],
}


@pytest.mark.parametrize("path", list(EXAMPLES), ids=[" ".join(p) for p in EXAMPLES])
def test_examples_appear_whole_each_on_a_line_of_its_own(path: tuple[str, ...]) -> None:
    examples = _section(_help(*path), "Examples")
    lines = [line.strip() for line in examples.splitlines()]
    for line in EXAMPLES[path]:
        assert line in lines, f"statetool {' '.join(path)} --help lacks the example {line!r}:\n{examples}"


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A state at head beside its config; tests that change it copy nothing back."""
    config = write_config(tmp_path_factory.mktemp("help") / "pipeline")
    proc = run_cli("-c", str(config), "init")
    assert proc.returncode == 0, describe(proc)
    return config


def test_a_cursor_value_starting_with_a_dash_is_refused_with_the_line_that_works(state: Path) -> None:
    before = tree_digest(state.parent)
    proc = run_cli("-c", str(state), "--json-errors", "exports", "set-cursor", "orders", "-5")
    err = error_object(proc)
    assert (proc.returncode, err["code"]) == (1, "RIVET_CLI_USAGE"), describe(proc)
    assert f"put -- before it: statetool -c {state} --json-errors exports set-cursor orders -- -5" in err["message"]
    assert "Usage: statetool exports set-cursor [OPTIONS] NAME VALUE" in err["message"], err
    assert tree_digest(state.parent) == before

    proc = run_cli("-c", str(state), "exports", "set-cursor", "orders", "--", "-5")
    assert proc.returncode == 0, describe(proc)
    shown = run_cli("-c", str(state), "--json", "exports", "show", "orders")
    assert json.loads(shown.stdout)["export"]["cursor"] == "-5", describe(shown)


@pytest.mark.parametrize(("args", "hint"), [
    (("exports", "show", "-orders"), "statetool --json-errors exports show -- -orders"),
    (("leases", "release", "-x"), "statetool --json-errors leases release -- -x"),
    (("leases", "run", "--export", "orders", "-x"), "statetool --json-errors leases run --export orders -- -x"),
    (("exports", "set-cursor", "orders", "-5", "--reason", "x"), "statetool exports set-cursor [OPTIONS] -- VALUE"),
    (("info", "-x"), None),  # a command that takes no value: an option it is, and no hint
    (("identity", "rekey", "--olt", "k"), None),
])
def test_an_unknown_option_hints_at_dash_dash_wherever_the_command_takes_a_value(
        tmp_path: Path, args: tuple[str, ...], hint: str | None) -> None:
    proc = run_cli("--json-errors", *args, cwd=tmp_path)
    err = error_object(proc)
    assert (proc.returncode, err["code"]) == (1, "RIVET_CLI_USAGE"), describe(proc)
    assert "No such option" in err["message"], err
    if hint is None:
        assert " -- " not in err["message"], err
    else:
        assert hint in err["message"], err


@pytest.mark.parametrize(("args", "usage"), [
    (("relocate",), "Usage: statetool relocate [OPTIONS]"),
    (("exports", "show"), "Usage: statetool exports show [OPTIONS] NAME"),
    (("leases", "release", "a", "b"), "Usage: statetool leases release [OPTIONS] KEY"),
    (("--lock-wait", "-1", "info"), "Usage: statetool [OPTIONS] COMMAND [ARGS]..."),
    (("infoo",), "Usage: statetool [OPTIONS] COMMAND [ARGS]..."),
    (("transfer",), "Usage: statetool transfer [OPTIONS]"),  # neither --to nor --to-env: the command says so
    (("leases", "run", "--export", "orders"), "Usage: statetool leases run [OPTIONS] [COMMAND]..."),
])
def test_a_usage_error_shows_the_usage_line_of_its_command(tmp_path: Path, args: tuple[str, ...],
                                                           usage: str) -> None:
    proc = run_cli(*args, cwd=tmp_path)
    assert proc.returncode == 1 and proc.stdout == "", describe(proc)
    assert "Error [RIVET_CLI_USAGE]" in proc.stderr and f"\n{usage}\n" in proc.stderr, describe(proc)


@pytest.mark.parametrize("group", [("identity",), ("exports",), ()], ids=["identity", "exports", "statetool"])
def test_a_group_without_its_command_is_a_usage_error_listing_its_commands_on_stderr(
        tmp_path: Path, group: tuple[str, ...]) -> None:
    proc = run_cli(*group, cwd=tmp_path)
    assert proc.returncode == 1 and proc.stdout == "", describe(proc)
    command = dict(TREE)[group]
    assert f"Usage: {' '.join(('statetool', *group))} [OPTIONS] COMMAND" in proc.stderr, describe(proc)
    for name, sub in command.commands.items():
        assert re.search(rf"^  {re.escape(name)} +{re.escape(_summary(sub))}$", proc.stderr, re.M), describe(proc)
    err = error_object(run_cli("--json-errors", *group, cwd=tmp_path))
    assert (err["code"], err["exit_code"]) == ("RIVET_CLI_USAGE", 1), err


def test_leases_without_a_command_still_lists_the_leases(state: Path) -> None:
    proc = run_cli("-c", str(state), "--json", "leases")
    assert proc.returncode == 0 and set(json.loads(proc.stdout)) == {"leases"}, describe(proc)
