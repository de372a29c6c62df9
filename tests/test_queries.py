"""Look-ups and housekeeping: get_task, list_finished pages, prune, load_output."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from cronoq_store import _queries as queries
from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import Dependency, Mutation, TaskId
from cronoq_store._queries import (
    PRUNE_BATCH,
    PRUNE_BATCH_MAX,
    PRUNE_BATCH_SECONDS,
    next_prune_batch,
)
from cronoq_store._store import PgStore

from .support import (
    FAILED,
    HOUR,
    RUNNING,
    START_BASE,
    SUCCEEDED,
    changed,
    stored_ids,
    submitted,
)


async def test_prune_deletes_in_batches_and_keeps_what_live_tasks_depend_on(
    store: PgStore, pg_url: URL, migrated: str
) -> None:
    old = 2 * PRUNE_BATCH + 500
    batch: list[Mutation] = []
    for id in range(1, old + 1):
        batch += [submitted(id, key=f"k{id}"), changed(id, SUCCEEDED, at=-2 * HOUR, attempt=2)]
    # Protected: 7 by id, 9 by key (and so is every other finished task with that key).
    batch += [submitted(old + 1, key="k9"), changed(old + 1, FAILED, at=-3 * HOUR, attempt=2)]
    batch += [submitted(50_000, deps=[Dependency(TaskId(7)), Dependency("k9")])]
    # Pruned although NOT IN would keep it if NULL keys were not handled: it has no key.
    batch += [submitted(old + 2), changed(old + 2, SUCCEEDED, at=-2 * HOUR, attempt=2)]
    # Kept: finished recently, or live.
    batch += [submitted(50_001), changed(50_001, SUCCEEDED, at=-60 * 10**9, attempt=2)]
    batch += [submitted(50_002), changed(50_002, RUNNING, at=-2 * HOUR, attempt=2)]
    await store.commit(0, START_BASE, batch, [])

    assert await store.prune(3600) == old - 1
    assert await stored_ids(pg_url, migrated) == [7, 9, old + 1, 50_000, 50_001, 50_002]

    # Once the dependent task finishes, what it protected can go too.
    await store.commit(0, START_BASE, [changed(50_000, SUCCEEDED, at=-2 * HOUR, attempt=2)], [])
    assert await store.prune(3600) == 4
    assert await stored_ids(pg_url, migrated) == [50_001, 50_002]
    assert await store.prune(3600) == 0
    with pytest.raises(ValueError, match="older_than"):
        await store.prune(-1)


async def test_prune_reports_the_running_total_after_each_batch(
    store: PgStore, pg_url: URL, migrated: str
) -> None:
    old = 2 * PRUNE_BATCH + 500
    batch: list[Mutation] = []
    for id in range(1, old + 1):
        batch += [submitted(id), changed(id, SUCCEEDED, at=-2 * HOUR, attempt=2)]
    batch += [submitted(old + 1)]  # live: neither pruned nor counted
    await store.commit(0, START_BASE, batch, [])

    totals: list[int] = []
    assert await store.prune(3600, progress=totals.append) == old
    # The first batch is PRUNE_BATCH rows, later ones sized by time: never below
    # PRUNE_BATCH, at most four times the last; the last batch is short (or empty), and
    # reports the whole.
    batches = [b - a for a, b in itertools.pairwise([0, *totals])]
    full, last = batches[:-1], batches[-1]
    assert full[0] == PRUNE_BATCH, totals
    assert totals[-1] == old, totals
    assert all(PRUNE_BATCH <= b <= 4 * a for a, b in itertools.pairwise(full)), totals
    assert 0 <= last <= 4 * full[-1], totals
    assert await stored_ids(pg_url, migrated) == [old + 1]
    # Nothing left to prune: one batch, reported once.
    assert await store.prune(3600, progress=totals.append) == 0
    assert totals[-1] == 0


@pytest.mark.parametrize(
    ("rows", "seconds", "expected"),
    [
        (1000, 0.05, 4000),  # fast: toward PRUNE_BATCH_SECONDS, four times at most
        (1000, 0.001, 4000),
        (1000, 0.0, 4000),
        (4000, 0.1, 8000),
        (8000, 0.2, 8000),  # on target: kept
        (32_000, 0.8, 8000),  # slow (commits it waited for): a quarter at least
        (32_000, 60.0, 8000),
        (1000, 5.0, 1000),  # never below PRUNE_BATCH
        (64_000, 0.01, 64_000),  # nor above PRUNE_BATCH_MAX
    ],
)
def test_prune_batches_are_sized_by_the_time_the_last_took(
    rows: int, seconds: float, expected: int
) -> None:
    assert PRUNE_BATCH_SECONDS == 0.2
    assert PRUNE_BATCH_MAX == 64_000
    assert next_prune_batch(rows, seconds) == expected


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
    store: PgStore, pg_url: URL, migrated: str, deps: str
) -> None:
    """A row written by hand may hold any jsonb: prune keeps working, and what such a row
    cannot name protects nothing, while well-formed dependencies still protect."""
    batch: list[Mutation] = [
        submitted(7, key="k7"),
        changed(7, SUCCEEDED, at=-2 * HOUR, attempt=2),
        submitted(8, key="k8"),
        changed(8, SUCCEEDED, at=-2 * HOUR, attempt=2),
        submitted(20, deps=[Dependency(TaskId(8))]),
        submitted(21),
    ]
    await store.commit(0, START_BASE, batch, [])
    async with store.engine.begin() as conn:
        await conn.execute(
            text(
                f'UPDATE "{store.config.schema}".cronoq_tasks SET deps = CAST(:d AS jsonb) '
                "WHERE id = 21"
            ),
            {"d": deps},
        )

    assert await store.prune(3600) == 1
    assert await stored_ids(pg_url, migrated) == [8, 20, 21]


#: A session_timeout shorter than the client's work between two statements of a read.
SHORT = {"session_timeout": 0.3, "keepalive": 0.1, "lock_poll": 0.05}


@pytest.mark.parametrize("shared", [False, True], ids=["connect", "from_engine"])
async def test_a_page_whose_rows_take_longer_than_session_timeout_to_read(
    pg_url: URL, engine: AsyncEngine, migrated: str, monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    """The client holds the page's transaction open while it turns rows into records (a
    loaded machine, a large ``limit``): the read takes no lock a takeover waits for, so
    ``session_timeout`` does not bound it."""
    config = PgStoreConfig(schema=migrated, **SHORT)  # type: ignore[arg-type]
    opened = PgStore.from_engine(engine, config) if shared else PgStore.connect(pg_url, config)
    async with await opened as store:
        await store.commit(0, START_BASE, [submitted(i) for i in (1, 2, 3)], [])
        await store.commit(0, START_BASE, [changed(i, SUCCEEDED, attempt=2) for i in (1, 2, 3)], [])
        listed_task = queries.listed_task
        busy = [3 * config.session_timeout]

        def slow(row: Any) -> queries.ListedTask:
            if busy:
                time.sleep(busy.pop())  # the client's own work, between two statements
            return listed_task(row)

        monkeypatch.setattr(queries, "listed_task", slow)
        assert [t.id for t in await store.list_finished()] == [1, 2, 3]
