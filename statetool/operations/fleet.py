"""The fleet pre-flight (issue 16 item 1): ``check``, ``info`` and ``doctor`` over several
pipeline configs in one command.

Each pipeline is read exactly as the single-config command reads it: a
:class:`~statetool.operations.context.Context` of its own, the same operation, the same
document, nested in the fleet's. The reads run on a thread pool of at most
:data:`MAX_WORKERS` threads (:func:`read_all`; a read waits mostly in SQLite's C code or on
a PostgreSQL server, which release the GIL), and the pipelines are listed in the order they
were given, whatever order their reads end in. Then the fleet finds what no single read can
see (:func:`fleet_findings`): pipelines whose configs resolve to one state, and CDC
checkpoints that two pipelines keep in one file or one directory.

Where each pipeline's state is (docs/decisions.md, "Several pipelines at once"): beside its
config, or where the environment variable named for it by ``--state-url-env CONFIG=NAME``
says, read as its tasks read ``RIVET_STATE_URL``. One ``--state-url`` or ``RIVET_STATE_URL``
for several pipelines would put them all into one state: it is refused.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from statetool.backends.faults import os_fault
from statetool.errors import (REGISTRY, STOP_RANK, WARNINGS, StateError, error_object, failure_exit_code,
                              failure_object, pipeline_failure, worst_exit_code)
from statetool.location import ENV_VAR, Location, file_identity, resolve_checkpoint
from statetool.operations.context import Context, ProgressFactory, no_progress

if TYPE_CHECKING:
    from statetool.config import PipelineConfig

#: The most pipelines read at once: each read holds a connection (a SQLite file, or a
#: PostgreSQL session of the server's ``max_connections``) and the machine's cores are few;
#: eight overlap the waits without crowding a server. A fleet of n reads min(8, n) at once.
MAX_WORKERS = 8

T = TypeVar("T")
R = TypeVar("R")


def workers(count: int) -> int:
    """How many reads of a fleet of ``count`` pipelines run at once: min(:data:`MAX_WORKERS`, count), at least 1."""
    return max(1, min(MAX_WORKERS, count))


def read_all(items: list[T], read: Callable[[T], R], progress: ProgressFactory = no_progress) -> list[R]:
    """``read(item)`` for every item, on a pool of :func:`workers` threads; the results in
    the order of ``items``, whatever order the reads end in. ``progress`` is told
    ``(done, total)`` pipelines as each read ends. An exception a read raises is raised
    here once every read has ended (a bug: the CLI makes it ``RIVET_INTERNAL``)."""
    with ThreadPoolExecutor(max_workers=workers(len(items)), thread_name_prefix="statetool-fleet") as pool, \
            progress(f"reading {len(items)} pipelines") as update:
        futures = [pool.submit(read, item) for item in items]
        for done, _ in enumerate(as_completed(futures), 1):
            update(done, len(futures))
    return [future.result() for future in futures]


@dataclass(frozen=True)
class Pipeline:
    """One pipeline of a fleet: its config as given, and the environment variable its state
    URL is read from (``--state-url-env CONFIG=NAME``; None: its state is beside its config)."""

    config: Path
    state_url_env: str | None = None


def expand_configs(pattern: str) -> list[Path]:
    """The files ``--configs GLOB`` names, expanded by statetool (Python's ``glob``: ``*``,
    ``?``, ``[...]``, ``**`` across directories, ``~`` the user's home; relative to the
    working directory), sorted. Raises ``RIVET_CONFIGS_NO_MATCH`` when it names none."""
    matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
    if not matches:
        raise StateError("RIVET_CONFIGS_NO_MATCH", f"--configs {pattern!r} matches no file (relative to "
                         f"{os.getcwd()}): no pipeline to read", {"pattern": pattern})
    return [Path(match) for match in matches]


def _same_file(path: Path) -> str:
    return os.path.realpath(path)


def fleet_pipelines(configs: list[Path], pattern: str | None, state_url_envs: list[str], env: Mapping[str, str],
                    state_url_flag: str | None) -> list[Pipeline]:
    """The pipelines of one fleet command: the ``-c`` configs in the order given, then the
    files ``pattern`` matches (:func:`expand_configs`), a config named twice (by its real
    path) kept at its first place; each paired with the variable ``--state-url-env
    CONFIG=NAME`` names for it.

    Raises ``RIVET_CONFIGS_NO_MATCH``, and ``RIVET_CLI_USAGE`` for: ``--state-url`` (one
    place for every pipeline); ``RIVET_STATE_URL`` set while a pipeline has no
    ``--state-url-env`` (it would put those pipelines into one state); a ``--state-url-env``
    that is not ``CONFIG=NAME``, names no config of the fleet, names one twice, or names a
    variable that is unset or empty. Issue 16 item 1.
    """
    if state_url_flag is not None:
        raise StateError("RIVET_CLI_USAGE", "--state-url names one state, and several configs are given: each "
                         "pipeline has a state of its own; give it with --state-url-env CONFIG=NAME (the variable "
                         "NAME holds that pipeline's RIVET_STATE_URL), or leave it beside its config")
    given: dict[str, Path] = {}
    for path in [*configs, *(expand_configs(pattern) if pattern is not None else [])]:
        given.setdefault(_same_file(path), path)
    named: dict[str, str] = {}
    for pairing in state_url_envs:
        config, sep, name = pairing.rpartition("=")
        if not sep or not config or not name:
            raise StateError("RIVET_CLI_USAGE", f"--state-url-env {pairing!r} is not CONFIG=NAME (a config of the "
                             "fleet, and the environment variable that holds its state URL)")
        key = _same_file(Path(config))
        if key not in given:
            raise StateError("RIVET_CLI_USAGE", f"--state-url-env {pairing}: {config} is not one of the configs "
                             "given (-c, --configs)")
        if key in named:
            raise StateError("RIVET_CLI_USAGE", f"--state-url-env names {config} twice ({named[key]} and {name})")
        if not env.get(name, "").strip():
            raise StateError("RIVET_CLI_USAGE", f"--state-url-env {pairing}: the environment variable {name} is not "
                             f"set or empty; export it with {config}'s state URL (as its tasks' RIVET_STATE_URL)")
        named[key] = name
    unnamed = [str(path) for key, path in given.items() if key not in named]
    if env.get(ENV_VAR, "").strip() and unnamed:
        raise StateError("RIVET_CLI_USAGE", f"{ENV_VAR} is set, and with several configs it would put every "
                         f"pipeline without --state-url-env ({', '.join(unnamed)}) into that one state; unset it for "
                         f"this command (env -u {ENV_VAR} statetool ...), or give each pipeline its state with "
                         "--state-url-env CONFIG=NAME")
    return [Pipeline(path, named.get(key)) for key, path in given.items()]


def pipeline_context(pipeline: Pipeline, env: Mapping[str, str], lock_wait: float, command: str,
                     log: Callable[[str], None]) -> Context:
    """The context one pipeline of a fleet is read with: its config (named, so it must
    exist), the environment with ``RIVET_STATE_URL`` set from its ``state_url_env`` (or
    removed: its state is beside its config), no progress display of its own, and ``log``
    lines prefixed with its config."""
    own = {k: v for k, v in env.items() if k != ENV_VAR}
    if pipeline.state_url_env is not None:
        own[ENV_VAR] = env[pipeline.state_url_env]
    return Context(pipeline.config, None, own, lock_wait, command,
                   log=lambda message: log(f"{pipeline.config}: {message}"), config_given=True)


# -- what each command reads of one pipeline ----------------------------------------------


@dataclass
class PipelineReport:
    """One pipeline's result in a fleet: its config as given, the variable of its state URL,
    its location (``Location.as_dict()``, None when it does not resolve), the exit code its
    single-config command exits with, ``body`` (the single command's document as the fleet
    nests it: ``{"checks": [...]}``, ``{"info": {...}}``, ``{"doctor": {...}}``), the error
    that stopped the read (info, doctor: a state that cannot be described), and the failure
    object of its worst failure with the export it is about (for ``--json-errors``)."""

    config: str
    state_url_env: str | None
    location: dict[str, object] | None
    exit_code: int
    body: dict[str, Any]
    error: StateError | None = None
    failure: dict[str, Any] | None = None
    failure_export: str | None = None

    def as_dict(self, named_by_failing: bool = False) -> dict[str, Any]:
        """``{config, state_url_env, location, ok, exit_code, error, <body>}``; ``ok`` is false
        when its own read failed or ``named_by_failing`` (a failing fleet finding names this
        pipeline: :attr:`FleetResult.failing_findings`); ``exit_code`` is its own command's;
        ``error`` is the error object of ``--json-errors`` or null."""
        return {"config": self.config, "state_url_env": self.state_url_env, "location": self.location,
                "ok": self.exit_code == 0 and not named_by_failing, "exit_code": self.exit_code,
                "error": error_object(self.error) if self.error is not None else None, **self.body}


@dataclass(frozen=True)
class FleetCommand:
    """How a fleet runs one command: ``name`` (``check``, ``info``, ``doctor``), ``read``
    (one pipeline's context -> exit code, body, failure object or None, its export), the
    body of a pipeline whose read raised, whether failing fleet findings fail the command
    (``gates``: check and doctor; info describes), and ``strict`` (check --strict: warning
    findings fail as refusal, as warning rows do)."""

    name: str
    read: Callable[[Context], tuple[int, dict[str, Any], dict[str, Any] | None, str | None]]
    empty: dict[str, Any]
    gates: bool = True
    strict: bool = False


def check_command(strict: bool = False, target: str | None = None) -> FleetCommand:
    """``check`` in a fleet: each pipeline's rows as ``check --json`` gives them (``target``:
    ``check --target``, e.g. the pod rule, for every pipeline)."""
    from statetool.operations.check import check, require_target

    require_target(target)

    def read(ctx: Context) -> tuple[int, dict[str, Any], dict[str, Any] | None, str | None]:
        result = check(ctx, strict=strict, target=target)
        w = result.worst
        failure = failure_object(w.code, w.message, w.error) if w is not None and w.code else None
        export = w.id.split(":", 1)[1] if w is not None and w.id.startswith("doctor:") else None
        return result.exit_code, {"checks": result.as_dict()["checks"]}, failure, export

    return FleetCommand("check", read, {"checks": []}, strict=strict)


def info_command() -> FleetCommand:
    """``info`` in a fleet: each pipeline's ``info --json`` document under ``info``."""
    from statetool.operations.inspect import info

    def read(ctx: Context) -> tuple[int, dict[str, Any], dict[str, Any] | None, str | None]:
        return 0, {"info": info(ctx).as_dict()}, None, None

    return FleetCommand("info", read, {"info": None}, gates=False)


