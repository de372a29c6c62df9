"""Look-ups and the one prune loop, on connections the store hands in.

Arguments are checked by the ``*_params`` functions before anything connects, so that bad
input is a ``ValueError`` and never a database error; ``PgStore`` runs the rest inside its
error translation. The CLI prunes through ``PgStore.prune`` (its ``progress`` callback), so
there is one loop that takes the leader row lock before every batch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any, NamedTuple

from sqlalchemy import Executable
from sqlalchemy.ext.asyncio import AsyncConnection

from . import _catalog as catalog
from . import _door as door
from . import _statements as st
from ._domain import (
    I64_MAX,
    UNIX_EPOCH,
    TaskId,
    TaskRef,
    TaskStatus,
    check_seconds,
    check_task_id,
    clean_text,
)
from ._door import holder_of
from ._errors import ClusterReplacedError, StoreError
from ._results import LockHolder, TaskRecord
from ._schema import RECORD_COLUMNS, task_record

__all__ = [
    "HOLDER_COLUMNS",
    "MAX_PRUNE_AGE",
    "PRUNE_BATCH",
    "TAKEOVER_GRACE",
    "ClusterFacts",
    "ListedTask",
    "cluster_facts",
    "facts_of",
    "finished_params",
    "get_listed_task",
    "get_listed_tasks",
    "get_task",
    "holder_of",
    "incarnation",
    "leader_columns",
    "leader_lock_holder",
    "list_finished",
    "list_listed_finished",
    "listed_task",
    "load_output",
    "lock_keys",
    "lookup_params",
    "migration_lock_holder",
    "next_prune_batch",
    "prune",
    "prune_age_ns",
    "prune_cutoff",
    "server_prune_cutoff",
]

#: Rows the first statement of :func:`prune` deletes; later ones are sized by how long the
#: last took (:func:`next_prune_batch`), from this to :data:`PRUNE_BATCH_MAX`.
PRUNE_BATCH = 1000
PRUNE_BATCH_MAX = 64_000
#: How long a prune batch aims to take. Commits wait for a batch (it holds the leader
#: table), so it stays short; but each batch reads every live task's dependencies again,
#: a fixed cost (two thirds of a batch of 1,000 with 20,000 live dependents) that larger
#: batches pay fewer times.
PRUNE_BATCH_SECONDS = 0.2
#: The oldest ``older_than`` :func:`prune_cutoff` takes, in seconds (100 years): cutoffs are
#: Unix nanoseconds in a BIGINT, which ends 292 years from 1970.
MAX_PRUNE_AGE = 36500 * 86400


def lookup_params(ref: TaskRef) -> dict[str, object]:
    """The parameters of :func:`get_task`: a cleaned key, or an id (``ValueError`` for an
    id no task can have, rather than a database error or a silent miss)."""
    if isinstance(ref, str):
        return {"key": clean_text(ref)}
    check_task_id("ref", ref)
    return {"id": int(ref)}


class ListedTask(NamedTuple):
    """A task as an operator's listing shows it: its record, and its status as stored,
    which is a newer build's status name where ``record.status`` can only say ``None``."""

    record: TaskRecord
    stored_status: str


#: Where the stored status stands in a task row (:data:`~cronoq_store._schema.RECORD_COLUMNS`).
_STATUS_AT = RECORD_COLUMNS.index("status")


def listed_task(row: Sequence[Any]) -> ListedTask:
    """A task row (:data:`~cronoq_store._schema.RECORD_COLUMNS`) as a listing shows it."""
    return ListedTask(task_record(*row), row[_STATUS_AT])


async def get_listed_task(conn: AsyncConnection, params: dict[str, object]) -> ListedTask | None:
    """The task with an id, or the newest task with a key (parameters from
    :func:`lookup_params`), with its stored status."""
    stmt: Executable = st.task_by_key if "key" in params else st.task_by_id
    row = (await conn.execute(stmt, params)).first()
    return None if row is None else listed_task(row)


async def get_listed_tasks(
    conn: AsyncConnection, ids: Sequence[TaskId], limit: int
) -> list[ListedTask]:
    """The tasks among ``ids`` (in id order, ``limit`` at most), with their stored statuses:
    what a short id names, in whichever epochs hold it."""
    for id_ in ids:
        check_task_id("ids", id_)
    rows = (await conn.execute(st.tasks_by_ids, {"ids": list(ids), "limit": limit})).all()
    return [listed_task(row) for row in rows]


async def get_task(conn: AsyncConnection, params: dict[str, object]) -> TaskRecord | None:
    """The task with an id, or the newest task with a key (parameters from
    :func:`lookup_params`)."""
    listed = await get_listed_task(conn, params)
    return None if listed is None else listed.record


