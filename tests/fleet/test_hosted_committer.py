"""A group committer on hosted stores (``PgHost``): its batches take the host's commit bus
(two clusters' batches, queued behind a busy lane, land in one transaction) and the
hosted store's size check, with the size the committer measured: a submission over a
lowered ``max_commit_bytes`` fails alone with ``BatchTooLargeError`` and the others land.
"""

from __future__ import annotations

import asyncio

from cronoq_store import BatchTooLargeError, GroupCommitter

from .conftest import Fleet
from .test_commit_bus import BASE, hosting, plugged, statuses, task, xmins


async def test_committers_on_hosted_stores_share_the_bus_and_its_size_check(
    fleet: Fleet,
) -> None:
    a, b, plug = fleet.clusters(3)
    async with hosting(fleet, [a, b, plug]) as served:
        stores = served.host.led()
        stores[b].max_commit_bytes = 2**16
        committers = {
            s: GroupCommitter(stores[s], stores[s].epoch or 0, BASE, max_batches_in_flight=1)
            for s in (a, b)
        }
        async with committers[a], committers[b]:
            async with plugged(fleet, stores[plug]):
                submits = [
                    asyncio.ensure_future(committers[a].submit([task(stores[a], 10)])),
                    asyncio.ensure_future(committers[b].submit([task(stores[b], 10)])),
                    asyncio.ensure_future(
                        committers[b].submit([task(stores[b], 11, bytes(2**16))])
                    ),
                ]
                await asyncio.sleep(0.2)  # each committer's batch queues on the busy lane
            done = await asyncio.wait_for(asyncio.gather(*submits, return_exceptions=True), 60)
            more = [task(stores[b], n) for n in (12, 13)]
            await asyncio.wait_for(committers[b].submit(more), 60)
        assert done[:2] == [None, None], done
        assert isinstance(done[2], BatchTooLargeError), done[2]
        ids_a, ids_b = task(stores[a], 10).id, task(stores[b], 10).id
        assert set(await statuses(fleet, b)) == {ids_b, more[0].id, more[1].id}
        assert (await xmins(fleet, a))[ids_a] == (await xmins(fleet, b))[ids_b]
