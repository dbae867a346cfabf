"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
"""

import sqlalchemy as sa

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = None
depends_on = None

#: Tables this upgrade rebuilds (copies every row of), for the migrate plan.
UPGRADE_REBUILDS: tuple[str, ...] = ()
#: Table -> SQL predicate of the rows whose data the downgrade drops (None: every row).
DOWNGRADE_LOSES: dict[str, str | None] = {}


def upgrade() -> None:
    # Imported here, not at the top: statetool imports this module to read its constants
    # (statetool/migrations.py), and `check` and `info` must not load alembic.
    from alembic import op

    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    from alembic import op

    ${downgrades if downgrades else "pass"}
