"""The commit bus of a host on an application's engine (``PgHost.from_engine``): commits
of one kind of write go as one fenced statement each inside the group's shared
transaction, opened with the store's settings. Each member answers as alone; the
application's sessions are left idle, under their own settings."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store import FencedError, IdCollisionError, KeyTakenError, TaskSpec
from cronoq_store._domain import Mutation, Submitted, task_id
from cronoq_store._host.host import HostedStore, PgHost
from cronoq_store._urls import async_url

from ..pgharness import admin_execute
from ..support import bump_epoch
from ..waits import until
from .conftest import Fleet
from .hosts import Served, config
from .test_commit_bus import BASE, commit, moved, plugged, statuses, task, xmins

APP = "borrowed bus app"


def keyed(store: HostedStore, n: int, key: str) -> Submitted:
    assert store.epoch is not None
    return Submitted(task_id(store.epoch, n), n, BASE.engine_ns, TaskSpec(b"k", key=key))


@pytest.mark.parametrize("mode", ["insert", "update"])
async def test_a_borrowed_hosts_group_answers_each_member_as_alone(fleet: Fleet, mode: str) -> None:
    a, b, c, d, e, plug = fleet.clusters(6)
    schemas = [a, b, c, d, e, plug]
    app = create_async_engine(
        async_url(fleet.url),
        pool_size=4,
        max_overflow=0,
        pool_reset_on_return=None,
        connect_args={
            "server_settings": {
                "application_name": APP,
                "search_path": "pg_temp",
                "statement_timeout": "17s",
            }
        },
    )
    try:
        host = await PgHost.from_engine(app, config(fleet, "borrowing"))
        served = Served(host)
        await host.enroll(schemas)
        served.task = asyncio.ensure_future(host.serve(served.lead))
        try:
            await until(lambda: len(host.led()) == len(schemas), "the host to lead all")
            stores = host.led()
            writer = stores[a]._commits.writer
            assert writer.borrowed_opening is not None  # the borrowed shape, not the pool's
            for s in (a, b, c, d, e):
                await commit(stores[s], [task(stores[s], 2), keyed(stores[s], 9, "held")])
            batches: dict[str, Sequence[Mutation]]
            if mode == "insert":
                batches = {
                    a: [task(stores[a], 3)],
                    b: [task(stores[b], 3)],
                    c: [task(stores[c], 3), task(stores[c], 4)],
                    d: [task(stores[d], 2, b"another task under the same id")],
                    e: [keyed(stores[e], 5, "held")],
                }
            else:
                batches = {s: [moved(stores[s], 2)] for s in (a, b, c, d, e)}
                batches[d] = [task(stores[d], 2, b"another task under the same id")]
                batches[e] = [task(stores[e], 2)]  # the same submission: a no-op
            before_b = await statuses(fleet, b)
            async with plugged(fleet, stores[plug]):
                commits = [
                    asyncio.ensure_future(commit(stores[s], batches[s])) for s in (a, b, c, d, e)
                ]
                await asyncio.sleep(0)
                await bump_epoch(fleet.url, b)
            done = await asyncio.gather(*commits, return_exceptions=True)
            assert done[0] is None, done
            assert isinstance(done[1], FencedError), done
            assert done[2] is None, done
            assert isinstance(done[3], IdCollisionError), done
            if mode == "insert":
                assert isinstance(done[4], KeyTakenError), done
                assert done[4].keys == ["held"]
            else:
                assert done[4] is None, done
            assert await statuses(fleet, b) == before_b
            landed_a, landed_c = await xmins(fleet, a), await xmins(fleet, c)
            new = 3 if mode == "insert" else 2
            assert landed_a[task(stores[a], new).id] == landed_c[task(stores[c], new).id]
            if mode == "update":
                assert (await statuses(fleet, a))[task(stores[a], 2).id] == "running"
            assert len(await statuses(fleet, d)) == 2
        finally:
            await host.close()
            await asyncio.wait({served.task})
        rows = await admin_execute(
            fleet.url,
            "SELECT state FROM pg_stat_activity WHERE application_name = $1 "
            "AND state LIKE 'idle in transaction%'",
            APP,
        )
        assert rows == []
        async with app.connect() as conn:
            raw = await conn.get_raw_connection()
            driver = raw.driver_connection
            assert driver is not None
            assert not driver.is_in_transaction()
            got = (
                await conn.execute(
                    text(
                        "SELECT current_setting('search_path'), "
                        "current_setting('statement_timeout')"
                    )
                )
            ).one()
            assert tuple(got) == ("pg_temp", "17s")
            await conn.rollback()
    finally:
        assert app.sync_engine.pool.checkedout() == 0  # type: ignore[attr-defined]
        await app.dispose()