def finished_params(
    pools: Sequence[str], statuses: Sequence[TaskStatus], after: TaskId | None, limit: int
) -> dict[str, Any]:
    """The parameters of a page of :func:`list_finished`; ``ValueError`` for a bad limit or
    ``after``."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit <= I64_MAX:
        raise ValueError(f"limit: must be an integer in 0..2**63-1, got {limit!r}")
    if after is not None:
        check_task_id("after", after)
    return {
        "pools": [clean_text(p) for p in pools],
        "statuses": [s.value for s in statuses],
        "after": -1 if after is None else after,
        "limit": limit,
    }


async def list_listed_finished(conn: AsyncConnection, params: dict[str, Any]) -> list[ListedTask]:
    """One page of finished tasks in id order (parameters from :func:`finished_params`),
    with their stored statuses."""
    rows = (await conn.execute(st.finished_page, params)).all()
    return [listed_task(row) for row in rows]


async def list_finished(conn: AsyncConnection, params: dict[str, Any]) -> list[TaskRecord]:
    """One page of finished tasks in id order (parameters from :func:`finished_params`)."""
    return [listed.record for listed in await list_listed_finished(conn, params)]


async def load_output(conn: AsyncConnection, id: TaskId) -> bytes | None:
    """The output of task ``id`` if it succeeded, else ``None``."""
    output: bytes | None = (await conn.execute(st.task_output, {"id": id})).scalar()
    return output


def next_prune_batch(rows: int, seconds: float) -> int:
    """The size of the prune batch after one of ``rows`` that took ``seconds``: scaled
    toward :data:`PRUNE_BATCH_SECONDS`, at most four times larger or smaller than the last,
    within :data:`PRUNE_BATCH` and :data:`PRUNE_BATCH_MAX`. A batch slowed by commits it
    waited for makes the next smaller, never larger."""
    scaled = 4 * rows if seconds <= 0 else round(rows * PRUNE_BATCH_SECONDS / seconds)
    return max(PRUNE_BATCH, min(PRUNE_BATCH_MAX, 4 * rows, max(rows // 4, scaled)))


def prune_age_ns(older_than: float) -> int:
    """``older_than`` seconds in ns; ``ValueError`` for a bad age (before anything
    connects)."""
    return round(check_seconds("older_than:", older_than, most=MAX_PRUNE_AGE) * 1e9)


def prune_cutoff(older_than: float) -> int:
    """The Unix ns before which finished tasks are pruned, on this process's clock: the
    in-memory store's, which has no server."""
    return time.time_ns() - prune_age_ns(older_than)


async def server_prune_cutoff(conn: AsyncConnection, older_than: float) -> int:
    """The Unix ns before which finished tasks are pruned, on the database server's clock:
    what ``PgStore.prune`` and ``cronoq-store prune`` count from, so that every machine
    that prunes one cluster agrees, whatever its own clock says (a host whose clock runs
    days ahead must not delete tasks that finished an hour ago)."""
    age = prune_age_ns(older_than)
    now = (await conn.execute(catalog.server_now)).scalar_one()
    return (now - UNIX_EPOCH) // timedelta(microseconds=1) * 1000 - age


async def incarnation(conn: AsyncConnection, schema: str) -> int:
    """The cluster's incarnation in ``schema`` now (its leader table's OID), for an
    operator's prune to stay in the cluster it started in; ``StoreError`` without a leader
    row."""
    found: int | None = (await conn.execute(st.incarnation)).scalar()
    if found is None:
        raise StoreError(f"the leader row of schema {schema!r} is missing: run the migrations")
    return found


async def prune(
    in_transaction: Callable[[Callable[[AsyncConnection], Awaitable[int]]], Awaitable[int]],
    cutoff: int,
    progress: Callable[[int], None] | None = None,
    *,
    cluster: tuple[str, int],
    lock_wait: float,
    waiter: str,
) -> int:
    """Delete finished tasks updated before ``cutoff`` that no live task depends on, by id
    or key, in batches (:data:`PRUNE_BATCH` rows first, then sized by time:
    :func:`next_prune_batch`), each batch in a transaction of its own
    (``in_transaction(batch)`` runs ``batch`` in one, and may run it again after a failure
    that rolled it back); returns how many were deleted, and calls ``progress`` with the
    running total after each batch. Only in ``cluster`` (the schema and the incarnation the
    store was opened on): a batch that finds the schema holding another deletes nothing
    there and raises ``ClusterReplacedError``.

    Each batch first takes :data:`~cronoq_store._statements.leader_barrier`: every commit
    holds the leader row ``FOR SHARE`` (and so its table ``ROW SHARE``) from its epoch check
    to its end, so the batch waits for the commits in flight and its ``DELETE``, under a new
    snapshot, sees the dependencies they added; commits arriving meanwhile wait for one
    batch, and cannot starve it. The batch records the largest id it
    deletes in the same statement (:data:`~cronoq_store._statements.prune_batch`).

    The barrier waits at most ``lock_wait`` seconds for the leader table: a
    session holding it longer (any session that may lock the leader row) is named in a
    ``LockHeldError``; ``waiter`` names the call and where its bound is set.
    """
    schema, incarnation = cluster
    params = {"cutoff": cutoff, "batch": PRUNE_BATCH, "incarnation": incarnation}

    async def batch(conn: AsyncConnection) -> int:
        await door.leader_barrier(conn.execute, schema, lock_wait, waiter)
        recorded = (await conn.execute(st.prune_batch, params)).first()
        if recorded is None:
            found = (await conn.execute(st.incarnation)).scalar()
            raise ClusterReplacedError(schema, incarnation, found, "pruning finished tasks")
        deleted: int = recorded[0]
        return deleted

    total = 0
    while True:
        started = time.monotonic()
        deleted = await in_transaction(batch)
        total += deleted
        if progress is not None:
            progress(total)
        if deleted < params["batch"]:
            return total
        params["batch"] = next_prune_batch(deleted, time.monotonic() - started)


