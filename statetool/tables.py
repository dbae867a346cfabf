"""The fixed names of the state's tables (SPEC §10), without SQLAlchemy.

:mod:`statetool.schema` builds its Core tables under these names; the read paths
(statetool/operations/probe.py, the backends' catalog checks) need only the names, and
must not load SQLAlchemy to learn them (issue 13 item 1).
"""

from __future__ import annotations

#: The version table of every path (online, offline ``--sql``, stamping), never alembic's
#: default ``alembic_version`` (SPEC §10); alembic/env.py reads it from statetool.schema.
VERSION_TABLE = "rivet_state_version"
#: The version-table value of a move's target until the source is retired (decisions.md,
#: "Moves: one live place"): every opener refuses it (``RIVET_STATE_MOVE_IN_FLIGHT``) on
#: both backends. At most 32 characters (alembic's column); never a revision id of any release.
IN_FLIGHT_REVISION = "move-in-flight"
#: The PostgreSQL lease table (revision 0002) and the last fencing token of every key
#: (revision 0004); raw SQL in backends/postgres_leases.py, so no Core table for them.
LEASE_TABLE = "rivet_leases"
LEASE_TOKENS_TABLE = "rivet_lease_tokens"
LEASE_TABLES = frozenset({LEASE_TABLE, LEASE_TOKENS_TABLE})

EXPORTS = "rivet_exports"
RUNS = "rivet_runs"
CHUNKS = "rivet_chunks"
RUN_AGGREGATES = "rivet_run_aggregates"
LOAD_LEDGER = "rivet_load_ledger"
IDENTITY = "rivet_identity"
AUDIT = "rivet_audit"
#: The state's lineage id and write serial (revision 0005: one row, ``id`` 1, ``lineage`` a
#: UUID, ``serial`` raised by every write); read where it exists, null where it does not.
LINEAGE = "rivet_lineage"

#: The tables of the early state (revision 0001): their presence without a version
#: table is what makes a *legacy* state (SPEC §4).
LEGACY_TABLES = frozenset({EXPORTS, RUNS, CHUNKS})
#: Every table name the state schema has ever had, for "a database of another application".
STATE_TABLES = frozenset({EXPORTS, RUNS, CHUNKS, RUN_AGGREGATES, LOAD_LEDGER, IDENTITY, AUDIT}) | LEASE_TABLES | {
    VERSION_TABLE}
