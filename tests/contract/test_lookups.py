"""Look-ups and housekeeping: ``get_task``, ``list_finished`` pages, ``prune``, outputs."""

from __future__ import annotations

from datetime import timedelta, timezone
from typing import Any

import pytest

from cronoq_store import Dependency, Mutation, Priority, TaskId

from ..support import (
    CANCELLED,
    FAILED,
    HOUR,
    QUEUED,
    RUNNING,
    START_BASE,
    SUCCEEDED,
    changed,
    submitted,
)
from .support import Cluster, when


async def test_get_task_by_id_and_the_newest_by_key(cluster: Cluster) -> None:
    store = await cluster.open()
    await store.commit(
        0,
        START_BASE,
        [
            submitted(1, key="k", pool="io", kind="email", priority=Priority.HIGH, tenant="t"),
            changed(1, FAILED, at=-HOUR, message="boom", attempt=2),
            submitted(5, key="k"),
            changed(5, SUCCEEDED, attempt=2),
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
    assert abs(one.updated - when(-HOUR)) < timedelta(microseconds=2)
    newest = await store.get_task("k")
    assert newest is not None
    assert (newest.id, newest.status) == (7, QUEUED)
    done = await store.get_task(TaskId(5))
    assert done is not None
    assert done.output == b"five"
    by_nul_key = await store.get_task("n\0ul")  # looked up as stored, with U+FFFD
    assert by_nul_key is not None
    assert (by_nul_key.id, by_nul_key.key) == (8, "n\ufffdul")
    assert await store.get_task(TaskId(99)) is None
    assert await store.get_task("missing") is None


async def test_list_finished_filters_and_pages_in_id_order(cluster: Cluster) -> None:
    store = await cluster.open()
    batch: list[Mutation] = []
    for id in range(30, 0, -1):  # submitted in reverse: the order is the ids'
        pool = "a" if id % 2 else "b"
        status = [SUCCEEDED, FAILED, CANCELLED][id % 3]
        batch += [submitted(id, pool=pool), changed(id, status, attempt=2)]
    batch += [submitted(31, pool="a"), changed(31, RUNNING, attempt=2), submitted(32, pool="a")]
    await store.commit(0, START_BASE, batch, [])

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
    assert len(await store.list_finished()) == 30  # the default limit is 100
    with pytest.raises(ValueError, match="limit"):
        await store.list_finished(limit=-1)


async def test_prune_keeps_what_live_tasks_depend_on_by_id_or_key(cluster: Cluster) -> None:
    store = await cluster.open()
    batch: list[Mutation] = []
    for id in range(1, 21):
        batch += [submitted(id, key=f"k{id}"), changed(id, SUCCEEDED, at=-2 * HOUR, attempt=2)]
    # Protected: 7 by id, 9 by key (and so is every other finished task with that key).
    batch += [submitted(21, key="k9"), changed(21, FAILED, at=-3 * HOUR, attempt=2)]
    batch += [submitted(100, deps=[Dependency(TaskId(7)), Dependency("k9")])]
    batch += [submitted(22), changed(22, SUCCEEDED, at=-2 * HOUR, attempt=2)]  # no key: pruned
    # Kept: finished recently, or live.
    batch += [submitted(101), changed(101, SUCCEEDED, at=-60 * 10**9, attempt=2)]
    batch += [submitted(102), changed(102, RUNNING, at=-2 * HOUR, attempt=2)]
    await store.commit(0, START_BASE, batch, [])

    assert await store.prune(3600) == 19
    left = [i for i in range(1, 103) if await store.get_task(TaskId(i)) is not None]
    assert left == [7, 9, 21, 100, 101, 102]
    # Once the dependent task finishes, what it protected can go too.
    await store.commit(0, START_BASE, [changed(100, SUCCEEDED, at=-2 * HOUR, attempt=2)], [])
    assert await store.prune(3600) == 4
    assert [r.id for r in await store.list_finished()] == [101]
    assert await store.prune(3600) == 0
    with pytest.raises(ValueError, match="older_than"):
        await store.prune(-1)


async def test_load_output_only_for_tasks_that_succeeded(cluster: Cluster) -> None:
    store = await cluster.open()
    await store.commit(
        0,
        START_BASE,
        [
            submitted(1),
            changed(1, SUCCEEDED, attempt=2),
            submitted(2),
            changed(2, FAILED, attempt=2),
            submitted(3),
        ],
        [(TaskId(1), b"\0ok"), (TaskId(2), b"partial"), (TaskId(3), b"early")],
    )
    assert await store.load_output(TaskId(1)) == b"\0ok"
    assert await store.load_output(TaskId(2)) is None
    assert await store.load_output(TaskId(3)) is None
    assert await store.load_output(TaskId(4)) is None


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda s: s.get_task(TaskId(2**63)), "ref"),
        (lambda s: s.get_task(TaskId(-1)), "ref"),
        (lambda s: s.load_output(TaskId(2**63)), "id"),
        (lambda s: s.list_finished(after=TaskId(2**63)), "after"),
        (lambda s: s.list_finished(limit=2**63), "limit"),
        (lambda s: s.prune(1e12), "older_than"),
        (lambda s: s.prune(float("nan")), "older_than"),
    ],
    ids=["id-too-big", "id-negative", "output-id", "after", "limit", "older-than", "nan"],
)
async def test_arguments_no_task_can_match_are_refused_by_name(
    cluster: Cluster, call: Any, argument: str
) -> None:
    """An id outside BIGINT or an age past the cutoffs' range is the caller's mistake: a
    ``ValueError`` naming the argument, the same from every store, never a database error
    or a silent empty answer."""
    store = await cluster.open()
    with pytest.raises(ValueError, match=rf"^{argument}: "):
        await call(store)
