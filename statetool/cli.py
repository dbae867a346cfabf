"""The command line: parse, call one operation, render (SPEC §8).

Start-up stays light: only typer and the error registry load here; each command imports
its operation (SQLAlchemy, psycopg, alembic where the schema changes) and
``statetool.render`` when it runs (rich only when a page holds a table or a line goes to
stderr), and typer converts a command's function to its click command only when that
command is looked up (:func:`command_tree`), so ``statetool --help`` costs about what
``import typer`` does.

Each option more than one command takes is declared once, as an ``Annotated`` alias below
(STYLE §3); the global options are declared once in :func:`main_options`, and the help of
every subcommand lists them from there (:mod:`statetool.cli_help`). Every parameter that
takes a value names it (``metavar``: ``SECONDS``, ``NAME``), and every command's docstring
starts with a one-line summary short enough to show whole in the top-level help of an
80-column terminal; a command's ``epilog`` holds its examples.
"""

import contextlib
import functools
import gc
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from typer.models import TyperPath

from statetool import DEFAULT_CONFIG, __version__
from statetool.cli_help import App, lazy_command_tree, usage_error
from statetool.errors import EXIT_INTERRUPTED, StateError, internal_error, interrupted

app = App(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
          help="Inspect, guard and migrate the state of rivet pipelines (SQLite or PostgreSQL).")
identity_app = App(no_args_is_help=True, rich_markup_mode=None,
                   help="Read, adopt or deliberately re-key the state's identity.")
exports_app = App(no_args_is_help=True, rich_markup_mode=None,
                  help="Progress per export; deliberate cursor changes and resets.")
checkpoints_app = App(rich_markup_mode=None, subcommand_metavar="[COMMAND [ARGS]...]",
                      help="Every CDC checkpoint; move positions into the state and back.\n\n"
                           "Without a command: the same as statetool checkpoints list.")
backups_app = App(no_args_is_help=True, rich_markup_mode=None,
                  help="Backups and keeps beside a SQLite state: list, verify, prune.")
leases_app = App(rich_markup_mode=None, subcommand_metavar="[COMMAND [ARGS]...]",
                 help="Who holds which lease; release a stale one; run under one.\n\n"
                      "Without a command: the same as statetool leases list.")
app.add_typer(identity_app, name="identity")
app.add_typer(exports_app, name="exports")
app.add_typer(leases_app, name="leases")
app.add_typer(backups_app, name="backups")
app.add_typer(checkpoints_app, name="checkpoints")

