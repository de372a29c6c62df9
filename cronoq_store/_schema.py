"""The cluster's tables as one SQLAlchemy ``MetaData``, without a schema name.

Every scheduler cluster lives in its own PostgreSQL schema. The tables here carry no schema,
so one compiled statement serves every cluster: the schema is applied at execution time with
``schema_translate_map`` (see :func:`schema_options`), never pasted into SQL text.

Index design is a throughput lever: every status transition rewrites every index of
``cronoq_tasks`` (``updated_unix_ns`` is indexed, so no update is HOT). Each index below
serves a query the store runs; none is speculative.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, OID
from sqlalchemy.sql.expression import ColumnClause

from ._config import validate_schema_name

__all__ = [
    "LEADER_ROW_ID",
    "LEGACY_VERSION_TABLE",
    "VERSION_TABLE",
    "leader",
    "leader_history",
    "leader_tableoid",
    "metadata",
    "recurring",
    "schema_options",
    "tasks",
]

#: Alembic's version table, per schema, named so it never collides with an application's own.
VERSION_TABLE = "cronoq_alembic_version"
#: The version table of builds before Alembic (versions 1 to 5), adopted and then dropped
#: by revision 0006.
LEGACY_VERSION_TABLE = "cronoq_schema_version"
#: ``cronoq_leader`` holds exactly one row, with this id.
LEADER_ROW_ID = 1


metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

leader = Table(
    "cronoq_leader",
    metadata,
    Column("id", SmallInteger, primary_key=True, autoincrement=False),
    # Fencing epoch: bumped by every new leader, checked by every commit.
    Column("epoch", Integer, nullable=False, server_default=text("0")),
    # High-water mark of issued task ids, so pruning can never cause id reuse.
    Column("max_id", BigInteger, nullable=False, server_default=text("0")),
    # The lock session that took the current epoch (its pid, backend start and role), so
    # that anyone can tell the leader from a session that only holds the lock: only a role
    # that may write this row can record itself (docs/reliability.md, "Who holds the lock").
    Column("holder_pid", Integer),
    Column("holder_backend_start", DateTime(timezone=True)),
    Column("holder_role", OID),
    # The epoch that session took: an epoch that moved without it (a build before this
    # column, mid rolling upgrade) leaves the record stale, and the holder unknown.
    Column("holder_epoch", Integer),
    CheckConstraint("id = 1", name="single_row"),
)

#: A row for each epoch taken (the last ``TERMS_KEPT``, pruned by the takeover that writes
#: one): when it began and the lock session that took it, its role, application name and
#: address as text (a role or address may be gone when the row is read).
#: ``lock_seen_held_at``: the taker's last poll that found the lock still held, when it
#: waited for it; the lock was free for at most the time from then to ``began_at``.
leader_history = Table(
    "cronoq_leader_history",
    metadata,
    Column("epoch", Integer, primary_key=True, autoincrement=False),
    Column("began_at", DateTime(timezone=True), nullable=False),
    Column("lock_seen_held_at", DateTime(timezone=True)),
    Column("pid", Integer, nullable=False),
    Column("role", Text),
    Column("application_name", Text),
    Column("client_addr", Text),
    # The newest terms first, and the prune's cut.
    Index("ix_cronoq_leader_history_began_at", "began_at"),
)

#: The leader table's OID, read through the system column ``tableoid`` of its row: the
#: cluster's incarnation (docs/reliability.md, "The cluster's incarnation"). A physical copy
#: of the server (a replica, a point-in-time restore) and ``pg_upgrade`` keep it; a table
#: made again (the schema dropped and migrated, renamed into another's place, restored
#: from a logical dump) has another. Not a ``Column`` of the table: the migrations and
#: their drift check must never see it.
leader_tableoid = ColumnClause("tableoid", OID(), _selectable=leader)

tasks = Table(
    "cronoq_tasks",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=False),
    Column("seq", BigInteger, nullable=False),
    Column("arrival_unix_ns", BigInteger, nullable=False),
    Column("pool", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("priority", SmallInteger, nullable=False),
    Column("key", Text),
    Column("payload", LargeBinary, nullable=False),
    Column("deadline_unix_ns", BigInteger),
    Column("fixed_at_unix_ns", BigInteger),
    Column("fixed_tolerance_ns", BigInteger),
    Column("fixed_on_miss", Text),
    Column("duration_hint_ns", BigInteger),
    Column("timeout_ns", BigInteger),
    Column("retry", JSONB),
    Column("deps", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
    Column("resources", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("tags", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
    # 'queued' for a live task with no attempt yet, else a TaskStatus value.
    Column("status", Text, nullable=False),
    Column("terminal", Boolean, nullable=False),
    Column("attempt", Integer, nullable=False, server_default=text("0")),
    Column("updated_unix_ns", BigInteger, nullable=False),
    Column("message", Text),
    Column("output", LargeBinary),
    Column("labels", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
    Column("tenant", Text),
    # Recovery reads live tasks in id order.
    Index("ix_cronoq_tasks_live", "id", postgresql_where=text("NOT terminal")),
    # A key names at most one live task; finished tasks release it.
    Index(
        "uq_cronoq_tasks_live_key",
        "key",
        unique=True,
        postgresql_where=text("NOT terminal AND key IS NOT NULL"),
    ),
    # Recovery's retention window and prune's oldest-first victims.
    Index(
        "ix_cronoq_tasks_finished_updated",
        "updated_unix_ns",
        "id",
        postgresql_where=text("terminal"),
    ),
    # The newest task with a key (get_task), and finished tasks depended on by key.
    Index("ix_cronoq_tasks_key_id", "key", "id", postgresql_where=text("key IS NOT NULL")),
    # Prune's scan of live tasks that have dependencies.
    Index(
        "ix_cronoq_tasks_live_deps",
        "id",
        postgresql_where=text("NOT terminal AND deps <> '[]'::jsonb"),
    ),
)

recurring = Table(
    "cronoq_recurring",
    metadata,
    Column("name", Text, primary_key=True),
    Column("spec", JSONB, nullable=False),
    Column("template_payload", LargeBinary, nullable=False),
    Column("next_unix_ns", BigInteger),
    # The occurrence a queued recurring schedule chains to.
    Column("last_task_id", BigInteger),
)


def schema_options(schema: str) -> dict[str, Any]:
    """Execution options that point the schema-less tables at the cluster's ``schema``."""
    return {"schema_translate_map": {None: validate_schema_name(schema)}}
