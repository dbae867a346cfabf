"""How the command line explains itself: help pages and usage errors (issue 12 item 6).

- A subcommand's help ends with its examples and with the global options it accepts.
  The examples are the command's ``epilog``, printed line for line under "Examples:"
  (a line to copy is never rewrapped); the global options are the root command's own
  declarations (``cli.main_options``), so no command repeats them.
- Arguments show their metavar (``NAME``), never a type (``<str>``), under "Arguments:"
  and in the usage line, where a required one is ``NAME`` and an optional one ``[NAME]``.
- A parser error becomes ``RIVET_CLI_USAGE`` (:func:`usage_error`) with the usage line of
  the command it was for, a hint at ``--`` when a command that takes values met an
  unknown option (a value starting with ``-``: ``exports set-cursor orders -- -5``), and,
  for a group typed without its command, the commands it has. A ``RIVET_CLI_USAGE`` that
  a command raises itself gets its usage line too (:meth:`Command.invoke`).

typer's own classes do the rest; :class:`App` makes every command and group of the app
use these. :func:`lazy_command_tree` builds the click tree lazily (issue 13 item 5): a
command is converted from its function when it is first looked up, and a group lists its
commands from their registrations, so ``statetool --help`` converts only the root's options.
"""

import copy
import functools
import inspect
from collections.abc import Callable, Iterator, MutableMapping
from gettext import gettext
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup
from typer.main import get_command_from_info, get_command_name, get_group_from_info, solve_typer_info_defaults
from typer.models import TyperInfo

from statetool.errors import StateError

#: The heading of the global options' section in a subcommand's help.
GLOBAL_HEADING = "Global options (before or after the command name)"


def _argument_name(param: Any) -> str:
    """An argument as help shows it: its metavar (or its name in capitals), ``...`` when it
    takes several values."""
    name = param.metavar or param.name.upper()
    return f"{name}..." if param.nargs != 1 else name


def _format_examples(command: Any, formatter: Any) -> None:
    """The command's ``epilog`` under "Examples:", each line as written (indented, never
    rewrapped, so a command line stays whole to copy)."""
    if not command.epilog:
        return
    with formatter.section("Examples"):
        for line in inspect.cleandoc(command.epilog).splitlines():
            formatter.write(f"{'':{formatter.current_indent}}{line}\n" if line.strip() else "\n")


def _format_globals(ctx: Any, formatter: Any) -> None:
    """The global options (the root command's parameters) with their help, in the help of
    every command below the root; the root lists them as its own options already."""
    root = ctx.find_root()
    if root is ctx:
        return
    rows = [record for param in root.command.params if (record := param.get_help_record(root)) is not None]
    with formatter.section(GLOBAL_HEADING):
        formatter.write_dl(rows)


class Command(TyperCommand):
    """A command whose help shows argument metavars, then its examples and the global options."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        """``[OPTIONS] NAME VALUE`` (``[NAME]`` when optional), instead of typer's ``{name}``."""
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name != "argument":
                pieces.extend(param.get_usage_pieces(ctx))
            elif param.required:
                pieces.append(_argument_name(param))
            else:
                pieces.append(f"[{_argument_name(param).removesuffix('...')}]" + ("..." if param.nargs != 1 else ""))
        return pieces

    def format_options(self, ctx: Any, formatter: Any) -> None:
        """"Arguments:" (by metavar, with their help and extras) and "Options:"."""
        arguments, options = [], []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                arguments.append((_argument_name(param), record[1]))
            else:
                options.append(record)
        for heading, rows in (("Arguments", arguments), ("Options", options)):
            if rows:
                with formatter.section(heading):
                    formatter.write_dl(rows)

    def format_epilog(self, ctx: Any, formatter: Any) -> None:
        """Examples, then the global options."""
        _format_examples(self, formatter)
        _format_globals(ctx, formatter)

    def invoke(self, ctx: Any) -> Any:
        """Run the command. A ``RIVET_CLI_USAGE`` it raises (what the parser cannot judge:
        an empty cursor, no command after ``--``, ``--to`` and ``--to-env`` together) ends
        with the command's usage line, as the parser's own errors do."""
        try:
            return super().invoke(ctx)
        except StateError as err:
            if err.code != "RIVET_CLI_USAGE":
                raise
            raise StateError(err.code, f"{err.message}\n{ctx.get_usage()}", err.details) from err


class _Pending:
    """A command not converted yet: how to describe it to a group's listing, and how to
    build it (a plain class: a ``NamedTuple`` class would cost about 0.1 ms at every start-up)."""

    __slots__ = ("describe", "build")

    def __init__(self, describe: Callable[[], Command], build: Callable[[], Any]) -> None:
        self.describe = describe
        self.build = build


