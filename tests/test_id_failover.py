"""A failover to an asynchronous standby never brings back an id the standby saw stored.

Commits record no id high-water mark; prune records the largest id it deletes in the
statement that deletes it. So the standby replays both or neither: a new leader there
starts above every id the standby ever had, even when the newest tasks were pruned, the
epoch wrapped, and the stream was held back before the primary crashed (what the standby
never received is lost, as docs/reliability.md says, but nothing it had comes back).
"""

from __future__ import annotations

import asyncio

import pytest

from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import (
    EPOCH_MAX,
    TaskId,
    task_id,
)

from .pgharness import admin_execute
from .replication import stores_on_a_replicated_pair
from .support import OLD_BASE, PROCESS_BASE, SUCCEEDED, changed, submitted
from .waits import bounded

pytestmark = pytest.mark.slow

SCHEMA = "id_failover"


def config(name: str) -> PgStoreConfig:
    return PgStoreConfig(
        schema=SCHEMA,
        lock_poll=0.1,
        keepalive=0.2,
        session_timeout=1.0,
        commit_timeout=2.0,
        application_name=f"id-failover-{name}",
    )


async def test_a_failover_to_an_asynchronous_standby_never_reissues_a_pruned_id(
    binaries: None,
) -> None:
    async with stores_on_a_replicated_pair(config, synchronous=False) as (pair, replication, a, b):
        await admin_execute(
            pair.primary.url(), f'UPDATE "{SCHEMA}".cronoq_leader SET epoch = {EPOCH_MAX - 1}'
        )
        epoch = await a.acquire_leadership()
        assert epoch == EPOCH_MAX
        # The last term before the wrap: its ids are the largest, all finished and pruned.
        ids = [TaskId(task_id(epoch, n)) for n in range(50)]
        done = [m for i in ids for m in (submitted(i), changed(i, SUCCEEDED, 2))]
        await a.commit(epoch, OLD_BASE, done, [])
        assert await a.prune(1) == len(ids)
        await pair.replayed()

        # The stream is held back; the primary goes on alone, then crashes.
        replication.stall()
        late = TaskId(task_id(epoch, 1000))
        await a.commit(epoch, PROCESS_BASE, [submitted(late, b"late", seq=1000)], [])
        await asyncio.to_thread(pair.primary.stop, "immediate")
        await asyncio.to_thread(pair.promote)

        wrapped = await bounded(b.acquire_leadership(), "b to lead on the promoted standby")
        recovered = await b.recover(PROCESS_BASE)
        assert wrapped == 1  # the wrap: the epoch prefix no longer keeps ids apart
        assert await b.get_task(late) is None  # never received: lost, as documented
        assert max(recovered.next_id, task_id(wrapped, 0)) == max(ids) + 1
