"""Tenant of a task, for fair sharing.

Revision ID: 0005_task_tenant
Revises: 0004_task_labels
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from cronoq_store._migrations import cluster_schema

revision: str = "0005_task_tenant"
down_revision: str | Sequence[str] | None = "0004_task_labels"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "cronoq_tasks", sa.Column("tenant", sa.Text(), nullable=True), schema=cluster_schema()
    )


def downgrade() -> None:
    op.drop_column("cronoq_tasks", "tenant", schema=cluster_schema())