class PathName(TyperPath):
    """The type of every option and argument of the CLI that names a file or a directory
    (:data:`FILE_NAME`, :data:`ANY_NAME`): typer's own path type, except that an empty name
    is ``RIVET_CLI_USAGE`` naming the option (``Invalid value for '--archive': ...``), where
    it would be taken for the working directory and fail far from it ("Is a directory",
    "is a symlink or not a regular file"). A fresh user's finding (issue 16 item 2)."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        """``value`` as the path type converts it; an empty one fails."""
        if isinstance(value, str | bytes) and not value:
            self.fail("an empty name names no file: give a path (./NAME for one in this directory)", param, ctx)
        return super().convert(value, param, ctx)


#: A file statetool reads or writes (-o, --archive, --textfile, import FILE): an existing
#: one must be readable, as typer's path type has it.
FILE_NAME = PathName()
#: A name whose file statetool checks itself (-c; --to DIR, restore COPY and diff's A and B,
#: which may also name a state by URL or a backup by name): only an empty one is refused.
ANY_NAME = PathName(readable=False)

#: ``--dry-run`` of every command that can plan a change (migrate, relocate, transfer,
#: identity adopt/rekey, exports set-cursor/reset, leases release).
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the plan; change nothing.")]
#: ``--reason`` of every audited change that asks why (identity rekey, leases release).
Reason = Annotated[str, typer.Option("--reason", metavar="WHY", help="Why, for the audit row.")]


def _complete_exports(ctx: typer.Context) -> list[tuple[str, str]]:
    """Shell completion of an export name: the config's and the state's (statetool.completion)."""
    from statetool.completion import export_names

    return export_names(ctx)


#: The export a command of the ``exports`` group acts on.
ExportName = Annotated[str, typer.Argument(metavar="NAME", help="Export name.", show_default=False,
                                           autocompletion=_complete_exports)]
#: ``--export NAME`` of the commands that can act on one export only (doctor, export).
OnlyExport = Annotated[str | None, typer.Option("--export", metavar="NAME", help="Only this export.",
                                                autocompletion=_complete_exports)]
#: The commands that read several pipelines at once (-c more than once, --configs GLOB;
#: issue 16 item 1, docs/decisions.md "Several pipelines at once"), and their two options.
FLEET_COMMANDS = ("check", "info", "doctor", "metrics")
ConfigsGlob = Annotated[str | None, typer.Option("--configs", metavar="GLOB", show_default=False,
                                                 help="Also every config GLOB matches (quote it: statetool "
                                                      "expands it, sorted).")]
StateUrlEnv = Annotated[list[str] | None, typer.Option("--state-url-env", metavar="CONFIG=NAME", show_default=False,
                                                       help="With several configs: CONFIG's state URL is in the "
                                                            "variable NAME (its RIVET_STATE_URL).")]


class Globals:
    """The global options of one invocation (a plain class: a ``NamedTuple`` class costs
    more to create than the rest of this module, at every start-up; no ``dataclasses``)."""

    __slots__ = ("configs", "state_url", "json", "json_errors", "lock_wait", "debug", "command", "config_given")

    def __init__(self, configs: list[Path], state_url: str | None, json: bool, json_errors: bool, lock_wait: float,
                 debug: bool, command: str = "statetool", config_given: bool = False) -> None:
        #: Every --config/-c, in the order given (the default alone when none is).
        self.configs = configs
        self.state_url = state_url
        self.json = json
        self.json_errors = json_errors
        self.lock_wait = lock_wait
        self.debug = debug
        self.command = command
        #: Whether --config/-c was given: a named config must exist even where the state's
        #: place does not depend on it (docs/decisions.md, "Leases without a pipeline config").
        self.config_given = config_given

    def progress(self) -> Any:
        """The progress display: a rich bar on a terminal without --json, else silent."""
        from statetool.operations.context import no_progress

        if not self.json and sys.stderr.isatty():
            from statetool.render import rich_progress

            return rich_progress
        return no_progress

    @staticmethod
    def log(message: str) -> None:
        """A progress line on stderr (waiting for a lease, ...)."""
        sys.stderr.write(f"statetool: {message}\n")

    def context(self) -> Any:
        """The operations' :class:`~statetool.operations.context.Context` for these options.
        Raises ``RIVET_CLI_USAGE`` when -c was given more than once: only the commands of
        :data:`FLEET_COMMANDS` read several pipelines (:meth:`fleet`)."""
        from statetool.operations.context import Context

        if len(self.configs) > 1:
            several = f"{', '.join(FLEET_COMMANDS[:-1])} and {FLEET_COMMANDS[-1]}"
            raise StateError("RIVET_CLI_USAGE", f"--config/-c was given {len(self.configs)} times, and this command "
                             f"reads one pipeline; {several} read several (-c more than once, or --configs GLOB)")
        return Context(self.configs[0], self.state_url, dict(os.environ), self.lock_wait, self.command,
                       self.progress(), log=self.log, config_given=self.config_given)

    def fleet_contexts(self, pattern: str | None, state_url_envs: list[str] | None) -> Any:
        """``(pipelines, contexts)`` of every pipeline given (-c more than once, --configs:
        :func:`~statetool.operations.fleet.fleet_pipelines`), one context each, or None for
        one config given as always (the fleet's module is then not even loaded).
        ``--state-url-env`` without several configs is ``RIVET_CLI_USAGE``."""
        if pattern is None and len(self.configs) < 2:
            if state_url_envs:
                raise StateError("RIVET_CLI_USAGE", "--state-url-env is for several configs (-c more than once, or "
                                 "--configs GLOB); with one, give --state-url or RIVET_STATE_URL")
            return None
        from statetool.operations import fleet

        configs = self.configs if self.config_given else []
        pipelines = fleet.fleet_pipelines(configs, pattern, state_url_envs or [], os.environ, self.state_url)
        return pipelines, [fleet.pipeline_context(p, dict(os.environ), self.lock_wait, self.command, self.log)
                           for p in pipelines]

    def fleet(self, name: str, pattern: str | None, state_url_envs: list[str] | None, **options: Any) -> Any:
        """The :class:`~statetool.operations.fleet.FleetResult` of command ``name`` (one of
        :data:`FLEET_COMMANDS`, with its ``options``) over every pipeline given
        (:meth:`fleet_contexts`), or None for one config given as always (the command's own
        output, unchanged)."""
        several = self.fleet_contexts(pattern, state_url_envs)
        if several is None:
            return None
        from statetool.operations import fleet

        command = {"check": fleet.check_command, "info": fleet.info_command, "doctor": fleet.doctor_command}[name]
        return fleet.run_fleet(command(**options), *several, self.progress())


def _version(ctx: typer.Context, value: bool) -> None:
    if value and not ctx.resilient_parsing:  # a completion request parses --version too, and prints none
        typer.echo(f"statetool {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    ctx: typer.Context,
    config: Annotated[list[Path], typer.Option("--config", "-c", metavar="PATH", click_type=ANY_NAME,
                                               help="Pipeline config (YAML); the default state lives beside it. "
                                                    "check, info, doctor, metrics take several.")
                      ] = [Path(DEFAULT_CONFIG)],  # noqa: B006 - typer copies it; never mutated
    state_url: Annotated[str | None, typer.Option("--state-url", metavar="URL", show_default=False,
                                                  help="Where the state is (sqlite:/dir, postgresql://...); "
                                                       "default RIVET_STATE_URL, else beside the config.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")] = False,
    json_errors: Annotated[bool, typer.Option("--json-errors", help="Print failures as one JSON line on stderr.")] = False,
    lock_wait: Annotated[float, typer.Option("--lock-wait", metavar="SECONDS", min=0, max=604800,
                                             help="How long to wait for a busy lease or lock; 0 refuses at "
                                                  "once; at most 7 days.")] = 600,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Inspect, guard and migrate the state of rivet pipelines (SQLite or PostgreSQL)."""
    from statetool.redact import command_line

    argv = ctx.obj if isinstance(ctx.obj, list) else sys.argv[1:]  # main() hands over the argv it was given
    given = ctx.get_parameter_source("config")
    ctx.obj = Globals(config, state_url, json_out, json_errors, lock_wait, debug, command_line(["statetool", *argv]),
                      config_given=given is not None and given.name != "DEFAULT")
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


def _fleet_done(g: Globals, result: Any) -> None:
    """Print a fleet's document (:func:`statetool.render.fleet` for people), its
    ``--json-errors`` line when it failed, and exit with its worst exit code."""
    from statetool import render

    _emit(g, result.as_dict(), render.fleet)
    line = result.error_line() if g.json_errors else None
    if line is not None:
        import json

        sys.stderr.write(json.dumps(line) + "\n")
    if result.exit_code:
        raise typer.Exit(result.exit_code)


@app.command()
def info(ctx: typer.Context, configs: ConfigsGlob = None, state_url_env: StateUrlEnv = None) -> None:
    """Where the state is and why, its revision, identity, progress.

    Also the leases, and the warnings a write would give. A missing state is described,
    not refused. With several configs (-c more than once, --configs GLOB): each pipeline,
    and what they share.
    """
    from statetool import render
    from statetool.operations.inspect import info as op

    g = _g(ctx)
    fleet = g.fleet("info", configs, state_url_env)
    if fleet is not None:
        _fleet_done(g, fleet)
        return
    _emit(g, op(g.context()).as_dict(), render.info)


@app.command(epilog="""
    The pre-flight of a pod (an init container), before a run on it:
      statetool check --target pods
    """)
def check(ctx: typer.Context,
          strict: Annotated[bool, typer.Option("--strict", help="Fail on warnings too (exit 5).")] = False,
          target: Annotated[str | None, typer.Option("--target", metavar="TARGET", show_default=False,
                                                     help="Where the runs run: pods refuses a SQLite state and "
                                                          "CDC positions in files (exit 5).")] = None,
          configs: ConfigsGlob = None, state_url_env: StateUrlEnv = None) -> None:
    """CI pre-flight: every check, read-only; fails with the worst.

    The exit code is the class of the worst failing check (docs/errors.md); --strict
    fails on warnings too; --target pods adds the pod rule: the state in PostgreSQL,
    every CDC position in the state or a server slot, none in a file. With several configs
    (-c more than once, --configs GLOB): every pipeline's checks, and what they share; the
    exit code is the worst of them.
    """
    from statetool import render
    from statetool.operations.check import check as op

    g = _g(ctx)
    fleet = g.fleet("check", configs, state_url_env, strict=strict, target=target)
    if fleet is not None:
        if os.environ.get("GITHUB_ACTIONS") == "true":
            render.github_annotations(render.fleet_rows(fleet.as_dict()), to_stderr=g.json)
        _fleet_done(g, fleet)
        return
    result = op(g.context(), strict=strict, target=target)
    _emit(g, result.as_dict(), render.check)
    if os.environ.get("GITHUB_ACTIONS") == "true":
        render.github_annotations(result.as_dict()["checks"], to_stderr=g.json)
    if result.worst is not None and g.json_errors:
        w = result.worst
        render.print_failure_line(w.code, w.message, w.error, result.failures)
    if result.exit_code:
        raise typer.Exit(result.exit_code)


@contextlib.contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """The cyclic garbage collector paused for the body (reference counting still frees
    every object), then restored as it was. ``doctor`` builds a few objects per export
    (config nodes, resume points, diagnoses, their documents) that all live until it has
    printed: the collector only traversed them, again and again, and found no cycle,
    about a tenth of a doctor of 2,000 exports (issue 13)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@app.command()
def doctor(ctx: typer.Context,
           export: OnlyExport = None, configs: ConfigsGlob = None, state_url_env: StateUrlEnv = None) -> None:
    """Per export: will the next run resume, or be a FIRST RUN?

    Says why for each export, and fails when any next run would be a first run or be
    refused, with the exit code of the reason on top (5; 4 for a damaged checkpoint,
    state or position row). With several configs (-c more than once, --configs GLOB):
    every pipeline's exports, and what they share.
    """
    from statetool import render
    from statetool.operations.doctor import doctor as op

    g = _g(ctx)
    with _no_cycle_collection():
        fleet = g.fleet("doctor", configs, state_url_env, export=export)
    if fleet is not None:
        _fleet_done(g, fleet)
        return
    with _no_cycle_collection():
        result = op(g.context(), export)
        _emit(g, result.as_dict(), render.doctor)
    reason = result.worst
    if result.exit_code and g.json_errors and reason is not None:
        render.print_failure_line(reason.code, reason.message, failures=result.failures)
    if result.exit_code:
        raise typer.Exit(result.exit_code)


@app.command(epilog="""
    The metrics on stdout:
      statetool metrics
    For node-exporter's textfile collector (from cron or a systemd timer):
      statetool metrics --textfile "$TEXTFILE_DIR/rivet-sales.prom"
    """)
def metrics(
    ctx: typer.Context,
    textfile: Annotated[Path | None, typer.Option("--textfile", metavar="PATH", click_type=FILE_NAME,
                                                  show_default=False,
                                                  help="Replace PATH whole (a temporary file renamed over it) "
                                                       "instead of printing.")] = None,
    configs: ConfigsGlob = None, state_url_env: StateUrlEnv = None,
) -> None:
    """OpenMetrics text for monitoring: progress, leases, backups.

    Read-only. A state that cannot be read still gives its metrics (statetool_state_up
    0, statetool_state_error with its code); the exit is then that code's, after the
    text is out.
    """
    from statetool.operations.metrics import metrics as op

    g = _g(ctx)
    if g.json:
        raise StateError("RIVET_CLI_USAGE", "metrics prints OpenMetrics text and has no JSON document: leave out "
                         "--json (statetool info --json gives the same facts as JSON)")
    several = g.fleet_contexts(configs, state_url_env)
    if several is None:
        result = op([g.context()], textfile=textfile)
    else:
        result = op(several[1], textfile=textfile, labelled=True)
    if textfile is None:
        sys.stdout.write(result.text)
    if result.worst is not None:
        from statetool import render

        if g.json_errors:
            render.print_failure_line(result.worst.code, result.worst.message, result.worst, result.failures)
        for error in [] if g.json_errors else result.down:
            render.print_error(error)
        raise typer.Exit(result.exit_code)


@checkpoints_app.callback(invoke_without_command=True)
def checkpoints_default(ctx: typer.Context) -> None:
    """``statetool checkpoints`` without a command lists them, as ``checkpoints list``."""
    if ctx.invoked_subcommand is None:
        checkpoints_list(ctx)


@checkpoints_app.command("list")
def checkpoints_list(ctx: typer.Context) -> None:
    """Every CDC checkpoint: where it resolves, present, age.

    Also its size, position and warnings, why it resolves where it does, and whether the
    position lives in the state, a file or a server slot.
    """
    from statetool import render
    from statetool.operations.checkpoints import checkpoints as op

    g = _g(ctx)
    _emit(g, op(g.context()).as_dict(), render.checkpoints)


CdcExport = Annotated[str | None, typer.Option("--export", metavar="NAME", autocompletion=_complete_exports,
                                               help="Only this CDC export (default: every one).")]


@checkpoints_app.command("import")
def checkpoints_import(ctx: typer.Context, name: CdcExport = None, dry_run: DryRun = False) -> None:
    """Move each checkpoint file's position into the state (audited).

    Under the export's run lease; the file is renamed NAME.imported-TIME after.
    """
    from statetool import render
    from statetool.operations.positions import import_positions

    g = _g(ctx)
    _emit(g, import_positions(g.context(), name, dry_run=dry_run).as_dict(), render.positions_moved)


@checkpoints_app.command("export")
def checkpoints_export(ctx: typer.Context, name: CdcExport = None, dry_run: DryRun = False) -> None:
    """Write the state's positions back to their files (the rollback)."""
    from statetool import render
    from statetool.operations.positions import export_positions

    g = _g(ctx)
    _emit(g, export_positions(g.context(), name, dry_run=dry_run).as_dict(), render.positions_moved)


@app.command(epilog="""
    The whole state's progress, to a file (never overwritten without --force):
      statetool export -o state.json
    One export, with its run history, on stdout:
      statetool export --export orders --with-history
    """)
def export(
    ctx: typer.Context,
    name: OnlyExport = None,
    with_history: Annotated[bool, typer.Option("--with-history",
                                               help="Add the run history (rivet_runs, rivet_run_aggregates).")
                            ] = False,
    output: Annotated[Path | None, typer.Option("--output", "-o", metavar="FILE", click_type=FILE_NAME,
                                                show_default=False,
                                                help="Write to FILE (atomically) instead of stdout.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing regular FILE.")] = False,
) -> None:
    """Write the state as one rivet-state/1 JSON document.

    Identity, lineage, serial, revision and each export's progress; read-only.
    """
    from statetool import render
    from statetool.operations.portable import export_state

    g = _g(ctx)
    result = export_state(g.context(), export=name, with_history=with_history, output=output, force=force)
    if output is None:
        import json

        sys.stdout.write(json.dumps(result.as_dict(), indent=2, default=str) + "\n")
        return
    _emit(g, result.summary(), render.export_written)


@app.command(epilog="""
    What a reset changed, against the backup it left:
      statetool diff .rivet_state.db.backup-reset-orders-* rivet.yaml
    An export against the live state, for a script:
      statetool --json diff state.json sqlite:/srv/rivet/state
    """)
def diff(
    ctx: typer.Context,
    a: Annotated[str, typer.Argument(metavar="A", show_default=False, click_type=ANY_NAME,
                                     help="A state (sqlite:/dir, URL, config), state file or export.")],
    b: Annotated[str, typer.Argument(metavar="B", show_default=False, click_type=ANY_NAME,
                                     help="The other side, as A.")],
) -> None:
    """Compare two states, state files or exports, field by field.

    Identity, lineage, serial, revision and each export's progress; read-only. Exits 0
    when they are equal, 1 when they differ.
    """
    from statetool import render
    from statetool.operations.diff import diff as op

    g = _g(ctx)
    result = op(g.context(), a, b)
    _emit(g, result.as_dict(), render.diff)
    if not result.equal:
        raise typer.Exit(1)


@app.command("import", epilog="""
    See what it would do; nothing changes:
      statetool import state.json --dry-run
    Put one export's progress back into the live state:
      statetool import state.json --export orders
    """)
def import_(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(metavar="FILE", show_default=False, click_type=FILE_NAME,
                                         help="A rivet-state/1 file that statetool export wrote.")],
    name: Annotated[str | None, typer.Option("--export", metavar="NAME", autocompletion=_complete_exports,
                                             help="Only this export (into a live state: required).")] = None,
    dry_run: DryRun = False,
) -> None:
    """Make a state from its export, or put one export back.

    Where no state is: the same state (identity, lineage, serial). Into a live state: one
    export (--export), under its run lease, backed up and audited.
    """
    from statetool import render
    from statetool.operations.importing import import_state

    g = _g(ctx)
    _emit(g, import_state(g.context(), file, export=name, dry_run=dry_run).as_dict(), render.imported)


