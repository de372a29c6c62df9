"""Recovery: what a new leader loads, through its own time base."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest

from cronoq_store import (
    Dependency,
    DependencyCondition,
    FixedStart,
    MissPolicy,
    Priority,
    RecoveredTerminal,
    RetryPolicy,
    TaskId,
    TaskSpec,
    TimeBase,
)

from ..support import (
    FAILED,
    HOUR,
    OLD_BASE,
    RETRYING,
    RUNNING,
    START_BASE,
    SUCCEEDED,
    changed,
    submitted,
)
from .support import Capability, Cluster, summary


async def test_live_tasks_come_back_with_every_field_through_the_new_time_base(
    cluster: Cluster,
) -> None:
    store = await cluster.open()
    spec = TaskSpec(
        b"\x00\xff",
        kind="email",
        pool="io",
        priority=Priority.HIGH,
        key="k",
        deadline=5_000,
        fixed_start=FixedStart(7_000, timedelta(seconds=3), MissPolicy.RUN),
        duration_hint=timedelta(milliseconds=1500),
        timeout=timedelta(seconds=9),
        retry=RetryPolicy(max_attempts=5, backoff=timedelta(seconds=2)),
        deps=[Dependency(TaskId(3), DependencyCondition.FINISHED), Dependency("other")],
        resources={"gpu": 2},
        tags=["a", "b"],
        labels=["linux"],
        tenant="acme",
    )
    await store.commit(
        0,
        START_BASE,
        [submitted(9, spec, seq=4, arrival=123), changed(9, RETRYING, 1, attempt=2)],
        [],
    )
    # The new leader's engine clock reads 1,000,000 ns more at the same wall-clock time.
    later = TimeBase(engine_ns=START_BASE.engine_ns + 10**6, unix_ns=START_BASE.unix_ns)
    recovered = await store.recover(later)
    [task] = recovered.tasks
    assert (task.id, task.seq, task.arrival, task.attempt) == (9, 4, 123 + 10**6, 2)
    shifted = FixedStart(7_000 + 10**6, timedelta(seconds=3), MissPolicy.RUN)
    assert task.spec == replace(spec, deadline=5_000 + 10**6, fixed_start=shifted)
    assert recovered.next_id == 10


async def test_finished_tasks_within_retention_and_those_a_live_task_depends_on(
    cluster: Cluster,
) -> None:
    store = await cluster.open(retention=3600.0)
    await store.commit(
        0,
        START_BASE,
        [
            submitted(1),
            changed(1, SUCCEEDED, -2 * HOUR),  # old: dropped
            submitted(2),
            changed(2, FAILED, -(HOUR // 6)),  # 10 minutes ago: kept
            submitted(3),
            changed(3, SUCCEEDED, -48 * HOUR),  # old, but task 6 depends on it by id
            submitted(4, key="dep"),
            changed(4, SUCCEEDED, -30 * HOUR),  # old, but task 6 depends on its key
            submitted(5, key="dep"),
            changed(5, SUCCEEDED, -20 * HOUR),  # a later task with the same key: kept too
            submitted(6, deps=[Dependency(TaskId(3)), Dependency("dep")]),
            submitted(7),
            changed(7, RUNNING, -3 * HOUR),  # live, however old
        ],
        [],
    )
    recovered = await store.recover(START_BASE)
    assert [t.id for t in recovered.tasks] == [6, 7]
    assert recovered.terminal == [  # oldest first
        RecoveredTerminal(TaskId(3), None, SUCCEEDED, -48 * HOUR),
        RecoveredTerminal(TaskId(4), "dep", SUCCEEDED, -30 * HOUR),
        RecoveredTerminal(TaskId(5), "dep", SUCCEEDED, -20 * HOUR),
        RecoveredTerminal(TaskId(2), None, FAILED, -(HOUR // 6)),
    ]


async def test_next_id_is_above_every_id_ever_issued(cluster: Cluster) -> None:
    store = await cluster.open()
    # A high-water mark of 0 may mean id 0 was issued: no store ever answers 0.
    assert summary(await store.recover(START_BASE)) == {
        "next_id": 1,
        "tasks": [],
        "terminal": [],
        "recurring": [],
    }
    await store.commit(0, START_BASE, [submitted(0)], [])
    assert (await store.recover(START_BASE)).next_id == 1  # a stored id 0 counts
    high = TaskId((3 << 48) | 41)
    await store.commit(0, OLD_BASE, [submitted(high), changed(high, SUCCEEDED, 0)], [])
    await store.commit(0, OLD_BASE, [submitted(5), changed(5, SUCCEEDED, 0)], [])
    assert await store.prune(1) == 2
    assert await store.get_task(high) is None
    # Pruned, but issued: its id is never issued again.
    assert (await store.recover(START_BASE)).next_id == high + 1


async def test_a_hand_issued_id_0_is_never_issued_again_once_pruned(cluster: Cluster) -> None:
    """Id 0 submitted by hand, finished, pruned; the next leader's ``next_id`` stays above it
    (the high-water mark it recorded is 0, the column's default)."""
    first = await cluster.open()
    epoch = await first.acquire_leadership()
    await first.commit(epoch, OLD_BASE, [submitted(0), changed(0, SUCCEEDED, 0)], [])
    assert await first.prune(1) == 1
    assert await first.get_task(TaskId(0)) is None
    await first.release_leadership()
    second = await cluster.open()
    await second.acquire_leadership()
    assert (await second.recover(START_BASE)).next_id == 1


@pytest.mark.needs(Capability.DURABLE)
async def test_recover_in_a_new_process(cluster: Cluster) -> None:
    """What was committed survives the process that committed it. InMemoryStore keeps its
    state in one ``InMemoryDatabase`` object and does not declare ``DURABLE``."""
    store = await cluster.open()
    epoch = await store.acquire_leadership()
    await store.commit(
        epoch,
        START_BASE,
        [
            submitted(1, key="a"),
            changed(1, RUNNING, 10, attempt=2),
            submitted(2),
            changed(2, SUCCEEDED, -60),
        ],
        [],
    )
    here = summary(await store.recover(START_BASE))
    assert here["tasks"] == [[1, 1, 1, 2, "a"]]
    assert here["terminal"] == [[2, None, "succeeded", -60]]
    assert await cluster.recover_in_new_process(START_BASE) == here


async def test_a_live_task_the_new_time_base_cannot_express_is_recovered_at_the_bound(
    cluster: Cluster,
) -> None:
    """Through a base whose engine clock is near 2**63, the stored arrival of task 1 has
    no 64-bit engine time: the row is valid all the same (only the reader's base is odd),
    so it is recovered with the arrival at the bound, never quarantined."""
    store = await cluster.open()
    await store.commit(0, START_BASE, [submitted(1, key="k"), submitted(2, arrival=-(2**62))], [])
    odd = TimeBase(engine_ns=2**63 - 1, unix_ns=START_BASE.unix_ns)  # arrival 1 is 2**63 there
    recovered = await store.recover(odd)
    assert [(t.id, t.arrival) for t in recovered.tasks] == [
        (1, 2**63 - 1),
        (2, 2**63 - 1 - 2**62),
    ]
    assert recovered.terminal == []
    record = await store.get_task(TaskId(1))
    assert record is not None
    assert (record.status, record.message) == (None, None)
    again = await store.recover(START_BASE)
    assert [(t.id, t.arrival) for t in again.tasks] == [(1, 1), (2, -(2**62))]