def doctor_command(export: str | None = None) -> FleetCommand:
    """``doctor [--export NAME]`` in a fleet: each pipeline's ``doctor --json`` document
    under ``doctor`` (a pipeline without export NAME fails ``RIVET_EXPORT_UNKNOWN``, as
    alone)."""
    from statetool.operations.doctor import doctor

    def read(ctx: Context) -> tuple[int, dict[str, Any], dict[str, Any] | None, str | None]:
        result = doctor(ctx, export)
        reason = result.worst
        if not result.exit_code or reason is None:
            return result.exit_code, {"doctor": result.as_dict()}, None, None
        state_wide = reason.as_dict() in result.state.get("reasons", ())
        about = None if state_wide else next((e.name for e in result.exports if reason in e.reasons), None)
        return result.exit_code, {"doctor": result.as_dict()}, failure_object(reason.code, reason.message), about

    return FleetCommand("doctor", read, {"doctor": None})


def _location_doc(ctx: Context) -> dict[str, object] | None:
    try:
        return ctx.location.as_dict()
    except StateError:
        return None


def read_pipeline(command: FleetCommand, pipeline: Pipeline, ctx: Context) -> PipelineReport:
    """One pipeline read by ``command``: a registered failure that stops the read (a state
    info cannot describe, a config doctor cannot read, an environment fault such as a
    permission) is that pipeline's ``error``, never the fleet's; anything else raises."""
    location = _location_doc(ctx)
    try:
        code, body, failure, export = command.read(ctx)
    except (StateError, OSError) as exc:
        err = exc if isinstance(exc, StateError) else os_fault(exc)
        if err is None:
            raise
        return PipelineReport(str(pipeline.config), pipeline.state_url_env, location, err.exit_code,
                              dict(command.empty), err, error_object(err), err.details.get("export"))
    return PipelineReport(str(pipeline.config), pipeline.state_url_env, location, code, body, None, failure, export)


