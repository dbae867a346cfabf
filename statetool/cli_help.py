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
use these.
"""

from __future__ import annotations

import inspect
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

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


class Group(TyperGroup):
    """A command group whose help ends with its examples and the global options (below the root)."""

    def format_epilog(self, ctx: Any, formatter: Any) -> None:
        """Examples, then the global options."""
        _format_examples(self, formatter)
        _format_globals(ctx, formatter)


class App(typer.Typer):
    """A typer app whose groups are :class:`Group` and whose commands are :class:`Command`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cls=Group, **kwargs)

    def command(self, name: str | None = None, **kwargs: Any) -> Any:
        """typer's ``command`` decorator, with :class:`Command` unless another class is given."""
        kwargs.setdefault("cls", Command)
        return super().command(name, **kwargs)


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
