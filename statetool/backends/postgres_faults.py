"""Faults of a PostgreSQL state, named truly (SPEC §7, §8a; docs/decisions.md, "PostgreSQL
rights and faults"): :func:`driver_error` translates any driver error by its SQLSTATE,
the same wherever it was met, and :func:`rights_problem` finds, before anything is
changed, the rights a role lacks for what it is about to do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from statetool.errors import StateError
from statetool.tables import AUDIT, LEASE_TABLES, STATE_TABLES, VERSION_TABLE

if TYPE_CHECKING:
    from statetool.backends.base import Reader

#: SQLSTATEs of a refused login (invalid_password, invalid_authorization_specification).
_AUTH_STATES = {"28P01", "28000"}
#: The server's FATAL texts of those SQLSTATEs. libpq reports a refused login as a failed
#: connection without a SQLSTATE, so the text is all there is: a role that does not exist,
#: one that may not log in, no pg_hba.conf line for it, or a failed password/peer/ident
#: check (https://www.postgresql.org/docs/15/client-authentication-problems.html).
_AUTH_TEXT = re.compile(r'FATAL:\s+(role "[^"]*" (does not exist|is not permitted to log in)'
                        r"|no pg_hba\.conf entry|pg_hba\.conf rejects connection"
                        r"|(password|peer|ident|ldap|radius|pam|gss|sspi|cert) authentication failed)"
                        r"|password authentication failed|no password supplied", re.IGNORECASE)
#: SQLSTATE classes and codes a re-run may get past (https://www.postgresql.org/docs/15/errcodes-appendix.html):
#: connection exceptions, insufficient resources, operator intervention; serialization failure, deadlock,
#: lock_not_available. disk_full (53100) is not among them: it stays until someone frees space.
_TRANSIENT_CLASSES = {"08", "53", "57"}
#: connection_exception: the server was not reached, or the connection to it failed.
_CONNECTION_CLASS = "08"
_TRANSIENT_STATES = {"40001", "40P01", "55P03"}
_DISK_FULL = "53100"
#: insufficient_privilege (a missing GRANT, or "must be owner of"), read_only_sql_transaction.
_PRIVILEGE, _READ_ONLY = "42501", "25006"
#: The database refuses on purpose, the same way every time: integrity constraints, a trigger's RAISE.
_REFUSING_CLASSES = {"23", "P0"}


def ident(name: str) -> str:
    """``name`` as a quoted SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def _first_line(orig: BaseException) -> str:
    text = str(orig).strip()
    return text.splitlines()[0] if text else type(orig).__name__


def driver_error(err: BaseException, where: str, setting: str | None = None) -> StateError:
    """The one translation of a PostgreSQL driver error (docs/decisions.md, "PostgreSQL rights
    and faults"), the same wherever it was met: connecting, locking, committing, or inside an
    operation's own SQL. ``err`` is psycopg's own error (a read session's) or SQLAlchemy's
    wrapper of it (a write's: its ``orig``, and whether it invalidated the connection);
    ``where`` names the state (its display URL); ``setting`` the setting that gave its URL
    (``--state-url``, ``RIVET_STATE_URL``, a transfer's ``--to``: :attr:`Location.setting
    <statetool.location.Location.setting>`), which a fault of the URL itself names first,
    as every refusal of a location does: a server that cannot be reached (no SQLSTATE, or
    class 08), a refused login, no such database.

    Faults of the environment keep their code everywhere: ``RIVET_STATE_AUTH_FAILED``
    (28P01, 28000, and a connection the server refused with their texts: no such role, a
    role that may not log in, no pg_hba.conf entry, a failed password; issue 12 fixB item 4),
    ``RIVET_STATE_URL_INVALID`` (3D000: no such database),
    ``RIVET_STATE_PERMISSION_DENIED`` (42501), ``RIVET_STATE_READ_ONLY`` (25006),
    ``RIVET_STATE_DISK_FULL`` (53100), ``RIVET_STATE_WRITE_REFUSED`` (classes 23, P0),
    ``RIVET_STATE_UNREACHABLE`` (classes 08, 53, 57, states 40001, 40P01, 55P03, and a
    connection that failed or was lost without a SQLSTATE). Anything else is an error of
    statetool's own SQL (an undefined column, a syntax error, a wrong parameter):
    ``RIVET_INTERNAL``, one line naming the SQLSTATE, never retryable (SPEC §7, §8a).
    """
    import psycopg

    orig: BaseException = getattr(err, "orig", None) or err
    invalidated = bool(getattr(err, "connection_invalidated", False))
    sqlstate = getattr(orig, "sqlstate", None)
    text = _first_line(orig)
    details = {"sqlstate": sqlstate} if sqlstate else {}
    named = f"{setting}: " if setting else ""
    if sqlstate in _AUTH_STATES or sqlstate is None and _AUTH_TEXT.search(text):
        return StateError("RIVET_STATE_AUTH_FAILED", f"{named}the state database at {where} refused the login: {text}")
    if sqlstate == "3D000" or sqlstate is None and "does not exist" in text and "database" in text:
        return StateError("RIVET_STATE_URL_INVALID", f"{named}the state database named in {where} does not exist "
                          f"on that server: {text}")
    if sqlstate == _PRIVILEGE:
        return StateError("RIVET_STATE_PERMISSION_DENIED",
                          f"the state database at {where} denied the role a right it needs (SQLSTATE 42501): "
                          f"{text}; nothing was written. {_grant_hint(str(orig))}", details)
    if sqlstate == _READ_ONLY:
        return StateError("RIVET_STATE_READ_ONLY",
                          f"the state database at {where} accepts only reads in this session (SQLSTATE 25006, a hot "
                          f"standby or default_transaction_read_only on): {text}; nothing was written", details)
    if sqlstate == _DISK_FULL:
        return StateError("RIVET_STATE_DISK_FULL", f"the server of the state database at {where} has no space left "
                          f"on its disk (SQLSTATE 53100): {text}; the transaction was rolled back", details)
    lost = sqlstate is None and (invalidated or isinstance(orig, psycopg.OperationalError))
    if lost or sqlstate is not None and (sqlstate[:2] in _TRANSIENT_CLASSES or sqlstate in _TRANSIENT_STATES):
        unreached = named if lost or sqlstate is not None and sqlstate[:2] == _CONNECTION_CLASS else ""
        return StateError("RIVET_STATE_UNREACHABLE", f"{unreached}the state database at {where} is unreachable or "
                          f"busy: {text}", details)
    if sqlstate is not None and sqlstate[:2] in _REFUSING_CLASSES:
        return StateError("RIVET_STATE_WRITE_REFUSED", f"the state database at {where} refused the write "
                          f"(SQLSTATE {sqlstate}): {text}", details)
    return StateError("RIVET_INTERNAL", f"statetool's own SQL failed on the state database at {where} "
                      f"({type(orig).__name__}, SQLSTATE {sqlstate or 'none'}): {text}", details)


