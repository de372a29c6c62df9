"""The lock session that took the current epoch, recorded in the leader row.

Any role that can connect can take the leader's advisory lock; only a role that may write
the leader row can record itself there. ``health`` and ``status`` compare the lock's holder
with this record to tell the leader from a foreign holder (docs/reliability.md, "Who holds
the lock"). Empty until the next leader takes an epoch; ``holder_epoch`` says which epoch
the record belongs to, so that an epoch a build before this revision takes (during a
rolling upgrade) leaves its holder unknown rather than foreign.

Revision ID: 0007_leader_holder
Revises: 0006_drop_legacy_version_table
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from cronoq_store._migrations import cluster_schema

revision: str = "0007_leader_holder"
down_revision: str | Sequence[str] | None = "0006_drop_legacy_version_table"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = ("holder_pid", "holder_backend_start", "holder_role", "holder_epoch")


def upgrade() -> None:
    schema = cluster_schema()
    op.add_column("cronoq_leader", sa.Column("holder_pid", sa.Integer()), schema=schema)
    op.add_column(
        "cronoq_leader",
        sa.Column("holder_backend_start", sa.DateTime(timezone=True)),
        schema=schema,
    )
    op.add_column("cronoq_leader", sa.Column("holder_role", postgresql.OID()), schema=schema)
    op.add_column("cronoq_leader", sa.Column("holder_epoch", sa.Integer()), schema=schema)


def downgrade() -> None:
    schema = cluster_schema()
    for name in reversed(_COLUMNS):
        op.drop_column("cronoq_leader", name, schema=schema)
