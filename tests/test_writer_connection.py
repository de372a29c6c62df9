"""The writer connection a store holds for its term (``CommitPath(hold=True)``): reused by
one commit at a time, never when in doubt, returned at step-down, fencing and close."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from sqlalchemy.engine import URL

from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import TaskId, TaskSpec
from cronoq_store._errors import FencedError, UnavailableError
from cronoq_store._mutations import Submitted
from cronoq_store._store import PgStore

from .pgharness import admin_execute, asyncpg_dsn, terminate_backend
from .test_commit import BASE, submitted
from .waits import until, until_value


@pytest.fixture
def name(migrated: str) -> str:
    return f"cronoq-held-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def leader(pg_url: URL, migrated: str, name: str) -> AsyncIterator[tuple[PgStore, int]]:
    config = PgStoreConfig(
        schema=migrated, max_connections=3, application_name=name, commit_timeout=1.0
    )
    store = await PgStore.connect(pg_url, config)
    try:
        yield store, await store.acquire_leadership()
    finally:
        await store.close()


def checked_out(store: PgStore) -> int:
    return int(store.engine.pool.checkedout())  # type: ignore[attr-defined]


async def writers(pg_url: URL, name: str) -> set[int]:
    """Backends of the store's pool that ran an insert (its lock session runs none)."""
    rows = await admin_execute(
        pg_url,
        "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND query LIKE $2",
        name,
        "%INSERT INTO%cronoq_tasks%",
    )
    return {r["pid"] for r in rows}


async def stored(pg_url: URL, schema: str) -> list[int]:
    rows = await admin_execute(pg_url, f'SELECT id FROM "{schema}".cronoq_tasks ORDER BY id')
    return [r["id"] for r in rows]


async def test_one_connection_is_held_for_the_term_and_returned_at_step_down(
    pg_url: URL, migrated: str, name: str, leader: tuple[PgStore, int]
) -> None:
    store, epoch = leader
    for n in range(1, 6):
        await store.commit(epoch, BASE, [submitted(n)], [])
        assert checked_out(store) == 1  # kept between commits, not returned
    assert len(await writers(pg_url, name)) == 1
    await store.release_leadership()
    assert checked_out(store) == 0
    assert await stored(pg_url, migrated) == [1, 2, 3, 4, 5]


async def test_a_held_connection_the_server_closed_is_replaced_before_the_commit(
    pg_url: URL, migrated: str, name: str, leader: tuple[PgStore, int]
) -> None:
    store, epoch = leader
    await store.commit(epoch, BASE, [submitted(1)], [])
    [pid] = await writers(pg_url, name)
    held = store._commits.connections.held
    assert held is not None
    assert await terminate_backend(pg_url, pid)
    await until(
        lambda: held.driver_connection.is_closed(),  # type: ignore[union-attr]
        "the event loop to read the held connection's closed socket",
    )
    await store.commit(epoch, BASE, [submitted(2)], [])  # no error: a new connection
    assert pid not in await writers(pg_url, name)
    assert checked_out(store) == 1
    assert await stored(pg_url, migrated) == [1, 2]


async def test_a_commit_cut_short_gives_up_the_held_connection(
    pg_url: URL, migrated: str, name: str, leader: tuple[PgStore, int]
) -> None:
    store, epoch = leader
    await store.commit(epoch, BASE, [submitted(1)], [])
    [pid] = await writers(pg_url, name)
    blocker = await asyncpg.connect(asyncpg_dsn(pg_url))
    try:
        lock = blocker.transaction()
        await lock.start()
        await blocker.execute(f'SELECT 1 FROM "{migrated}".cronoq_leader FOR UPDATE')
        with pytest.raises(UnavailableError, match="commit_timeout"):
            await store.commit(epoch, BASE, [submitted(2)], [])
        await lock.rollback()
    finally:
        await blocker.close()
    # The interrupted connection was closed, not kept: its backend is gone.
    assert checked_out(store) == 0
    await store.commit(epoch, BASE, [submitted(2)], [])
    assert pid not in await writers(pg_url, name)
    assert checked_out(store) == 1
    assert await stored(pg_url, migrated) == [1, 2]


async def test_concurrent_commits_use_the_pool_beside_the_held_connection(
    pg_url: URL, migrated: str, name: str, leader: tuple[PgStore, int]
) -> None:
    store, epoch = leader
    await store.commit(epoch, BASE, [submitted(1)], [])
    blocker = await asyncpg.connect(asyncpg_dsn(pg_url))
    try:
        lock = blocker.transaction()
        await lock.start()
        await blocker.execute(f'SELECT 1 FROM "{migrated}".cronoq_leader FOR UPDATE')
        commits = [
            asyncio.ensure_future(store.commit(epoch, BASE, [submitted(n)], [])) for n in (2, 3, 4)
        ]
        # All three wait on the leader row, each on its own connection.
        await until_value(
            lambda: checked_out(store), lambda n: n == 3, "three commits waiting on the row"
        )
        await lock.rollback()
    finally:
        await blocker.close()
    await asyncio.gather(*commits)
    assert checked_out(store) == 1
    assert len(await writers(pg_url, name)) == 3
    assert await stored(pg_url, migrated) == [1, 2, 3, 4]


async def test_a_fenced_commit_returns_the_held_connection(
    pg_url: URL, migrated: str, leader: tuple[PgStore, int]
) -> None:
    store, epoch = leader
    await store.commit(epoch, BASE, [submitted(1)], [])
    await admin_execute(pg_url, f'UPDATE "{migrated}".cronoq_leader SET epoch = epoch + 1')
    with pytest.raises(FencedError):
        await store.commit(epoch, BASE, [submitted(2)], [])
    assert checked_out(store) == 0
    assert await stored(pg_url, migrated) == [1]


async def test_a_held_connection_to_a_demoted_primary_is_not_reused(
    pg_url: URL, migrated: str, leader: tuple[PgStore, int]
) -> None:
    store, epoch = leader
    await store.commit(epoch, BASE, [submitted(1)], [])
    # The held session now behaves like one on a demoted primary: the commit fails, the
    # store disposes the pool, and the next commit must not run on that session again.
    held = store._commits.connections.held
    assert held is not None
    driver: Any = held.driver_connection
    await driver.execute("SET SESSION default_transaction_read_only = on")
    with pytest.raises(UnavailableError) as caught:
        await store.commit(epoch, BASE, [submitted(2)], [])
    assert caught.value.reconnect
    await store.commit(epoch, BASE, [submitted(2)], [])
    assert store._commits.connections.held is not held
    assert await stored(pg_url, migrated) == [1, 2]


async def test_a_store_with_one_connection_holds_none(
    pg_url: URL, migrated: str, name: str
) -> None:
    # Reads, pings and the committer's checks need a connection between commits.
    config = PgStoreConfig(schema=migrated, max_connections=1, application_name=name)
    async with await PgStore.connect(pg_url, config) as store:
        epoch = await store.acquire_leadership()
        spec = TaskSpec(b"p")
        await store.commit(epoch, BASE, [Submitted(TaskId(1), 1, 0, spec)], [])
        assert checked_out(store) == 0
        assert await store.get_task(TaskId(1)) is not None