def _grant_hint(text: str) -> str:
    """What fixes a 42501 whose server text names the object (``permission denied for table
    x``, ``must be owner of table x``)."""
    match = re.search(r"permission denied for (table|schema|database|sequence) (\S+)", text)
    if match:
        kind, name = match.groups()
        right = {"table": "SELECT, INSERT, UPDATE, DELETE", "schema": "USAGE, CREATE",
                 "database": "CONNECT" if "CONNECT privilege" in text else "CREATE", "sequence": "USAGE"}[kind]
        return f"As its owner or a superuser: GRANT {right} ON {kind.upper()} {name} TO <this role>."
    if "must be owner" in text:
        return "Run it as the role that owns those tables (or a member of it)."
    return "Grant the role the right the server names, or run as a role that has it."


@dataclass(frozen=True)
class _Need:
    """The rights one kind of session needs (see :meth:`PostgresBackend.check_rights`)."""

    verb: str
    write: bool = False
    ddl: bool = False
    create: bool = False
    #: The tables it touches (None: every state table).
    tables: frozenset[str] | None = None


#: read: USAGE on the schema, SELECT on every state table. write: also INSERT, UPDATE,
#: DELETE (rivet_audit: INSERT; the version table: SELECT) and USAGE on the schema's
#: sequences. migrate: also CREATE on the schema and ownership of every state table (a
#: migration alters them). create (init, a transfer's destination): CREATE on the database
#: when the schema is absent, USAGE and CREATE on it when it is there. lease (``leases
#: run``, a run): the write rights on the two lease tables only.
NEEDS = {"read": _Need("read"), "write": _Need("write", write=True),
         "migrate": _Need("migrate", write=True, ddl=True), "create": _Need("create", write=True, create=True),
         "lease": _Need("hold a lease of", write=True, tables=LEASE_TABLES)}
_APPEND_ONLY = {AUDIT: ("SELECT", "INSERT"), VERSION_TABLE: ("SELECT",)}
_DML = ("SELECT", "INSERT", "UPDATE", "DELETE")


