"""High-water mark of issued task ids, so pruning can never cause id reuse.

Revision ID: 0002_leader_max_id
Revises: 0001_base
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from cronoq_store._migrations import cluster_schema

revision: str = "0002_leader_max_id"
down_revision: str | Sequence[str] | None = "0001_base"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "cronoq_leader",
        sa.Column("max_id", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        schema=cluster_schema(),
    )


def downgrade() -> None:
    op.drop_column("cronoq_leader", "max_id", schema=cluster_schema())
