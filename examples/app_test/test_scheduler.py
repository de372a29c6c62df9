"""An application's tests against a real PostgreSQL, through the pytest plugin."""

from __future__ import annotations

from cronoq_store import GroupCommitter, PgStore, Submitted, TaskId, TaskSpec, TimeBase, task_id


async def test_a_fresh_cluster_recovers_nothing(cronoq_store: PgStore) -> None:
    await cronoq_store.acquire_leadership()
    assert (await cronoq_store.recover(TimeBase.now())).tasks == []


async def test_a_submitted_task_is_recovered(cronoq_store: PgStore) -> None:
    epoch = await cronoq_store.acquire_leadership()
    base = TimeBase.now()
    job = Submitted(TaskId(task_id(epoch, 0)), 0, 0, TaskSpec(b"job", key="nightly"))
    async with GroupCommitter(cronoq_store, epoch, base) as committer:
        await committer.submit([job])
    assert [task.spec.key for task in (await cronoq_store.recover(base)).tasks] == ["nightly"]
