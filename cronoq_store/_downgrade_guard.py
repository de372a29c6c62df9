"""A downgrade never runs under a live leader, nor to base of a cluster that issued ids,
unless the operator forces it.

Every revision's downgrade drops columns or tables, rows and all (no upgrade removes or
rewrites rows: 0006 drops only the hand-rolled version table it replaced). So before the
first downgrade step, in the migration's own transaction, the run takes the leader lock with
``pg_try_advisory_xact_lock`` and holds it until COMMIT: a standby that wants to lead waits
behind the downgrade, and then finds what it left. An instance that holds the lock is named
and the run refused. To base, a cluster that ever issued a task id (its epoch moved, or it
holds a task) is refused too: one made again in its place starts at epoch 0 and issues the
same ids again.

Forced (``force``: ``--force``, ``-x force=true``), the run goes on, and fences a live leader:
it locks the cluster's tables (waiting for commits in flight) and bumps the epoch before
its DDL, so every later commit of the old leader fails, as ``FencedError`` (the epoch
moved) or :class:`~cronoq_store._errors.SchemaGoneError` (its tables or columns are gone).

``guarded`` wraps the command's migration function, which Alembic calls inside the run's
transaction with the steps it will run: whatever the revision argument (``base``, ``-1``, a
range), the check sees the steps themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from alembic.runtime.environment import EnvironmentContext
from alembic.runtime.migration import MigrationContext, RevisionStep
from sqlalchemy import Connection, text

from . import _catalog as catalog
from . import _lock_waits as lock_waits
from . import _queries as queries
from . import _statements as st
from ._errors import MigrationError
from ._lock_waits import LockWait
from ._results import LockHolder
from ._schema import schema_options

__all__ = ["FORCE", "forced", "guarded"]

logger = logging.getLogger("cronoq_store")

#: ``Config.attributes`` key and ``-x`` argument (``-x force=true``) of a forced downgrade.
FORCE = "force"
#: The revision that adds the leader row's record of who bumped the epoch.
HOLDER_REVISION = "0007_leader_holder"

_MigrationFn = Callable[[Any, MigrationContext], Iterable[Any]]


def forced(context: EnvironmentContext) -> bool:
    """Whether the operator forces this run: ``attributes["force"]`` or ``-x force=true``."""
    given = context.config.attributes.get(FORCE)
    if given is None:
        given = context.get_x_argument(as_dictionary=True).get(FORCE, "false")
    return given is True or str(given).strip().lower() in ("true", "1", "yes")


def guarded(
    context: EnvironmentContext, schema: str, conn: Connection | None, wait: LockWait | None
) -> _MigrationFn | None:
    """The command's migration function, checking its steps before the first one runs: on
    ``conn`` online, in the script offline (``conn`` is ``None``); ``None`` if it has none.
    ``wait`` bounds a forced downgrade's wait for the cluster's tables (online)."""
    fn: _MigrationFn | None = context.context_opts.get("fn")
    if fn is None:
        return None
    force = forced(context)

    def steps(heads: Any, migration: MigrationContext) -> list[Any]:
        planned = list(fn(heads, migration))
        undone = [s for s in planned if isinstance(s, RevisionStep) and s.is_downgrade]
        if undone:
            to_base = any(not s.to_revisions for s in undone)
            if conn is None:
                _script(context, migration, schema, force, heads)
            else:
                assert wait is not None, "an online run always bounds its waits"
                _check(conn, schema, force=force, to_base=to_base, wait=wait)
        return planned

    return steps


def _check(conn: Connection, schema: str, *, force: bool, to_base: bool, wait: LockWait) -> None:
    oid = conn.execute(st.schema_oid, {"schema": schema}).scalar_one()
    lock = (st.LOCK_NS_LEADER, oid)
    cluster = schema_options(schema)
    took = conn.execute(st.try_leader_lock_for_transaction, {"k1": lock[0], "k2": lock[1]})
    if not took.scalar():
        row = conn.execute(catalog.leader_lock_holder, queries.lock_keys(lock)).first()
        holder = _describe(None if row is None else queries.holder_of(row, store_instance=False))
        if not force:
            raise MigrationError(
                f"an instance leads schema {schema!r} ({holder} holds its leader lock): "
                "refusing to downgrade under a live leader, which would lose what it commits; "
                "stop every instance first, or force it (`cronoq-store downgrade --force`, "
                "`alembic -x force=true`: the leader is fenced, and what the downgrade "
                "removes is lost)"
            )
        logger.warning(
            "forced downgrade under a live leader: fencing it",
            extra={"schema": schema, "holder": holder},
        )
        # Waits for its commits in flight (bounded, holders named); the bump fences every
        # later one.
        lock_waits.lock_tables(conn, schema, wait.then(f"the tables of schema {schema!r}"))
        columns = frozenset(conn.execute(catalog.leader_columns, {"schema": schema}).scalars())
        conn.execute(_bump(columns >= queries.HOLDER_COLUMNS), execution_options=cluster)
        return
    if (
        to_base
        and not force
        and conn.execute(st.cluster_issued_ids, execution_options=cluster).scalar()
    ):
        raise MigrationError(
            f"schema {schema!r} has issued task ids: downgrading it to base drops them, and "
            "a cluster migrated again in its place starts at epoch 0 and issues the same ids "
            "again, to other tasks; force it (`cronoq-store downgrade --force`, `alembic -x "
            "force=true`) only if no one keeps an id of this cluster"
        )


def _bump(records_holder: bool) -> Any:
    """The epoch bump a forced downgrade fences with: a leader table from revision 0007 on
    records who bumped; an older one has no columns for it."""
    return st.bump_epoch if records_holder else st.bump_epoch_only


def _records_holder(context: EnvironmentContext, heads: Any) -> bool:
    """Whether the schema a script starts from (``heads``) has the holder columns: whether
    :data:`HOLDER_REVISION` is among its revisions."""
    assert context.script is not None
    start = tuple(heads or ())
    if not start:
        return False
    return any(
        r.revision == HOLDER_REVISION for r in context.script.iterate_revisions(start, "base")
    )


def _script(
    context: EnvironmentContext,
    migration: MigrationContext,
    schema: str,
    force: bool,
    heads: Any,
) -> None:
    """The same in an offline script: refuse a live leader and hold the lock, or, forced,
    lock the tables and fence with the epoch. The base check (issued ids) is online only."""
    if not force:
        context.execute(st.refuse_live_leader)
        return
    context.execute(st.lock_cluster_tables(schema, migration.dialect))
    bump = _bump(_records_holder(context, heads)).compile(
        dialect=migration.dialect,
        schema_translate_map={None: schema},
        render_schema_translate=True,
        compile_kwargs={"literal_binds": True},
    )
    context.execute(text(str(bump)))


def _describe(holder: LockHolder | None) -> str:
    """The holder, in words; it may have let go since the lock was tried."""
    if holder is None:
        return "a session that has let go since"
    since = "an unknown time" if holder.since is None else holder.since.isoformat()
    return (
        f"pid {holder.pid}, application {holder.application_name!r}, role "
        f"{holder.role or '(hidden)'!r}, client "
        f"{holder.client_addr or 'local socket or hidden'}, since {since}"
    )