@app.command()
def init(ctx: typer.Context) -> None:
    """Create a new empty state, stamped with its identity.

    At the resolved location; anything already there is refused.
    """
    from statetool import render
    from statetool.operations.create import init as op

    g = _g(ctx)
    _emit(g, op(g.context()).as_dict(), render.init)


@app.command(epilog="""
    See the plan first; nothing changes:
      statetool migrate --dry-run
    Upgrade to head (a SQLite state is backed up first):
      statetool migrate
    Hand the SQL to a DBA instead (PostgreSQL):
      statetool migrate --sql > upgrade.sql
    Go down to 0002, dropping what it names, on purpose:
      statetool migrate --to 0002 --allow-data-loss
    """)
def migrate(
    ctx: typer.Context,
    to: Annotated[str | None, typer.Option("--to", metavar="REV",
                                           help="Target revision (default head); lower moves down.")] = None,
    dry_run: DryRun = False,
    sql: Annotated[bool, typer.Option("--sql", help="Print the SQL for a DBA (PostgreSQL); change nothing.")] = False,
    allow_data_loss: Annotated[bool, typer.Option("--allow-data-loss",
                                                  help="Let a downgrade drop the data it names.")] = False,
) -> None:
    """Upgrade the state to head, backed up and verified.

    Or to another revision with --to REV. Pre-flight first; a SQLite state is backed up;
    the steps run in one transaction and are verified before the commit.
    """
    from statetool import render
    from statetool.operations.migrate import migrate as op

    g = _g(ctx)
    result = op(g.context(), to=to, dry_run=dry_run, sql=sql, allow_data_loss=allow_data_loss)
    _emit(g, result.as_dict(), render.migrate)


