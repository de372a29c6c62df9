"""Hosts in this test's process, each with its own host session and pool, on a real server:
sharing, balancing, a lost session, commits fenced per cluster, backends per host."""

from __future__ import annotations

import asyncio

import pytest

from cronoq_store import FencedError, LockHeldError, PgStore
from cronoq_store._host.host import HostedStore, PgHost

from ..pgharness import admin_execute
from ..support import named_config
from ..waits import until, until_value
from .conftest import Fleet
from .hosts import commit_one, config, serving


async def test_one_host_leads_every_enrolled_cluster_at_the_stored_epoch(fleet: Fleet) -> None:
    schemas = fleet.clusters(5)
    async with serving(fleet.url, config(fleet, "solo"), schemas) as served:
        await until(lambda: len(served.host.led()) == 5, "the host to lead all 5 clusters")
        for schema, store in served.host.led().items():
            assert store.epoch == await fleet.stored_epoch(schema)
            await commit_one(store, 1)
            rows = await admin_execute(
                fleet.url, f'SELECT count(*) AS n FROM "{schema}".cronoq_tasks'
            )
            assert rows[0]["n"] == 1
        owners = await fleet.owners()
        assert set(owners) == set(schemas)
        assert set(owners.values()) == {served.host.process_id}


async def test_a_joining_host_gets_its_share_through_fenced_handovers(fleet: Fleet) -> None:
    schemas = fleet.clusters(7)
    async with serving(fleet.url, config(fleet, "first"), schemas) as first:
        await until(lambda: len(first.host.led()) == 7, "the first host to lead all 7")
        before = dict(first.host.led())
        epochs = {schema: store.epoch for schema, store in before.items()}
        async with serving(fleet.url, config(fleet, "second")) as second:
            await until_value(fleet.shares, lambda s: s == [4, 3], "a 4/3 split")
            await until(lambda: len(second.host.led()) in (3, 4), "the second host to lead")
            moved = set(second.host.led())
            assert moved
            assert not moved & set(first.host.led())
            for schema in moved:
                old = before[schema]
                assert not old.is_leader
                with pytest.raises(FencedError):
                    await commit_one(old, 2, epochs[schema])
                new = second.host.led()[schema]
                assert new.epoch is not None
                assert old.epoch is None
                assert new.epoch == await fleet.stored_epoch(schema)
                await commit_one(new, 3)


async def test_a_host_whose_session_dies_loses_its_clusters_to_the_others(fleet: Fleet) -> None:
    schemas = fleet.clusters(6)
    async with (
        serving(fleet.url, config(fleet, "victim"), schemas) as victim,
        serving(fleet.url, config(fleet, "survivor")),
    ):
        await until_value(fleet.shares, lambda s: s == [3, 3], "a 3/3 split")
        await until(lambda: len(victim.host.led()) == 3, "the victim to lead 3")
        lost = dict(victim.host.led())
        epochs = {schema: store.epoch for schema, store in lost.items()}
        old_id = victim.host.process_id
        await admin_execute(
            fleet.url,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name LIKE 'victim leader %'",
        )
        await until(lambda: not any(s.is_leader for s in lost.values()), "the victim to step down")
        owners = await until_value(
            fleet.owners,
            lambda o: all(p is not None and p != old_id for p in o.values()),
            "every cluster owned by a live process",
        )
        assert old_id not in owners.values()
        for schema, store in lost.items():
            with pytest.raises(FencedError):
                await asyncio.wait_for(commit_one(store, 9, epochs[schema]), 30)
            assert await fleet.stored_epoch(schema) > (epochs[schema] or 0)
        await until_value(fleet.shares, lambda s: s == [3, 3], "a 3/3 split again")
        assert victim.host.process_id not in (None, old_id)


async def test_a_host_holds_its_pool_and_one_session_whatever_it_leads(fleet: Fleet) -> None:
    schemas = fleet.clusters(12)
    async with serving(fleet.url, config(fleet, "frugal"), schemas) as served:
        await until(lambda: len(served.host.led()) == 12, "the host to lead all 12")
        await asyncio.gather(*(commit_one(s, 1) for s in served.host.led().values()))
        rows = await admin_execute(
            fleet.url,
            "SELECT count(*) AS n FROM pg_stat_activity WHERE application_name LIKE 'frugal%'",
        )
        assert rows[0]["n"] <= 3 + 1
        locks = await admin_execute(
            fleet.url,
            "SELECT count(*) AS n FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
            "WHERE l.locktype = 'advisory' AND a.application_name LIKE 'frugal%'",
        )
        assert locks[0]["n"] == 1


async def test_enrolling_a_cluster_a_standalone_store_leads_is_refused(fleet: Fleet) -> None:
    [schema] = fleet.clusters(1)
    store = await PgStore.connect(fleet.url, named_config(schema, "standalone"))
    try:
        await store.acquire_leadership()
        host = await PgHost.connect(fleet.url, config(fleet, "late"))
        try:
            with pytest.raises(LockHeldError, match="standalone"):
                await host.enroll(schema)
        finally:
            await host.close()
        assert await fleet.owners() == {}
    finally:
        await store.close()


async def test_a_cluster_the_application_fails_on_is_handed_over(fleet: Fleet) -> None:
    [schema] = fleet.clusters(1)
    host = await PgHost.connect(fleet.url, config(fleet, "flaky"))
    epochs: list[int] = []

    async def lead(store: HostedStore) -> None:
        assert store.epoch is not None
        epochs.append(store.epoch)
        if len(epochs) == 1:
            raise RuntimeError("the application's scheduler failed")
        await store.leadership_lost()

    try:
        await host.enroll(schema)
        task = asyncio.ensure_future(host.serve(lead))
        await until(lambda: len(epochs) >= 2, "the cluster to be led again after the failure")
        assert epochs[1] > epochs[0]
    finally:
        await host.close()
        await asyncio.wait({task})


async def test_a_removed_cluster_is_fenced_for_the_host_and_open_to_a_standalone(
    fleet: Fleet,
) -> None:
    [schema, kept] = fleet.clusters(2)
    async with serving(fleet.url, config(fleet, "owner"), [schema, kept]) as served:
        await until(lambda: len(served.host.led()) == 2, "the host to lead both clusters")
        hosted = served.host.led()[schema]
        epoch = hosted.epoch
        assert epoch is not None
        assert await served.host.remove(schema)
        assert not await served.host.remove(schema)
        with pytest.raises(FencedError):
            await commit_one(hosted, 1, epoch)
        await until(lambda: schema not in served.host.led(), "the host to step the cluster down")
        assert kept in served.host.led()
        assert list(await fleet.owners()) == [kept]
        store = await PgStore.connect(fleet.url, named_config(schema, "standalone-after"))
        try:
            assert await store.acquire_leadership() > epoch + 1
        finally:
            await store.close()
