"""Leadership and fencing: standbys wait, take over with the next epoch, and a deposed
leader, or any instance holding a stale epoch, never writes again."""

from __future__ import annotations

import asyncio

import pytest

from cronoq_store import (
    EPOCH_MAX,
    FencedError,
    IdCollisionError,
    StoreError,
    Submitted,
    TaskId,
    TaskSpec,
    task_id,
)

from ..support import RUNNING, START_BASE, changed, submitted
from ..waits import bounded, holds_for
from .support import Cluster, ContractStore, observe


async def lead(store: ContractStore) -> int:
    """``acquire_leadership()``, bounded: a store that cannot lead fails the test."""
    return await bounded(store.acquire_leadership(), "the leadership")


async def still_waiting(acquisition: asyncio.Future[int]) -> bool:
    """Whether ``acquisition`` stays pending for a while (a negative claim, watched 0.3 s)."""
    await holds_for(lambda: not acquisition.done(), "the standby's acquisition pending", 0.3)
    return True


async def test_a_standby_waits_and_takes_over_with_the_next_epoch_on_release(
    cluster: Cluster,
) -> None:
    a, b = await cluster.open(), await cluster.open()
    assert await lead(a) == 1
    assert (a.is_leader, a.epoch) == (True, 1)
    standby = asyncio.ensure_future(b.acquire_leadership())
    assert await still_waiting(standby)
    assert (b.is_leader, b.epoch) == (False, None)
    await a.commit(1, START_BASE, [submitted(1)], [])

    await a.release_leadership()
    assert (a.is_leader, a.epoch) == (False, None)
    await bounded(a.leadership_lost(), "leadership_lost() after the release")
    assert await bounded(standby, "the standby's takeover after the release") == 2
    assert (b.is_leader, b.epoch) == (True, 2)
    with pytest.raises(FencedError, match="leadership was lost"):
        await a.commit(1, START_BASE, [changed(1, RUNNING, 100)], [])
    await b.commit(2, START_BASE, [changed(1, RUNNING, 5)], [])
    [task] = (await b.recover(START_BASE)).tasks
    assert (task.id, task.attempt) == (1, 1)


async def test_a_stale_epoch_is_fenced_and_nothing_is_written(cluster: Cluster) -> None:
    a, b, zombie = await cluster.open(), await cluster.open(), await cluster.open()
    assert await lead(a) == 1
    await a.commit(1, START_BASE, [submitted(1)], [])
    await a.release_leadership()
    assert await lead(b) == 2
    before = await observe(b, [1, 2])
    # An instance that never led commits with the old epoch: the commit's own epoch check
    # refuses it, and from then on it refuses at once, even an epoch that would pass.
    with pytest.raises(FencedError, match="stored epoch is 2"):
        await zombie.commit(
            1, START_BASE, [changed(1, RUNNING, 100), submitted(2)], [(TaskId(1), b"o")]
        )
    assert not zombie.is_leader
    with pytest.raises(FencedError, match="leadership was lost"):
        await zombie.commit(2, START_BASE, [submitted(2)], [])
    assert await observe(b, [1, 2]) == before


async def test_a_leader_whose_lock_session_ends_steps_down_and_a_standby_takes_over(
    cluster: Cluster,
) -> None:
    a, b = await cluster.open(), await cluster.open()
    epoch = await lead(a)
    await a.commit(epoch, START_BASE, [submitted(1), changed(1, RUNNING, 5)], [])
    standby = asyncio.ensure_future(b.acquire_leadership())
    assert await still_waiting(standby)

    await cluster.end_lock_session(a)
    await asyncio.wait_for(a.leadership_lost(), cluster.step_down_bound)
    assert not a.is_leader
    assert await bounded(standby, "the standby's takeover") == epoch + 1
    with pytest.raises(FencedError):
        await a.commit(epoch, START_BASE, [submitted(2)], [])
    recovered = await b.recover(START_BASE)
    assert [(t.id, t.attempt) for t in recovered.tasks] == [(1, 1)]
    assert await b.get_task(TaskId(2)) is None


async def test_leadership_lost_waits_until_leadership_held_is_lost(cluster: Cluster) -> None:
    a = await cluster.open()
    lost = asyncio.ensure_future(a.leadership_lost())
    await holds_for(lambda: not lost.done(), "leadership_lost() pending with nothing held", 0.1)
    await lead(a)
    await holds_for(lambda: not lost.done(), "leadership_lost() pending while leading", 0.3)
    await a.release_leadership()
    await bounded(lost, "leadership_lost() after the release")