class LazyCommands(MutableMapping[str, Any]):
    """A group's commands by name, in the order they were registered. A command added with
    :meth:`defer` is built on its first lookup and kept; iterating over the names builds
    nothing, and :meth:`listing` answers what a group's listing needs without building."""

    def __init__(self, commands: dict[str, Any]) -> None:
        self._commands: dict[str, Any] = dict(commands)

    def defer(self, name: str, describe: Callable[[], Command], build: Callable[[], Any]) -> None:
        """Register ``name``, built by ``build()`` when first looked up; until then a
        group's listing shows ``describe()``, a stand-in with the command's help, short
        help, hidden and deprecated, and nothing else."""
        self._commands[name] = _Pending(describe, build)

    def listing(self, name: str) -> Any:
        """The command ``name`` as a listing needs it: the command once built, else its
        stand-in. Raises ``KeyError`` for an unknown name."""
        found = self._commands[name]
        return found.describe() if isinstance(found, _Pending) else found

    def __getitem__(self, name: str) -> Any:
        found = self._commands[name]
        if isinstance(found, _Pending):
            found = self._commands[name] = found.build()
        return found

    def __setitem__(self, name: str, command: Any) -> None:
        self._commands[name] = command

    def __delitem__(self, name: str) -> None:
        del self._commands[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._commands)

    def __len__(self) -> int:
        return len(self._commands)


class Group(TyperGroup):
    """A command group whose help ends with its examples and the global options (below the
    root), and whose commands are :class:`LazyCommands`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.commands = LazyCommands(dict(self.commands))

    def list_commands(self, ctx: Any) -> list[str]:
        """The commands' names in the order they were registered, as typer's, building none."""
        return list(self.commands)

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        """typer's "Commands:" listing (name and short help, hidden ones left out), read
        from :meth:`LazyCommands.listing`: listing a group builds none of its commands."""
        commands = [(name, command) for name in self.list_commands(ctx)
                    if not (command := self.commands.listing(name)).hidden]
        if not commands:
            return
        limit = formatter.width - 6 - max(len(name) for name, _ in commands)
        with formatter.section(gettext("Commands")):
            _write_listing(formatter, [(name, command.get_short_help_str(limit)) for name, command in commands])

    def format_epilog(self, ctx: Any, formatter: Any) -> None:
        """Examples, then the global options."""
        _format_examples(self, formatter)
        _format_globals(ctx, formatter)


def _write_listing(formatter: Any, rows: list[tuple[str, str]]) -> None:
    """``formatter.write_dl(rows)`` for a group's listing, without click's wrapping of each
    row where no row needs it (a third of a millisecond of ``statetool --help``): typer cuts
    each summary to fit its line, so when every name fits click's first column (30) and every
    summary is one plain line that fits the second, the rows are written as ``write_dl``
    writes them; any other listing goes through ``write_dl``."""
    name_width = max(len(name) for name, _ in rows)
    first_col = name_width + 2
    text_width = max(formatter.width - first_col - 2, 10)
    plain = name_width <= 30 and all(text and len(text) <= text_width and text == " ".join(text.split())
                                     and "\x1b" not in name + text and "\b" not in text for name, text in rows)
    if not plain:
        formatter.write_dl(rows)
        return
    for name, text in rows:
        formatter.write(f"{'':>{formatter.current_indent}}{name:<{first_col}}{text}\n")


class App(typer.Typer):
    """A typer app whose groups are :class:`Group` and whose commands are :class:`Command`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cls=Group, **kwargs)

    def command(self, name: str | None = None, **kwargs: Any) -> Any:
        """typer's ``command`` decorator, with :class:`Command` unless another class is given."""
        kwargs.setdefault("cls", Command)
        return super().command(name, **kwargs)


def _group(info: TyperInfo, settings: dict[str, Any]) -> Group:
    """The click group of ``info``'s typer app, its commands and groups deferred
    (:meth:`LazyCommands.defer`). typer's ``get_group_from_info`` builds the group itself
    from a copy of the app without commands, so every group setting is solved as typer
    solves it; ``settings`` are its keyword arguments, handed down to every level."""
    app = info.typer_instance
    bare_app = copy.copy(app)
    bare_app.registered_commands, bare_app.registered_groups = [], []
    bare = copy.copy(info)
    bare.typer_instance = bare_app
    group = get_group_from_info(bare, **settings)
    convert = {k: v for k, v in settings.items() if k != "suggest_commands"}
    for command in app.registered_commands:
        name = command.name or get_command_name(command.callback.__name__)
        group.commands.defer(name, functools.partial(_describe_command, name, command),
                             functools.partial(get_command_from_info, command, **convert))
    for sub in app.registered_groups:
        solved = solve_typer_info_defaults(sub)
        if not solved.name:
            raise TypeError("a group added with add_typer needs a name (typer would merge its commands)")
        group.commands.defer(solved.name, functools.partial(_describe, solved.name, solved, solved.help),
                             functools.partial(_group, sub, settings))
    return group


