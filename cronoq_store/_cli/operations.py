"""What the operator's commands read and do to a cluster, each defined once: the CLI's
commands (``health``, ``handover``, ``prune``) and the console (:mod:`cronoq_store._console`)
both call these, so the two can never give different verdicts, end a session on different
checks, or count a different prune."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, NamedTuple

from sqlalchemy.ext.asyncio import AsyncConnection

from .. import _catalog as catalog
from .. import _lock_statements as lock_st
from .. import _queries as queries
from .._domain import I64_MAX
from .._migrations import RevisionStatus
from .._queries import ClusterFacts
from .._stored_values import LockHolder
from . import database, output
from .exits import CliError, ExitCode

__all__ = [
    "PUBLIC_CONNECT_WARNING",
    "Health",
    "PrunePlan",
    "batch_transactions",
    "end_leader_session",
    "fresh_facts",
    "health_document",
    "leader_lock",
    "migration_lock_warning",
    "plan_prune",
    "prune_batches",
    "read_health",
    "schema_facts",
    "verdict",
    "wait_for_new_leader",
]

#: How often a handover looks for the new leader while it waits.
_POLL = 0.1

#: Why a database where PUBLIC may connect is worth a line (docs/reliability.md).
PUBLIC_CONNECT_WARNING = (
    "every role may connect to this database (CONNECT is granted to PUBLIC), so any of them "
    "can hold the leader lock: instances refuse to lead here unless allow_untrusted_connect; "
    "run REVOKE CONNECT ON DATABASE ... FROM PUBLIC"
)


async def leader_lock(conn: AsyncConnection, schema: str) -> tuple[int, int]:
    """The keys of ``schema``'s leader lock: the store's namespace and the schema's OID."""
    oid = (await conn.execute(lock_st.schema_oid, {"schema": schema})).scalar_one()
    return (lock_st.LOCK_NS_LEADER, oid)


def verdict(
    revision: RevisionStatus, facts: ClusterFacts | None, holder: LockHolder | None
) -> tuple[ExitCode, list[str]]:
    """The exit code ``health`` gives (the gravest reason's) and every reason, in words."""
    codes: list[ExitCode] = []
    reasons: list[str] = []
    if not revision.at_head:
        codes.append(ExitCode.NEWER_DATABASE if revision.unknown else ExitCode.NOT_MIGRATED)
        reasons.append(
            f"schema {revision.schema} is {revision.describe()} (this build's head is "
            f"{revision.head})"
        )
    if holder is None:
        codes.append(ExitCode.NO_LEADER)
        reasons.append("no instance holds the leader lock")
    elif facts is None:
        reasons.append(
            f"backend pid {holder.pid} ({holder.application_name or 'details hidden'}) holds the "
            f"leader lock, but schema {revision.schema} is not migrated: it cannot lead it"
        )
    elif not holder.store_instance:
        codes.append(ExitCode.FOREIGN_HOLDER)
        reasons.append(output.describe_foreign(holder))
    return (codes[0] if codes else ExitCode.OK), reasons


class Health(NamedTuple):
    """What ``health`` reads of a schema, and its verdict."""

    revision: RevisionStatus
    facts: ClusterFacts | None
    holder: LockHolder | None
    public_connect: bool
    code: ExitCode
    reasons: list[str]
    #: Who holds the schema's migration lock, if a session does.
    migration_lock: LockHolder | None = None

    @property
    def warnings(self) -> list[str]:
        """What ``health`` says whatever its exit code: facts that do not make the cluster
        unhealthy now, but stop something later."""
        said = [] if self.migration_lock is None else [migration_lock_warning(self.migration_lock)]
        return said + ([PUBLIC_CONNECT_WARNING] if self.public_connect else [])


def migration_lock_warning(holder: LockHolder) -> str:
    """A held migration lock, in words (``health``, ``status``)."""
    return (
        f"the migration lock is held by {output.describe_session(holder)}: every migration "
        "of this schema (`cronoq-store migrate`, Alembic, an instance opening on a schema "
        "behind its head) waits for it"
    )


async def schema_facts(
    conn: AsyncConnection, revision: RevisionStatus
) -> tuple[ClusterFacts | None, LockHolder | None]:
    """The leadership facts a schema at any revision holds (``None`` without a leader
    table), and the leader lock's holder. Read by the leader table's columns, not by the
    revision, so that a schema older or newer than this build's head reads as well as it
    can."""
    if not revision.exists:
        return None, None
    lock = await leader_lock(conn, revision.schema)
    columns = await queries.leader_columns(conn, revision.schema)
    if "epoch" not in columns:
        # No leader row, but a leader may still hold the lock (its tables were dropped
        # under it): say so rather than "no instance holds the lock".
        return None, await queries.leader_lock_holder(conn, lock)
    recorded = columns >= queries.HOLDER_COLUMNS
    facts = await queries.cluster_facts(conn, lock, recorded=recorded)
    return facts, facts.holder


