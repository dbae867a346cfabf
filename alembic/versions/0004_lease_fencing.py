"""lease fencing tokens and holder start times (PostgreSQL lease table)

SPEC §5: every acquisition of a lease gets a fencing token, monotonic per key, and a
holder is identified by its pid AND its process start time, so a reused pid never reads
as alive. ``rivet_leases`` gains the token, the holder's start time, and the pid and
start time of the command a ``leases run`` wrapper started (a wrapper that died while its
command lives on this host keeps the lease live). ``rivet_lease_tokens`` keeps the last
token of every key across releases, which delete the lease row. SQLite leases are flock
sidecars whose records carry the same fields, so SQLite gets no table here.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

#: Tables this upgrade rebuilds (copies every row of), for the migrate plan.
UPGRADE_REBUILDS: tuple[str, ...] = ()
#: Table -> SQL predicate of the rows whose data the downgrade drops (None: every row).
#: The tokens are bookkeeping of live coordination, not progress: dropping them loses no data.
DOWNGRADE_LOSES: dict[str, str | None] = {}


def upgrade() -> None:
    # Imported here, not at the top: statetool imports this module to read its constants
    # (statetool/migrations.py), and `check` and `info` must not load alembic.
    from alembic import op

    if op.get_context().dialect.name != "postgresql":
        return
    op.add_column("rivet_leases", sa.Column("fencing_token", sa.BigInteger))
    op.add_column("rivet_leases", sa.Column("holder_started", sa.BigInteger))
    op.add_column("rivet_leases", sa.Column("child_pid", sa.Integer))
    op.add_column("rivet_leases", sa.Column("child_started", sa.BigInteger))
    op.create_table(
        "rivet_lease_tokens",
        sa.Column("key", sa.Text, primary_key=True),
        sa.Column("token", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    from alembic import op

    if op.get_context().dialect.name != "postgresql":
        return
    op.drop_table("rivet_lease_tokens")
    for column in ("child_started", "child_pid", "holder_started", "fencing_token"):
        op.drop_column("rivet_leases", column)
