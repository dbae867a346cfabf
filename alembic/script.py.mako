"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
"""

import sqlalchemy as sa
from alembic import op

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = None
depends_on = None

#: Tables this upgrade rebuilds (copies every row of), for the migrate plan.
UPGRADE_REBUILDS: tuple[str, ...] = ()
#: Table -> SQL predicate of the rows whose data the downgrade drops (None: every row).
DOWNGRADE_LOSES: dict[str, str | None] = {}


def upgrade() -> None:
    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    ${downgrades if downgrades else "pass"}
