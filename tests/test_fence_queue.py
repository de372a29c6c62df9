"""Commits share the fence, and what must wait for all of them still gets its turn.

A takeover's bump and a prune batch wait for every commit in flight. Waiting on the leader
row alone is not enough: PostgreSQL lets a ``FOR SHARE`` request join the share lockers of a
row even while an ``UPDATE`` (or ``FOR NO KEY UPDATE``) waits for them, so commits that
overlap, one taking the row before the last lets it go, hold it for as long as they keep
coming. A deposed leader's commit load would then starve the next leader's takeover (and
keep committing under its stale epoch), and a prune would never run under load. Both take
the leader table ``EXCLUSIVE`` first: the lock manager queues the later commits behind it.

The commits here are the store's own, on an application's engine (each a transaction:
``BEGIN`` with the epoch check, the insert, ``COMMIT``), through a link of 10 ms each way,
so that each holds the row across round trips, as on any network.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import Submitted, TaskId, TaskSpec
from cronoq_store._errors import FencedError
from cronoq_store._store import PgStore
from cronoq_store._urls import async_url

from .pgharness import admin_execute
from .support import PROCESS_BASE
from .tcpproxy import TcpProxy
from .waits import bounded, until, until_value

#: Concurrent callers of the deposed leader's ``commit``: enough that one always holds the
#: row (each holds it about two thirds of its time).
CALLERS = 12
#: How many of the load's slowest commits the takeover or the prune may take: the commits in
#: flight end within a few of their own round trips. Starved, each waits for as long as the
#: callers go on, which is for ever; the bound is how long the test takes to say so.
COMMITS_WITHIN = 40
#: The least bound, whatever the commits measured: time for the event loop and the server
#: to be scheduled at all on a busy machine.
LEAST_WITHIN = 10.0


@dataclass
class Load:
    """The deposed leader's callers: the ids committed, how long each commit took, how many
    were fenced."""

    committed: list[int] = field(default_factory=list)
    took: list[float] = field(default_factory=list)
    fenced: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def within(self) -> float:
        """How long what waits for the commits in flight may take, from how long the
        commits took so far on this machine, now."""
        return max(LEAST_WITHIN, COMMITS_WITHIN * max(self.took))


@pytest.fixture
async def slow_engine(pg_url: URL) -> AsyncIterator[AsyncEngine]:
    async with TcpProxy.to(pg_url) as proxy:
        proxy.delay(0.01)
        engine = create_async_engine(async_url(proxy.url(pg_url)), pool_size=CALLERS)
        try:
            yield engine
        finally:
            await engine.dispose()


async def commit_load(store: PgStore, epoch: int, load: Load) -> list[asyncio.Task[None]]:
    ids = itertools.count(1)

    async def caller() -> None:
        while not load.stop.is_set():
            id = next(ids)
            started = time.monotonic()
            try:
                await store.commit(
                    epoch, PROCESS_BASE, [Submitted(TaskId(id), id, 1, TaskSpec(b"p"))], []
                )
            except FencedError:
                load.fenced += 1
                return
            load.took.append(time.monotonic() - started)
            load.committed.append(id)

    tasks = [asyncio.ensure_future(caller()) for _ in range(CALLERS)]
    # In full swing: every caller has had a turn, and comes back for the next.
    await until_value(
        lambda: len(load.committed),
        lambda n: n >= 3 * CALLERS,
        f"{3 * CALLERS} commits of the load",
    )
    return tasks


async def test_a_deposed_leaders_overlapping_commits_do_not_starve_the_takeover(
    slow_engine: AsyncEngine, engine: AsyncEngine, migrated: str, pg_url: URL
) -> None:
    """The takeover's bump comes within a few round trips, every caller of the deposed
    leader is fenced from then on, and every commit it was told of is stored."""
    deposed = await PgStore.from_engine(slow_engine, PgStoreConfig(schema=migrated))
    successor = await PgStore.from_engine(engine, PgStoreConfig(schema=migrated))
    load = Load()
    callers = await commit_load(deposed, 0, load)
    try:
        within = load.within()
        epoch = await bounded(
            successor.acquire_leadership(),
            f"the takeover under the deposed leader's commits (slowest {max(load.took):.3f} s)",
            within,
        )
        await bounded(
            asyncio.gather(*callers), "every caller of the deposed leader to be fenced", within
        )
    finally:
        load.stop.set()
        await asyncio.gather(*callers, return_exceptions=True)
        await successor.close()
        await deposed.close()
    assert epoch == 1
    assert load.fenced == CALLERS
    stored = await admin_execute(pg_url, f'SELECT count(*) FROM "{migrated}".cronoq_tasks')
    assert stored[0][0] == len(load.committed)


async def test_a_prune_batch_is_not_starved_by_overlapping_commits(
    slow_engine: AsyncEngine, engine: AsyncEngine, migrated: str
) -> None:
    """A prune under the same commit load runs within a few round trips, the commits
    going on around it."""
    leader = await PgStore.from_engine(slow_engine, PgStoreConfig(schema=migrated))
    pruner = await PgStore.from_engine(engine, PgStoreConfig(schema=migrated))
    load = Load()
    callers = await commit_load(leader, 0, load)
    try:
        within = load.within()
        pruned = await bounded(
            pruner.prune(1),
            f"the prune under the leader's commits (slowest {max(load.took):.3f} s)",
            within,
        )
        assert pruned == 0
        before = len(load.committed)
        await until(
            lambda: len(load.committed) > before, "the commits to go on after the prune", within
        )
    finally:
        load.stop.set()
        await asyncio.gather(*callers, return_exceptions=True)
        await pruner.close()
        await leader.close()
    assert load.fenced == 0
