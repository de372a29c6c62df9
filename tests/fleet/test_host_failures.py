"""The host where processes, sessions, schemas and applications fail it: a second control
schema, a dead process, a lead that ignores its cancellation, a schema dropped or made
again, an epoch moved outside the host, a session ended mid-claim, a refused cluster, a lock
held on one cluster's tables, concurrent enrolments, the rows of processes long gone; on a
real server, with real sessions ended by ``pg_terminate_backend``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from cronoq_store import MigrationError, PgStoreConfig, StoreError
from cronoq_store._door import LockSession
from cronoq_store._host.control import prepare_control
from cronoq_store._host.host import HostedStore, PgHost, PgHostConfig
from cronoq_store._urls import async_url

from ..pgharness import admin_execute, asyncpg_dsn
from ..waits import until, until_value
from .conftest import Fleet
from .hosts import STORE, config, serving, serving_until_it_waits_on_a_lock


def other_control(fleet: Fleet, group: str | None = None) -> Fleet:
    """A second control schema in the same database (the fixture's tag in its name, so the
    fixture drops it), with ``fleet``'s group name unless ``group`` is given."""
    return replace(fleet, control=f"{fleet.control}_b", group=group or fleet.group)


async def asyncpg_connect(url: URL) -> asyncpg.Connection:
    """A raw session of the test's own, outside every pool under test."""
    return await asyncpg.connect(asyncpg_dsn(url))


async def terminate(fleet: Fleet, name: str) -> None:
    """End the host session of the host named ``name`` (its lock session's name)."""
    await admin_execute(
        fleet.url,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name LIKE $1",
        f"{name} leader %",
    )


async def test_a_second_control_schema_in_a_database_is_refused(fleet: Fleet) -> None:
    """Process locks are the database's, keyed by ids each control schema draws from its own
    sequence, and a cluster's mark names its group only: two control schemas would hand one
    id to two processes (a dead one read as alive while the other holds its lock) and let
    two groups lead one cluster. A second is refused, naming the first, before it exists."""
    [schema] = fleet.clusters(1)
    async with serving(fleet.url, config(fleet, "ctl_a"), [schema]) as first:
        await until(lambda: schema in first.host.led(), "the first host to lead")
        second = other_control(fleet)
        with pytest.raises(MigrationError, match=fleet.control):
            await PgHost.connect(fleet.url, config(second, "ctl_b"))
        rows = await admin_execute(
            fleet.url, "SELECT 1 FROM pg_namespace WHERE nspname = $1", second.control
        )
        assert rows == []
        assert schema in first.host.led()


async def test_a_lead_that_outlives_its_cancellation_does_not_stop_the_keeper(
    fleet: Fleet,
) -> None:
    """An application whose lead outlives its cancellation (or swallows it) never holds the
    keeper: the keeper cancels an overdue lead and goes on, so when the host session ends it
    still steps every other cluster down before another process may claim them."""
    first, second = fleet.clusters(2)
    host = await PgHost.connect(fleet.url, config(fleet, "stubborn", handover_grace=0.2))
    stores: dict[str, HostedStore] = {}
    unstick = asyncio.Event()

    async def lead(store: HostedStore) -> None:
        stores[store.config.schema] = store
        if store.config.schema != first:
            await store.leadership_lost()
            return
        await until(lambda: second in stores, "both clusters led")
        await store.release_leadership()
        # A cleanup that takes longer than the cancellation allows (a committer draining, a
        # scheduler stopping); here it ignores the cancellation until the test ends it.
        while not unstick.is_set():
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(unstick.wait(), 1)

    await host.enroll([first, second])
    task = asyncio.ensure_future(host.serve(lead))
    try:
        await until(lambda: second in stores, "the host to lead the second cluster")
        led = stores[second]
        await asyncio.sleep(1.0)  # the first cluster's lead is cancelled by now
        await terminate(fleet, "stubborn")
        await until(
            lambda: not led.is_leader,
            "the host to step the second cluster down once its session ended "
            f"(session_timeout {STORE.session_timeout} s)",
            within=STORE.session_timeout + 3,
        )
    finally:
        unstick.set()
        await host.close()
        await asyncio.wait({task})


