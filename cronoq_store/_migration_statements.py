"""The migrations' own statements: what an offline (``--sql``) script checks before its DDL,
what a downgrade runs under the leader lock (:mod:`cronoq_store._downgrade_guard`), and the
bounded waits for a lock (:mod:`cronoq_store._lock_waits`): the migration lock tried, the
tables locked an attempt at a time.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    ColumnElement,
    Float,
    Integer,
    Text,
    bindparam,
    func,
    literal,
    literal_column,
    or_,
    select,
    text,
    true,
)
from sqlalchemy.schema import DDL
from sqlalchemy.sql.selectable import Select

from ._lock_statements import LOCK_NS_MIGRATE
from ._schema import leader, recurring, tasks

__all__ = [
    "checked_schema",
    "cluster_issued_ids",
    "lock_cluster_tables",
    "pause",
    "refuse_foreign_owner",
    "refuse_live_leader",
    "release_savepoint",
    "rollback_to_savepoint",
    "savepoint",
    "set_local_lock_timeout",
    "try_leader_lock_for_transaction",
    "try_migration_lock",
]

# --- offline migration script -------------------------------------------------------------


#: Where the script's owner check finds the schema's name: a setting, so that the check
#: itself is constant text (a ``DO`` block takes no parameters).
_CHECKED_SCHEMA: ColumnElement[str] = literal_column("'cronoq_store._schema'")


def checked_schema(schema: str) -> Select[tuple[str]]:
    """Name ``schema`` to :data:`refuse_foreign_owner` until the end of the transaction (the
    offline script renders the name as a literal)."""
    return select(func.pg_catalog.set_config(_CHECKED_SCHEMA, literal(schema, Text), true()))


#: What an offline (``--sql``) script runs right after ``CREATE SCHEMA IF NOT EXISTS``: stop,
#: before any DDL, if a role other than the one running it, and not a superuser, owns the
#: schema named by :func:`checked_schema` (it could have planted code the script would run
#: as us). Only the owner: the online run's full check (``trust.refuse_untrusted``)
#: needs its answers in Python.
refuse_foreign_owner = DDL(  # type: ignore[no-untyped-call]  # SQLAlchemy leaves DDL untyped
    """DO $cronoq$
DECLARE
    schema_ pg_catalog.text := pg_catalog.current_setting('cronoq_store._schema');
    owner_ pg_catalog.name;
BEGIN
    SELECT r.rolname INTO owner_
    FROM pg_catalog.pg_namespace n JOIN pg_catalog.pg_roles r ON r.oid = n.nspowner
    WHERE n.nspname = schema_ AND r.rolname <> current_user AND NOT r.rolsuper;
    IF FOUND THEN
        RAISE EXCEPTION USING
            ERRCODE = 'insufficient_privilege',
            MESSAGE = 'cronoq-store: schema ' || pg_catalog.quote_ident(schema_)
                || ' is owned by ' || pg_catalog.quote_ident(owner_) || ', neither '
                || pg_catalog.quote_ident(current_user) || ' nor a superuser: refusing to '
                || 'migrate it (its owner could have planted code that would run as '
                || pg_catalog.quote_ident(current_user) || '); run the script as its owner';
    END IF;
END
$cronoq$"""
)


# --- a downgrade, under the leader lock (``cronoq_store._downgrade_guard``) --------------------

#: ``pg_try_advisory_xact_lock(k1, k2)``: true if this transaction now holds the leader lock,
#: until it ends; a standby's ``pg_try_advisory_lock`` fails meanwhile.
try_leader_lock_for_transaction = select(
    func.pg_try_advisory_xact_lock(bindparam("k1", type_=Integer), bindparam("k2", type_=Integer))
)

#: Whether the cluster ever issued a task id: someone led (the epoch moved) or a task is stored.
#: A cluster made again after a downgrade to base starts at epoch 0 and issues them again.
cluster_issued_ids = select(
    or_(
        select(leader.c.id).where(leader.c.epoch > 0).exists(),
        select(tasks.c.id).exists(),
    )
)


#: The cluster's tables in the order a migration locks them: the leader row first, as every
#: commit takes it, so no commit can deadlock with the migration's DDL.
CLUSTER_TABLES = tuple(t.name for t in (leader, tasks, recurring))


def lock_cluster_tables(schema: str, dialect: Any, names: tuple[str, ...] = CLUSTER_TABLES) -> DDL:
    """``LOCK TABLE`` of the cluster's tables ``names`` in ``schema``, all in one statement
    before a migration touches any: it waits for commits in flight, and later ones wait for
    it, in :data:`CLUSTER_TABLES`' order, so none can deadlock with its DDL."""
    quote = dialect.identifier_preparer.quote
    ordered = [name for name in CLUSTER_TABLES if name in names]
    listed = ", ".join(f"{quote(schema)}.{quote(name)}" for name in ordered)
    return DDL(f"LOCK TABLE ONLY {listed} IN ACCESS EXCLUSIVE MODE")  # type: ignore[no-untyped-call]


