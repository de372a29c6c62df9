"""The host's commit bus on a real server: several clusters' commits in one transaction,
each answered as it would be alone.

Each test's host has one lane (``max_connections=3``). A commit to a plug cluster whose
leader row the test holds keeps the lane busy while the commits under test queue behind
it, so that they go together when the plug is released. Each cluster is fenced on its own:
a fence moved or an id refused is that commit's answer alone, and the others land in one
transaction (their rows share an ``xmin``). A session lost in the middle of a group fails
every commit of it, having written nothing. One cluster's schema name needs quoting, and
its batches take the transaction path, closed by a check rendered with its name.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from cronoq_store import FencedError, IdCollisionError, TaskStatus, UnavailableError
from cronoq_store._domain import Mutation, StatusChanged, Submitted, TaskSpec, TimeBase, task_id
from cronoq_store._host.host import HostedStore

from ..pgharness import admin_execute
from ..support import LeaderRowHold, bump_epoch
from ..waits import until
from .conftest import Fleet
from .hosts import Served, commit_one, config, serving

#: Every commit's time base: a batch sent again is the same tasks.
BASE = TimeBase.now()


def task(store: HostedStore, n: int, payload: bytes = b"bus") -> Submitted:
    assert store.epoch is not None
    return Submitted(task_id(store.epoch, n), n, BASE.engine_ns, TaskSpec(payload))


def moved(store: HostedStore, n: int) -> StatusChanged:
    assert store.epoch is not None
    return StatusChanged(task_id(store.epoch, n), TaskStatus.RUNNING, 1, BASE.engine_ns)


async def commit(store: HostedStore, batch: Sequence[Mutation]) -> None:
    assert store.epoch is not None
    await store.commit(store.epoch, BASE, batch, [])


async def xmins(fleet: Fleet, schema: str) -> dict[int, str]:
    """Each stored task's id and the transaction that wrote it."""
    rows = await admin_execute(
        fleet.url, f'SELECT id, xmin::text AS x FROM "{schema}".cronoq_tasks'
    )
    return {int(r["id"]): str(r["x"]) for r in rows}


async def statuses(fleet: Fleet, schema: str) -> dict[int, str]:
    rows = await admin_execute(fleet.url, f'SELECT id, status FROM "{schema}".cronoq_tasks')
    return {int(r["id"]): str(r["status"]) for r in rows}


@asynccontextmanager
async def hosting(fleet: Fleet, schemas: list[str]) -> AsyncIterator[Served]:
    async with serving(fleet.url, config(fleet, "bus"), schemas) as served:
        await until(lambda: len(served.host.led()) == len(schemas), "the host to lead all")
        yield served


@asynccontextmanager
async def plugged(fleet: Fleet, store: HostedStore) -> AsyncIterator[None]:
    """The lane busy with a commit to ``store``, waiting on its leader row, for the block;
    the commits started inside queue behind it and go together once it returns."""
    hold = LeaderRowHold(fleet.url, store.config.schema)
    await hold.lock()
    plug = asyncio.ensure_future(commit_one(store, 1))
    try:
        await hold.waited_on(plug, "the plug's commit to wait for its leader row")
        yield
    finally:
        await hold.release()
        await plug


def started(*commits: tuple[HostedStore, Sequence[Mutation]]) -> list[asyncio.Task[None]]:
    """The commits as tasks. Each reaches the bus's queue in its first step (no I/O comes
    before it): one pass of the loop, the ``sleep(0)`` that follows."""
    return [asyncio.ensure_future(commit(store, batch)) for store, batch in commits]