class ClusterFacts(NamedTuple):
    """What any session can read of a cluster's leadership and revision
    (:data:`~cronoq_store._statements.health_facts`), and its incarnation (the leader
    table's OID; ``None`` without a leader table)."""

    stored_epoch: int
    holder: LockHolder | None
    revision: tuple[str, ...]
    incarnation: int | None = None
    #: The host group the leader row names (``PgHost``); ``None``: a standalone cluster.
    hosted_by: str | None = None


#: How long a holder that is not (yet) a store instance gets before it is reported as
#: foreign: a takeover checks the schema between taking the lock and moving the epoch (a
#: few milliseconds, two statements), and a probe landing there must not see an intruder.
TAKEOVER_GRACE = 0.5


def lock_keys(lock: tuple[int, int]) -> dict[str, int]:
    """The parameters of :data:`~cronoq_store._statements.health_facts` for the store's
    keys: the store passes the schema OID as a signed int4; pg_locks shows it unsigned."""
    return {"k1": lock[0], "k2": lock[1] & 0xFFFFFFFF}


def facts_of(row: Any) -> ClusterFacts:
    """A row of :data:`~cronoq_store._statements.health_facts`, as facts."""
    return ClusterFacts(
        row.epoch,
        holder_of(row),
        tuple(sorted(row.revisions or ())),
        row.tableoid,
        row.hosted_by,
    )


async def cluster_facts(
    conn: AsyncConnection, lock: tuple[int, int], *, recorded: bool = True
) -> ClusterFacts:
    """The stored epoch, who holds the leader lock ``lock`` (the store's keys) and whether
    it is a store instance, and the recorded revisions: what ``PgStore.health`` and
    ``cronoq-store health`` report. One statement; a holder that is not a store instance is
    read again after :data:`TAKEOVER_GRACE`, and reported foreign only if it still is.
    ``recorded=False`` for a leader table without the holder columns (:data:`HOLDER_COLUMNS`,
    :func:`leader_columns`)."""
    keys = lock_keys(lock)
    statement = catalog.health_facts if recorded else catalog.health_facts_unrecorded
    facts = facts_of((await conn.execute(statement, keys)).one())
    if facts.holder is None or facts.holder.store_instance:
        return facts
    await asyncio.sleep(TAKEOVER_GRACE)
    await conn.execute(catalog.clear_stats_snapshot)
    return facts_of((await conn.execute(statement, keys)).one())


#: The leader table's columns that record the lock session of the current epoch (revision
#: 0007): without them, :func:`cluster_facts` needs ``recorded=False``.
HOLDER_COLUMNS = frozenset({"holder_pid", "holder_backend_start", "holder_role", "holder_epoch"})


async def leader_columns(conn: AsyncConnection, schema: str) -> frozenset[str]:
    """The columns of ``schema``'s leader table, empty when it has none: what a schema at
    another revision than this build's head lets :func:`cluster_facts` read."""
    return frozenset((await conn.execute(catalog.leader_columns, {"schema": schema})).scalars())


async def migration_lock_holder(conn: AsyncConnection, schema: str) -> LockHolder | None:
    """Who holds ``schema``'s migration lock (a migration in its transaction, or any session
    that took it): every migration of the schema waits for it. Never a store instance as
    the leader lock's holder can be: ``store_instance`` is ``False``."""
    row = (await conn.execute(catalog.migration_lock_holder, {"schema": schema})).first()
    return None if row is None else holder_of(row, store_instance=False)


async def leader_lock_holder(conn: AsyncConnection, lock: tuple[int, int]) -> LockHolder | None:
    """Who holds the leader lock ``lock`` where the schema has no leader row to read (not
    migrated, or its tables dropped under a running leader): without the row nobody can
    be told a store instance, so none is."""
    row = (await conn.execute(catalog.leader_lock_holder, lock_keys(lock))).first()
    return None if row is None else holder_of(row, store_instance=False)
