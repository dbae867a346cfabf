"""The command line: parse, call one operation, render (SPEC §8).

Start-up stays light: only typer and the error registry load here; each command imports
its operation (SQLAlchemy, psycopg, alembic where the schema changes) and
``statetool.render`` (rich: loaded under ``--json`` too, though it formats none of that
output) when it runs, so ``statetool --help`` costs about what ``import typer`` does.

Each option more than one command takes is declared once, as an ``Annotated`` alias below
(STYLE §3); the global options are declared once in :func:`main_options`.
"""

import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from statetool import __version__
from statetool.errors import EXIT_INTERRUPTED, StateError, internal_error
from statetool.location import DEFAULT_CONFIG

#: Global options: name -> takes a value. They work before or after the command name.
GLOBAL_OPTIONS: dict[str, bool] = {
    "--config": True, "-c": True, "--state-url": True, "--lock-wait": True,
    "--json": False, "--json-errors": False, "--debug": False, "--version": False,
}

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Inspect, guard and migrate the state of rivet pipelines (SQLite or PostgreSQL).")
identity_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Read, adopt or deliberately re-key the state's identity.")
exports_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Progress per export; deliberate cursor changes and resets.")
leases_app = typer.Typer(rich_markup_mode=None, help="Who holds which lease; release a stale one; run under a lease.")
app.add_typer(identity_app, name="identity")
app.add_typer(exports_app, name="exports")
app.add_typer(leases_app, name="leases")

#: ``--dry-run`` of every command that can plan a change (migrate, relocate, transfer).
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the plan; change nothing.")]
#: ``--reason`` of every audited change that asks why (identity rekey, leases release).
Reason = Annotated[str, typer.Option("--reason", help="Why, for the audit row.")]
#: The export a command of the ``exports`` group acts on.
ExportName = Annotated[str, typer.Argument(help="Export name.")]


@dataclass
class Globals:
    """The global options of one invocation."""

    config: Path
    state_url: str | None
    json: bool
    json_errors: bool
    lock_wait: float
    debug: bool
    command: str = "statetool"

    def context(self) -> Any:
        """The operations' :class:`~statetool.operations.context.Context` for these options."""
        from statetool.operations.context import Context, no_progress

        progress = no_progress
        if not self.json and sys.stderr.isatty():
            from statetool.render import rich_progress

            progress = rich_progress
        return Context(self.config, self.state_url, dict(os.environ), self.lock_wait, self.command, progress,
                       log=lambda message: sys.stderr.write(f"statetool: {message}\n"))


