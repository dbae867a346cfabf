"""THE state resolver (SPEC §1): where the state lives, and why.

No other code computes a state path. Every command and the runtime API call
:func:`resolve_location`, and every message names :attr:`Location.display`, the place
that was actually opened.
"""

from __future__ import annotations

import os
import re
import shlex
import stat
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple
from urllib.parse import parse_qsl, urlencode, urlsplit

import statetool
from statetool.errors import StateError
from statetool.redact import mask_userinfo, redact_text, redact_url, remember_secrets, userinfo_problem

#: The SQLite state file's name, beside the config or in a declared directory (SPEC §1).
STATE_FILE = ".rivet_state.db"
#: The folder of SQLite lease sidecars beside the state file (SPEC §5, §10).
LEASE_DIR = ".rivet_state.leases"
#: The longest sidecar file name (bytes), well inside every filesystem's 255.
MAX_LEASE_FILE_NAME = 240
_LEASE_NAME_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


#: The ASCII characters outside ``_LEASE_NAME_SAFE`` and their escapes, for ``str.translate``.
_ASCII_ESCAPES = {c: f"%{c:02X}" for c in range(128) if chr(c) not in _LEASE_NAME_SAFE}


def lease_file_name(key: str) -> str:
    """The sidecar file name of lease ``key`` (SPEC §5): every byte outside ``[A-Za-z0-9_-]``
    percent-encoded (``.`` and ``/`` too), so no key can name ``..``, a path or a hidden file.
    May be longer than :data:`MAX_LEASE_FILE_NAME`: callers refuse such keys. (An ASCII key,
    the common case, is encoded by one ``str.translate``: the config loader names the run
    lease of every export, 2,000 of them in a large pipeline.)"""
    if key.isascii():
        return key.translate(_ASCII_ESCAPES)
    return "".join(ch if ch in _LEASE_NAME_SAFE else "".join(f"%{b:02X}" for b in ch.encode()) for ch in key)


#: The pipeline config read when no --config/-c is given (SPEC §2): defined in the package
#: itself (the CLI's start-up needs it and nothing else of this module), named here.
DEFAULT_CONFIG = statetool.DEFAULT_CONFIG
#: The environment variable that selects the state (SPEC §1).
ENV_VAR = "RIVET_STATE_URL"
#: The PostgreSQL schema of a state whose URL names none (SPEC §1).
DEFAULT_SCHEMA = "rivet_state"

ACCEPTED_FORMS = (
    "unset or empty (SQLite .rivet_state.db beside the config); "
    "sqlite:/absolute/directory (declared directory); "
    "postgres://, postgresql:// or postgresql+psycopg://user@host:port/db[?schema=NAME] (shared)"
)
_PG_SCHEMES = {"postgres", "postgresql", "postgresql+psycopg"}
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]{0,62}$")