# --- bounded lock waits (``cronoq_store._lock_waits``) ---------------------------------------

#: ``pg_try_advisory_xact_lock`` of the migration lock of the schema named ``schema``: true
#: if this transaction now holds it, until it ends. Tried, never waited on: the waiter
#: looks at who holds it between tries, says so, and gives up after its bound.
try_migration_lock = select(
    func.pg_try_advisory_xact_lock(
        literal(LOCK_NS_MIGRATE, Integer), func.hashtext(bindparam("schema", type_=Text))
    )
)

#: ``lock_timeout`` (``ms``, an integer as text) until the end of the transaction, or of
#: the savepoint it is set in: how long the next lock wait may take before it fails with
#: 55P03 instead of waiting on.
set_local_lock_timeout = select(
    func.pg_catalog.set_config(
        literal("lock_timeout", Text), bindparam("ms", type_=Text), true(), type_=Text
    )
)

#: A pause of ``seconds`` on the server: the same round trip on a greenlet's connection as on
#: a plain one, where a client's sleep would block an event loop.
pause = select(func.pg_catalog.pg_sleep(bindparam("seconds", type_=Float)))

#: One attempt at a lock, inside the caller's transaction, that can fail without ending it.
savepoint = text("SAVEPOINT cronoq_lock_wait")
rollback_to_savepoint = text("ROLLBACK TO SAVEPOINT cronoq_lock_wait")
release_savepoint = text("RELEASE SAVEPOINT cronoq_lock_wait")


#: What an offline (``--sql``) downgrade script runs before its first revision: stop if a
#: session holds the leader lock of the schema named by :func:`checked_schema`, else hold it
#: until the script's COMMIT, as the online run does (``-x force=true`` leaves this out).
#: The key is :data:`LOCK_NS_LEADER`, written out: the block is constant text.
refuse_live_leader = DDL(  # type: ignore[no-untyped-call]  # SQLAlchemy leaves DDL untyped
    """DO $cronoq$
DECLARE
    schema_ pg_catalog.text := pg_catalog.current_setting('cronoq_store._schema');
    holder_ pg_catalog.text;
BEGIN
    IF NOT pg_catalog.pg_try_advisory_xact_lock(1668444017, pg_catalog.to_regnamespace(
            pg_catalog.quote_ident(schema_))::pg_catalog.oid::pg_catalog.int4) THEN
        SELECT 'pid ' || l.pid || ', role ' || pg_catalog.quote_nullable(a.usename)
                || ', application ' || pg_catalog.quote_nullable(a.application_name)
                || ', since ' || COALESCE(a.backend_start::pg_catalog.text, 'unknown')
            INTO holder_
        FROM pg_catalog.pg_locks l LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
        WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
            AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d
                WHERE d.datname = pg_catalog.current_database())
            AND l.classid = 1668444017 AND l.objid = pg_catalog.to_regnamespace(
                pg_catalog.quote_ident(schema_))::pg_catalog.oid;
        RAISE EXCEPTION USING
            ERRCODE = 'object_in_use',
            MESSAGE = 'cronoq-store: an instance leads schema ' || pg_catalog.quote_ident(schema_)
                || ' (it holds the leader lock: ' || COALESCE(holder_, 'let go since')
                || '): refusing to downgrade under a live leader; stop every instance, or '
                || 'generate the script with -x force=true';
    END IF;
END
$cronoq$"""
)
