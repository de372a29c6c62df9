"""Batches in flight, attacked: what each submitter is told once another batch is fenced,
and what the writer leaves behind when it dies with a batch waiting for one in flight.

A commit's reply can come back after a later batch's: here a store whose first commit's
reply is held (the commit has landed) until the test lets it through.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta

import pytest
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store._committer import GroupCommitter
from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import (
    IntervalSchedule,
    RecurringSpec,
    TaskId,
    TaskSpec,
    TaskStatus,
    TimeBase,
)
from cronoq_store._errors import CommitterClosedError, FencedError, IdCollisionError
from cronoq_store._mutations import (
    Mutation,
    RecurringRemove,
    RecurringUpsert,
    StatusChanged,
    Submitted,
)
from cronoq_store._store import PgStore
from cronoq_store._urls import async_url
from cronoq_store.telemetry import Telemetry

from .pgharness import admin_execute
from .test_group_commit import LeaderRowHold
from .waits import until

BASE = TimeBase.now()
_ids = itertools.count(1)


def new() -> Submitted:
    id = next(_ids)
    return Submitted(TaskId(id), id, 1, TaskSpec(b"p%d" % id))


@pytest.fixture
async def store(pg_url: URL, migrated: str) -> AsyncIterator[PgStore]:
    async with await PgStore.connect(pg_url, PgStoreConfig(schema=migrated)) as s:
        yield s


class SlowFirstReply:
    """A store whose first commit lands at once but whose reply waits for ``reply``."""

    def __init__(self, store: PgStore) -> None:
        self._store = store
        self.landed = asyncio.Event()
        self.reply = asyncio.Event()
        self._first = True

    @property
    def max_commit_bytes(self) -> int:
        return self._store.max_commit_bytes

    @property
    def telemetry(self) -> Telemetry:
        return self._store.telemetry

    async def ping(self) -> None:
        await self._store.ping()

    async def commit(
        self,
        epoch: int,
        base: TimeBase,
        batch: Sequence[Mutation],
        outputs: Sequence[tuple[TaskId, bytes]],
    ) -> None:
        first, self._first = self._first, False
        await self._store.commit(epoch, base, batch, outputs)
        if first:
            self.landed.set()
            await self.reply.wait()


async def stored(url: URL, schema: str) -> list[int]:
    rows = await admin_execute(url, f'SELECT id FROM "{schema}".cronoq_tasks ORDER BY id')
    return [r[0] for r in rows]


async def test_a_batch_that_landed_is_acknowledged_though_a_later_one_was_fenced(
    store: PgStore, migrated: str, pg_url: URL
) -> None:
    """The first batch commits under its epoch; a takeover follows; a second, independent
    batch is fenced by its own check before the first one's reply is back. The first
    batch's submitter is told it is durable (its rows are stored), not FencedError; the
    second's is fenced, and nothing of it is stored."""
    slow = SlowFirstReply(store)
    committer = GroupCommitter(slow, 0, BASE, max_batches_in_flight=2)
    first, second = new(), new()
    one = asyncio.ensure_future(committer.submit([first]))
    await asyncio.wait_for(slow.landed.wait(), 10)
    await admin_execute(pg_url, f'UPDATE "{migrated}".cronoq_leader SET epoch = epoch + 1')
    two = asyncio.ensure_future(committer.submit([second]))
    await until(lambda: committer.fenced, "the second batch fenced")
    slow.reply.set()
    outcomes = await asyncio.wait_for(asyncio.gather(one, two, return_exceptions=True), 10)
    await committer.close()
    assert await stored(pg_url, migrated) == [first.id]
    assert outcomes[0] is None, outcomes[0]
    assert isinstance(outcomes[1], FencedError)


