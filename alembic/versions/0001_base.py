"""Base schema: the leader row, tasks and recurring schedules.

Revision ID: 0001_base
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

from cronoq_store._migrations import cluster_schema

revision: str = "0001_base"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    schema = cluster_schema()
    op.create_table(
        "cronoq_leader",
        sa.Column("id", sa.SmallInteger(), autoincrement=False, nullable=False),
        sa.Column("epoch", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.CheckConstraint("id = 1", name=op.f("ck_cronoq_leader_single_row")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_cronoq_leader")),
        schema=schema,
    )
    leader = sa.table(
        "cronoq_leader",
        sa.column("id", sa.SmallInteger()),
        sa.column("epoch", sa.Integer()),
        schema=schema,
    )
    op.execute(leader.insert().values(id=1, epoch=0))
    op.create_table(
        "cronoq_tasks",
        sa.Column("id", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("arrival_unix_ns", sa.BigInteger(), nullable=False),
        sa.Column("pool", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("priority", sa.SmallInteger(), nullable=False),
        sa.Column("key", sa.Text(), nullable=True),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
        sa.Column("deadline_unix_ns", sa.BigInteger(), nullable=True),
        sa.Column("fixed_at_unix_ns", sa.BigInteger(), nullable=True),
        sa.Column("fixed_tolerance_ns", sa.BigInteger(), nullable=True),
        sa.Column("fixed_on_miss", sa.Text(), nullable=True),
        sa.Column("duration_hint_ns", sa.BigInteger(), nullable=True),
        sa.Column("timeout_ns", sa.BigInteger(), nullable=True),
        sa.Column("retry", JSONB(), nullable=True),
        sa.Column("deps", JSONB(), server_default=sa.text("'[]'::jsonb"), nullable=False),
        sa.Column("resources", JSONB(), server_default=sa.text("'{}'::jsonb"), nullable=False),
        sa.Column("tags", JSONB(), server_default=sa.text("'[]'::jsonb"), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("terminal", sa.Boolean(), nullable=False),
        sa.Column("attempt", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("updated_unix_ns", sa.BigInteger(), nullable=False),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("output", sa.LargeBinary(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_cronoq_tasks")),
        schema=schema,
    )
    op.create_index(
        "ix_cronoq_tasks_live",
        "cronoq_tasks",
        ["id"],
        postgresql_where=sa.text("NOT terminal"),
        schema=schema,
    )
    op.create_index(
        "uq_cronoq_tasks_live_key",
        "cronoq_tasks",
        ["key"],
        unique=True,
        postgresql_where=sa.text("NOT terminal AND key IS NOT NULL"),
        schema=schema,
    )
    op.create_index(
        "ix_cronoq_tasks_finished_updated",
        "cronoq_tasks",
        ["updated_unix_ns", "id"],
        postgresql_where=sa.text("terminal"),
        schema=schema,
    )
    op.create_index(
        "ix_cronoq_tasks_key_id",
        "cronoq_tasks",
        ["key", "id"],
        postgresql_where=sa.text("key IS NOT NULL"),
        schema=schema,
    )
    op.create_index(
        "ix_cronoq_tasks_live_deps",
        "cronoq_tasks",
        ["id"],
        postgresql_where=sa.text("NOT terminal AND deps <> '[]'::jsonb"),
        schema=schema,
    )
    op.create_table(
        "cronoq_recurring",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("spec", JSONB(), nullable=False),
        sa.Column("template_payload", sa.LargeBinary(), nullable=False),
        sa.Column("next_unix_ns", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_cronoq_recurring")),
        schema=schema,
    )


def downgrade() -> None:
    schema = cluster_schema()
    op.drop_table("cronoq_recurring", schema=schema)
    op.drop_table("cronoq_tasks", schema=schema)
    op.drop_table("cronoq_leader", schema=schema)
