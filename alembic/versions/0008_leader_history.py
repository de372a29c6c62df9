"""Leadership history: a row for each epoch taken, with the lock session that took it.

The leader row keeps only the latest holder; this table keeps the last
:data:`~cronoq_store._statements.TERMS_KEPT` takeovers, written in the transaction
that bumps the epoch and pruned there, never on the commit path. ``status`` and the
console show it as a timeline. A build before this revision takes its epochs without a
row here (during a rolling upgrade): the timeline then skips those epochs.

Whoever may bump the epoch (``UPDATE`` on ``cronoq_leader``) must be able to record the
term, or its next takeover fails: the upgrade grants each such role (not the owner) the
rows of this table too, and each role that may read the leader row (the console's reader)
may read these, so that a deployment of least-privilege roles (docs/reliability.md, and
docs/console.md) goes on after the migration without a grant of its own. In SQL, server side,
so that ``--sql`` prints it as it runs (without ``%``, which the printed SQL would
double).

Revision ID: 0008_leader_history
Revises: 0007_leader_holder
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from cronoq_store._migrations import cluster_schema

revision: str = "0008_leader_history"
down_revision: str | Sequence[str] | None = "0007_leader_holder"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    schema = cluster_schema()
    op.create_table(
        "cronoq_leader_history",
        sa.Column("epoch", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("began_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("lock_seen_held_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("role", sa.Text(), nullable=True),
        sa.Column("application_name", sa.Text(), nullable=True),
        sa.Column("client_addr", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("epoch", name=op.f("pk_cronoq_leader_history")),
        schema=schema,
    )
    op.create_index(
        "ix_cronoq_leader_history_began_at",
        "cronoq_leader_history",
        ["began_at"],
        unique=False,
        schema=schema,
    )
    _grant_as_leader(schema)


#: Each role that may write the leader row may write the history rows; each that may read
#: it (the console's reader, an ops role running ``status``) may read them.
_GRANT_AS_LEADER = """
DO $grant$
DECLARE
    grantee text;
    privilege text;
BEGIN
    FOR grantee, privilege IN
        SELECT DISTINCT
            CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END,
            a.privilege_type
        FROM pg_catalog.pg_class c
        CROSS JOIN LATERAL pg_catalog.aclexplode(c.relacl) a
        LEFT JOIN pg_catalog.pg_roles r ON r.oid = a.grantee
        WHERE c.oid = {leader}::regclass
          AND a.privilege_type IN ('SELECT', 'UPDATE')
          AND a.grantee <> c.relowner
    LOOP
        EXECUTE 'GRANT '
            || CASE privilege
                WHEN 'UPDATE' THEN 'SELECT, INSERT, UPDATE, DELETE'
                ELSE 'SELECT'
            END
            || ' ON ' || {history}::regclass::text || ' TO ' || grantee;
    END LOOP;
END
$grant$
"""


def _grant_as_leader(schema: str) -> None:
    quote = op.get_context().dialect.identifier_preparer.quote

    def literal(table: str) -> str:
        name = f"{quote(schema)}.{table}"
        return "'" + name.replace("'", "''") + "'"

    op.execute(
        _GRANT_AS_LEADER.format(
            leader=literal("cronoq_leader"), history=literal("cronoq_leader_history")
        )
    )


def downgrade() -> None:
    schema = cluster_schema()
    op.drop_index(
        "ix_cronoq_leader_history_began_at", table_name="cronoq_leader_history", schema=schema
    )
    op.drop_table("cronoq_leader_history", schema=schema)