async def test_each_acquisition_is_a_new_term_with_a_new_epoch(cluster: Cluster) -> None:
    a = await cluster.open()
    assert await lead(a) == 1
    assert await lead(a) == 2  # acquiring while leading starts a new term
    await a.release_leadership()
    assert await lead(a) == 3
    await a.commit(3, START_BASE, [submitted(1)], [])  # the new term commits
    assert await a.get_task(TaskId(1)) is not None


async def test_closing_frees_the_lock_and_stops_a_pending_acquisition(cluster: Cluster) -> None:
    a, b, c = await cluster.open(), await cluster.open(), await cluster.open()
    await lead(a)
    pending = asyncio.ensure_future(b.acquire_leadership())
    assert await still_waiting(pending)
    await bounded(b.close(), "close() of the store acquiring")
    with pytest.raises(StoreError):
        await bounded(pending, "the closed store's acquisition to end")
    await bounded(a.close(), "close() of the leader")
    assert await lead(c) == 2


async def test_the_epoch_wraps_from_32767_to_1_and_ids_stay_unique(cluster: Cluster) -> None:
    await cluster.start_at_epoch(EPOCH_MAX - 1)

    async def term() -> tuple[ContractStore, int, list[TaskId]]:
        """A new leader that recovers and issues two ids by the documented rule."""
        store = await cluster.open()
        epoch = await lead(store)
        first = max((await store.recover(START_BASE)).next_id, task_id(epoch, 0))
        ids = [TaskId(first), TaskId(first + 1)]
        await store.commit(epoch, START_BASE, [submitted(i) for i in ids], [])
        await store.release_leadership()
        return store, epoch, ids

    _, epoch, last = await term()
    assert (epoch, last[0]) == (EPOCH_MAX, task_id(EPOCH_MAX, 0))
    store, epoch, wrapped = await term()
    assert epoch == 1
    assert wrapped == [last[1] + 1, last[1] + 2]  # task_id(1, n) is below ids issued
    epoch = await lead(store)
    naive = [Submitted(task_id(EPOCH_MAX, 0), 7, 7, TaskSpec(b"new")), submitted(9)]
    with pytest.raises(IdCollisionError, match=f"task id {task_id(EPOCH_MAX, 0)} "):
        await store.commit(epoch, START_BASE, naive, [])
    recovered = await store.recover(START_BASE)
    assert [t.id for t in recovered.tasks] == [*last, *wrapped]
    assert recovered.next_id == wrapped[-1] + 1


async def test_a_leader_whose_epoch_moved_on_is_fenced_steps_down_and_frees_the_lock(
    cluster: Cluster,
) -> None:
    a, b = await cluster.open(), await cluster.open()
    epoch = await lead(a)
    standby = asyncio.ensure_future(b.acquire_leadership())
    assert await still_waiting(standby)
    await cluster.move_epoch()  # the term of `epoch` is over, whether `a` noticed or not
    with pytest.raises(FencedError):
        await a.commit(epoch, START_BASE, [submitted(1)], [])
    await asyncio.wait_for(a.leadership_lost(), cluster.step_down_bound)
    assert not a.is_leader
    assert await bounded(standby, "the standby's takeover") == epoch + 2
    assert await b.get_task(TaskId(1)) is None


async def test_a_late_commit_of_an_earlier_term_never_ends_the_current_one(
    cluster: Cluster,
) -> None:
    """Only a fence of the current epoch ends the current term: a commit stamped with an
    earlier term's epoch (a retry from that term's committer), or with an epoch this
    instance never held, is fenced and nothing of it is written, and the term goes on."""
    a, b = await cluster.open(), await cluster.open()
    earlier = await lead(a)
    await a.release_leadership()
    current = await lead(a)
    standby = asyncio.ensure_future(b.acquire_leadership())
    assert await still_waiting(standby)
    lost = asyncio.ensure_future(a.leadership_lost())
    with pytest.raises(FencedError):
        await a.commit(earlier, START_BASE, [submitted(1)], [])
    with pytest.raises(FencedError):
        await a.commit(current + 5, START_BASE, [submitted(2)], [])
    assert (a.is_leader, a.epoch) == (True, current)
    await a.commit(current, START_BASE, [submitted(3)], [])
    assert not lost.done()
    assert await still_waiting(standby)
    assert [await a.get_task(TaskId(i)) is not None for i in (1, 2, 3)] == [False, False, True]
    lost.cancel()
