"""The benchmarks' generated history (``benchmarks.history``) is what the store itself would
have written: every row decodes, the mix is the one the scale figures claim, and the
indexes come back after the load."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from benchmarks.common import dsn
from benchmarks.history import HISTORY_EPOCH, seed
from cronoq_store import Dependency, TaskStatus, TimeBase, task_id
from cronoq_store._config import PgStoreConfig
from cronoq_store._store import PgStore

ROWS = 2_000


@pytest.fixture
async def conn(pg_url: URL) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(dsn(pg_url))
    try:
        yield connection
    finally:
        await connection.close()


async def test_the_history_decodes_and_has_the_stated_mix(
    engine: AsyncEngine, migrated: str, conn: asyncpg.Connection
) -> None:
    indexes = "SELECT count(*) FROM pg_indexes WHERE schemaname = $1"
    before = await conn.fetchval(indexes, migrated)
    await seed(conn, migrated, ROWS, epoch=HISTORY_EPOCH, key_prefix="hist-")
    assert await conn.fetchval(indexes, migrated) == before

    counts = dict(
        await conn.fetch(f'SELECT status, count(*) FROM "{migrated}".cronoq_tasks GROUP BY status')
    )
    assert counts == {
        "queued": 67,
        TaskStatus.RUNNING.value: 33,
        TaskStatus.SUCCEEDED.value: 1710,
        TaskStatus.FAILED.value: 95,
        TaskStatus.CANCELLED.value: 95,
    }

    config = PgStoreConfig(schema=migrated, retention=3600.0)
    async with await PgStore.from_engine(engine, config) as store:
        recovered = await store.recover(TimeBase.now())
    # Nothing quarantined: every live row decoded, deps and retry policies included.
    assert len(recovered.tasks) == 100
    assert len(recovered.terminal) == ROWS - 100
    newest = recovered.tasks[-1]
    assert newest.id == task_id(HISTORY_EPOCH, ROWS)
    assert newest.spec.key == f"hist-{ROWS}"
    assert newest.spec.deps == (Dependency(task_id(HISTORY_EPOCH, ROWS - 1)),)
    assert newest.spec.retry is not None
