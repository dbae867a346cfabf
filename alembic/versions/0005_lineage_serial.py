"""state lineage id and serial

SPEC §9: every copy of a state (backup, keep, export, transfer target) carries the
state's lineage id and serial, so an older or foreign copy is never restored or imported
silently. ``rivet_lineage`` holds one row: ``lineage``, a UUID the state gets once (here,
or at ``init``, which runs this revision) and keeps for life, through moves and copies;
``serial``, which every write increments in its own transaction (statetool's guarded
write path); ``write_id``, a UUID each of those writes gives it, so that two states
that went apart from one copy and were each written as often (a rollback written over,
one copy restored at two places) are told apart at the same serial; ``updated_at``, the
time of the last increment. A copy of the same lineage with a higher serial than the
live state, or the same serial and another ``write_id``, means the live state was rolled
back or replaced. The upgrade gives the state a new lineage at serial 1; a downgrade below this
revision drops it, and an upgrade after that starts a new lineage (copies taken before
it then read as of another lineage: docs/decisions.md, "Lineage and serial").

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

#: Tables this upgrade rebuilds (copies every row of), for the migrate plan.
UPGRADE_REBUILDS: tuple[str, ...] = ()
#: Table -> SQL predicate of the rows whose data the downgrade drops (None: every row).
DOWNGRADE_LOSES: dict[str, str | None] = {"rivet_lineage": None}


def upgrade() -> None:
    # Imported here, not at the top: statetool imports this module to read its constants
    # (statetool/migrations.py), and `check` and `info` must not load alembic.
    import uuid
    from datetime import UTC, datetime

    from alembic import op

    table = op.create_table(
        "rivet_lineage",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("lineage", sa.Text, nullable=False),
        sa.Column("serial", sa.BigInteger, nullable=False),
        sa.Column("write_id", sa.Text, nullable=False),
        sa.Column("updated_at", sa.Text, nullable=False),
        sa.CheckConstraint("id = 1", name="ck_rivet_lineage_single_row"),
        sa.CheckConstraint("serial >= 1", name="ck_rivet_lineage_serial_positive"),
    )
    if op.get_context().as_sql:
        # A DBA's script may be applied to several schemas: each gets a lineage of its own,
        # made by the server when the script runs (md5 of randomness: any PostgreSQL version).
        op.execute("INSERT INTO rivet_lineage (id, lineage, serial, write_id, updated_at) VALUES (1, "
                   "md5(random()::text || clock_timestamp()::text)::uuid::text, 1, "
                   "md5(clock_timestamp()::text || random()::text)::uuid::text, "
                   "to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'))")
        return
    op.bulk_insert(table, [{"id": 1, "lineage": str(uuid.uuid4()), "serial": 1, "write_id": str(uuid.uuid4()),
                            "updated_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")}])


def downgrade() -> None:
    from alembic import op

    op.drop_table("rivet_lineage")
