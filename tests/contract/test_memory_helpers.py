"""What ``InMemoryStore`` offers beyond the contract: the helpers an application's tests use
to stage what ``PgStore`` meets in production (a partitioned leader, a cluster's age)."""

from __future__ import annotations

import pytest

from cronoq_store import EPOCH_MAX, FencedError, Store, StoreError, StoreQueries, TaskId
from cronoq_store.testing import InMemoryDatabase, InMemoryStore

from ..support import START_BASE, submitted
from ..waits import bounded


async def test_it_is_a_store_for_the_scheduler_and_for_tools() -> None:
    store: Store = InMemoryStore()  # and mypy agrees
    queries: StoreQueries = InMemoryStore()
    assert isinstance(store, Store)
    assert isinstance(queries, StoreQueries)


async def test_a_leader_that_has_not_noticed_its_lock_session_ended_is_fenced_by_the_epoch() -> (
    None
):
    database = InMemoryDatabase()
    a, b = InMemoryStore(database), InMemoryStore(database)
    assert await a.acquire_leadership() == 1
    a.end_lock_session(noticed=False)
    assert a.is_leader  # partitioned: it believes it leads
    await a.commit(1, START_BASE, [submitted(1)], [])  # nobody took over yet: this lands
    assert await bounded(b.acquire_leadership(), "the takeover") == 2
    with pytest.raises(FencedError, match="stored epoch is 2"):
        await a.commit(1, START_BASE, [submitted(2)], [])
    await bounded(a.leadership_lost(), "leadership_lost() after the fence")
    assert [t.id for t in (await b.recover(START_BASE)).tasks] == [1]


async def test_a_database_starts_at_the_epoch_given() -> None:
    database = InMemoryDatabase(epoch=EPOCH_MAX)
    async with InMemoryStore(database) as store:
        assert await store.acquire_leadership() == 1
    assert database.epoch == 1
    for bad in (-1, EPOCH_MAX + 1, True, 1.0):
        with pytest.raises(ValueError, match="epoch"):
            InMemoryDatabase(epoch=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="retention"):
        InMemoryStore(retention=0)


async def test_stores_on_different_databases_share_nothing() -> None:
    a, b = InMemoryStore(), InMemoryStore()
    await a.commit(0, START_BASE, [submitted(1)], [])
    assert await b.get_task(TaskId(1)) is None
    assert await a.acquire_leadership() == await b.acquire_leadership() == 1


async def test_a_closed_store_refuses_every_call_and_keeps_the_data_for_the_others() -> None:
    database = InMemoryDatabase()
    a = InMemoryStore(database)
    await a.commit(0, START_BASE, [submitted(1)], [])
    await a.close()
    await a.close()  # twice is harmless
    with pytest.raises(StoreError, match="closed"):
        await a.commit(0, START_BASE, [submitted(2)], [])
    with pytest.raises(StoreError, match="closed"):
        await a.get_task(TaskId(1))
    with pytest.raises(StoreError, match="closed"):
        await a.acquire_leadership()
    assert await InMemoryStore(database).get_task(TaskId(1)) is not None