# -- what no single read can see -------------------------------------------------------------


@dataclass
class Finding:
    """A fleet finding: ``id`` (``fleet:state``, ``fleet:checkpoint``), ``status`` (``fail``
    or ``warn``), a registered code, the message, the configs it is about (as given) and
    the place they share (a state, a checkpoint file or directory)."""

    id: str
    status: str
    code: str
    message: str
    configs: list[str]
    place: str

    @property
    def action(self) -> str:
        """The registered action of the code."""
        return REGISTRY[self.code].action if self.code in REGISTRY else WARNINGS[self.code]

    def as_dict(self) -> dict[str, object]:
        """``{id, status, code, message, action, configs, place}``."""
        return {"id": self.id, "status": self.status, "code": self.code, "message": self.message,
                "action": self.action, "configs": self.configs, "place": self.place}


def state_place(location: Location) -> tuple[object, ...]:
    """What two locations must share to be one state: :meth:`Location.same_state_key`, the
    one rule (a SQLite file by its identity, device and inode, when it exists, else by its
    real path; a PostgreSQL server, database and schema by libpq's parse,
    :attr:`Location.server`). Two names of one server (``localhost`` and ``127.0.0.1``)
    are not known to be one."""
    return location.same_state_key()


def _names(labels: list[str]) -> str:
    return ", ".join(labels[:-1]) + f" and {labels[-1]}" if len(labels) > 1 else labels[0]