@app.command(epilog="""
    See the plan first; nothing changes:
      statetool relocate --to /srv/rivet/state --dry-run
    Move the state, creating the directory:
      statetool relocate --to /srv/rivet/state --create-dir
    Then every task of the pipeline runs with:
      RIVET_STATE_URL=sqlite:/srv/rivet/state
    """)
def relocate(
    ctx: typer.Context,
    to: Annotated[str, typer.Option("--to", metavar="DIR", show_default=False, click_type=ANY_NAME,
                                    help="Absolute directory to move the SQLite state into.")],
    create_dir: Annotated[bool, typer.Option("--create-dir", help="Create the target directory.")] = False,
    dry_run: DryRun = False,
    full_verify: Annotated[bool, typer.Option("--full-verify",
                                              help="integrity_check the copy (slow: about 20 s per GiB).")] = False,
) -> None:
    """Move a SQLite state into a declared directory, verified.

    Its CDC checkpoints move along; the old place is retired (a tombstone names the new
    one).
    """
    from statetool import render
    from statetool.operations.relocate import relocate as op

    g = _g(ctx)
    _emit(g, op(g.context(), to, create_dir=create_dir, dry_run=dry_run, full_verify=full_verify).as_dict(),
          render.relocate)


@app.command(epilog="""
    See the plan first, with the URL in a variable (no password in ps):
      export PG_URL='postgresql://rivet@db.internal/rivet?schema=rivet_sales'
      statetool transfer --to-env PG_URL --dry-run
    Move the state:
      statetool transfer --to-env PG_URL
    With the CDC positions of its checkpoint files, so that a pod needs no volume:
      statetool transfer --to-env PG_URL --with-checkpoints
    Then every task of the pipeline runs with:
      RIVET_STATE_URL=$PG_URL
    Back into a SQLite file, or into another schema:
      statetool --state-url "$PG_URL" transfer --to sqlite:/srv/rivet/sales
      statetool --state-url "$PG_URL" transfer --to-env OTHER_URL
    """)