def _describe(name: str, info: Any, doc: str | None) -> Command:
    """A stand-in for the command or group ``name`` registered as ``info`` (a
    ``CommandInfo``, or a solved ``TyperInfo``) with the help ``doc``: what a listing
    reads, and nothing else."""
    return Command(name, help=doc, short_help=info.short_help, hidden=info.hidden, deprecated=info.deprecated)


def _describe_command(name: str, command: Any) -> Command:
    """:func:`_describe` for a command: its help as typer's ``get_command_from_info`` takes
    it (the ``help=`` it was registered with, cleaned, else its function's docstring)."""
    doc = inspect.cleandoc(command.help) if command.help is not None else inspect.getdoc(command.callback)
    return _describe(name, command, doc)


def lazy_command_tree(app: typer.Typer) -> Group:
    """The click command tree of ``app``, as ``typer.main.get_command(app)`` builds it, but
    lazy: a command's function is converted to its click command (typer's
    ``get_command_from_info``: its signature and type hints read) when the command is first
    looked up, a group's when it is first looked up, so ``statetool --help`` converts the
    root's options alone (issue 13 item 5). The root is always a group (typer makes one
    for an app with a callback, as statetool's has), and typer's completion options are not
    added (statetool's app has ``add_completion=False``)."""
    return _group(TyperInfo(app), {"pretty_exceptions_short": app.pretty_exceptions_short,
                                   "rich_markup_mode": app.rich_markup_mode, "suggest_commands": app.suggest_commands})


def _dash_dash_hint(ctx: Any, token: str, args: list[str]) -> str:
    """The hint for an unknown option ``token`` met by a command that takes values: a value
    that starts with ``-`` goes after ``--``. When nothing after ``token`` looks like an
    option, the corrected line itself (redacted, shell-quoted): ``args`` with ``--`` put
    before ``token``."""
    at = args.index(token) if token in args else -1
    if at < 0 or any(arg.startswith("-") for arg in args[at + 1:]):
        return (f"if {token} is a value, not an option, put -- before it, after the options: "
                f"{ctx.command_path} [OPTIONS] -- VALUE")
    from statetool.redact import command_line  # loads on a usage error, not at start-up (issue 13 item 5)

    corrected = command_line(["statetool", *args[:at], "--", *args[at:]])
    return f"if {token} is a value, not an option, put -- before it: {corrected}"


def _offending_token(option: str, args: list[str]) -> str:
    """The argument as typed that holds the unknown option ``option`` (the parser names
    ``-5`` for ``-5000``, ``--x`` for ``--x=1``); ``option`` itself when none does."""
    for arg in args:
        if arg == "--":
            break
        if arg == option or arg.startswith(f"{option}=") or (not option.startswith("--") and arg.startswith(option)
                                                             and not arg.startswith("--")):
            return arg
    return option


def usage_error(exc: Exception, args: list[str]) -> StateError:
    """``RIVET_CLI_USAGE`` for an error of the argument parser (docs/errors.md), ``args``
    being the command line as parsed (global options in front).

    The message is the parser's own, then (when the parser knows the command) that
    command's usage line: a group typed without its command says so and lists its
    commands; an unknown option of a command that takes values (arguments) adds the hint
    that a value starting with ``-`` needs ``--`` before it (:func:`_dash_dash_hint`).
    """
    ctx = getattr(exc, "ctx", None)
    if ctx is None:
        return StateError("RIVET_CLI_USAGE", getattr(exc, "format_message", lambda: str(exc))())
    command = ctx.command
    if type(exc).__name__ == "NoArgsIsHelpError":  # a bare group: what it needs, and what it has
        listing = ctx.make_formatter()
        command.format_commands(ctx, listing)
        return StateError("RIVET_CLI_USAGE", f"{ctx.command_path} needs a command\n{ctx.get_usage()}\n"
                          f"{listing.getvalue().rstrip()}")
    message = exc.format_message()  # type: ignore[attr-defined]
    option = getattr(exc, "option_name", None)
    if option and type(exc).__name__ == "NoSuchOption" and any(p.param_type_name == "argument"
                                                                 for p in command.params):
        message += f"; {_dash_dash_hint(ctx, _offending_token(option, args), args)}"
    return StateError("RIVET_CLI_USAGE", f"{message}\n{ctx.get_usage()}")