def _facts(ctx: Context) -> tuple[Location, PipelineConfig, str] | None:
    """The location, config and computed key of one pipeline already read (cached on its
    context); None when the location or config does not resolve (its own rows say why)."""
    try:
        location, config = ctx.location, ctx.config
    except (StateError, OSError):
        return None
    try:
        key = ctx.computed_key
    except StateError:
        key = ""
    return location, config, key


def _shared_states(facts: list[tuple[str, Location, PipelineConfig, str]]) -> list[Finding]:
    groups: dict[tuple[object, ...], list[tuple[str, Location, PipelineConfig, str]]] = {}
    for fact in facts:
        groups.setdefault(state_place(fact[1]), []).append(fact)
    found = []
    for members in groups.values():
        if len(members) < 2:
            continue
        labels = [m[0] for m in members]
        first = members[0][1]
        shown = os.path.realpath(first.path) if first.path is not None else first.display
        sources = {m[3] for m in members if m[3]}
        listed = "; ".join(f"{m[0]}: {m[3] or 'not computable (no source URL)'}" for m in members)
        if len(sources) > 1:
            found.append(Finding("fleet:state", "fail", "RIVET_STATE_SHARED",
                                 f"{_names(labels)} resolve to one state, {shown}, but belong to different sources "
                                 f"({listed}): a state holds one source's progress, and each pipeline's runs would "
                                 "read and overwrite the other's cursors, or be refused as foreign", labels, shown))
            continue
        counts: dict[str, int] = {}
        for m in members:
            for name in {e.name for e in m[2].exports}:
                counts[name] = counts.get(name, 0) + 1
        common = sorted(name for name, n in counts.items() if n > 1)
        which = f"of one source ({sources.pop()})" if len(sources) == 1 and all(m[3] for m in members) \
            else f"whose sources are not all known ({listed})"
        effect = (f"the exports {', '.join(common)} are declared by more than one of them and share one cursor, "
                  "one chunk checkpoint and one run lease each: the pipelines will fight over them" if common else
                  "they declare no export in common, so no cursor is shared, but a migration or another write of "
                  "the whole state by one of them stops the runs of all")
        found.append(Finding("fleet:state", "warn", "RIVET_STATE_SHARED_SAME_SOURCE",
                             f"{_names(labels)} resolve to one state, {shown}, {which}: {effect}", labels, shown))
    return found