async def test_a_schema_dropped_and_enrolled_again_is_led_or_refused_at_enrolment(
    fleet: Fleet,
) -> None:
    """A schema whose cluster was replaced (dropped, migrated again) and enrolled again is
    listed as the cluster standing there now, and led: never left marked as the group's
    while every claim refuses the control row of the old incarnation."""
    [schema] = fleet.clusters(1)
    host = await PgHost.connect(fleet.url, config(fleet, "again"))
    try:
        await host.enroll(schema)
        await admin_execute(fleet.url, f'DROP SCHEMA "{schema}" CASCADE')
        try:
            await host.enroll(schema)
        except StoreError:
            return  # refused with a reason: the operator knows
    finally:
        await host.close()
    rows = await admin_execute(fleet.url, f'SELECT tableoid FROM "{schema}".cronoq_leader')
    incarnation = int(rows[0]["tableoid"])
    async with serving(fleet.url, config(fleet, "again2")) as served:

        def led_anew() -> bool:
            store = served.host.led().get(schema)
            return store is not None and store.incarnation == incarnation and store.is_leader

        try:
            await until(led_anew, "the new cluster under the old name to be led", within=15)
        except AssertionError as failure:
            state = await admin_execute(
                fleet.url,
                f'SELECT state, refused_why FROM "{fleet.control}".clusters',
            )
            found = [dict(r) for r in state]
            raise AssertionError(f"not led; its control row: {found}") from failure


async def test_a_hosted_term_ends_when_its_schema_is_dropped(fleet: Fleet) -> None:
    """A hosted term ends once its schema is dropped, as a standalone keeper steps down
    (``schema_gone``), even while it does not commit: the host's sweep reads its clusters'
    leader rows, which the control schema cannot show."""
    [schema] = fleet.clusters(1)
    async with serving(fleet.url, config(fleet, "dropped"), [schema]) as served:
        await until(lambda: schema in served.host.led(), "the host to lead")
        store = served.host.led()[schema]
        await admin_execute(fleet.url, f'DROP SCHEMA "{schema}" CASCADE')
        await until(
            lambda: not store.is_leader,
            "the hosted term to end once its schema is gone (a standalone keeper: keepalive)",
            within=STORE.keepalive * 10,
        )


async def test_a_hosted_term_ends_when_its_epoch_moves_outside_the_host(fleet: Fleet) -> None:
    """A forced downgrade (or any bump outside the host) moves the epoch without touching
    the control schema; the hosted term ends at the sweep's next read of its row, as a
    standalone keeper steps down, even while it does not commit."""
    [schema] = fleet.clusters(1)
    async with serving(fleet.url, config(fleet, "bumped"), [schema]) as served:
        await until(lambda: schema in served.host.led(), "the host to lead")
        store = served.host.led()[schema]
        await admin_execute(fleet.url, f'UPDATE "{schema}".cronoq_leader SET epoch = epoch + 1')
        await until(
            lambda: not store.is_leader,
            "the hosted term to end once its epoch moved (a standalone keeper: keepalive)",
            within=STORE.keepalive * 10,
        )