async def test_a_writer_cancelled_with_a_batch_waiting_for_one_in_flight_fails_it(
    store: PgStore, migrated: str, pg_url: URL
) -> None:
    """The second batch (a transition of the first batch's task) waits for the first, which
    waits on a held leader row. The writer task is cancelled (a loop shutting down): every
    submitter is told, the waiting batch's too, none is left waiting for ever."""
    task = new()
    committer = GroupCommitter(store, 0, BASE, max_batches_in_flight=2)
    async with LeaderRowHold(pg_url, migrated) as hold:
        one = asyncio.ensure_future(committer.submit([task]))
        await asyncio.sleep(0.2)
        two = asyncio.ensure_future(
            committer.submit([StatusChanged(task.id, TaskStatus.RUNNING, 1, 5)])
        )
        await asyncio.sleep(0.2)
        assert not one.done()
        assert not two.done()
        writers = [t for t in asyncio.all_tasks() if t.get_name() == "cronoq-group-commit-epoch-0"]
        assert len(writers) == 1
        writers[0].cancel()
        await asyncio.wait({writers[0]}, timeout=10)
        await hold.release()
        outcomes = await asyncio.wait_for(asyncio.gather(one, two, return_exceptions=True), 10)
    await committer.close()
    assert all(isinstance(o, CommitterClosedError) for o in outcomes), outcomes


async def waiting_pids(url: URL, name: str) -> list[int]:
    """The sessions of ``name`` whose commits wait on the held leader row."""
    rows = await admin_execute(
        url,
        "SELECT pid FROM pg_stat_activity WHERE application_name = $1 "
        "AND wait_event_type = 'Lock' ORDER BY backend_start",
        name,
    )
    return [r[0] for r in rows]


@pytest.mark.parametrize("then", ["release", "takeover"])
async def test_a_batch_whose_session_is_killed_in_flight_lands_once_or_is_fenced(
    pg_url: URL, migrated: str, then: str
) -> None:
    """Three batches wait in flight on the held leader row; one's backend is terminated
    there. With the row released, the killed batch is retried and every submission lands,
    each once; with a takeover instead, every one (the retried batch's too) is fenced and
    nothing is stored."""
    name = f"kill-{migrated}"
    config = PgStoreConfig(schema=migrated, application_name=name)
    async with await PgStore.connect(pg_url, config) as store:
        committer = GroupCommitter(store, 0, BASE, max_batch_mutations=1, max_batches_in_flight=3)
        tasks = [new() for _ in range(5)]
        async with LeaderRowHold(pg_url, migrated) as hold:
            waiting = [asyncio.ensure_future(committer.submit([t])) for t in tasks]

            async def three() -> bool:
                return len(await waiting_pids(pg_url, name)) == 3

            await until(three, "three batches in flight")
            killed = (await waiting_pids(pg_url, name))[1]
            await admin_execute(pg_url, "SELECT pg_terminate_backend($1)", killed)
            await asyncio.sleep(0.3)  # the killed batch fails and is sent again
            if then == "takeover":
                await hold.execute(f'UPDATE "{migrated}".cronoq_leader SET epoch = epoch + 1')
                await hold.release(commit=True)
            else:
                await hold.release()
            outcomes = await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), 30)
        await committer.close()
    if then == "takeover":
        assert all(isinstance(o, FencedError) for o in outcomes), outcomes
        assert await stored(pg_url, migrated) == []
    else:
        assert outcomes == [None] * len(tasks)
        assert await stored(pg_url, migrated) == [t.id for t in tasks]


async def test_batches_in_flight_on_an_applications_one_connection_pool_with_a_prune(
    pg_url: URL, migrated: str
) -> None:
    """An application's engine with one connection and no overflow; four batches in flight
    and a prune share it. Nothing deadlocks: the flights take the connection in turn, the
    prune takes its barrier between them, and every submission lands."""
    app = create_async_engine(async_url(pg_url), pool_size=1, max_overflow=0)
    try:
        async with await PgStore.from_engine(app, PgStoreConfig(schema=migrated)) as store:
            committer = GroupCommitter(
                store, 0, BASE, max_batch_mutations=2, max_batches_in_flight=4
            )
            tasks = [new() for _ in range(40)]
            submissions = [asyncio.ensure_future(committer.submit([t])) for t in tasks]
            pruned = asyncio.ensure_future(store.prune(1))
            outcomes = await asyncio.wait_for(asyncio.gather(*submissions), 30)
            assert await asyncio.wait_for(pruned, 30) == 0
            await committer.close()
    finally:
        await app.dispose()
    assert outcomes == [None] * len(tasks)
    assert await stored(pg_url, migrated) == [t.id for t in tasks]