def transfer(
    ctx: typer.Context,
    to: Annotated[str | None, typer.Option("--to", metavar="URL", show_default=False,
                                           help="The destination: a PostgreSQL URL (?schema=NAME allowed), "
                                                "or sqlite:/dir for a SQLite file.")] = None,
    to_env: Annotated[str | None, typer.Option("--to-env", metavar="NAME", show_default=False,
                                               help="Read the destination URL from environment variable NAME "
                                                    "(keeps a password out of the process list).")] = None,
    with_checkpoints: Annotated[bool, typer.Option(
        "--with-checkpoints", help="Move each CDC position from its checkpoint file into the destination, in "
                                   "the same transaction; the files are renamed *.imported-TIME.")] = False,
    dry_run: DryRun = False,
) -> None:
    """Move a state between SQLite and PostgreSQL, verified.

    Either way, or from one PostgreSQL schema or database to another. One transaction on the
    destination, checked table by table before the commit; the old place is retired (a
    tombstone, or a marker in the schema, names the new one).
    """
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
    setting = "--to" if to_env is None else f"--to-env {to_env}"
    _emit(g, op(context, to, dry_run=dry_run, to_setting=setting, with_checkpoints=with_checkpoints).as_dict(),
          render.transfer)


@app.command(epilog="""
    See what it would do; nothing changes:
      statetool restore .rivet_state.db.backup-migrate-20261201T120000Z --dry-run
    At a container's boot, only where no state is (exit 0 when one is):
      statetool restore /backups/rivet_state.db --if-absent
    """)