async def test_a_host_session_ended_during_a_claim_is_registered_again(fleet: Fleet) -> None:
    """A claim waits in ``leader_barrier`` behind a session holding the leader table; the
    host session is ended meanwhile. The host must step down, register again, and lead the
    cluster once the table is free, as after any lost session."""
    [schema] = fleet.clusters(1)
    store = PgStoreConfig(
        application_name="barred", lock_poll=0.1, keepalive=3.0, session_timeout=10.0
    )
    cfg = PgHostConfig(
        store=store, control_schema=fleet.control, group=fleet.group, join_settle=0.2
    )
    host = await PgHost.connect(fleet.url, cfg)
    await host.enroll(schema)
    blocker = await asyncpg_connect(fleet.url)
    task: asyncio.Future[None] | None = None
    try:
        await blocker.execute("BEGIN")
        await blocker.execute(f'SELECT epoch FROM "{schema}".cronoq_leader FOR SHARE')

        task = await serving_until_it_waits_on_a_lock(
            fleet, host, "barred", "the claim to wait in the leader barrier"
        )
        first_id = host.process_id
        await terminate(fleet, "barred")
        await blocker.execute("ROLLBACK")
        await until(
            lambda: host.process_id not in (None, first_id) and schema in host.led(),
            "the host to register again and lead the cluster",
            within=20,
        )
    finally:
        await blocker.close()
        await host.close()
        if task is not None:
            await asyncio.wait({task}, timeout=30)


async def test_a_refused_cluster_is_led_again_once_the_cause_is_gone(fleet: Fleet) -> None:
    """A claim refuses a cluster whose trust check fails (here an unknown trigger) and marks
    its row ``refused``; once the trigger is dropped, enrolling the cluster again clears the
    refusal and it is led again."""
    [schema] = fleet.clusters(1)
    host = await PgHost.connect(fleet.url, config(fleet, "refused"))
    try:
        await host.enroll(schema)
    finally:
        await host.close()
    await admin_execute(
        fleet.url,
        f'CREATE FUNCTION "{schema}".f() RETURNS trigger LANGUAGE plpgsql '
        "AS $$BEGIN RETURN NEW; END$$",
    )
    await admin_execute(
        fleet.url,
        f'CREATE TRIGGER audit BEFORE INSERT ON "{schema}".cronoq_tasks '
        f'FOR EACH ROW EXECUTE FUNCTION "{schema}".f()',
    )

    async def state() -> str:
        rows = await admin_execute(
            fleet.url,
            f'SELECT state FROM "{fleet.control}".clusters WHERE schema_name = $1',
            schema,
        )
        return str(rows[0]["state"])

    async with serving(fleet.url, config(fleet, "refused2")) as served:
        await until_value(state, lambda s: s == "refused", "the claim to refuse the cluster")
        await admin_execute(fleet.url, f'DROP TRIGGER audit ON "{schema}".cronoq_tasks')
        await admin_execute(fleet.url, f'DROP FUNCTION "{schema}".f()')
        await served.host.enroll(schema)  # the operator's only tool
        await until(
            lambda: schema in served.host.led(),
            "the cluster to be led again once its trigger is gone (the design: within 60 s)",
            within=65,
        )


async def test_the_control_schema_is_not_enrolled_as_a_cluster(fleet: Fleet) -> None:
    """``enroll`` refuses the host's own control schema: a cluster living among the control
    tables would take them with it when dropped or downgraded."""
    host = await PgHost.connect(fleet.url, config(fleet, "itself"))
    try:
        try:
            added = await host.enroll(fleet.control)
        except (StoreError, ValueError):
            return
        tables = await admin_execute(
            fleet.url,
            "SELECT relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = $1 AND c.relkind = 'r' ORDER BY relname",
            fleet.control,
        )
        raise AssertionError(
            f"the control schema was enrolled as a cluster ({added}); it now holds "
            f"{[r['relname'] for r in tables]}"
        )
    finally:
        await host.close()


async def test_every_process_may_enroll_the_same_clusters_at_its_start(fleet: Fleet) -> None:
    """The natural deployment runs the same code in every process: enroll the tenant list,
    then serve. Two enrolments of one cluster at once both succeed (the second waits a moment
    for the first's hold on its leader lock), and an enrolled cluster stays as it is."""
    schemas = fleet.clusters(5)
    first = await PgHost.connect(fleet.url, config(fleet, "enrol1"))
    second = await PgHost.connect(fleet.url, config(fleet, "enrol2"))
    try:
        await first.enroll(schemas)
        for _ in range(20):
            results = await asyncio.gather(
                first.enroll(schemas, migrate=False),
                second.enroll(schemas, migrate=False),
                return_exceptions=True,
            )
            failures = [r for r in results if isinstance(r, BaseException)]
            assert not failures, f"enrolling at once failed: {failures[0]!r}"
    finally:
        await first.close()
        await second.close()


