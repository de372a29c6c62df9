"""Commits share the fence: each checks the epoch under ``FOR SHARE`` and none takes the
leader row exclusively, so commits in flight never wait for one another; a takeover still
waits for all of them. And without a high-water mark written by every commit, no id once
stored is ever issued again: prune records the largest id it deletes with the deletion.

Each way an id could come back is tried: a prune then a takeover, the epoch's wrap, a
failed batch (a commit refused, a prune batch killed), and a failover to an asynchronous
standby (``tests/test_id_failover.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import asyncpg
import pytest
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from cronoq_store._commit_path import COPY_MIN_ROWS
from cronoq_store._committer import GroupCommitter
from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import (
    EPOCH_MAX,
    Mutation,
    Submitted,
    TaskId,
    task_id,
)
from cronoq_store._errors import KeyTakenError, StoreError
from cronoq_store._store import PgStore

from .pgharness import admin_execute, asyncpg_dsn
from .support import OLD_BASE, PROCESS_BASE, SUCCEEDED, changed, submitted
from .waits import bounded, until_value

#: Batches that insert tasks, one per write path: one statement for one task and for
#: several, COPY, and a transaction (new tasks and a transition of a stored one).
SHAPES: dict[str, Callable[[int], list[Mutation]]] = {
    "one task": lambda n: [submitted(n)],
    "several tasks": lambda n: [submitted(n + i) for i in range(3)],
    "copy": lambda n: [submitted(n + i) for i in range(COPY_MIN_ROWS)],
    "transaction": lambda n: [submitted(n), changed(1, SUCCEEDED, 2)],
}


@pytest.mark.parametrize("shape", SHAPES)
async def test_a_commit_does_not_wait_for_a_commit_in_flight(
    store: PgStore, migrated: str, pg_url: URL, shape: str
) -> None:
    """Another commit in flight holds the leader row as every commit does (FOR SHARE): a
    commit that inserts tasks goes through meanwhile. Were a commit to take the row
    exclusively (to record the id high-water mark there, say), it would queue behind."""
    await store.commit(0, PROCESS_BASE, [submitted(1)], [])
    in_flight = await asyncpg.connect(asyncpg_dsn(pg_url))
    try:
        tx = in_flight.transaction()
        await tx.start()
        await in_flight.execute(
            f'SELECT epoch FROM "{migrated}".cronoq_leader WHERE id = 1 FOR SHARE'
        )
        batch = SHAPES[shape](100)
        # Blocked by the holder, it would wait as long as the holder: the bound is how long
        # the test takes to say so.
        await bounded(
            store.commit(0, PROCESS_BASE, batch, []), "the commit beside a FOR SHARE holder"
        )
        await tx.rollback()
    finally:
        await in_flight.close()
    rows = await admin_execute(pg_url, f'SELECT count(*) FROM "{migrated}".cronoq_tasks')
    assert rows[0][0] == 1 + sum(isinstance(m, Submitted) for m in batch)


#: Each test runs on a store on an application's engine and on one on its own pool.
STORE_OPENINGS = ("from_engine", "connect")


async def takeover(engine: AsyncEngine, schema: str) -> tuple[PgStore, int, int]:
    """A new instance takes leadership and recovers: the store, its epoch, its first id
    (as the README issues them: ``max(next_id, task_id(epoch, 0))``)."""
    leader = await PgStore.from_engine(engine, PgStoreConfig(schema=schema))
    epoch = await leader.acquire_leadership()
    recovered = await leader.recover(PROCESS_BASE)
    return leader, epoch, max(recovered.next_id, task_id(epoch, 0))


async def lead_at_the_wrap(engine: AsyncEngine, schema: str, pg_url: URL) -> tuple[PgStore, int]:
    """The leader of the last epoch before the wrap (32767) and its first id. From the next
    term on, the epoch prefix no longer keeps ids apart: only ``next_id`` does."""
    await admin_execute(pg_url, f'UPDATE "{schema}".cronoq_leader SET epoch = {EPOCH_MAX - 1}')
    leader, epoch, start = await takeover(engine, schema)
    assert epoch == EPOCH_MAX
    assert start == task_id(EPOCH_MAX, 0)
    return leader, start


def done(ids: list[int]) -> list[Mutation]:
    return [m for i in ids for m in (submitted(i), changed(i, SUCCEEDED, 2))]


async def test_prune_then_takeover_never_issues_a_pruned_id_again(
    engine: AsyncEngine, migrated: str, pg_url: URL
) -> None:
    """Past the wrap, two leaders in turn issue ids that all finish and are pruned: the
    third leader's first id is above every one of them."""
    last, start = await lead_at_the_wrap(engine, migrated, pg_url)
    issued = [start + n for n in range(3)]
    await last.commit(EPOCH_MAX, OLD_BASE, done(issued), [])
    await last.close()
    wrapped, epoch, start = await takeover(engine, migrated)
    assert epoch == 1
    assert start == max(issued) + 1
    issued += [start, start + 1]
    await wrapped.commit(epoch, OLD_BASE, done(issued[-2:]), [])
    assert await wrapped.prune(1) == 5
    await wrapped.close()
    third, epoch, start = await takeover(engine, migrated)
    try:
        assert epoch == 2
        assert start == max(issued) + 1
    finally:
        await third.close()