def _shared_checkpoints(facts: list[tuple[str, Location, PipelineConfig, str]]) -> list[Finding]:
    """Checkpoint files of two or more pipelines (one file by the one rule,
    :func:`~statetool.location.file_identity`, named by the real path of its
    first user), and checkpoint directories they share."""
    by_identity: dict[tuple[object, ...], str] = {}
    files: dict[str, list[tuple[str, str]]] = {}
    for label, location, config, _ in facts:
        for export in config.exports:
            if export.cdc is None:
                continue
            where = resolve_checkpoint(export.cdc.checkpoint, export.cdc.engine, location, config.directory).path
            if where is not None:
                path = by_identity.setdefault(file_identity(where), os.path.realpath(where))
                files.setdefault(path, []).append((label, export.name))
    found = []
    for path, users in files.items():
        labels = list(dict.fromkeys(label for label, _ in users))
        if len(labels) > 1:
            named = ", ".join(f"{label} ({name})" for label, name in users)
            found.append(Finding("fleet:checkpoint", "fail", "RIVET_STATE_CHECKPOINT_SHARED",
                                 f"the CDC exports {named} keep their position in one checkpoint file, {path}: each "
                                 "run overwrites the other's position, and the next run of either resumes from the "
                                 "other stream's position or re-anchors, losing changes without an error",
                                 labels, path))
    directories: dict[str, list[tuple[str, str, str]]] = {}
    for path, users in files.items():
        for label, name in users:
            directories.setdefault(os.path.dirname(path), []).append((label, name, path))
    for directory, users in directories.items():
        labels = list(dict.fromkeys(label for label, _, _ in users))
        if len(labels) > 1 and len({path for _, _, path in users}) > 1:
            named = ", ".join(f"{label} ({name})" for label, name, _ in users)
            found.append(Finding("fleet:checkpoint", "warn", "RIVET_STATE_CHECKPOINT_DIR_SHARED",
                                 f"the CDC checkpoints of {named} are in one directory, {directory}: restoring, "
                                 "cleaning up or moving that directory for one pipeline changes the other's "
                                 "positions too", labels, directory))
    return found


def fleet_findings(read: list[tuple[str, Context]]) -> list[Finding]:
    """What the pipelines ``read`` (config label, its context after its read) share, which no
    single read can see (issue 16 item 1), in this order:

    - one state (:func:`state_place`) for configs of different sources (their computed
      ``state_key`` values differ): ``RIVET_STATE_SHARED`` (fail); of one source, or of
      sources not all computable: warning ``RIVET_STATE_SHARED_SAME_SOURCE``, naming the
      exports they both declare (one cursor, chunk checkpoint and run lease each);
    - one CDC checkpoint file (real path) for exports of two pipelines:
      ``RIVET_STATE_CHECKPOINT_SHARED`` (fail); checkpoint files of two pipelines in one
      directory: warning ``RIVET_STATE_CHECKPOINT_DIR_SHARED``.

    A pipeline whose location or config does not resolve is left out (its own read fails).
    Reads no state; resolves each checkpoint as ``doctor`` does (an existence test).
    """
    facts = []
    for label, ctx in read:
        got = _facts(ctx)
        if got is not None:
            facts.append((label, *got))
    return _shared_states(facts) + _shared_checkpoints(facts)