def _version(value: bool) -> None:
    if value:
        typer.echo(f"statetool {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    ctx: typer.Context,
    config: Annotated[Path, typer.Option("--config", "-c", help="Pipeline config (YAML).",
                                                 readable=False)] = Path(DEFAULT_CONFIG),
    state_url: Annotated[str | None, typer.Option("--state-url", help="State location; default RIVET_STATE_URL.",
                                                  show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")] = False,
    json_errors: Annotated[bool, typer.Option("--json-errors", help="Print failures as one JSON line on stderr.")] = False,
    lock_wait: Annotated[float, typer.Option("--lock-wait", min=0, max=604800,
                                             help="Seconds to wait for a busy lock (at most 7 days).")] = 600.0,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Inspect, guard and migrate the state of rivet pipelines (SQLite or PostgreSQL)."""
    from statetool.redact import command_line

    argv = ctx.obj if isinstance(ctx.obj, list) else sys.argv[1:]  # main() hands over the argv it was given
    ctx.obj = Globals(config, state_url, json_out, json_errors, lock_wait, debug,
                      command_line(["statetool", *argv]))
    if state_url:
        _warn_password_in_argv("--state-url", state_url)


def _warn_password_in_argv(option: str, url: str) -> None:
    """Warn ``RIVET_STATE_PASSWORD_IN_ARGV`` on stderr when ``url``, given on the command
    line, carries a password (SPEC §7): the URL still works."""
    from statetool.errors import StateWarning
    from statetool.redact import has_password

    if has_password(url):
        warning = StateWarning("RIVET_STATE_PASSWORD_IN_ARGV",
                               f"the password in {option} is visible to every user of this host in the process list "
                               "(ps, /proc/<pid>/cmdline)")
        sys.stderr.write(f"Warning [{warning.code}]: {warning.message}\n  Try: {warning.action}\n")


def _g(ctx: typer.Context) -> Globals:
    return ctx.find_root().obj  # type: ignore[no-any-return]


def _emit(g: Globals, doc: dict[str, Any], human: Any) -> None:
    if g.json:  # one JSON document on stdout, written by json: rich formats none of it
        import json

        sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    else:
        from statetool.render import human as show

        show(human, doc)


@app.command()
def info(ctx: typer.Context) -> None:
    """Where the state is and why, its revision, identity, per-export progress, warnings."""
    from statetool import render
    from statetool.operations.inspect import info as op

    g = _g(ctx)
    _emit(g, op(g.context()).as_dict(), render.info)


@app.command()
def check(ctx: typer.Context,
          strict: Annotated[bool, typer.Option("--strict", help="Fail on warnings too (exit 5).")] = False) -> None:
    """CI pre-flight: every check, read-only; the exit code is the worst failing class."""
    from statetool import render
    from statetool.operations.check import check as op

    g = _g(ctx)
    result = op(g.context(), strict=strict)
    _emit(g, result.as_dict(), render.check)
    if os.environ.get("GITHUB_ACTIONS") == "true":
        render.github_annotations(result.as_dict()["checks"], to_stderr=g.json)
    if result.worst is not None and g.json_errors:
        w = result.worst
        render.print_failure_line(w.code, w.message, w.error, result.failures)
    if result.exit_code:
        raise typer.Exit(result.exit_code)


@app.command()
def doctor(ctx: typer.Context,
           export: Annotated[str | None, typer.Option("--export", help="Only this export.")] = None) -> None:
    """Per export: will the next run resume, or be a FIRST RUN, and why (exit 5 if any would)."""
    from statetool import render
    from statetool.operations.doctor import doctor as op

    g = _g(ctx)
    result = op(g.context(), export)
    _emit(g, result.as_dict(), render.doctor)
    reason = result.worst
    if result.exit_code and g.json_errors and reason is not None:
        render.print_failure_line(reason.code, reason.message, failures=result.failures)
    if result.exit_code:
        raise typer.Exit(result.exit_code)


@app.command()
def checkpoints(ctx: typer.Context) -> None:
    """Every CDC checkpoint: resolved path and why, present, size, age, position, warnings."""
    from statetool import render
    from statetool.operations.checkpoints import checkpoints as op

    g = _g(ctx)
    _emit(g, op(g.context()).as_dict(), render.checkpoints)


@app.command()
def init(ctx: typer.Context) -> None:
    """Create a new empty state at the resolved location, stamped with its identity."""
    from statetool import render
    from statetool.operations.create import init as op

    g = _g(ctx)
    _emit(g, op(g.context()).as_dict(), render.init)


@app.command()
def migrate(
    ctx: typer.Context,
    to: Annotated[str | None, typer.Option("--to", help="Target revision (default head); lower moves down.")] = None,
    dry_run: DryRun = False,
    sql: Annotated[bool, typer.Option("--sql", help="Print the SQL for a DBA (PostgreSQL); change nothing.")] = False,
    allow_data_loss: Annotated[bool, typer.Option("--allow-data-loss",
                                                  help="Let a downgrade drop the data it names.")] = False,
) -> None:
    """Pre-flight, backup (SQLite), upgrade to head (or --to), verify."""
    from statetool import render
    from statetool.operations.migrate import migrate as op

    g = _g(ctx)
    result = op(g.context(), to=to, dry_run=dry_run, sql=sql, allow_data_loss=allow_data_loss)
    _emit(g, result.as_dict(), render.migrate)


@app.command()
def relocate(
    ctx: typer.Context,
    to: Annotated[str, typer.Option("--to", help="Absolute directory to move the SQLite state into.")],
    create_dir: Annotated[bool, typer.Option("--create-dir", help="Create the target directory.")] = False,
    dry_run: DryRun = False,
    full_verify: Annotated[bool, typer.Option("--full-verify",
                                              help="integrity_check the copy (slow: about 20 s per GiB).")] = False,
) -> None:
    """Move a SQLite state (and its CDC checkpoints) into a declared directory, verified."""
    from statetool import render
    from statetool.operations.relocate import relocate as op

    g = _g(ctx)
    _emit(g, op(g.context(), to, create_dir=create_dir, dry_run=dry_run, full_verify=full_verify).as_dict(),
          render.relocate)


@app.command()
def transfer(
    ctx: typer.Context,
    to: Annotated[str | None, typer.Option("--to", help="PostgreSQL URL of the destination (?schema=NAME allowed).",
                                           show_default=False)] = None,
    to_env: Annotated[str | None, typer.Option("--to-env", metavar="NAME", show_default=False,
                                               help="Read the destination URL from environment variable NAME "
                                                    "(keeps a password out of the process list).")] = None,
    dry_run: DryRun = False,
) -> None:
    """Move a SQLite state into PostgreSQL: one transaction, verified, the old place retired."""
    from statetool import render
    from statetool.operations.transfer import transfer as op

    g = _g(ctx)
    context = g.context()
    if (to is None) == (to_env is None):
        raise StateError("RIVET_CLI_USAGE", "give exactly one of --to URL and --to-env NAME")
    if to_env is not None:
        to = context.env.get(to_env, "").strip()
        if not to:
            raise StateError("RIVET_CLI_USAGE", f"--to-env {to_env}: the environment variable {to_env} is not set "
                             "or empty; export it with the destination URL (postgresql://user@host/db)")
    else:
        _warn_password_in_argv("--to", to or "")
    assert to is not None
    _emit(g, op(context, to, dry_run=dry_run).as_dict(), render.transfer)


@app.command()
def revisions(ctx: typer.Context) -> None:
    """Every revision of this release, oldest first, and which the state has."""
    from statetool import render
    from statetool.operations.inspect import revisions as op

    g = _g(ctx)
    _emit(g, op(g.context()).as_dict(), render.revisions)


@identity_app.command("show")
def identity_show(ctx: typer.Context) -> None:
    """Recorded and computed state_key, and what a write would do."""
    from statetool import render
    from statetool.operations.identity_ops import show

    g = _g(ctx)
    _emit(g, show(g.context()).as_dict(), render.identity)


@identity_app.command("adopt")
def identity_adopt(ctx: typer.Context) -> None:
    """Record this config's state_key on a state that has none."""
    from statetool import render
    from statetool.operations.identity_ops import adopt

    g = _g(ctx)
    _emit(g, adopt(g.context()).as_dict(), render.identity_change)


@identity_app.command("rekey")
def identity_rekey(
    ctx: typer.Context,
    old: Annotated[str, typer.Option("--old", help="The key recorded now (exactly).")],
    new: Annotated[str | None, typer.Option("--new", help="The new key (default: this config's).")] = None,
    reason: Reason = "",
) -> None:
    """Deliberately change the recorded key (the source moved); audited."""
    from statetool import render
    from statetool.operations.identity_ops import rekey

    g = _g(ctx)
    _emit(g, rekey(g.context(), old, new, reason).as_dict(), render.identity_change)


@exports_app.command("list")
def exports_list(ctx: typer.Context) -> None:
    """Progress of every export (config and state)."""
    from statetool import render
    from statetool.operations.inspect import info

    g = _g(ctx)
    described = info(g.context())
    _emit(g, {"exports": described.exports, "warnings": described.warnings}, render.export_list)


@exports_app.command("show")
def exports_show(ctx: typer.Context, name: ExportName) -> None:
    """One export's progress and its recent runs."""
    from statetool import render
    from statetool.operations.inspect import export_show

    g = _g(ctx)
    _emit(g, export_show(g.context(), name).as_dict(), render.export_detail)


@exports_app.command("set-cursor")
def exports_set_cursor(ctx: typer.Context, name: ExportName,
                       value: Annotated[str, typer.Argument(help="The new cursor value.")]) -> None:
    """Rewind or advance an export's cursor on purpose (backup and audit row first)."""
    from statetool import render
    from statetool.operations.exports import set_cursor

    g = _g(ctx)
    _emit(g, set_cursor(g.context(), name, value).as_dict(), render.export_change)


@exports_app.command("reset")
def exports_reset(ctx: typer.Context, name: ExportName) -> None:
    """Make an export's next run a FIRST RUN on purpose (backup and audit row first)."""
    from statetool import render
    from statetool.operations.exports import reset

    g = _g(ctx)
    _emit(g, reset(g.context(), name).as_dict(), render.export_change)


@leases_app.callback(invoke_without_command=True)
def leases_default(ctx: typer.Context) -> None:
    """Every lease: key, export, state (live, stale, free), holder, acquired, heartbeat, TTL."""
    if ctx.invoked_subcommand is None:
        leases_list(ctx)


@leases_app.command("list")
def leases_list(ctx: typer.Context) -> None:
    """Every lease, read without taking any lock."""
    from statetool import render
    from statetool.operations.leases import list_leases

    g = _g(ctx)
    _emit(g, list_leases(g.context()).as_dict(), render.leases)


@leases_app.command("release")
def leases_release(
    ctx: typer.Context,
    key: Annotated[str, typer.Argument(help="Lease key, e.g. chunk-run:orders.")],
    reason: Reason = "",
) -> None:
    """Release a STALE lease (audited); a live holder is refused."""
    from statetool import render
    from statetool.operations.leases import release

    g = _g(ctx)
    _emit(g, release(g.context(), key, reason), render.lease_release)


@leases_app.command("run", context_settings={"allow_interspersed_args": False})
def leases_run(
    ctx: typer.Context,
    export: Annotated[str, typer.Option("--export", help="The export whose run lease to hold.")],
    command: Annotated[list[str] | None, typer.Argument(help="The command, after --.", show_default=False)] = None,
    lease_ttl: Annotated[int, typer.Option("--lease-ttl", min=1, max=86400,
                                           help="Seconds a PostgreSQL lease lives without a heartbeat.")] = 30,
) -> None:
    """Hold an export's run lease for the whole life of a command (like flock(1)); a lost
    lease stops the command and exits 2 (RIVET_STATE_LEASE_LOST)."""
    from statetool.operations.leases import run_under_lease

    g = _g(ctx)
    context = g.context()
    context.lease_ttl = lease_ttl
    raise typer.Exit(run_under_lease(context, export, command or []))


def hoist_globals(argv: list[str]) -> list[str]:
    """Move global options (and their values) in front of the command name, so
    ``statetool info --json`` means ``statetool --json info``. Stops at ``--``."""
    front: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest.extend(argv[i:])
            break
        name = arg.split("=", 1)[0]
        if name in GLOBAL_OPTIONS:
            takes_value = GLOBAL_OPTIONS[name] and "=" not in arg
            front.extend(argv[i:i + 2] if takes_value else [arg])
            i += 2 if takes_value else 1
            continue
        rest.append(arg)
        i += 1
    return front + rest


def _interrupted(exc: BaseException) -> bool:
    """True when a KeyboardInterrupt stands anywhere in ``exc``'s chain of causes."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _print_traceback() -> None:
    import traceback

    from statetool.redact import redact_text

    sys.stderr.write(redact_text(traceback.format_exc()))


def _fail(error: StateError, json_errors: bool) -> NoReturn:
    try:
        if json_errors:  # one line on stderr, written by json: no rich markup or wrapping
            import json

            from statetool.errors import error_object

            sys.stderr.write(json.dumps(error_object(error)) + "\n")
        else:
            from statetool.render import print_error

            print_error(error)
        sys.stderr.flush()
    except (OSError, SystemExit):
        # The reader of stderr went away (`2>&1 | head -1`; rich then exits 1 by itself): the
        # exit code must still be the error's class.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
    raise SystemExit(error.exit_code)


@functools.cache
def _command() -> Any:
    """The click command tree of :data:`app`, built once per process (typer's ``app(...)``
    builds it anew, about 20 ms, on every call: a long-lived caller such as the test suite
    calls :func:`main` thousands of times)."""
    return typer.main.get_command(app)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI; every failure leaves through one handler (SPEC §7)."""
    given = list(sys.argv[1:] if argv is None else argv)
    args = hoist_globals(given)
    json_errors, debug = "--json-errors" in args, "--debug" in args
    try:
        code = _command().main(args=args, prog_name="statetool", standalone_mode=False, obj=given)
    except StateError as error:
        if debug:
            _print_traceback()
        _fail(error, json_errors)
    except typer.Exit as done:
        raise SystemExit(done.exit_code) from None
    except KeyboardInterrupt:
        raise SystemExit(EXIT_INTERRUPTED) from None
    except typer.TyperException as exc:  # the argument parser's usage errors
        if type(exc).__name__ == "NoArgsIsHelpError":  # a bare command group: its help is the answer
            sys.stdout.write(exc.format_message() + "\n")
            raise SystemExit(0) from None
        _fail(StateError("RIVET_CLI_USAGE", exc.format_message()), json_errors)
    except OSError as exc:  # an environment fault no layer below named: name it, never call it a bug
        from statetool.backends.faults import os_fault

        if debug:
            _print_traceback()
        _fail(os_fault(exc) or internal_error(exc), json_errors)
    except Exception as exc:  # noqa: BLE001 - the one place an unexpected error is turned into RIVET_INTERNAL
        if _interrupted(exc):
            # Ctrl-C while a transaction was open: the driver's cleanup error hides the
            # interrupt. Every write is one transaction, so nothing was committed.
            sys.stderr.write("statetool: interrupted; the open transaction was rolled back\n")
            raise SystemExit(EXIT_INTERRUPTED) from None
        if debug:
            _print_traceback()
        _fail(internal_error(exc), json_errors)
    raise SystemExit(code if isinstance(code, int) else 0)