@pytest.mark.parametrize("follower", ["a transition of its task", "a task taking its key"])
async def test_a_batch_waits_for_the_bisection_of_a_failed_batch_it_follows(
    store: PgStore, migrated: str, pg_url: URL, follower: str
) -> None:
    """The first batch holds an innocent submission (a new task, or the finish of the
    holder of key ``k``) and a guilty one (an id another task holds): it fails whole and is
    bisected. The second batch follows the innocent one (a transition of that task, or a
    new task with ``k``): it lands after the innocent half, as serially."""
    other, holder = new(), Submitted(TaskId(next(_ids)), 1, 1, TaskSpec(b"h", key="k"))
    await store.commit(0, BASE, [other, holder], [])
    task = new()
    if follower == "a transition of its task":
        innocent: list[Mutation] = [task]
        later: list[Mutation] = [StatusChanged(task.id, TaskStatus.RUNNING, 1, 5)]
    else:
        innocent = [StatusChanged(holder.id, TaskStatus.SUCCEEDED, 1, 5)]
        later = [Submitted(task.id, 2, 1, TaskSpec(b"n", key="k"))]
    guilty = Submitted(other.id, 9, 9, TaskSpec(b"not the same task"))
    committer = GroupCommitter(store, 0, BASE, max_batches_in_flight=4)
    async with LeaderRowHold(pg_url, migrated) as hold:
        one = asyncio.ensure_future(committer.submit(innocent))
        bad = asyncio.ensure_future(committer.submit([guilty]))
        await asyncio.sleep(0.2)  # one batch of both, in flight on the held row
        two = asyncio.ensure_future(committer.submit(later))
        await asyncio.sleep(0.2)
        assert not two.done()
        await hold.release()
        outcomes = await asyncio.wait_for(asyncio.gather(one, bad, two, return_exceptions=True), 10)
    await committer.close()
    assert outcomes[0] is None
    assert isinstance(outcomes[1], IdCollisionError)
    assert outcomes[2] is None, outcomes[2]
    record = await store.get_task(task.id)
    assert record is not None
    if follower == "a transition of its task":
        assert record.status is TaskStatus.RUNNING
    else:
        assert record.key == "k"


async def test_a_barrier_returns_only_once_everything_before_it_is_settled(
    store: PgStore, migrated: str, pg_url: URL
) -> None:
    """An empty submission is a barrier: it returns once everything submitted before it is
    settled. The first batch has landed but its reply is slow; a barrier submitted after it
    (a batch of its own, in flight beside it) does not return before it."""
    slow = SlowFirstReply(store)
    committer = GroupCommitter(slow, 0, BASE, max_batches_in_flight=4)
    one = asyncio.ensure_future(committer.submit([new()]))
    await asyncio.wait_for(slow.landed.wait(), 10)
    barrier = asyncio.ensure_future(committer.submit([]))
    await asyncio.sleep(0.3)
    barrier_first = barrier.done()
    slow.reply.set()
    await asyncio.wait_for(asyncio.gather(one, barrier), 10)
    await committer.close()
    assert not barrier_first, "the barrier returned before the submission before it settled"


async def test_a_schedules_upsert_and_remove_in_batches_in_flight_land_in_order(
    store: PgStore, migrated: str, pg_url: URL
) -> None:
    """A schedule is created in one batch (held in flight) and removed in the next: the
    removal waits for the creation, so the schedule is gone at the end, as serially."""
    spec = RecurringSpec("r", IntervalSchedule(timedelta(seconds=5)), TaskSpec(b"t"))
    committer = GroupCommitter(store, 0, BASE, max_batches_in_flight=4)
    async with LeaderRowHold(pg_url, migrated) as hold:
        one = asyncio.ensure_future(committer.submit([RecurringUpsert(spec)]))
        await asyncio.sleep(0.2)
        two = asyncio.ensure_future(committer.submit([RecurringRemove("r")]))
        await asyncio.sleep(0.2)
        assert not two.done()
        await hold.release()
        await asyncio.wait_for(asyncio.gather(one, two), 10)
    await committer.close()
    rows = await admin_execute(pg_url, f'SELECT count(*) FROM "{migrated}".cronoq_recurring')
    assert rows[0][0] == 0
