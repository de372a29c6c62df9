"""The host group a cluster is enrolled in, recorded in its leader row.

A cluster is led either by a standalone ``PgStore``, which holds its session advisory
lock, or by a host (``PgHost``) of one host group, which leads many clusters without a lock
of its own on each. This column is what tells the two apart, in the row every takeover
updates: NULL for a standalone cluster (every cluster until it is enrolled, exactly as
before this revision), else the group's name. A standalone's epoch bump is refused on an
enrolled cluster, and a host's bump names its group, so neither can take an epoch where the
other leads; the epoch still fences whichever lost the race. A build before this revision
ignores the column: enrol a cluster only once every instance that may lead it runs a build
that reads it.

Revision ID: 0009_host_group
Revises: 0008_leader_history
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from cronoq_store._migrations import cluster_schema

revision: str = "0009_host_group"
down_revision: str | Sequence[str] | None = "0008_leader_history"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    schema = cluster_schema()
    op.add_column("cronoq_leader", sa.Column("host_group", sa.Text()), schema=schema)


def downgrade() -> None:
    schema = cluster_schema()
    op.drop_column("cronoq_leader", "host_group", schema=schema)