async def test_the_epoch_wrap_after_a_prune_never_issues_a_pruned_id_again(
    engine: AsyncEngine, migrated: str, pg_url: URL
) -> None:
    """The first leader's ids stay stored; the leader of epoch 32767 issues the largest ids,
    which are pruned; the next epoch wraps to 1 and continues above them all."""
    first, epoch, start = await takeover(engine, migrated)
    low = [start, start + 1]
    await first.commit(epoch, OLD_BASE, [submitted(i) for i in low], [])
    await first.close()
    last, start = await lead_at_the_wrap(engine, migrated, pg_url)
    high = [start + n for n in range(3)]
    await last.commit(EPOCH_MAX, OLD_BASE, done(high), [])
    assert await last.prune(1) == 3
    await last.close()
    wrapped, epoch, start = await takeover(engine, migrated)
    try:
        assert epoch == 1
        assert start == max(high) + 1
    finally:
        await wrapped.close()


async def test_a_failed_batch_leaves_every_stored_id_unissuable(
    engine: AsyncEngine, migrated: str, pg_url: URL
) -> None:
    """At the wrap, a group commit's batch fails (a taken key) and is bisected; its innocent
    half lands, finishes and is pruned with everything else; the next leader issues none of
    the ids ever stored. The refused submissions' ids were never stored (nor acknowledged):
    only those may be issued again."""
    last, start = await lead_at_the_wrap(engine, migrated, pg_url)
    holder, innocent, guilty = start, start + 1, start + 2
    await last.commit(EPOCH_MAX, OLD_BASE, [submitted(holder, key="k")], [])
    async with GroupCommitter(last, EPOCH_MAX, OLD_BASE) as committer:
        results = await asyncio.gather(
            committer.submit([*done([innocent]), changed(holder, SUCCEEDED, 2)]),
            committer.submit([submitted(guilty, key="k2"), submitted(guilty + 1, key="k2")]),
            return_exceptions=True,
        )
    assert results[0] is None
    assert isinstance(results[1], KeyTakenError)
    assert await last.get_task(TaskId(guilty)) is None
    assert await last.prune(1) == 2
    await last.close()
    wrapped, epoch, start = await takeover(engine, migrated)
    try:
        assert epoch == 1
        assert start == innocent + 1
    finally:
        await wrapped.close()


async def test_a_prune_batch_killed_mid_way_records_nothing_and_deletes_nothing(
    store: PgStore, migrated: str, pg_url: URL
) -> None:
    """A prune batch waits for a commit in flight (it takes the leader row in a mode that
    conflicts with the commits' share lock); its session is killed there: nothing was
    deleted, nothing recorded, and the next prune records what it deletes."""
    high = TaskId(task_id(3, 41))
    await store.commit(0, OLD_BASE, [submitted(high), changed(high, SUCCEEDED, 2)], [])
    in_flight = await asyncpg.connect(asyncpg_dsn(pg_url))
    try:
        tx = in_flight.transaction()
        await tx.start()
        await in_flight.execute(
            f'SELECT epoch FROM "{migrated}".cronoq_leader WHERE id = 1 FOR SHARE'
        )
        pruning = asyncio.ensure_future(store.prune(1))
        waiting: list[int] = await until_value(
            lambda: _waiting_pids(pg_url),
            lambda pids: bool(pids) or pruning.done(),
            "the prune batch to wait for the commit in flight",
        )
        assert not pruning.done(), "the prune batch did not wait for the commit in flight"
        await admin_execute(pg_url, "SELECT pg_terminate_backend($1)", waiting[0])
        with pytest.raises(StoreError):
            await pruning
        await tx.rollback()
    finally:
        await in_flight.close()
    marks: list[Any] = await admin_execute(
        pg_url,
        f'SELECT max_id, (SELECT count(*) FROM "{migrated}".cronoq_tasks) '
        f'FROM "{migrated}".cronoq_leader',
    )
    assert tuple(marks[0]) == (0, 1)
    assert await store.prune(1) == 1
    assert (await store.recover(PROCESS_BASE)).next_id == high + 1


async def _waiting_pids(url: URL) -> list[int]:
    rows = await admin_execute(
        url,
        "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND query LIKE '%cronoq_leader%'",
    )
    return [r[0] for r in rows]
