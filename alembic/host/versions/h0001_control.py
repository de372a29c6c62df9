"""The host's control schema: its processes and the clusters they lead.

``process_ids`` is an int4 sequence without CYCLE: a process id is the second key of the
process's advisory lock (the two-key functions take int4), and is never taken again, so a
process seen dead stays dead. A schema is enrolled in one group at most
(``uq_clusters_schema_name``): two groups would lead it twice.

Revision ID: h0001_control
Revises:
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import OID
from sqlalchemy.schema import CreateSequence, DropSequence

from cronoq_store._host.control import PROCESS_ID_MAX, control_schema

revision: str = "h0001_control"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _process_ids(schema: str) -> sa.Sequence:
    return sa.Sequence(
        "process_ids",
        schema=schema,
        data_type=sa.Integer,
        start=1,
        minvalue=1,
        maxvalue=PROCESS_ID_MAX,
        cycle=False,
    )


def upgrade() -> None:
    schema = control_schema()
    op.execute(CreateSequence(_process_ids(schema)))
    op.create_table(
        "processes",
        sa.Column("process_id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("host_group", sa.Text(), nullable=False),
        sa.Column("instance", sa.Text(), nullable=False),
        sa.Column("backend_pid", sa.Integer(), nullable=False),
        sa.Column("role", sa.Text(), nullable=False),
        sa.Column("application_name", sa.Text(), nullable=False),
        sa.Column(
            "joined_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("left_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("state IN ('member', 'draining', 'left')", name="ck_processes_state"),
        sa.PrimaryKeyConstraint("process_id", name="pk_processes"),
        schema=schema,
    )
    op.create_index(
        "ix_processes_live",
        "processes",
        ["host_group", "process_id"],
        schema=schema,
        postgresql_where=sa.text("state <> 'left'"),
    )
    op.create_table(
        "clusters",
        sa.Column("host_group", sa.Text(), nullable=False),
        sa.Column("schema_name", sa.Text(), nullable=False),
        sa.Column("incarnation", OID(), nullable=False),
        sa.Column("owner", sa.Integer(), nullable=True),
        sa.Column("epoch", sa.Integer(), nullable=True),
        sa.Column("since", sa.DateTime(timezone=True), nullable=True),
        sa.Column("released_by", sa.Integer(), nullable=True),
        sa.Column("released_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("state", sa.Text(), server_default=sa.text("'active'"), nullable=False),
        sa.Column("refused_why", sa.Text(), nullable=True),
        sa.Column(
            "enrolled_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint("state IN ('active', 'refused')", name="ck_clusters_state"),
        sa.PrimaryKeyConstraint("host_group", "schema_name", name="pk_clusters"),
        sa.UniqueConstraint("schema_name", name="uq_clusters_schema_name"),
        schema=schema,
    )
    op.create_index(
        "ix_clusters_host_group_owner", "clusters", ["host_group", "owner"], schema=schema
    )


def downgrade() -> None:
    schema = control_schema()
    op.drop_table("clusters", schema=schema)
    op.drop_table("processes", schema=schema)
    op.execute(DropSequence(_process_ids(schema)))