# -- the fleet's result ----------------------------------------------------------------------


def _worst(objects: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The failure object whose class ranks highest (:data:`STOP_RANK`), the first among
    equals (in a fleet: the first pipeline's, in the order given; docs/commands.md)."""
    best: dict[str, Any] | None = None
    for obj in objects:
        if best is None or STOP_RANK[obj["class"]] > STOP_RANK[best["class"]]:
            best = obj
    return best


@dataclass
class FleetResult:
    """Every pipeline's report, in the order given, and the fleet's findings."""

    command: FleetCommand
    pipelines: list[PipelineReport]
    fleet: list[Finding] = field(default_factory=list)

    @property
    def failing_findings(self) -> list[Finding]:
        """The findings that fail the command: ``fail`` ones of a command that gates."""
        return [f for f in self.fleet if f.status == "fail"] if self.command.gates else []

    def named_by_failing(self, report: PipelineReport) -> bool:
        """True when a failing finding (:attr:`failing_findings`) names ``report``'s pipeline."""
        return any(report.config in f.configs for f in self.failing_findings)

    @property
    def exit_code(self) -> int:
        """The worst (:func:`statetool.errors.worst_exit_code`) of every pipeline's exit code
        and of each failing finding's class."""
        return worst_exit_code([p.exit_code for p in self.pipelines]
                               + [failure_exit_code(f.code) for f in self.failing_findings])

    @property
    def ok(self) -> bool:
        """True when the fleet exits 0."""
        return self.exit_code == 0

    @property
    def failures(self) -> list[dict[str, Any]]:
        """The ``failures[]`` of ``--json-errors``: each failed pipeline, in order, with the
        worst of its own failure and those of the failing findings that name it, its own
        first among equals (:func:`statetool.errors.pipeline_failure`: ``config`` and
        ``export`` added)."""
        out = []
        for p in self.pipelines:
            own = [(p.failure, p.failure_export)] if p.exit_code and p.failure is not None else []
            shared = [(failure_object(f.code, f.message), None) for f in self.failing_findings if p.config in f.configs]
            candidates = own + shared
            chosen = _worst([obj for obj, _ in candidates])
            if chosen is not None:
                export = next(export for obj, export in candidates if obj is chosen)
                out.append(pipeline_failure(p.config, chosen, export))
        return out

    def error_line(self) -> dict[str, Any] | None:
        """The ``--json-errors`` object of a failed fleet: the worst of :attr:`failures`, the
        first in the pipelines' order among equals (its ``config`` and ``export`` dropped),
        with ``failures``; None when the fleet is ok."""
        failures = self.failures
        worst = _worst(failures)
        if worst is None:
            return None
        return {**{k: v for k, v in worst.items() if k not in ("config", "export")}, "failures": failures}

    def as_dict(self) -> dict[str, object]:
        """``{"ok", "command", "pipelines": [...], "fleet": [...]}``."""
        return {"ok": self.ok, "command": self.command.name,
                "pipelines": [p.as_dict(self.named_by_failing(p)) for p in self.pipelines],
                "fleet": [f.as_dict() for f in self.fleet]}


def run_fleet(command: FleetCommand, pipelines: list[Pipeline], contexts: list[Context],
              progress: ProgressFactory = no_progress) -> FleetResult:
    """Read every pipeline with ``command`` (:func:`read_pipeline`, concurrently:
    :func:`read_all`), then find what they share (:func:`fleet_findings`); under
    ``command.strict`` a warning finding fails as refusal, as a warning row does. Never
    writes; a pipeline's failure is its report's, never raised."""
    reports = read_all(list(zip(pipelines, contexts)), lambda pair: read_pipeline(command, *pair), progress)
    findings = fleet_findings([(str(p.config), ctx) for p, ctx in zip(pipelines, contexts)])
    if command.strict:
        findings = [Finding(f.id, "fail", f.code, f.message, f.configs, f.place) if f.status == "warn" else f
                    for f in findings]
    return FleetResult(command, reports, findings)