async def read_health(conn: AsyncConnection, schema: str) -> Health:
    """Where ``schema`` stands, who holds its leader lock and its migration lock, and the
    verdict."""
    public = bool((await conn.execute(catalog.public_may_connect)).scalar())
    revision = await database.revision(conn, schema)
    facts, holder = await schema_facts(conn, revision)
    migrating = await queries.migration_lock_holder(conn, schema)
    await conn.rollback()
    code, reasons = verdict(revision, facts, holder)
    return Health(revision, facts, holder, public, code, reasons, migrating)


def health_document(schema: str, health: Health) -> dict[str, Any]:
    """``cronoq-store health --json``'s document (keys in docs/operations.md)."""
    revision, facts, holder = health.revision, health.facts, health.holder
    return {
        "healthy": health.code is ExitCode.OK,
        "schema": schema,
        "revision": list(revision.current),
        "head": revision.head,
        "at_head": revision.at_head,
        "revision_state": revision.describe(),
        "stored_epoch": None if facts is None else facts.stored_epoch,
        "leader": output.holder_document(output.leader_of(holder)),
        "lock_holder": output.holder_document(holder),
        "migration_lock": output.session_document(health.migration_lock),
        "reasons": health.reasons,
        "warnings": health.warnings,
    }


async def fresh_facts(conn: AsyncConnection, lock: tuple[int, int]) -> ClusterFacts:
    """The cluster's leadership facts, the transaction ended after them: pg_stat_activity
    is read once per transaction, so the next look sees what changed meanwhile."""
    facts = await queries.cluster_facts(conn, lock)
    await conn.rollback()
    return facts


async def end_leader_session(conn: AsyncConnection, lock: tuple[int, int], pid: int) -> None:
    """End session ``pid`` if it still holds the leader lock (a handover's one write);
    exit 1 if the lock changed hands meanwhile or the session could not be ended."""
    current = (await fresh_facts(conn, lock)).holder
    if current is None or current.pid != pid:
        raise CliError("the leader lock changed hands meanwhile: look again", ExitCode.FAILED)
    ended = (await conn.execute(catalog.terminate_backend, {"pid": pid})).scalar()
    await conn.rollback()
    if not ended:
        raise CliError(f"session pid {pid} could not be ended", ExitCode.FAILED)


async def wait_for_new_leader(
    conn: AsyncConnection,
    lock: tuple[int, int],
    before: ClusterFacts,
    old: LockHolder,
    timeout: float,
) -> ClusterFacts:
    """Once another session holds the lock and the epoch moved (a leader bumps it after
    taking the lock), the facts; exit 6 if that does not happen within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        facts = await fresh_facts(conn, lock)
        holder = facts.holder
        moved = facts.stored_epoch != before.stored_epoch
        if holder is not None and holder.pid != old.pid and moved:
            return facts
        if time.monotonic() >= deadline:
            raise CliError(
                f"no standby leads after {timeout:g} s (epoch {facts.stored_epoch}): is one "
                "running?",
                ExitCode.NO_LEADER,
            )
        await asyncio.sleep(_POLL)


class PrunePlan(NamedTuple):
    """A prune's dry run: its cutoff (Unix ns, on the server's clock), how many finished
    tasks it would delete, and how many older ones it keeps because live tasks depend on
    them."""

    cutoff_ns: int
    victims: int
    protected: int


async def plan_prune(conn: AsyncConnection, older_than: int) -> PrunePlan:
    """The dry run of a prune of finished tasks older than ``older_than`` seconds on the
    server's clock (what ``PgStore.prune`` counts from)."""
    cutoff_ns = await queries.server_prune_cutoff(conn, older_than)
    old = (await conn.execute(catalog.finished_before_count, {"cutoff": cutoff_ns})).scalar_one()
    victims = (
        await conn.execute(catalog.prunable_count, {"cutoff": cutoff_ns, "batch": I64_MAX})
    ).scalar_one()
    await conn.rollback()
    return PrunePlan(cutoff_ns, victims, max(0, old - victims))


def batch_transactions(
    conn: AsyncConnection,
) -> Callable[[], AbstractAsyncContextManager[AsyncConnection]]:
    """``conn``, one transaction per prune batch, for the store's loop (``queries.prune``)."""

    @asynccontextmanager
    async def transaction() -> AsyncIterator[AsyncConnection]:
        async with conn.begin():
            yield conn

    return transaction


async def prune_batches(
    conn: AsyncConnection, schema: str, cutoff_ns: int, progress: Callable[[int], None]
) -> int:
    """Prune on ``conn`` with the store's own loop, one transaction per batch, each waiting
    at most :data:`~cronoq_store._cli.database.LOCK_WAIT` for the leader table; returns how
    many were deleted."""
    return await queries.prune(
        batch_transactions(conn),
        cutoff_ns,
        progress,
        schema=schema,
        lock_wait=database.LOCK_WAIT,
        waiter=f"pruning (a command waits {database.LOCK_WAIT:g} s at most)",
    )