def restore(
    ctx: typer.Context,
    copy: Annotated[str, typer.Argument(metavar="COPY", show_default=False, click_type=ANY_NAME,
                                        help="The name of a backup or keep beside the state (statetool backups "
                                             "list), or the path of a state file.")],
    allow_older: Annotated[bool, typer.Option("--allow-older",
                                              help="Restore a copy older than the live state (audited).")] = False,
    if_absent: Annotated[bool, typer.Option("--if-absent",
                                            help="Only where no state is; do nothing (exit 0) where one is.")] = False,
    dry_run: DryRun = False,
) -> None:
    """Put a verified copy back; the state it replaces is kept.

    Refuses a copy of another source or lineage, and one older than the live state unless
    --allow-older. Holds every run lease; a kill leaves one whole state.
    """
    from statetool import render
    from statetool.operations.restore import restore as op

    g = _g(ctx)
    _emit(g, op(g.context(), copy, allow_older=allow_older, if_absent=if_absent, dry_run=dry_run).as_dict(),
          render.restored)


@backups_app.command("list")
def backups_list(ctx: typer.Context) -> None:
    """Every backup and keep: time, revision, identity, lineage, serial."""
    from statetool import render
    from statetool.operations.backups import list_backups

    g = _g(ctx)
    _emit(g, list_backups(g.context()).as_dict(), render.backups)


@backups_app.command("verify")
def backups_verify(
    ctx: typer.Context,
    name: Annotated[str | None, typer.Argument(metavar="[NAME]", show_default=False,
                                               help="One backup or keep (default: every one).")] = None,
) -> None:
    """Run integrity_check on each copy; read its revision and identity.

    Fails with the worst copy's code (a damaged one: 4).
    """
    from statetool import render
    from statetool.operations.backups import list_backups

    g = _g(ctx)
    result = list_backups(g.context(), name, verify=True)
    _emit(g, result.as_dict(), render.backups)
    if result.exit_code:
        raise typer.Exit(result.exit_code)


@backups_app.command("prune", epilog="""
    See what would go; nothing changes:
      statetool backups prune --keep 5 --dry-run
    """)
def backups_prune(
    ctx: typer.Context,
    keep: Annotated[int | None, typer.Option("--keep", metavar="N", help="Keep the N newest copies.")] = None,
    older_than: Annotated[float | None, typer.Option("--older-than", metavar="DAYS",
                                                     help="Remove copies older than DAYS days.")] = None,
    dry_run: DryRun = False,
) -> None:
    """Remove old backups and keeps (audited); never the newest good one."""
    from statetool import render
    from statetool.operations.backups import prune

    g = _g(ctx)
    _emit(g, prune(g.context(), keep=keep, older_than=older_than, dry_run=dry_run).as_dict(), render.pruned)


@app.command(epilog="""
    Count what would go; nothing changes:
      statetool prune --keep-runs 1000 --dry-run
    Remove last year's history, keeping the removed rows:
      statetool prune --before 2026-01-01 --archive runs-2025.jsonl.gz
    """)
def prune(
    ctx: typer.Context,
    before: Annotated[str | None, typer.Option("--before", metavar="DATE", show_default=False,
                                               help="Remove what started before DATE (ISO, UTC).")] = None,
    keep_runs: Annotated[int | None, typer.Option("--keep-runs", metavar="N", show_default=False,
                                                  help="Keep the N newest runs of each export.")] = None,
    export: OnlyExport = None,
    # retention.DEFAULT_BATCH and MAX_BATCH, spelt out: importing the operation here would
    # load SQLAlchemy at every start-up (tests/test_prune.py holds the two equal)
    batch_size: Annotated[int, typer.Option("--batch-size", metavar="N", min=1, max=10_000,
                                            help="Rows per batch (one short write each).")] = 1000,
    archive: Annotated[Path | None, typer.Option("--archive", metavar="FILE", click_type=FILE_NAME, show_default=False,
                                                 help="Write the removed rows to FILE (gzipped JSON lines, new).")
                       ] = None,
    vacuum: Annotated[bool, typer.Option("--vacuum", help="Give the space back afterwards (VACUUM).")] = False,
    dry_run: DryRun = False,
) -> None:
    """Remove old run history and ledger rows, in audited batches.

    Never the latest succeeded run, what a chunked run resumes from, a cursor or a CDC
    position. Not statetool backups prune, which removes copies of the state.
    """
    from statetool import render
    from statetool.operations.retention import prune_history

    g = _g(ctx)
    _emit(g, prune_history(g.context(), before=before, keep_runs=keep_runs, export=export, batch_size=batch_size,
                           archive=archive, vacuum=vacuum, dry_run=dry_run).as_dict(), render.history_pruned)