async def test_a_hosted_store_says_what_it_is(fleet: Fleet) -> None:
    """``repr`` of a :class:`HostedStore` names it: a log line tells a hosted term from a
    standalone store."""
    [schema] = fleet.clusters(1)
    async with serving(fleet.url, config(fleet, "named"), [schema]) as served:
        await until(lambda: schema in served.host.led(), "the host to lead")
        assert repr(served.host.led()[schema]).startswith("HostedStore(")


async def test_close_returns_when_a_lead_outlives_its_cancellation(fleet: Fleet) -> None:
    """``close()`` waits ``handover_grace`` for each lead, cancels the late ones, and returns
    within a bound even when a lead's cleanup outlives its cancellation or swallows it."""
    [schema] = fleet.clusters(1)
    host = await PgHost.connect(fleet.url, config(fleet, "closing", handover_grace=0.2))
    unstick = asyncio.Event()
    led = asyncio.Event()

    async def lead(store: HostedStore) -> None:
        led.set()
        while not unstick.is_set():
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(unstick.wait(), 1)

    await host.enroll(schema)
    task = asyncio.ensure_future(host.serve(lead))
    closing: asyncio.Future[None] | None = None
    try:
        await asyncio.wait_for(led.wait(), 30)
        closing = asyncio.ensure_future(host.close())
        done, _ = await asyncio.wait({closing}, timeout=10)
        assert done, "close() still waiting 10 s after a handover_grace of 0.2 s"
    finally:
        unstick.set()
        if closing is not None:
            await asyncio.wait({closing}, timeout=30)
        await asyncio.wait({task}, timeout=30)


async def test_a_lock_on_one_clusters_table_does_not_cost_the_host_its_other_clusters(
    fleet: Fleet,
) -> None:
    """A lock on one cluster's table (an index built on it, an operator's ``LOCK``) that
    makes a claim's statement wait past its bound costs that claim, which waits for the next
    round: the session answered, so the host's other clusters stay led."""
    kept, locked = fleet.clusters(2)
    async with serving(fleet.url, config(fleet, "locked"), [kept]) as served:
        await until(lambda: kept in served.host.led(), "the host to lead the first cluster")
        store = served.host.led()[kept]
        host = await PgHost.connect(fleet.url, config(fleet, "enroller"))
        try:
            await host.enroll(locked)
        finally:
            await host.close()
        blocker = await asyncpg_connect(fleet.url)
        try:
            await blocker.execute("BEGIN")
            await blocker.execute(f'LOCK TABLE "{locked}".cronoq_leader_history IN SHARE MODE')
            served.host._wake.set()  # claim now rather than at the next poll
            for _ in range(int((STORE.session_timeout + 2) / 0.05)):
                assert store.is_leader, (
                    "the first cluster stepped down while a claim of the second waited for "
                    "its history table"
                )
                await asyncio.sleep(0.05)
        finally:
            await blocker.close()