async def test_a_fenced_member_fails_alone_and_the_others_land_in_one_transaction(
    fleet: Fleet,
) -> None:
    a, b, plug = fleet.clusters(3)
    quoted = f"{fleet.prefix}_Quoted"
    async with hosting(fleet, [a, b, plug, quoted]) as served:
        stores = served.host.led()
        for schema in (b, quoted):
            await commit(stores[schema], [task(stores[schema], 2)])
        # Updates and inserts: the transaction path, the epoch read FOR SHARE and the
        # closing check rendered with the schema's name (quoted for one).
        batches: dict[str, list[Mutation]] = {
            a: [task(stores[a], 3)],
            b: [moved(stores[b], 2), task(stores[b], 3)],
            quoted: [moved(stores[quoted], 2), task(stores[quoted], 3)],
        }
        ids = {s: [task(stores[s], 2).id, task(stores[s], 3).id] for s in (a, b, quoted)}
        async with plugged(fleet, stores[plug]):
            commits = started(*((stores[s], batches[s]) for s in (a, b, quoted)))
            await asyncio.sleep(0)
            await bump_epoch(fleet.url, b)  # a takeover of b while its commit waits
        done = await asyncio.gather(*commits, return_exceptions=True)
        assert done[0] is None, done
        assert done[2] is None, done
        assert isinstance(done[1], FencedError)
        assert not stores[b].is_leader
        assert stores[a].is_leader
        assert stores[quoted].is_leader
        assert await statuses(fleet, b) == {ids[b][0]: "queued"}
        assert await statuses(fleet, quoted) == {
            ids[quoted][0]: "running",
            ids[quoted][1]: "queued",
        }
        landed_a = await xmins(fleet, a)
        landed_q = await xmins(fleet, quoted)
        assert landed_a[ids[a][1]] == landed_q[ids[quoted][1]]  # one transaction


async def test_a_refused_member_gets_its_own_error_and_the_others_land(fleet: Fleet) -> None:
    a, b, c, plug = fleet.clusters(4)
    async with hosting(fleet, [a, b, c, plug]) as served:
        stores = served.host.led()
        await commit(stores[b], [task(stores[b], 2, b"first")])
        async with plugged(fleet, stores[plug]):
            commits = started(
                (stores[a], [task(stores[a], 2)]),
                (stores[b], [task(stores[b], 2, b"another task under the same id")]),
                (stores[c], [task(stores[c], 2)]),
            )
            await asyncio.sleep(0)
        done = await asyncio.gather(*commits, return_exceptions=True)
        assert done[0] is None, done
        assert done[2] is None, done
        assert isinstance(done[1], IdCollisionError)
        assert all(store.is_leader for store in stores.values())
        landed_a = await xmins(fleet, a)
        landed_c = await xmins(fleet, c)
        assert len(landed_a) == len(landed_c) == 1
        assert set(landed_a.values()) == set(landed_c.values())  # one transaction


async def test_a_session_lost_mid_group_fails_every_member_and_a_retry_lands_each_once(
    fleet: Fleet,
) -> None:
    a, b, c, plug = fleet.clusters(4)
    async with hosting(fleet, [a, b, c, plug]) as served:
        stores = served.host.led()
        batches: dict[str, list[Mutation]] = {s: [task(stores[s], 2)] for s in (a, b, c)}
        held = LeaderRowHold(fleet.url, c)
        await held.lock()
        try:
            async with plugged(fleet, stores[plug]):
                commits = started(*((stores[s], batches[s]) for s in (a, b, c)))
                await asyncio.sleep(0)
            # The group wrote a and b, and waits for c's leader row: its session ends.
            group = asyncio.ensure_future(asyncio.gather(*commits, return_exceptions=True))
            await held.waited_on(group, "the group to wait for c's leader row")
            await admin_execute(
                fleet.url,
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE $1 = ANY(pg_blocking_pids(pid))",
                held.pid,
            )
            done = await group
        finally:
            await held.release()
        assert all(isinstance(d, UnavailableError) for d in done), done
        assert all(store.is_leader for store in stores.values())
        for s in (a, b, c):
            assert await xmins(fleet, s) == {}  # the group wrote nothing that committed
        for s in (a, b, c):
            await commit(stores[s], batches[s])
            await commit(stores[s], batches[s])  # once more: idempotent
            assert list(await xmins(fleet, s)) == [task(stores[s], 2).id]