@app.command()
def revisions(ctx: typer.Context) -> None:
    """Every revision of this release, and which the state has.

    Oldest first.
    """
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
def identity_adopt(ctx: typer.Context, dry_run: DryRun = False) -> None:
    """Record this config's state_key on a state that has none."""
    from statetool import render
    from statetool.operations.identity_ops import adopt

    g = _g(ctx)
    _emit(g, adopt(g.context(), dry_run=dry_run).as_dict(), render.identity_change)


@identity_app.command("rekey")
def identity_rekey(
    ctx: typer.Context,
    old: Annotated[str, typer.Option("--old", metavar="KEY", show_default=False,
                                     help="The key recorded now (exactly).")],
    new: Annotated[str | None, typer.Option("--new", metavar="KEY",
                                            help="The new key, or a source URL (default: this config's).")] = None,
    reason: Reason = "",
    dry_run: DryRun = False,
) -> None:
    """Deliberately change the recorded key (the source moved); audited."""
    from statetool import render
    from statetool.operations.identity_ops import rekey

    g = _g(ctx)
    _emit(g, rekey(g.context(), old, new, reason, dry_run=dry_run).as_dict(), render.identity_change)


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


@exports_app.command("set-cursor", epilog="""
    See the plan first; nothing changes:
      statetool exports set-cursor --dry-run orders 2026-01-01T00:00:00Z
    Rewind orders to a point in time:
      statetool exports set-cursor orders 2026-01-01T00:00:00Z
    A value that starts with '-' goes after --:
      statetool exports set-cursor orders -- -5
    """)
def exports_set_cursor(ctx: typer.Context, name: ExportName,
                       value: Annotated[str, typer.Argument(metavar="VALUE", show_default=False,
                                                            help="The new cursor value.")],
                       dry_run: DryRun = False) -> None:
    """Rewind or advance an export's cursor on purpose.

    A SQLite state is backed up first; the change writes an audit row.
    """
    from statetool import render
    from statetool.operations.exports import set_cursor

    g = _g(ctx)
    _emit(g, set_cursor(g.context(), name, value, dry_run=dry_run).as_dict(), render.export_change)


@exports_app.command("reset")
def exports_reset(ctx: typer.Context, name: ExportName, dry_run: DryRun = False) -> None:
    """Make an export's next run a FIRST RUN on purpose.

    Clears its cursor and chunk checkpoints, keeps its history. A SQLite state is backed
    up first; the change writes an audit row.
    """
    from statetool import render
    from statetool.operations.exports import reset

    g = _g(ctx)
    _emit(g, reset(g.context(), name, dry_run=dry_run).as_dict(), render.export_change)


@leases_app.callback(invoke_without_command=True)
def leases_default(ctx: typer.Context) -> None:
    """``statetool leases`` without a command lists the leases, as ``leases list``."""
    if ctx.invoked_subcommand is None:
        leases_list(ctx)


@leases_app.command("list")
def leases_list(ctx: typer.Context) -> None:
    """Every lease: its state (live, stale, free) and holder.

    Read without taking any lock.
    """
    from statetool import render
    from statetool.operations.leases import show_leases

    g = _g(ctx)
    _emit(g, show_leases(g.context()).as_dict(), render.leases)


def _complete_lease_keys(ctx: typer.Context) -> list[tuple[str, str]]:
    """Shell completion of a lease key: the leases the state lists (statetool.completion)."""
    from statetool.completion import lease_keys

    return lease_keys(ctx)


@leases_app.command("release")
def leases_release(
    ctx: typer.Context,
    key: Annotated[str, typer.Argument(metavar="KEY", show_default=False, help="Lease key, e.g. chunk-run:orders.",
                                       autocompletion=_complete_lease_keys)],
    reason: Reason = "",
    dry_run: DryRun = False,
) -> None:
    """Release a STALE lease (audited); a live holder is refused."""
    from statetool import render
    from statetool.operations.leases import release

    g = _g(ctx)
    _emit(g, release(g.context(), key, reason, dry_run=dry_run), render.lease_release)


@leases_app.command("run", context_settings={"allow_interspersed_args": False}, epilog="""
    Run the pipeline's export under its run lease:
      statetool leases run --export orders -- rivet run orders
    Refuse at once if a run holds it (no wait):
      statetool --lock-wait 0 leases run --export orders -- ./nightly.sh
    """)