class Location(NamedTuple):
    """A resolved state location.

    ``backend`` is ``"sqlite"`` or ``"postgres"``; ``scope`` is ``"beside_config"``,
    ``"declared_dir"`` or ``"shared"`` (the identity rules of SPEC §3 depend on it);
    ``origin`` says where the setting came from: ``"default"``, ``"env"`` or ``"flag"``.
    SQLite locations carry ``directory`` and ``path`` (absolute); PostgreSQL locations
    carry ``url`` (``postgresql://…`` with ``?schema`` stripped and the password kept:
    print only :attr:`display`) and ``schema``.
    """

    backend: str
    scope: str
    origin: str
    directory: Path | None = None
    path: Path | None = None
    url: str | None = None
    schema: str | None = None
    #: The state file itself when ``path`` is a symlink (resolved once, by the resolver);
    #: else equal to ``path``. Relocate and transfer retire this file (SPEC §9, issue 10).
    real_path: Path | None = None
    #: The setting that gave the location when it is neither ``--state-url`` nor
    #: ``RIVET_STATE_URL`` (a transfer's ``--to``, ``--to-env NAME``); see :attr:`setting`.
    named_by: str | None = None

    @property
    def display(self) -> str:
        """The place to name in messages: the file path, or the URL with its password masked."""
        if self.path is not None:
            return str(self.path)
        return f"{redact_url(self.url or '')} (schema {self.schema})"

    @property
    def lease_dir(self) -> Path | None:
        """The folder of SQLite lease sidecars beside the real state file (:data:`LEASE_DIR`):
        a symlinked state and the directory its file really is in share one lease of each
        key (SPEC §5); None for PostgreSQL, whose leases are rows."""
        return (self.real_path or self.path).parent / LEASE_DIR if self.path is not None else None

    def companion(self, suffix: str) -> Path | None:
        """The file SQLite keeps beside the state file, named by ``suffix`` (``-journal``,
        ``-wal``, ``-shm``); None for PostgreSQL."""
        return Path(f"{self.path}{suffix}") if self.path is not None else None

    @property
    def state_url(self) -> str:
        """The ``RIVET_STATE_URL`` value that selects this location, password masked."""
        if self.scope == "beside_config":
            return ""
        if self.backend == "sqlite":
            return f"sqlite:{self.directory}"
        url = self.url or ""
        if self.schema != DEFAULT_SCHEMA:
            url += f"{'&' if '?' in url else '?'}schema={self.schema}"
        return redact_url(url)

    def directory_missing(self, hint: str = "") -> StateError:
        """``RIVET_STATE_DIR_MISSING`` for this declared directory, which does not exist,
        naming the setting that declared it (``--state-url`` or ``RIVET_STATE_URL``), as every
        refusal of a location does; ``hint`` ends the sentence (a likely misspelling)."""
        return StateError("RIVET_STATE_DIR_MISSING",
                          f"{self.setting}: the declared state directory {self.directory} does not exist (a volume "
                          f"that did not mount?){hint or self._spelling_hint()}", {"path": str(self.directory)})

    def directory_problem(self) -> StateError | None:
        """What is wrong with the directory the SQLite state file belongs in, the one check
        every command makes before it opens, lists or creates anything there: None when it is
        a directory (or for PostgreSQL); else ``RIVET_STATE_DIR_MISSING`` when a declared
        directory does not exist (:meth:`directory_missing`), or when the directory, declared or
        beside the config, is a file (a ``sqlite:`` location that names the state file itself
        gets the spelling that names its directory). Reads one ``stat``."""
        if self.directory is None:
            return None
        try:
            if stat.S_ISDIR(os.stat(self.directory).st_mode):
                return None
        except FileNotFoundError:
            return self.directory_missing() if self.scope == "declared_dir" else None
        except NotADirectoryError:
            pass
        except OSError:
            return None  # a directory this user may not look at: the open says so, by its own code
        return self.not_a_directory()

    def not_a_directory(self) -> StateError:
        """``RIVET_STATE_DIR_MISSING`` for a state directory that is a file, or has a file
        where a directory of its path belongs (ENOTDIR)."""
        hint = self._spelling_hint() or f"; a sqlite: location names the directory that holds {STATE_FILE}"
        origin = f"{self.setting}: " if self.scope == "declared_dir" else ""
        return StateError("RIVET_STATE_DIR_MISSING", f"{origin}{self.directory} is a file, not a directory{hint}",
                          {"path": str(self.directory)})

    @property
    def setting(self) -> str:
        """The setting that gave this location, as a refusal of it names it first:
        ``--state-url``, ``RIVET_STATE_URL`` (also for the default beside the config, which
        an empty or unset variable gives), or :attr:`named_by`."""
        return self.named_by or ("--state-url" if self.origin == "flag" else ENV_VAR)

    def _spelling_hint(self) -> str:
        directory = self.directory
        if directory is None or not (directory.name == STATE_FILE or directory.suffix == ".db"):
            return ""
        return f"; a sqlite: location names the directory that holds {STATE_FILE}: sqlite:{directory.parent}"

    @property
    def server(self) -> str | None:
        """The PostgreSQL server and database this location names, in one canonical
        spelling (:func:`canonical_server`: libpq's own parse of :attr:`url`, no user, no
        password); None for SQLite."""
        return canonical_server(self.url or "") if self.backend == "postgres" else None

    def same_state_key(self) -> tuple[object, ...]:
        """What two locations share exactly when they are one state (issue 16 item 1):
        a SQLite file's :func:`file_identity` (so a symlinked directory, a hard link and a
        bind mount are all found); a PostgreSQL
        ``("postgres", server, schema)`` (:attr:`server`). Reads one ``stat``."""
        if self.path is None:
            return ("postgres", self.server, self.schema)
        return ("sqlite", *file_identity(self.path))

    def as_dict(self) -> dict[str, object]:
        """JSON shape: ``{backend, scope, origin, path, directory, url, schema, display}``."""
        return {
            "backend": self.backend,
            "scope": self.scope,
            "origin": self.origin,
            "path": str(self.path) if self.path else None,
            "directory": str(self.directory) if self.directory else None,
            "url": redact_url(self.url) if self.url else None,
            "schema": self.schema,
            "display": self.display,
        }


