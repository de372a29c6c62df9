"""Look-ups and housekeeping: get_task, list_finished pages, prune, load_output."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from cronoq_store.config import PgStoreConfig
from cronoq_store.domain import (
    Dependency,
    Mutation,
    Priority,
    StatusChanged,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    TimeBase,
)
from cronoq_store.queries import PRUNE_BATCH
from cronoq_store.store import PgStore

NOW = time.time_ns()
BASE = TimeBase(engine_ns=0, unix_ns=NOW)
HOUR = 3600 * 10**9
RUNNING, SUCCEEDED, FAILED, CANCELLED = (
    TaskStatus.RUNNING,
    TaskStatus.SUCCEEDED,
    TaskStatus.FAILED,
    TaskStatus.CANCELLED,
)


def submitted(id: int, **spec: Any) -> Submitted:
    return Submitted(TaskId(id), seq=id, arrival=0, spec=TaskSpec(b"p", **spec))


def changed(id: int, status: TaskStatus, ago: int = 0, message: str | None = None) -> StatusChanged:
    return StatusChanged(TaskId(id), status, attempt=2, at=-ago, message=message)


@pytest.fixture
async def store(engine: AsyncEngine, migrated: str) -> AsyncIterator[PgStore]:
    async with await PgStore.from_engine(engine, PgStoreConfig(schema=migrated)) as s:
        yield s


async def stored_ids(store: PgStore) -> list[int]:
    async with store.engine.connect() as conn:
        rows = await conn.execute(
            text(f'SELECT id FROM "{store.config.schema}".cronoq_tasks ORDER BY id')
        )
        return [r.id for r in rows]


async def test_get_task_by_id_and_by_key_returns_the_newest(store: PgStore) -> None:
    await store.commit(
        0,
        BASE,
        [
            submitted(1, key="k", pool="io", kind="email", priority=Priority.HIGH, tenant="t"),
            changed(1, FAILED, ago=HOUR, message="boom"),
            submitted(5, key="k"),
            changed(5, SUCCEEDED),
            submitted(7, key="k"),
            submitted(8, key="n\0ul"),
        ],
        [(TaskId(5), b"five")],
    )
    one = await store.get_task(TaskId(1))
    assert one is not None
    assert (one.id, one.key, one.pool, one.kind, one.priority, one.tenant) == (
        1,
        "k",
        "io",
        "email",
        Priority.HIGH,
        "t",
    )
    assert (one.status, one.attempt, one.message, one.output) == (FAILED, 2, "boom", None)
    assert one.updated.tzinfo is timezone.utc
    expected = datetime.fromtimestamp((NOW - HOUR) // 1000 / 1e6, tz=timezone.utc)
    assert abs(one.updated - expected) < timedelta(microseconds=2)

    newest = await store.get_task("k")
    assert newest is not None
    assert newest.id == 7
    assert newest.status is None  # queued
    finished = await store.get_task(TaskId(5))
    assert finished is not None
    assert finished.output == b"five"
    by_nul_key = await store.get_task("n\0ul")  # looked up as stored, with U+FFFD
    assert by_nul_key is not None
    assert by_nul_key.id == 8
    assert await store.get_task(TaskId(99)) is None
    assert await store.get_task("missing") is None


async def test_list_finished_filters_and_pages_by_id(store: PgStore) -> None:
    batch: list[Mutation] = []
    for id in range(1, 31):
        pool = "a" if id % 2 else "b"
        status = [SUCCEEDED, FAILED, CANCELLED][id % 3]
        batch += [submitted(id, pool=pool), changed(id, status)]
    batch += [submitted(31, pool="a"), changed(31, RUNNING), submitted(32, pool="a")]
    await store.commit(0, BASE, batch, [])

    everything = await store.list_finished(limit=1000)
    assert [r.id for r in everything] == list(range(1, 31))  # live tasks are not finished

    pages: list[list[int]] = []
    after: TaskId | None = None
    while page := await store.list_finished(pools=["a"], statuses=[FAILED], after=after, limit=2):
        pages.append([r.id for r in page])
        after = page[-1].id
    expected = [i for i in range(1, 31) if i % 2 and i % 3 == 1]
    assert pages == [expected[i : i + 2] for i in range(0, len(expected), 2)]

    both = await store.list_finished(pools=["a", "b"], statuses=[SUCCEEDED, CANCELLED], limit=5)
    assert [r.id for r in both] == [2, 3, 5, 6, 8]
    assert await store.list_finished(pools=["nope"]) == []
    assert await store.list_finished(limit=0) == []
    with pytest.raises(ValueError, match="limit"):
        await store.list_finished(limit=-1)


async def test_prune_deletes_in_batches_and_keeps_what_live_tasks_depend_on(
    store: PgStore,
) -> None:
    old = 2 * PRUNE_BATCH + 500
    batch: list[Mutation] = []
    for id in range(1, old + 1):
        batch += [submitted(id, key=f"k{id}"), changed(id, SUCCEEDED, ago=2 * HOUR)]
    # Protected: 7 by id, 9 by key (and so is every other finished task with that key).
    batch += [submitted(old + 1, key="k9"), changed(old + 1, FAILED, ago=3 * HOUR)]
    batch += [submitted(50_000, deps=[Dependency(TaskId(7)), Dependency("k9")])]
    # Pruned although NOT IN would keep it if NULL keys were not handled: it has no key.
    batch += [submitted(old + 2), changed(old + 2, SUCCEEDED, ago=2 * HOUR)]
    # Kept: finished recently, or live.
    batch += [submitted(50_001), changed(50_001, SUCCEEDED, ago=60 * 10**9)]
    batch += [submitted(50_002), changed(50_002, RUNNING, ago=2 * HOUR)]
    await store.commit(0, BASE, batch, [])

    assert await store.prune(3600) == old - 1
    assert await stored_ids(store) == [7, 9, old + 1, 50_000, 50_001, 50_002]

    # Once the dependent task finishes, what it protected can go too.
    await store.commit(0, BASE, [changed(50_000, SUCCEEDED, ago=2 * HOUR)], [])
    assert await store.prune(3600) == 4
    assert await stored_ids(store) == [50_001, 50_002]
    assert await store.prune(3600) == 0
    with pytest.raises(ValueError, match="older_than"):
        await store.prune(-1)


async def test_prune_reports_the_running_total_after_each_batch(store: PgStore) -> None:
    old = 2 * PRUNE_BATCH + 500
    batch: list[Mutation] = []
    for id in range(1, old + 1):
        batch += [submitted(id), changed(id, SUCCEEDED, ago=2 * HOUR)]
    batch += [submitted(old + 1)]  # live: neither pruned nor counted
    await store.commit(0, BASE, batch, [])

    totals: list[int] = []
    assert await store.prune(3600, progress=totals.append) == old
    assert totals == [PRUNE_BATCH, 2 * PRUNE_BATCH, old]
    assert await stored_ids(store) == [old + 1]
    # Nothing left to prune: one batch, reported once.
    assert await store.prune(3600, progress=totals.append) == 0
    assert totals[-1] == 0


@pytest.mark.parametrize(
    "deps",
    [
        '{"id": 7}',  # not an array
        '"k7"',
        "[5, null, []]",  # elements that are not objects
        '[{"id": "7"}]',  # an id that is not a number
        '[{"id": 7.5}]',
        '[{"id": 1e30}]',  # a number beyond BIGINT
        '[{"id": -1e30}]',
        '[{"key": 7}]',  # a key that is not a string
        '[{"id": {"deep": [1]}}]',
    ],
)
async def test_prune_is_not_stopped_by_a_live_row_whose_deps_are_corrupt(
    store: PgStore, deps: str
) -> None:
    """A row written by hand may hold any jsonb: prune keeps working, and what such a row
    cannot name protects nothing, while well-formed dependencies still protect."""
    batch: list[Mutation] = [
        submitted(7, key="k7"),
        changed(7, SUCCEEDED, ago=2 * HOUR),
        submitted(8, key="k8"),
        changed(8, SUCCEEDED, ago=2 * HOUR),
        submitted(20, deps=[Dependency(TaskId(8))]),
        submitted(21),
    ]
    await store.commit(0, BASE, batch, [])
    async with store.engine.begin() as conn:
        await conn.execute(
            text(
                f'UPDATE "{store.config.schema}".cronoq_tasks SET deps = CAST(:d AS jsonb) '
                "WHERE id = 21"
            ),
            {"d": deps},
        )

    assert await store.prune(3600) == 1
    assert await stored_ids(store) == [8, 20, 21]


async def test_load_output_only_for_succeeded_tasks(store: PgStore) -> None:
    await store.commit(
        0,
        BASE,
        [submitted(1), changed(1, SUCCEEDED), submitted(2), changed(2, FAILED), submitted(3)],
        [(TaskId(1), b"\0ok"), (TaskId(2), b"partial"), (TaskId(3), b"early")],
    )
    assert await store.load_output(TaskId(1)) == b"\0ok"
    assert await store.load_output(TaskId(2)) is None
    assert await store.load_output(TaskId(3)) is None
    assert await store.load_output(TaskId(4)) is None