def leases_run(
    ctx: typer.Context,
    export: Annotated[str, typer.Option("--export", metavar="NAME", show_default=False,
                                        help="The export whose run lease to hold.",
                                        autocompletion=_complete_exports)],
    command: Annotated[list[str] | None, typer.Argument(metavar="COMMAND", show_default=False,
                                                        help="The command and its arguments, after --.")] = None,
    lease_ttl: Annotated[int, typer.Option("--lease-ttl", metavar="SECONDS", min=1, max=86400,
                                           help="Seconds a PostgreSQL lease lives without a heartbeat.")] = 30,
    kill_after: Annotated[float, typer.Option("--kill-after", metavar="SECONDS", min=0, max=86400,
                                              help="Seconds between SIGTERM and SIGKILL of the command's process "
                                                   "group.")] = 10.0,
) -> None:
    """Hold an export's run lease while a command runs (like flock).

    The command never outlives the lease: a lost lease stops it, and the exit is 2
    (RIVET_STATE_LEASE_LOST); otherwise the exit is the command's. SIGTERM is forwarded
    to the command's process group; what of it has not ended --kill-after seconds later
    gets SIGKILL, and the lease is released only once none of it is left.
    """
    from statetool.operations.leases import run_under_lease

    g = _g(ctx)
    context = g.context()
    context.lease_ttl = lease_ttl
    # The wrapper lives as long as its command, and the process ends when it returns: what
    # start-up built (typer's tree, the modules) is never garbage. Frozen, neither the
    # collections while the command runs nor the full ones at interpreter exit traverse it
    # again (docs/decisions.md, "leases run: what start-up does not pay for"). Only here:
    # an in-process caller of main() would keep its garbage of the moment for good, and
    # the tests run `leases run` as a process (tests/support/cli.py).
    gc.freeze()
    raise typer.Exit(run_under_lease(context, export, command or [], kill_after=kill_after))


def _complete_shells() -> list[str]:
    """Shell completion of ``statetool completion SHELL``."""
    from statetool.completion import SHELLS

    return list(SHELLS)


@app.command(epilog="""
    Load it into the running bash (e.g. from ~/.bashrc):
      source <(statetool completion bash)
    Install it for zsh (a directory on $fpath) or fish:
      statetool completion zsh > ~/.zfunc/_statetool
      statetool completion fish > ~/.config/fish/completions/statetool.fish
    """)
def completion(shell: Annotated[str, typer.Argument(metavar="SHELL", show_default=False,
                                                    help="bash, zsh or fish.", autocompletion=_complete_shells)]
               ) -> None:
    """Print the shell completion script for bash, zsh or fish.

    Commands, options, export names and lease keys complete (the names from the config
    and the state, read-only).
    """
    from statetool.completion import script

    sys.stdout.write(script(shell))


@functools.cache
def global_options() -> dict[str, bool]:
    """The global options, as declared by :func:`main_options`: name (``--config``, ``-c``)
    -> whether it takes a value."""
    return {name: not param.is_flag for param in command_tree().params for name in param.opts}


def hoist_globals(argv: list[str]) -> list[str]:
    """Move global options (and their values) in front of the command name, so
    ``statetool info --json`` means ``statetool --json info``. Stops at ``--``."""
    options = global_options()
    front: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest.extend(argv[i:])
            break
        name = arg.split("=", 1)[0]
        if name in options:
            takes_value = options[name] and "=" not in arg
            front.extend(argv[i:i + 2] if takes_value else [arg])
            i += 2 if takes_value else 1
            continue
        rest.append(arg)
        i += 1
    return front + rest


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
def command_tree() -> Any:
    """The click command tree of :data:`app` that :func:`main` runs, built once per process
    (typer's ``app(...)`` builds it anew on every call: a long-lived caller such as the test
    suite calls :func:`main` thousands of times), and lazily: a command is converted from its
    function when it is first looked up (:func:`statetool.cli_help.lazy_command_tree`)."""
    return lazy_command_tree(app)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI; every failure leaves through one handler (SPEC §7)."""
    given = list(sys.argv[1:] if argv is None else argv)
    args = hoist_globals(given)
    json_errors, debug = "--json-errors" in args, "--debug" in args
    try:
        instruction = os.environ.get("_STATETOOL_COMPLETE")
        if instruction:  # a completion script asks (statetool.completion.COMPLETE_VAR): answer, run nothing
            from statetool.completion import answer

            raise SystemExit(answer(command_tree(), instruction, hoist_globals))
        code = command_tree().main(args=args, prog_name="statetool", standalone_mode=False, obj=given)
    except StateError as error:
        if debug:
            _print_traceback()
        _fail(error, json_errors)
    except typer.Exit as done:
        raise SystemExit(done.exit_code) from None
    except KeyboardInterrupt:
        raise SystemExit(EXIT_INTERRUPTED) from None
    except typer.TyperException as exc:  # the argument parser's usage errors, a bare group's too
        _fail(usage_error(exc, args), json_errors)
    except OSError as exc:  # an environment fault no layer below named: name it, never call it a bug
        from statetool.backends.faults import os_fault

        if debug:
            _print_traceback()
        _fail(os_fault(exc) or internal_error(exc), json_errors)
    except Exception as exc:  # noqa: BLE001 - the one place an unexpected error is turned into RIVET_INTERNAL
        if interrupted(exc):
            # Ctrl-C while a transaction was open: the driver's cleanup error hides the
            # interrupt. Every write is one transaction, so nothing was committed.
            sys.stderr.write("statetool: interrupted; the open transaction was rolled back\n")
            raise SystemExit(EXIT_INTERRUPTED) from None
        if debug:
            _print_traceback()
        _fail(internal_error(exc), json_errors)
    raise SystemExit(code if isinstance(code, int) else 0)