def resolve_location(env_value: str | None, flag_value: str | None, config_path: str | os.PathLike[str], *,
                     setting: str | None = None) -> Location:
    """Resolve the state location from ``--state-url`` (wins when given) or ``RIVET_STATE_URL``.

    ``config_path`` is the pipeline config; the default state lives in its directory.
    Raises ``RIVET_STATE_URL_INVALID`` for an unknown form or ``sqlite:///x`` (with the
    right spelling as a hint) and ``RIVET_STATE_DIR_RELATIVE`` for ``sqlite:`` with a
    relative directory; every message starts with the setting refused (``--state-url`` or
    ``RIVET_STATE_URL``; ``setting`` names another one that gave ``flag_value``, such as a
    transfer's ``--to``, and is kept as :attr:`Location.named_by`). Touches no file; for
    SQLite it reads one link: a state file that is a symlink is resolved here, once, into
    :attr:`Location.real_path`.
    """
    if flag_value is not None:
        raw, origin = flag_value, "flag"
    else:
        raw, origin = (env_value or ""), "env"
    raw = raw.strip()
    remember_secrets(raw)
    if not raw:
        directory = Path(os.path.abspath(os.fspath(config_path))).parent
        return Location("sqlite", "beside_config", "default" if origin == "env" else origin,
                        directory=directory, path=directory / STATE_FILE, real_path=_real_file(directory / STATE_FILE))
    scheme = raw.split(":", 1)[0].lower() if ":" in raw else ""
    source = setting or ("--state-url" if origin == "flag" else ENV_VAR)
    try:
        if scheme == "sqlite":
            return _sqlite_dir(raw, origin)._replace(named_by=setting)
        if scheme in _PG_SCHEMES and raw[len(scheme):].startswith("://"):
            return _postgres(raw, origin)._replace(named_by=setting)
    except StateError as err:  # every refusal names the setting it refuses: flag or environment
        raise StateError(err.code, f"{source}: {err.message}", err.details) from None
    raise StateError(
        "RIVET_STATE_URL_INVALID",
        f"{source} value '{raw}' is not a state location; accepted forms: {ACCEPTED_FORMS}",
        {"value": raw},
    )


