"""The occurrence a queued recurring schedule chains to.

Revision ID: 0003_recurring_last_task_id
Revises: 0002_leader_max_id
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from cronoq_store._migrations import cluster_schema

revision: str = "0003_recurring_last_task_id"
down_revision: str | Sequence[str] | None = "0002_leader_max_id"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "cronoq_recurring",
        sa.Column("last_task_id", sa.BigInteger(), nullable=True),
        schema=cluster_schema(),
    )


def downgrade() -> None:
    op.drop_column("cronoq_recurring", "last_task_id", schema=cluster_schema())
