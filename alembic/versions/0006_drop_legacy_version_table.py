"""Drop the hand-rolled version table of earlier builds, once Alembic has adopted the schema.

Alembic's ``cronoq_alembic_version`` is the only record of the schema's version from here on;
keeping the old table would leave two records that can disagree. Downgrading does not bring
it back: a schema downgraded below this revision is still versioned by Alembic.

Revision ID: 0006_drop_legacy_version_table
Revises: 0005_task_tenant
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from cronoq_store._migrations import cluster_schema

revision: str = "0006_drop_legacy_version_table"
down_revision: str | Sequence[str] | None = "0005_task_tenant"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_table("cronoq_schema_version", schema=cluster_schema(), if_exists=True)


def downgrade() -> None:
    pass