def _sqlite_dir(raw: str, origin: str) -> Location:
    rest = raw[len("sqlite:"):]
    if rest.startswith("//"):
        hint = "/" + rest.lstrip("/")
        raise StateError(
            "RIVET_STATE_URL_INVALID",
            f"'{raw}' is a SQLAlchemy file URL, not a state directory; "
            f"name the directory that holds {STATE_FILE}: sqlite:{hint}",
            {"value": raw, "hint": f"sqlite:{hint}"},
        )
    if not rest:
        raise StateError("RIVET_STATE_URL_INVALID",
                         f"'{raw}' names no directory; accepted forms: {ACCEPTED_FORMS}", {"value": raw})
    if not os.path.isabs(rest):
        raise StateError(
            "RIVET_STATE_DIR_RELATIVE",
            f"state directory '{rest}' is relative; every task of every scheduler must see the same "
            f"absolute path (for example sqlite:{os.path.normpath(os.path.join('/srv/rivet', rest.lstrip('~/')))})",
            {"value": raw},
        )
    directory = Path(os.path.normpath(rest))
    return Location("sqlite", "declared_dir", origin, directory=directory, path=directory / STATE_FILE,
                    real_path=_real_file(directory / STATE_FILE))


def file_location(path: str | os.PathLike[str]) -> Location:
    """The location of a SQLite state file named by its own path, whatever its name (a
    backup ``.rivet_state.db.backup-<label>-<time>`` a write left, a copy), for reading it
    (``statetool diff``): scope ``declared_dir``, origin ``flag``, ``path`` absolute. Pure:
    it touches no file but the one link :func:`resolve_location` reads too."""
    absolute = Path(os.path.abspath(os.fspath(path)))
    return Location("sqlite", "declared_dir", "flag", directory=absolute.parent, path=absolute,
                    real_path=_real_file(absolute))


def _real_file(path: Path) -> Path:
    """``path`` itself, or, when it is a symlink, the file it finally points at (absolute,
    every link of the chain followed; the file need not exist)."""
    return Path(os.path.realpath(path)) if os.path.islink(path) else path


#: libpq's sslmode values (a typo would otherwise surface only at connect time, as a retry).
SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")


def _url_invalid(raw: str, why: str) -> StateError:
    """``RIVET_STATE_URL_INVALID`` for a PostgreSQL URL, naming it with its userinfo masked
    up to the last ``@`` and never quoting a parser's message (which may hold a piece of
    the password)."""
    shown = mask_userinfo(raw)
    return StateError("RIVET_STATE_URL_INVALID", f"PostgreSQL state URL '{shown}' {why}; the accepted form is "
                      "postgresql://user@host:port/db[?schema=NAME] (a password percent-encoded)",
                      {"value": redact_text(shown)})