async def test_a_lost_session_is_not_logged_as_clusters_taken(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    """After a lost session the host registers again; the terms that ended with the old
    session are not reported as clusters taken from the process (nobody took them)."""
    [schema] = fleet.clusters(1)
    caplog.set_level(logging.INFO, "cronoq_store")
    async with serving(fleet.url, config(fleet, "relogged"), [schema]) as served:
        await until(lambda: schema in served.host.led(), "the host to lead")
        first_id = served.host.process_id
        await terminate(fleet, "relogged")
        await until(
            lambda: served.host.process_id not in (None, first_id) and schema in served.host.led(),
            "the host to register again and lead again",
        )
    taken = [r for r in caplog.records if "taken from this process" in r.getMessage()]
    assert not taken, f"{len(taken)} ERROR lines for a cluster lost with the session"


async def test_clusters_of_a_process_that_left_are_led_by_the_others(fleet: Fleet) -> None:
    """A process that closes hands its clusters to the others even while a lead ignores its
    cancellation; and a cluster still owned by a process that left (an older version's
    close, a claim committed as its process was buried) is freed, where only members are
    ever buried: before, it stayed owned by the left id and nobody led it."""
    one, two = fleet.clusters(2)
    host = await PgHost.connect(fleet.url, config(fleet, "leaving", handover_grace=0.2))
    unstick = asyncio.Event()
    leads: list[str] = []

    async def lead(store: HostedStore) -> None:
        leads.append(store.config.schema)
        while not unstick.is_set():
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(unstick.wait(), 1)

    await host.enroll([one, two])
    task = asyncio.ensure_future(host.serve(lead))
    try:
        await until(lambda: len(leads) == 2, "the leaving host to lead both clusters")
        left = host.process_id
        await asyncio.wait_for(host.close(), 30)
        assert await fleet.owners() == {one: None, two: None}
        await admin_execute(
            fleet.url,
            f'UPDATE "{fleet.control}".clusters SET owner = $1 WHERE schema_name = $2',
            left,
            two,
        )
        async with serving(fleet.url, config(fleet, "staying")) as other:
            owners = await until_value(
                fleet.owners,
                lambda o: set(o.values()) == {other.host.process_id},
                "the staying host to own both clusters",
            )
            assert set(owners) == {one, two}
            await until(lambda: len(other.gained) == 2, "the staying host to lead both")
    finally:
        unstick.set()
        await asyncio.wait({task}, timeout=30)


async def test_rows_of_processes_that_left_long_ago_are_pruned_a_bounded_number_a_tick(
    fleet: Fleet,
) -> None:
    """Every restart of a process adds a row that stays once it left (ids are never
    reused): a member deletes those older than a day on its balancing tick, 100 at most
    each time, so one prune stays a short statement whatever piled up."""
    engine = create_async_engine(async_url(fleet.url))
    try:
        await prepare_control(engine, fleet.control)
    finally:
        await engine.dispose()
    await admin_execute(
        fleet.url,
        f'INSERT INTO "{fleet.control}".processes (process_id, host_group, instance, '
        "backend_pid, role, application_name, state, left_at) "
        f"SELECT nextval('\"{fleet.control}\".process_ids'), $1, 'gone', 0, 'r', 'a', "
        "'left', now() - interval '2 days' FROM generate_series(1, 101)",
        fleet.group,
    )

    async def left() -> int:
        rows = await admin_execute(
            fleet.url,
            f"SELECT count(*) FROM \"{fleet.control}\".processes WHERE state = 'left'",
        )
        return int(rows[0][0])

    async with serving(fleet.url, config(fleet, "pruning")):
        assert await until_value(left, lambda n: n < 101, "a prune of the left rows") == 1


async def test_a_statement_gone_silent_in_a_host_transaction_is_the_error_raised(
    engine: AsyncEngine,
) -> None:
    """A statement of a host's transaction (a claim) that does not answer in time tears the
    session down; the rollback that follows cannot run on it, and the error raised says
    the statement went silent, not that the rollback found the session gone (a host lost
    at 10,000 clusters reported ``PendingRollbackError``, hiding why)."""
    session = await LockSession.open(engine, 5.0)
    try:
        with pytest.raises(TimeoutError, match=r"did not answer within 0\.5"):
            async with session.transaction(5.0):
                await session.findings(text("SELECT pg_catalog.pg_sleep(5)::text"), {}, 0.5)
    finally:
        await session.close()
