"""A cluster's control row may be ``moving`` (frozen by ``cronoq-store host move``) or
``moved`` (a tombstone left in the database it moved out of). No host claims either:
claims take ``active`` rows only, which every build's claim already says, so a process of
the build before this revision still running beside it leaves such rows alone.

Revision ID: h0002_moving
Revises: h0001_control
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from cronoq_store._host.control import control_schema

revision: str = "h0002_moving"
down_revision: str | Sequence[str] | None = "h0001_control"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    schema = control_schema()
    op.drop_constraint("ck_clusters_state", "clusters", schema=schema, type_="check")
    op.create_check_constraint(
        "ck_clusters_state",
        "clusters",
        "state IN ('active', 'refused', 'moving', 'moved')",
        schema=schema,
    )


def downgrade() -> None:
    schema = control_schema()
    op.drop_constraint("ck_clusters_state", "clusters", schema=schema, type_="check")
    op.create_check_constraint(
        "ck_clusters_state", "clusters", "state IN ('active', 'refused')", schema=schema
    )