def _postgres(raw: str, origin: str) -> Location:
    """The PostgreSQL location of ``raw``, checked before any use (no connection, no DNS).

    Refused with ``RIVET_STATE_URL_INVALID``: an ambiguous userinfo (a raw ``/ ? # @`` or
    whitespace before the last ``@``), whitespace or a ``#`` anywhere, an ``@`` or ``?``
    after the host part, a port that is not a number, no database named, ``schema``
    repeated or not an identifier, an ``sslmode`` libpq does not know, a parameter libpq
    does not know, a bad percent-encoding (docs/decisions.md, "URLs and secrets"); and a
    query libpq would misread (issue 12 item 8, docs/decisions.md "A state URL with a
    query"): a second ``?``, a parameter without ``=`` or without a name, a parameter glued
    onto the database name or onto another parameter's value by anything but ``&``.
    """
    problem = userinfo_problem(raw)
    if problem:
        raise _url_invalid(raw, f"is refused before any connection: {problem}")
    if any(ch.isspace() for ch in raw) or "#" in raw:
        raise _url_invalid(raw, "holds whitespace or a '#'; percent-encode them (%20, %23)")
    try:
        parts = urlsplit(raw)
        port = parts.port
    except ValueError:
        raise _url_invalid(raw, "has a port that is not a number from 1 to 65535 (or an unbalanced '[' ']' host)") \
            from None
    if port == 0:
        raise _url_invalid(raw, "has port 0; name the server's port (default 5432)")
    if "?" in parts.query:
        joined = parts.query.replace("?", "&")
        raise _url_invalid(raw, f"has a second '?' in its query ('?{redact_text(parts.query)}'): only the first "
                                f"parameter follows a '?', every further one is joined with '&' "
                                f"('?{redact_text(joined)}')")
    database = parts.path.lstrip("/")
    if not database or "/" in database:
        raise _url_invalid(raw, "names no database (one path segment: postgresql://host/db)")
    _check_query_pieces(raw, parts.query)
    query = parse_qsl(parts.query, keep_blank_values=True)
    schemas = [v for k, v in query if k == "schema"]
    if len(schemas) > 1:
        raise _url_invalid(raw, f"names the schema {len(schemas)} times ({', '.join(repr(s) for s in schemas)}); "
                                "give ?schema= once")
    schema = schemas[0] if schemas else DEFAULT_SCHEMA
    if not _IDENTIFIER.match(schema):
        raise _url_invalid(raw, f"has schema '{schema}', not a plain SQL identifier (letters, digits, _)")
    rest = [(k, v) for k, v in query if k != "schema"]
    _check_libpq_parameters(raw, database, rest)
    query_text = urlencode(rest)
    # Spelled out rather than urlunsplit, which drops the "//" of a URL with no host
    # (postgresql:///db?host=/run/postgresql): libpq needs it.
    url = f"postgresql://{parts.netloc}{parts.path}" + (f"?{query_text}" if query_text else "")
    _check_conninfo(raw, url)
    return Location("postgres", "shared", origin, url=url, schema=schema)


def _check_query_pieces(raw: str, query: str) -> None:
    """Refuse a query piece that is not ``name=value``: ``?host`` alone would connect to
    libpq's default socket, ``?=x`` names nothing. Empty pieces (``&&``, a trailing ``&``)
    are harmless and pass."""
    for piece in query.split("&"):
        name, equals, _ = piece.partition("=")
        if piece and not equals:
            raise _url_invalid(raw, f"has parameter '{redact_text(piece)}' without a value; write every parameter "
                                    "as name=value, joined with '&'")
        if equals and not name:
            raise _url_invalid(raw, "has a parameter without a name ('=…'); write every parameter as name=value, "
                                    "joined with '&'")


#: A parameter glued on by a separator that is not '&': after a ';' or a second '?'
#: (raw or percent-encoded) libpq takes it for part of the value before it, and fails to
#: connect, which would read as a retryable "unreachable" (issue 12 item 8).
_GLUED = re.compile(r"([?&;])([A-Za-z_]+)=")
#: Parameters whose value is a secret: never quoted, never searched for glued parameters.
_SECRET_PARAMETERS = frozenset({"password", "sslpassword"})


def _glued(text: str, known: set[str]) -> re.Match[str] | None:
    """The first ``<separator><parameter>=`` in ``text`` whose parameter libpq (or
    statetool, ``schema``) knows, or None."""
    return next((m for m in _GLUED.finditer(text) if m.group(2) in known or m.group(2) == "schema"), None)


def _check_libpq_parameters(raw: str, database: str, query: list[tuple[str, str]]) -> None:
    from psycopg import pq  # only for PostgreSQL URLs: the SQLite path never loads the driver

    known = {opt.keyword.decode() for opt in pq.Conninfo.get_defaults()}
    glued = _glued(database, known)
    if glued:
        raise _url_invalid(raw, f"has '{glued.group(0)}' in its database name '{redact_text(database)}': "
                                "parameters start after a '?' (postgresql://host/db?schema=NAME), every further one "
                                "joined with '&'")
    for key, value in query:
        glued = None if key in _SECRET_PARAMETERS else _glued(value, known)
        if glued:
            shown = "a value" if glued.group(2) in _SECRET_PARAMETERS else f"the value '{redact_text(value)}'"
            raise _url_invalid(raw, f"gives {key} {shown}, which holds a second parameter, '{glued.group(2)}', after "
                                    f"'{glued.group(1)}'; separate parameters with '&'")
    unknown = sorted({k for k, _ in query if k not in known})
    if unknown:
        raise _url_invalid(raw, f"has parameter(s) {', '.join(unknown)} that libpq does not know")
    repeated = sorted({k for k, _ in query if sum(1 for other, _ in query if other == k) > 1})
    if repeated:
        raise _url_invalid(raw, f"gives parameter(s) {', '.join(repeated)} more than once")
    for key, value in query:
        if key == "sslmode" and value not in SSLMODES:
            raise _url_invalid(raw, f"has sslmode '{value}'; libpq knows {', '.join(SSLMODES)}")


