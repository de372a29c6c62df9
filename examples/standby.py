"""A standby: wait for the leader lock, take over, and show what the new leader resumes.

Run it as ``python examples/standby.py URL [SCHEMA]`` beside ``examples/leader.py``. It
waits in ``acquire_leadership()`` while the leader lives; when the leader stops or dies
(its lock session ends), it takes the next epoch, recovers, reports, and hands back.
"""

from __future__ import annotations

import asyncio
import sys

from cronoq_store import PgStore, PgStoreConfig, TimeBase, epoch_of


async def main(url: str, schema: str) -> None:
    config = PgStoreConfig(schema=schema, application_name="example-standby")
    async with await PgStore.connect(url, config) as store:
        print("standing by", flush=True)
        epoch = await store.acquire_leadership()
        state = await store.recover(TimeBase.now())
        epochs = sorted({epoch_of(task.id) for task in state.tasks})
        print(f"took over at epoch {epoch}: {len(state.tasks)} live tasks", flush=True)
        print(f"issued by the epochs {epochs}", flush=True)
        await store.release_leadership()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cluster_a"))
