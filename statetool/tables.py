"""The fixed names of the state's tables (SPEC §10), without SQLAlchemy.

:mod:`statetool.schema` builds its Core tables under these names; the read paths
(statetool/operations/probe.py, the backends' catalog checks) need only the names, and
must not load SQLAlchemy to learn them (issue 13 item 1). With the marker of a retired
PostgreSQL state goes the one statement that reads where it went (:func:`retired_detail`),
for every opener of either layer (the probe, the lease store).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from statetool.backends.base import Reader

#: The version table of every path (online, offline ``--sql``, stamping), never alembic's
#: default ``alembic_version`` (SPEC §10); alembic/env.py reads it from statetool.schema.
VERSION_TABLE = "rivet_state_version"
#: The version-table value of a move's target until the source is retired (decisions.md,
#: "Moves: one live place"): every opener refuses it (``RIVET_STATE_MOVE_IN_FLIGHT``) on
#: both backends. At most 32 characters (alembic's column); never a revision id of any release.
IN_FLIGHT_REVISION = "move-in-flight"
#: The version-table value of a PostgreSQL state a transfer moved away (decisions.md,
#: "Retiring a PostgreSQL source"): the schema keeps its rows, but every opener refuses it,
#: this release with ``RIVET_STATE_RELOCATED`` (naming where the state went, from its last
#: ``retired`` audit row), any other one, a pipeline's alembic included, with a revision it
#: does not know. At most 32 characters; never a revision id of any release.
RELOCATED_REVISION = "state-relocated"
#: The audit action of that retirement: its detail says where the state went
#: (``to``, ``state_url``, ``at``, ``by``, ``how``, ``source_digest``).
RETIRED_ACTION = "retired"
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
#: The one row of the state's lineage id and serial (revision 0005, SPEC §9).
LINEAGE = "rivet_lineage"
#: One row per CDC export: its position, kept in the state (revision 0006, SPEC §6).
CDC_POSITIONS = "rivet_cdc_positions"

#: The tables of the early state (revision 0001): their presence without a version
#: table is what makes a *legacy* state (SPEC §4).
LEGACY_TABLES = frozenset({EXPORTS, RUNS, CHUNKS})
#: Every table name the state schema has ever had, for "a database of another application".
STATE_TABLES = frozenset({EXPORTS, RUNS, CHUNKS, RUN_AGGREGATES, LOAD_LEDGER, IDENTITY, AUDIT, LINEAGE,
                          CDC_POSITIONS}) | LEASE_TABLES | {
    VERSION_TABLE}


def retired_detail(conn: Reader) -> dict[str, Any]:
    """The detail of the last :data:`RETIRED_ACTION` audit row on ``conn``: where a transfer
    moved the state of a PostgreSQL schema whose version reads :data:`RELOCATED_REVISION`
    (``to``, ``state_url``, ``at``, ``by``, ...); ``{}`` when there is none or it is unreadable."""
    row = conn.one(f"SELECT detail FROM {AUDIT} WHERE action = :a ORDER BY id DESC LIMIT 1", {"a": RETIRED_ACTION})
    try:
        loaded = json.loads(row[0]) if row is not None else {}
    except ValueError:
        loaded = {}
    return loaded if isinstance(loaded, dict) else {}