def _check_conninfo(raw: str, url: str) -> None:
    """Let libpq parse ``url`` offline (no connection); its message is never shown: it may
    quote a piece of the password (a bad percent-encoding)."""
    from psycopg import ProgrammingError
    from psycopg.conninfo import conninfo_to_dict

    try:
        conninfo_to_dict(url)
    except ProgrammingError:
        raise _url_invalid(raw, "does not parse for libpq (a '%' must start %XX with two hex digits, "
                                "and %00 is never allowed)") from None


def file_identity(path: Path | str) -> tuple[object, ...]:
    """Which file ``path`` names, the one rule by which two names are one file (a state
    file of two pipelines, SPEC §1; a checkpoint file of two CDC exports, SPEC §6, §5a):
    ``("inode", st_dev, st_ino)`` where a file is there (through every symlink; a hard link
    and a bind mount are the same file), else ``("path", real path)`` (through every
    symlink and ``..``: where a file would be written). Reads nothing but ``stat``."""
    try:
        st = os.stat(path)
    except OSError:
        return ("path", os.path.realpath(path))
    return ("inode", st.st_dev, st.st_ino)


def _canonical_host(host: str) -> str:
    """One host of a conninfo: a socket directory (an absolute path, or libpq's ``@`` for
    an abstract socket) normalized as a path; a name or address lower-cased."""
    if host.startswith(("/", "@")):
        return os.path.normpath(host)
    return host.lower()


def canonical_server(conninfo: str) -> str:
    """The server and database a libpq ``conninfo`` names (a ``postgresql://`` URL or the
    ``key=value`` keyword form), as one canonical, password-free keyword string
    ``host=... port=... dbname=...`` (psycopg's ``make_conninfo``), so that every
    spelling of one server compares equal: the host in the authority or in ``?host=``, a
    socket directory with or without a trailing ``/``, the port 5432 spelled or not, the
    user, password and other parameters, which name no other server, left out. What is
    not given is what libpq would use (``PGHOST``, ``PGPORT``, ``PGDATABASE``, else
    libpq's defaults: the default socket, 5432, a database named as the user). Several
    hosts (``h1,h2``) keep their order, each with its port. Two names of one machine
    (``localhost``, ``127.0.0.1``) stay two. ``""`` when libpq cannot parse it. No
    connection, no DNS."""
    from psycopg import ProgrammingError, pq
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    try:
        given = {k: str(v) for k, v in conninfo_to_dict(conninfo).items() if v is not None and str(v) != ""}
    except ProgrammingError:
        return ""
    defaults = {o.keyword.decode(): o.val.decode() for o in pq.Conninfo.get_defaults() if o.val is not None}
    hosts = (given.get("host") or given.get("hostaddr") or defaults.get("host") or defaults.get("hostaddr")
             or "").split(",")
    default_port = defaults.get("port") or "5432"
    ports = (given.get("port") or default_port).split(",")
    if len(ports) == 1:
        ports *= len(hosts)
    dbname = given.get("dbname") or defaults.get("dbname") or given.get("user") or defaults.get("user") or ""
    return make_conninfo(host=",".join(_canonical_host(h) for h in hosts),
                         port=",".join(p or default_port for p in ports), dbname=dbname)


