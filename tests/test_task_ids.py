"""Task ids never collide silently: a different task under a stored id fails its whole batch,
the same submission sent again changes nothing, and ids derived from ``Recovered.next_id``
stay unique across the epoch wrap (32767 -> 1)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from cronoq_store import GroupCommitter, IdCollisionError
from cronoq_store._commit_path import COPY_MIN_ROWS
from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import (
    EPOCH_MAX,
    Mutation,
    StatusChanged,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    task_id,
)
from cronoq_store._store import PgStore

from .pgharness import admin_execute
from .support import START_BASE, submitted

#: Each test runs on a store on an application's engine and on one on its own pool.
STORE_OPENINGS = ("from_engine", "connect")


async def snapshot(store: PgStore) -> tuple[list[Any], list[Any]]:
    schema = store.config.schema
    async with store.engine.connect() as conn:
        tasks = await conn.execute(text(f'SELECT * FROM "{schema}".cronoq_tasks ORDER BY id'))
        leader = await conn.execute(text(f'SELECT id, epoch, max_id FROM "{schema}".cronoq_leader'))
        return [tuple(r) for r in tasks], [tuple(r) for r in leader]


# A different task under id 1 (stored as ``submitted(1, key="k")``), one field at a time.
OTHER_TASKS = {
    "seq": Submitted(TaskId(1), seq=2, arrival=1, spec=TaskSpec(b"p", key="k")),
    "arrival": Submitted(TaskId(1), seq=1, arrival=2, spec=TaskSpec(b"p", key="k")),
    "key": submitted(1, key="other"),
    "payload": submitted(1, b"q", key="k"),
    "tags": submitted(1, key="k", tags=["t"]),
}

# Each write path inserts its own way: one fenced statement (scalars for one task, else
# arrays), a transaction, COPY.
PATHS: dict[str, list[Mutation]] = {
    "one-task": [],
    "one-statement": [submitted(10)],
    "transaction": [StatusChanged(TaskId(2), TaskStatus.RUNNING, 1, 5), submitted(10)],
    "copy": [submitted(i) for i in range(10, 10 + COPY_MIN_ROWS)],
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("field", OTHER_TASKS)
async def test_a_different_task_under_a_stored_id_fails_and_nothing_is_written(
    store: PgStore, path: str, field: str
) -> None:
    await store.commit(0, START_BASE, [submitted(1, key="k"), submitted(2)], [])
    before = await snapshot(store)
    batch = [*PATHS[path], OTHER_TASKS[field]]
    with pytest.raises(IdCollisionError, match="task id 1 already taken") as caught:
        await store.commit(0, START_BASE, batch, [])
    assert caught.value.ids == [1]
    assert not caught.value.is_transient
    assert await snapshot(store) == before  # not even the high-water mark moved
    # The same submission again is a no-op, and the store goes on committing.
    await store.commit(0, START_BASE, [*PATHS[path], submitted(1, key="k")], [])
    tasks, _ = await snapshot(store)
    assert [r[0] for r in tasks] == [
        1,
        2,
        *sorted({m.id for m in PATHS[path] if isinstance(m, Submitted)}),
    ]


async def test_a_different_task_under_an_id_of_the_same_batch_fails(store: PgStore) -> None:
    with pytest.raises(IdCollisionError, match="task id 3 already taken by another Submitted"):
        await store.commit(0, START_BASE, [submitted(3), submitted(4), submitted(3, b"other")], [])
    assert await snapshot(store) == ([], [(1, 0, 0)])


async def test_ids_from_next_id_stay_unique_across_the_epoch_wrap(
    engine: AsyncEngine, migrated: str, pg_url: URL
) -> None:
    """Three leaders in turn: epoch 1, then 32767, then 1 again after the wrap."""
    config = PgStoreConfig(schema=migrated)

    async def term(issue: int, *, old: bool = False) -> tuple[int, list[TaskId], PgStore]:
        """A new leader that recovers and issues ``issue`` ids per the documented rule."""
        store = await PgStore.from_engine(engine, config)
        epoch = await store.acquire_leadership()
        recovered = await store.recover(START_BASE)
        first = max(recovered.next_id, task_id(epoch, 0))
        ids = [TaskId(first + n) for n in range(issue)]
        await store.commit(epoch, START_BASE, [submitted(i) for i in ids], [])
        return epoch, ids, store

    epoch, first_ids, store = await term(2)
    assert (epoch, first_ids) == (1, [task_id(1, 0), task_id(1, 1)])
    await store.close()
    await admin_execute(pg_url, f'UPDATE "{migrated}".cronoq_leader SET epoch = {EPOCH_MAX - 1}')
    epoch, last_ids, store = await term(3)
    assert (epoch, last_ids[0]) == (EPOCH_MAX, task_id(EPOCH_MAX, 0))
    await store.close()

    epoch, wrapped_ids, store = await term(2)
    try:
        assert epoch == 1  # wrapped: task_id(1, n) is below ids already issued
        assert wrapped_ids == [TaskId(last_ids[-1] + 1), TaskId(last_ids[-1] + 2)]
        recovered = await store.recover(START_BASE)
        assert recovered.next_id == wrapped_ids[-1] + 1
        assert sorted(t.id for t in recovered.tasks) == [*first_ids, *last_ids, *wrapped_ids]
        # An id reused naively, as if the epoch prefix were enough, is refused.
        naive = [Submitted(task_id(1, 0), 7, 7, TaskSpec(b"new")), submitted(task_id(1, 5))]
        with pytest.raises(IdCollisionError, match=f"task id {task_id(1, 0)} already taken"):
            await store.commit(epoch, START_BASE, naive, [])
        assert len((await store.recover(START_BASE)).tasks) == 7  # nothing of that batch
    finally:
        await store.close()


async def test_group_commit_fails_only_the_submission_that_reuses_an_id(store: PgStore) -> None:
    await store.commit(0, START_BASE, [submitted(1)], [])
    async with GroupCommitter(store, 0, START_BASE) as committer:
        results = await asyncio.gather(
            *(committer.submit([submitted(i)]) for i in range(10, 20)),
            committer.submit([submitted(1, b"another task")]),
            *(committer.submit([submitted(i)]) for i in range(20, 30)),
            return_exceptions=True,
        )
    errors = [r for r in results if r is not None]
    [error] = errors
    assert isinstance(error, IdCollisionError)
    assert error.ids == [1]
    tasks, _ = await snapshot(store)
    assert [(r[0], r[7]) for r in tasks] == [(1, b"p"), *((i, b"p") for i in range(10, 30))]
