"""An application's unit tests without a server: ``InMemoryStore`` stages a takeover."""

from __future__ import annotations

import asyncio

from cronoq_store import GroupCommitter, Submitted, TaskId, TaskSpec, TimeBase, task_id
from cronoq_store.testing import InMemoryDatabase, InMemoryStore


async def test_a_standby_takes_over_with_the_next_epoch() -> None:
    database = InMemoryDatabase()
    leader, standby = InMemoryStore(database), InMemoryStore(database)
    epoch = await leader.acquire_leadership()
    base = TimeBase.now()
    first = max((await leader.recover(base)).next_id, task_id(epoch, 0))
    async with GroupCommitter(leader, epoch, base) as committer:
        await committer.submit([Submitted(TaskId(first), 0, 0, TaskSpec(b"job", key="nightly"))])
    takeover = asyncio.ensure_future(standby.acquire_leadership())  # waits for the lock
    leader.end_lock_session()  # as if its lock session died: the lock is free at once
    await leader.leadership_lost()
    assert await takeover == epoch + 1
    assert [task.spec.key for task in (await standby.recover(base)).tasks] == ["nightly"]