class CheckpointPlace(NamedTuple):
    """Where a CDC export's checkpoint file resolves (SPEC §6), and why.

    ``path`` is absolute (None when the engine keeps its position server-side and no file
    is configured); ``why`` says which rule chose it; ``warning`` is the warning code the
    place carries (``RIVET_STATE_CHECKPOINT_BESIDE_CONFIG``,
    ``RIVET_STATE_CHECKPOINT_RELATIVE``) or None.
    """

    path: Path | None
    why: str
    warning: str | None = None


#: CDC engines whose position lives only in the checkpoint file (postgres keeps it in its slot).
FILE_CHECKPOINT_ENGINES = frozenset({"mysql", "mongodb", "oracle"})


def resolve_checkpoint(configured: str | None, engine: str, location: Location, config_dir: Path,
                       exists: Callable[[Path], bool] = os.path.lexists) -> CheckpointPlace:
    """Resolve a ``cdc.checkpoint`` (SPEC §6); the one function the runtime, doctor,
    checkpoints and relocate use.

    Absolute: as given. Relative: under the declared directory with ``sqlite:<dir>``
    (a file found only beside the config is used, warning
    ``RIVET_STATE_CHECKPOINT_BESIDE_CONFIG``); beside the config otherwise, with warning
    ``RIVET_STATE_CHECKPOINT_RELATIVE`` under PostgreSQL state. No file configured: the
    postgres engine's position is in its replication slot (``path`` None); for the other
    engines the file is mandatory and ``why`` says it is missing from the config.
    ``exists`` is the only I/O (injectable for tests of the rule itself): ``lexists``, so
    that a symlink to nothing under the declared directory (a volume not mounted) is what
    is there, never passed over for a stale file beside the config.
    """
    if not configured:
        if engine in FILE_CHECKPOINT_ENGINES:
            return CheckpointPlace(None, f"no cdc.checkpoint configured, but a {engine} stream keeps its "
                                         "position only in that file")
        return CheckpointPlace(None, "no file: the postgres engine keeps its position in its replication slot")
    if os.path.isabs(configured):
        return CheckpointPlace(Path(os.path.normpath(configured)), "absolute path in the config")
    beside = Path(os.path.normpath(config_dir / configured))
    if location.scope == "declared_dir":
        assert location.directory is not None
        declared = Path(os.path.normpath(location.directory / configured))
        if not exists(declared) and exists(beside):
            return CheckpointPlace(beside, "relative: not under the declared state directory, found beside the config",
                                   "RIVET_STATE_CHECKPOINT_BESIDE_CONFIG")
        return CheckpointPlace(declared, "relative: under the declared state directory")
    if location.backend == "postgres":
        return CheckpointPlace(beside, "relative: beside the config (the state is in PostgreSQL)",
                               "RIVET_STATE_CHECKPOINT_RELATIVE")
    return CheckpointPlace(beside, "relative: beside the config, with the state")


def checkpoint_relative_message(export: str, path: Path) -> str:
    """The text of ``RIVET_STATE_CHECKPOINT_RELATIVE`` (SPEC §6): every element it must state,
    and first among the remedies the one that needs no storage at all, the position moved into
    the state (issue 15 item 5), as a command to copy (the export's name shell-quoted)."""
    return (f"CDC export {export}: its checkpoint resolves to {path}, a file on this worker's own disk, while the "
            "state is in PostgreSQL. If that file is lost (a new pod, a rebuilt worker), the next run reads as a "
            "first run: the stream re-anchors at the current position, and the changes between the lost position "
            "and the new anchor are gone without an error. Move its position into the state with statetool "
            f"checkpoints import --export {shlex.quote(export)}, or set cdc.checkpoint to an absolute path on "
            "storage that outlives the worker.")
