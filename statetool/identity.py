"""State identity (SPEC §3): the ``state_key`` of a source URL, and the decision table.

Pure functions: no I/O. :func:`state_key` derives the key; :func:`identity_verdict`
applies the table for one (recorded, computed, scope, has-progress) combination;
:func:`identity_message` is the one sentence of each verdict and :func:`identity_warning`
the one warning a verdict gives (``RIVET_STATE_IDENTITY_ADOPTED``,
``RIVET_STATE_FOREIGN_BESIDE_CONFIG``), for every command that reports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlsplit

from statetool.errors import WARNINGS, StateError, StateWarning
from statetool.redact import mask_userinfo, userinfo_problem

#: Default ports filled into the key when the URL names none.
DEFAULT_PORTS: dict[str, int] = {
    "postgresql": 5432,
    "mysql": 3306,
    "mariadb": 3306,
    "mongodb": 27017,
    "oracle": 1521,
    "mssql": 1433,
    "sqlserver": 1433,
}
_SCHEME_ALIASES = {"postgres": "postgresql", "mongo": "mongodb"}


def state_key(source_url: str | None) -> str:
    """Return the canonical ``state_key`` of a source URL, or ``""`` if it cannot be computed.

    Shape: ``<scheme>://<host>:<port>/<database>``; scheme canonical (``postgres`` and
    ``postgresql+driver`` -> ``postgresql``), host lower-cased (IPv6 in brackets), port
    defaulted per engine (:data:`DEFAULT_PORTS`), database the first path segment. No
    user, password or query. ``""`` when the URL is empty, unparseable or names no host
    (a Unix-socket URL counts its ``?host=`` directory as the host).
    Example: ``postgres://u:p@DB.internal/sales`` -> ``postgresql://db.internal:5432/sales``.

    Raises ``RIVET_SOURCE_URL_INVALID`` for an ambiguous userinfo (a raw ``/ ? # @`` or
    whitespace before the last ``@``, :func:`statetool.redact.userinfo_problem`): no key
    is derived from a URL whose host might be a piece of its password (docs/decisions.md,
    "URLs and secrets").
    """
    if not source_url or "://" not in source_url:
        return ""
    problem = userinfo_problem(source_url.strip())
    if problem:
        raise StateError("RIVET_SOURCE_URL_INVALID",
                         f"the source URL {mask_userinfo(source_url.strip())} cannot give a state key: {problem}")
    try:
        parts = urlsplit(source_url.strip())
        port = parts.port
    except ValueError:
        return ""
    scheme = parts.scheme.lower()
    if "+" in scheme and not scheme.startswith("mongodb+srv"):
        scheme = scheme.split("+", 1)[0]
    scheme = _SCHEME_ALIASES.get(scheme, scheme)
    host = (parts.hostname or "").lower()
    if not host:
        host = next((v for k, v in parse_qsl(parts.query) if k == "host"), "")
    if not host or not scheme:
        return ""
    if ":" in host:
        host = f"[{host}]"
    if port is None:
        port = DEFAULT_PORTS.get(scheme)
    database = unquote(parts.path.lstrip("/").split("/", 1)[0])
    authority = f"{host}:{port}" if port is not None else host
    return f"{scheme}://{authority}/{database}"


@dataclass(frozen=True)
class Verdict:
    """What a write would do with a state's identity.

    ``action`` is one of ``skip`` (no computed key), ``stamp`` (record C on a state with
    no progress), ``adopt`` (record C on a state with progress, warning), ``ok``
    (R = C), ``refuse`` (declared directory, R != C), ``warn`` (beside the config,
    R != C) or ``report`` (PostgreSQL, R != C: shared by design). ``code`` is the error or
    warning code that goes with it, if any.
    """

    action: str
    code: str | None
    recorded: str | None
    computed: str

    @property
    def writes(self) -> bool:
        """True when a write command records the computed key (stamp or adopt)."""
        return self.action in ("stamp", "adopt")


def identity_verdict(recorded: str | None, computed: str, scope: str, has_progress: bool) -> Verdict:
    """Apply the decision table of SPEC §3 (recorded key R, computed key C, scope, progress).

    ``scope`` is a :class:`statetool.location.Location` scope: ``declared_dir``,
    ``beside_config`` or ``shared``. Never raises: the caller turns ``refuse`` into
    ``RIVET_STATE_FOREIGN`` with the place and the other source.
    """
    recorded = recorded or None
    if not computed:
        return Verdict("skip", None, recorded, computed)
    if recorded is None:
        if has_progress:
            return Verdict("adopt", "RIVET_STATE_IDENTITY_ADOPTED", recorded, computed)
        return Verdict("stamp", None, recorded, computed)
    if recorded == computed:
        return Verdict("ok", None, recorded, computed)
    if scope == "declared_dir":
        return Verdict("refuse", "RIVET_STATE_FOREIGN", recorded, computed)
    if scope == "beside_config":
        return Verdict("warn", "RIVET_STATE_FOREIGN_BESIDE_CONFIG", recorded, computed)
    return Verdict("report", None, recorded, computed)


def identity_message(verdict: Verdict, where: str, for_write: bool) -> str:
    """The sentence that explains an identity verdict (what happens, or would happen).

    ``where`` names the place (the declared directory, or the location's display);
    ``for_write`` says whether a write is doing it ("recorded") or a read reports what a
    write would do ("a write would record")."""
    r, c = verdict.recorded, verdict.computed
    record, adopt = ("recorded", "adopted") if for_write else ("a write would record", "a write would adopt")
    return {
        "skip": "the source URL is not known here, so no identity is compared or recorded",
        "stamp": f"no identity recorded and no progress: {record} {c}",
        "adopt": f"no identity recorded but the state has progress: {adopt} {c} as its source "
                 f"(check that this state really belongs to {c})",
        "ok": f"the state belongs to {c}",
        "refuse": f"the state in {where} belongs to {r}, not to this config's source {c}",
        "warn": f"the state beside the config belongs to {r}, not to this config's source {c}; "
                "states beside configs are shared by several configs, so this goes on",
        "report": f"the shared state records source {r}; this config's source is {c} (shared by design)",
    }[verdict.action]


def identity_warning(verdict: Verdict, where: str, for_write: bool) -> StateWarning | None:
    """The registered warning ``verdict`` gives, with its one text (:func:`identity_message`):
    ``RIVET_STATE_IDENTITY_ADOPTED`` or ``RIVET_STATE_FOREIGN_BESIDE_CONFIG``; None for a
    verdict that warns nothing (SPEC §3)."""
    if verdict.code not in WARNINGS:
        return None
    return StateWarning(verdict.code, identity_message(verdict, where, for_write))
