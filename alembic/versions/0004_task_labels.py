"""Worker labels a task requires.

Revision ID: 0004_task_labels
Revises: 0003_recurring_last_task_id
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

from cronoq_store._migrations import cluster_schema

revision: str = "0004_task_labels"
down_revision: str | Sequence[str] | None = "0003_recurring_last_task_id"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "cronoq_tasks",
        sa.Column("labels", JSONB(), server_default=sa.text("'[]'::jsonb"), nullable=False),
        schema=cluster_schema(),
    )


def downgrade() -> None:
    op.drop_column("cronoq_tasks", "labels", schema=cluster_schema())
