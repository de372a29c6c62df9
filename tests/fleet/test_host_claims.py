"""Claims of several clusters in one transaction on the host session: what they commit
together, that a cluster at fault in a batch costs only itself, and that the recoveries of
clusters gained together leave the pool to commits."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import asyncpg

from cronoq_store import StoreError, TimeBase
from cronoq_store._host.host import HostedStore, PgHost

from ..pgharness import admin_execute, asyncpg_dsn
from ..waits import PATIENCE, until
from .conftest import Fleet
from .hosts import commit_one, config, enrolled, serving


async def _control_rows(fleet: Fleet) -> dict[str, dict[str, object]]:
    rows = await admin_execute(
        fleet.url,
        f"SELECT schema_name, owner, epoch, state, refused_why, xmin::text AS xmin "
        f'FROM "{fleet.control}".clusters WHERE host_group = $1',
        fleet.group,
    )
    return {str(r["schema_name"]): dict(r) for r in rows}


async def test_clusters_claimed_together_commit_once_each_fenced_and_recorded(
    fleet: Fleet,
) -> None:
    """Clusters claimed together are given to the process by one commit, and each is
    fenced on its own: its epoch bumped past the stored one, by the host session (its
    holder), with its term in its own history."""
    schemas = fleet.clusters(4)
    await enrolled(fleet, schemas)
    async with serving(fleet.url, config(fleet, "together")) as served:
        await until(lambda: len(served.host.led()) == 4, "the host to lead every cluster")
        rows = await _control_rows(fleet)
        pid = await admin_execute(
            fleet.url,
            f'SELECT backend_pid FROM "{fleet.control}".processes WHERE process_id = $1',
            served.host.process_id,
        )
        for schema, store in served.host.led().items():
            leader = await admin_execute(
                fleet.url,
                f'SELECT l.epoch, l.holder_pid, l.holder_epoch, h.pid AS term_pid FROM "{schema}"'
                f'.cronoq_leader l JOIN "{schema}".cronoq_leader_history h USING (epoch)',
            )
            assert [tuple(leader[0])] == [
                (store.epoch, pid[0]["backend_pid"], store.epoch, pid[0]["backend_pid"])
            ], schema
            assert (store.epoch, rows[schema]["epoch"]) == (1, 1), schema
    assert len({row["xmin"] for row in rows.values()}) == 1, rows


async def test_a_cluster_refused_in_a_batch_costs_only_itself(fleet: Fleet) -> None:
    """A cluster whose leader row no longer names the group (it left behind the control
    schema's back) is refused, its reason recorded, while the others of its batch are
    claimed in the same transaction."""
    schemas = fleet.clusters(3)
    await enrolled(fleet, schemas)
    gone = schemas[1]
    await admin_execute(fleet.url, f"UPDATE \"{gone}\".cronoq_leader SET host_group = 'elsewhere'")
    async with serving(fleet.url, config(fleet, "refusing")) as served:
        await until(lambda: len(served.host.led()) == 2, "the host to lead the two others")
        await until(lambda: _refused(fleet, gone), "the cluster to be recorded refused", every=0.1)
        assert gone not in served.host.led()
    rows = await _control_rows(fleet)
    assert "left host group" in str(rows[gone]["refused_why"]), rows[gone]
    assert rows[gone]["owner"] is None
    epoch = await admin_execute(fleet.url, f'SELECT epoch FROM "{gone}".cronoq_leader')
    assert epoch[0]["epoch"] == 0, "the refused cluster's epoch moved"


async def test_a_leader_table_dropped_before_the_batch_locks_it_costs_only_its_cluster(
    fleet: Fleet,
) -> None:
    """A cluster whose leader table is dropped after its control row and schema were read
    fails its batch at the leader tables' lock: the batch is claimed again one cluster at a
    time, so the others are led and only that one is refused."""
    schemas = fleet.clusters(3)
    await enrolled(fleet, schemas)
    broken = schemas[0]
    await admin_execute(fleet.url, f'DROP TABLE "{broken}".cronoq_leader CASCADE')
    async with serving(fleet.url, config(fleet, "dropping")) as served:
        await until(
            lambda: sorted(served.host.led()) == schemas[1:], "the host to lead the two others"
        )
        await until(lambda: _refused(fleet, broken), "the broken cluster to be refused", every=0.1)


async def _refused(fleet: Fleet, schema: str) -> bool:
    return (await _control_rows(fleet))[schema]["state"] == "refused"


async def test_recoveries_of_clusters_gained_together_leave_commits_a_connection(
    fleet: Fleet,
) -> None:
    """Clusters gained together recover a few at a time, never on the commit lanes'
    connections: while recoveries wait (here for tables an operator locked), the commits of
    another cluster still find a connection, where recoveries holding every one would fail
    them. A pool of 2 is one lane and one recovery."""
    slow, slower, quick = fleet.clusters(3)
    await enrolled(fleet, [slow, slower, quick])
    committed = asyncio.get_running_loop().create_future()

    async def lead(store: HostedStore) -> None:
        if store.config.schema == quick:
            try:
                await commit_one(store, 1)
            except StoreError as error:
                committed.set_result(error)
            else:
                committed.set_result(None)
        else:
            await store.recover(TimeBase.now())
        await store.leadership_lost()

    blocker = await asyncpg.connect(asyncpg_dsn(fleet.url))
    settings = replace(config(fleet, "recovering"), max_connections=2, handover_grace=0.1)
    host = await PgHost.connect(fleet.url, settings)
    task = None
    try:
        await blocker.execute("BEGIN")
        for schema in (slow, slower):
            await blocker.execute(f'LOCK TABLE "{schema}".cronoq_tasks IN ACCESS EXCLUSIVE MODE')
        task = asyncio.ensure_future(host.serve(lead))
        assert await asyncio.wait_for(committed, PATIENCE) is None
    finally:
        await blocker.close()
        await host.close()
        if task is not None:
            await asyncio.wait({task})