def rights_problem(conn: Reader, schema_name: str, purpose: str, where: str) -> StateError | None:
    """The rights ``purpose`` (a key of :data:`NEEDS`) needs in ``schema_name`` that the
    session's role lacks, as one ``RIVET_STATE_PERMISSION_DENIED`` naming the role, the
    schema, its owner and the GRANT statements that fix it; None when nothing is missing.
    Reads only catalogs every role may read (``pg_namespace``, ``pg_class``), so a role
    without USAGE still learns that the state exists (SPEC §8a)."""
    need = NEEDS[purpose]
    found = conn.one(
        "SELECT current_user, current_database(), (SELECT pg_get_userbyid(datdba) FROM pg_database "
        "WHERE datname = current_database()), has_database_privilege(current_database(), 'CREATE'), "
        "pg_get_userbyid(n.nspowner), has_schema_privilege(n.oid, 'USAGE'), has_schema_privilege(n.oid, 'CREATE') "
        "FROM (SELECT 1) AS one LEFT JOIN pg_namespace n ON n.nspname = :s", {"s": schema_name})
    assert found is not None  # one row, whatever the schema: the LEFT JOIN keeps it
    role, database, db_owner, db_create, owner, usage, create = found
    schema_q = ident(schema_name)
    lacks: list[str] = []
    grants: list[str] = []
    if owner is None:
        if need.create and not db_create:
            lacks.append(f"CREATE on database {database} (the schema {schema_name} does not exist yet)")
            grants.append(f"GRANT CREATE ON DATABASE {ident(database)} TO {ident(role)}")
    else:
        lacks_tables, grants_tables, has_state = _table_rights(conn, schema_name, need, role)
        # CREATE on the schema: a migration adds tables; a new state (init, a transfer into
        # an empty schema) creates all of them
        schema_rights = [r for r, has in (("USAGE", usage), ("CREATE", create))
                         if not has and (r == "USAGE" or need.ddl or need.create and not has_state)]
        if schema_rights:
            lacks.append(f"{', '.join(schema_rights)} on schema {schema_name}")
            grants.append(f"GRANT {', '.join(schema_rights)} ON SCHEMA {schema_q} TO {ident(role)}")
        lacks += lacks_tables
        grants += grants_tables
    if not lacks:
        return None
    owned = f" (schema {schema_name} is owned by role {owner})" if owner else ""
    as_whom = f"role {owner}" if owner else f"role {db_owner} (the owner of database {database})"
    return StateError("RIVET_STATE_PERMISSION_DENIED",
                      f"role {role} may not {need.verb} the state at {where}: it lacks {'; '.join(lacks)}{owned}; "
                      f"nothing was changed. Fix it as {as_whom} or a superuser: {'; '.join(grants)}, or use a role "
                      "that has these rights",
                      {"role": role, "schema": schema_name, "owner": owner, "grants": grants})


def _table_rights(conn: Reader, schema_name: str, need: _Need, role: str) -> tuple[list[str], list[str], bool]:
    """What ``role`` lacks on the state tables and sequences of ``schema_name`` (one line
    each, and the GRANTs that fix it), and whether the schema holds any state table."""
    rows = conn.rows(
        "SELECT c.relname, c.relkind, pg_get_userbyid(c.relowner) AS owner, pg_has_role(c.relowner, 'USAGE') AS owns, "
        "has_table_privilege(c.oid, 'SELECT') AS s, has_table_privilege(c.oid, 'INSERT') AS i, "
        "has_table_privilege(c.oid, 'UPDATE') AS u, has_table_privilege(c.oid, 'DELETE') AS d, "
        "c.relkind = 'S' AND has_sequence_privilege(c.oid, 'USAGE') AS seq "
        "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = :s AND c.relkind IN ('r', 'p', 'S') ORDER BY c.relname", {"s": schema_name})
    missing: dict[tuple[str, ...], list[str]] = {}
    sequences: list[str] = []
    not_owned: dict[str, list[str]] = {}
    has_state = False
    for relname, relkind, owner, owns, s, i, u, d, seq in rows:
        if relkind == "S":
            if need.write and need.tables is None and not seq:
                sequences.append(relname)
            continue
        if relname not in (STATE_TABLES if need.tables is None else need.tables):
            continue
        has_state = True
        wanted = _APPEND_ONLY.get(relname, _DML) if need.write else ("SELECT",)
        has = {"SELECT": s, "INSERT": i, "UPDATE": u, "DELETE": d}
        lacking = tuple(r for r in wanted if not has[r])
        if lacking:
            missing.setdefault(lacking, []).append(relname)
        if need.ddl and not owns:
            not_owned.setdefault(owner, []).append(relname)
    lacks, grants = [], []
    for rights, tables in missing.items():
        lacks.append(f"{', '.join(rights)} on {', '.join(tables)}")
        grants.append(f"GRANT {', '.join(rights)} ON {', '.join(ident(schema_name) + '.' + ident(t) for t in tables)} "
                      f"TO {ident(role)}")
    if sequences:
        lacks.append(f"USAGE on sequences {', '.join(sequences)}")
        grants.append(f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA {ident(schema_name)} TO {ident(role)}")
    for owner, tables in not_owned.items():
        lacks.append(f"ownership of {', '.join(tables)} (owned by role {owner}; a migration alters them)")
        grants.append(f"GRANT {ident(owner)} TO {ident(role)}")
    return lacks, grants, has_state
