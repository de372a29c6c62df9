"""Claims in batches under faults around them: leader tables held one after another, a
recovery blocked by an operator's lock, a refusal the server fails, stuck holders that are
not the host's to end or not stuck, the host session ended mid-batch, and a cluster named
like the batch's placeholders. Each costs at most its own cluster, for a while."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import asyncpg

from cronoq_store import PgStoreConfig, TimeBase
from cronoq_store._host.host import HostedStore, PgHost
from cronoq_store._statements import LOCK_NS_LEADER

from ..pgharness import admin_execute, asyncpg_dsn
from ..waits import holds_for, until, until_value
from .conftest import Fleet
from .hosts import Served, config, enrolled, serving


async def test_a_batch_waiting_on_several_held_leader_tables_keeps_the_host_session(
    fleet: Fleet,
) -> None:
    """The batch's barrier is one statement, and ``lock_timeout`` bounds each lock wait,
    not the statement: eight leader tables each held for half the bound (commits in flight
    of the last owner, released one after the other) must not keep it waiting past what is
    left of ``session_timeout``, which would end the host session and step down the
    cluster the process already led."""
    store = PgStoreConfig(
        application_name="waits", lock_poll=0.1, keepalive=1.0, session_timeout=3.0
    )
    cfg = replace(config(fleet, "waits"), store=store)
    bound = min(store.keepalive, (store.session_timeout - store.keepalive) / 2)
    anchor, *held = fleet.clusters(9)
    await enrolled(fleet, [anchor, *held])
    gate = await asyncpg.connect(asyncpg_dsn(fleet.url))
    holders = {s: await asyncpg.connect(asyncpg_dsn(fleet.url)) for s in held}
    try:
        for schema, conn in holders.items():
            # The standalone lock keeps these out of the first batch, so that the host
            # leads the anchor first; each leader table held as a commit's FOR SHARE holds it.
            await gate.execute(
                "SELECT pg_advisory_lock($1, to_regnamespace(quote_ident($2))::int)",
                LOCK_NS_LEADER,
                schema,
            )
            await conn.execute("BEGIN")
            await conn.execute(f'LOCK TABLE "{schema}".cronoq_leader IN ROW SHARE MODE')
        async with serving(fleet.url, cfg) as served:
            await until(lambda: anchor in served.host.led(), "the host to lead the anchor")
            first = served.host.process_id
            await gate.execute("SELECT pg_advisory_unlock_all()")
            released: set[str] = set()
            while len(released) < len(held) and len(served.host.led()) < 9:
                rows = await admin_execute(
                    fleet.url,
                    "SELECT n.nspname FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
                    "JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE NOT l.granted AND l.mode = 'ExclusiveLock' "
                    "AND c.relname = 'cronoq_leader' AND n.nspname = ANY($1::text[])",
                    list(holders),
                )
                for row in rows:
                    schema = str(row["nspname"])
                    if schema not in released:
                        await asyncio.sleep(bound / 2)  # a commit that lands within the bound
                        await holders[schema].execute("COMMIT")
                        released.add(schema)
                await asyncio.sleep(0.02)
            await until(lambda: len(served.host.led()) == 9, "the host to lead every cluster")
            assert served.host.process_id == first, "the host session was lost to a claim"
            assert [s for s, _ in served.gained].count(anchor) == 1, served.gained
    finally:
        await gate.close()
        for conn in holders.values():
            await conn.close()


async def test_a_recovery_blocked_by_a_lock_gives_its_turn_back(fleet: Fleet) -> None:
    """A recovery blocked by an operator's lock (a migration of that one cluster) waits
    ``commit_timeout`` at most and gives its turn back, so that the other clusters the
    host gains recover. A pool of 3: one recovery at a time."""
    slow, quick = fleet.clusters(2)
    await enrolled(fleet, [slow, quick])
    recovered: set[str] = set()

    async def slow_recovery_waits() -> bool:
        rows = await admin_execute(
            fleet.url,
            "SELECT 1 FROM pg_locks WHERE NOT granted "
            "AND relation = to_regclass(quote_ident($1) || '.cronoq_tasks')",
            slow,
        )
        return bool(rows)

    async def lead(store: HostedStore) -> None:
        if store.config.schema == quick:
            await until(slow_recovery_waits, "the slow cluster's recovery to wait on its lock")
        await store.recover(TimeBase.now())
        recovered.add(store.config.schema)
        await store.leadership_lost()

    blocker = await asyncpg.connect(asyncpg_dsn(fleet.url))
    settings = config(fleet, "starving")
    settings = replace(settings, store=replace(settings.store, commit_timeout=3.0))
    host = await PgHost.connect(fleet.url, settings)
    task = None
    try:
        await blocker.execute("BEGIN")
        await blocker.execute(f'LOCK TABLE "{slow}".cronoq_tasks IN ACCESS EXCLUSIVE MODE')
        task = asyncio.ensure_future(host.serve(lead))
        await until(lambda: quick in recovered, "the quick cluster to recover", within=30)
    finally:
        await blocker.close()
        await host.close()
        if task is not None:
            await asyncio.wait({task})


async def test_a_stuck_holder_of_another_role_is_waited_for(fleet: Fleet) -> None:
    """A claim that finds the leader table held ends the holders stuck mid-statement; one
    of another role (here a superuser's, stuck in a COPY inside a transaction that read
    the leader row) is not the host role's to end (``pg_terminate_backend`` would raise),
    even where ``pg_monitor`` shows it: the claim waits, and the cluster is not refused."""
    from ..support import create_role, drop_role

    role = await create_role(fleet.url, f"r_{fleet.prefix}")
    await admin_execute(
        fleet.url, f'GRANT CREATE ON DATABASE "{fleet.url.database}" TO {role.name}'
    )
    # Monitoring rights, as many deployments grant: the role sees others' sessions' state.
    await admin_execute(fleet.url, f"GRANT pg_monitor TO {role.name}")
    (schema,) = fleet.clusters(1)
    hosted = replace(fleet, url=role.url)
    stuck = await asyncpg.connect(asyncpg_dsn(fleet.url))
    release = asyncio.Event()
    copying = None
    try:
        await enrolled(hosted, [schema])

        async def source() -> AsyncIterator[bytes]:
            yield b"x\n"
            await release.wait()

        await stuck.execute("CREATE TEMP TABLE sink (t text)")
        await stuck.execute("BEGIN")
        await stuck.execute(f'SELECT epoch FROM "{schema}".cronoq_leader FOR SHARE')
        copying = asyncio.ensure_future(stuck.copy_to_table("sink", source=source()))
        settings = config(fleet, "refusing")
        settings = replace(settings, store=replace(settings.store, commit_timeout=3.0))
        async with serving(role.url, settings) as served:
            store = served.host._config.store
            # Past both bounds (a COPY's and any other's), the claims meet the holder.
            watch = max(store.commit_timeout, 1.5 * store.session_timeout) + 3

            async def active() -> bool:
                rows = await admin_execute(
                    fleet.url,
                    f'SELECT state FROM "{fleet.control}".clusters WHERE schema_name = $1',
                    schema,
                )
                return bool(rows[0]["state"] == "active")

            await holds_for(active, "the cluster's enrolment (not refused)", watch)
    finally:
        release.set()
        if copying is not None:
            await asyncio.wait({copying})
        await stuck.close()
        await admin_execute(fleet.url, f'DROP SCHEMA IF EXISTS "{fleet.control}" CASCADE')
        await admin_execute(fleet.url, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await admin_execute(
            fleet.url, f'REVOKE CREATE ON DATABASE "{fleet.url.database}" FROM {role.name}'
        )
        await drop_role(fleet.url, role.name)


async def test_hosts_claiming_overlapping_batches_at_once_never_share_an_epoch(
    fleet: Fleet,
) -> None:
    """Three hosts start together over 24 clusters (mixed-case names, so Python's order and
    the server's collation differ): no (cluster, epoch) is gained twice, and at the end
    every cluster is owned once, at the epoch its leader row holds."""
    schemas = [f"{s}_{'A' if i % 2 else 'b'}" for i, s in enumerate(fleet.clusters(24))]
    schemas = [s.upper() if i % 3 == 0 else s for i, s in enumerate(schemas)]
    await enrolled(fleet, schemas)
    async with (
        serving(fleet.url, config(fleet, "one")) as one,
        serving(fleet.url, config(fleet, "two")) as two,
        serving(fleet.url, config(fleet, "three")) as three,
    ):
        hosts = (one, two, three)
        await until(lambda: sorted(len(h.host.led()) for h in hosts) == [8, 8, 8], "an even split")
        gained = [g for h in hosts for g in h.gained]
        assert len(gained) == len(set(gained)), sorted(gained)
        ids = {h.host.process_id for h in hosts}
        seen: list[dict[str, object]] = []

        async def owned_at_stored_epochs() -> bool:
            """Every cluster owned by one of the hosts at its leader row's epoch; a move in
            flight between the two reads (a handover as the split settles) passes."""
            rows = await admin_execute(
                fleet.url,
                f'SELECT schema_name, owner, epoch FROM "{fleet.control}".clusters '
                "WHERE host_group = $1",
                fleet.group,
            )
            seen[:] = [
                {**dict(row), "stored": await fleet.stored_epoch(row["schema_name"])}
                for row in rows
            ]
            return all(r["owner"] in ids and r["epoch"] == r["stored"] for r in seen)

        try:
            await until(owned_at_stored_epochs, "every cluster owned at its stored epoch")
        except AssertionError as failed:
            raise AssertionError(f"{failed}: {seen}") from None


async def test_a_host_session_terminated_while_a_claim_waits_leaves_nothing_half_claimed(
    fleet: Fleet,
) -> None:
    """The host session is terminated while a claim waits at a held leader table: nothing
    of that claim commits, and the next session claims every cluster, each owned at the
    epoch its leader row holds."""
    schemas = fleet.clusters(4)
    await enrolled(fleet, schemas)
    holder = await asyncpg.connect(asyncpg_dsn(fleet.url))
    try:
        await holder.execute("BEGIN")
        await holder.execute(f'LOCK TABLE "{schemas[2]}".cronoq_leader IN ROW SHARE MODE')
        async with serving(fleet.url, config(fleet, "terminated")) as served:

            async def waiting() -> list[asyncpg.Record]:
                return await admin_execute(
                    fleet.url,
                    "SELECT pid FROM pg_locks WHERE NOT granted AND mode = 'ExclusiveLock' "
                    "AND relation = to_regclass(quote_ident($1) || '.cronoq_leader')",
                    schemas[2],
                )

            # The batch waits its share of the bound there, then each claim alone waits the
            # whole bound: either is the host session's wait to end.
            waiters = await until_value(waiting, bool, "a claim to wait at the held table")
            pid = waiters[0]["pid"]
            await admin_execute(fleet.url, "SELECT pg_terminate_backend($1)", pid)
            # The held cluster's claim died with the session: nothing of it committed.
            assert await fleet.stored_epoch(schemas[2]) == 0
            await holder.execute("COMMIT")
            await until(lambda: len(served.host.led()) == 4, "the host to lead every cluster")
            owners = await fleet.owners()
            assert set(owners.values()) == {served.host.process_id}, owners
            rows = await admin_execute(
                fleet.url,
                f'SELECT schema_name, epoch FROM "{fleet.control}".clusters WHERE host_group = $1',
                fleet.group,
            )
            for row in rows:
                assert row["epoch"] == await fleet.stored_epoch(row["schema_name"]), dict(row)
    finally:
        await holder.close()


async def test_a_refusal_that_fails_leaves_no_claimed_cluster_unled(fleet: Fleet) -> None:
    """A batch commits its claims before the refusals of its other clusters are recorded,
    one statement each. A refusal the server fails (here a trigger cancels it as a role's
    ``statement_timeout`` would cancel one waiting on the row) must not end the round
    before the batch's claims are gained: owned by this live process and never led, no
    other process could claim them."""
    gone, *others = fleet.clusters(3)
    await enrolled(fleet, [gone, *others])
    await admin_execute(fleet.url, f"UPDATE \"{gone}\".cronoq_leader SET host_group = 'elsewhere'")
    gate = await asyncpg.connect(asyncpg_dsn(fleet.url))
    try:
        for schema in (gone, *others):
            # The standalone locks keep every cluster out of the claims until the trigger
            # stands (the control schema's trust check at registration refuses it).
            await gate.execute(
                "SELECT pg_advisory_lock($1, to_regnamespace(quote_ident($2))::int)",
                LOCK_NS_LEADER,
                schema,
            )
        async with serving(fleet.url, config(fleet, "orphaning")) as served:
            await until(lambda: served.host.process_id is not None, "the host to register")
            await admin_execute(
                fleet.url,
                f'CREATE FUNCTION "{fleet.control}".cancel() RETURNS trigger LANGUAGE plpgsql '
                "AS $$BEGIN IF NEW.state = 'refused' THEN RAISE EXCEPTION "
                "'canceling statement due to statement timeout' USING ERRCODE = '57014'; "
                "END IF; RETURN NEW; END$$",
            )
            await admin_execute(
                fleet.url,
                f'CREATE TRIGGER cancel_refusals BEFORE UPDATE ON "{fleet.control}".clusters '
                f'FOR EACH ROW EXECUTE FUNCTION "{fleet.control}".cancel()',
            )
            await gate.execute("SELECT pg_advisory_unlock_all()")
            await _orphans_led(fleet, served, others)
    finally:
        await gate.close()


async def _orphans_led(fleet: Fleet, served: Served, others: list[str]) -> None:
    """What the host owns, it leads, for a few claim rounds (``lock_poll`` each)."""

    seen: list[tuple[list[str], list[str]]] = []

    async def owns_what_it_leads() -> bool:
        """False once the same mismatch is seen twice in a row, a second apart (a claim
        committed but not yet gained is a moment's mismatch)."""
        owners = await fleet.owners()
        owned = sorted(s for s, o in owners.items() if o == served.host.process_id)
        now = (owned, sorted(served.host.led()))
        stuck = now[0] != now[1] and seen[-1:] == [now]
        seen.append(now)
        if stuck:
            print(f"owned by the host: {now[0]}; led: {now[1]}")
        return not stuck

    await holds_for(owns_what_it_leads, "what the host owns is what it leads", 6.0, every=1.0)


async def test_a_copy_that_streams_slowly_is_not_a_stuck_holder(fleet: Fleet) -> None:
    """A session streams a COPY, a row every 0.2 s, inside a transaction that read a leader
    row ``FOR SHARE``: it is never silent, but its state stays ``active`` since the COPY
    began and it waits in ``ClientRead`` between rows. Past ``1.5 x session_timeout`` it
    is still not ended: a COPY gets ``commit_timeout``, past which a live client gave up."""
    (schema,) = fleet.clusters(1)
    await enrolled(fleet, [schema])
    streaming = await asyncpg.connect(asyncpg_dsn(fleet.url))
    done = asyncio.Event()
    copying = None
    try:

        async def source() -> AsyncIterator[bytes]:
            while not done.is_set():
                yield b"x\n"
                await asyncio.sleep(0.2)

        await streaming.execute("CREATE TEMP TABLE sink (t text)")
        await streaming.execute("BEGIN")
        await streaming.execute(f'SELECT epoch FROM "{schema}".cronoq_leader FOR SHARE')
        copying = asyncio.ensure_future(streaming.copy_to_table("sink", source=source()))
        async with serving(fleet.url, config(fleet, "streaming")) as served:
            watch = 1.5 * served.host._config.store.session_timeout + 3
            pid = streaming.get_server_pid()

            async def streams() -> bool:
                rows = await admin_execute(
                    fleet.url, "SELECT 1 FROM pg_stat_activity WHERE pid = $1", pid
                )
                return bool(rows)

            await holds_for(streams, "the streaming COPY's session", watch, every=0.2)
    finally:
        done.set()
        if copying is not None:
            copying.cancel()
            await asyncio.wait({copying})
        await streaming.close()


async def test_a_cluster_named_like_a_placeholder_is_claimed_as_itself(fleet: Fleet) -> None:
    """The batch's statements name slot ``i`` ``cronoq_claim_<i>`` and map it to a cluster
    at execution: a cluster named ``cronoq_claim_0`` in slot 1 (after ``a_<tag>`` in slot
    0) is bumped in its own table, not re-mapped to slot 0's."""
    first, placeholder = f"a_{fleet.prefix}", "cronoq_claim_0"
    await admin_execute(fleet.url, f'DROP SCHEMA IF EXISTS "{placeholder}" CASCADE')
    try:
        await enrolled(fleet, [first, placeholder])
        async with serving(fleet.url, config(fleet, "placeholders")) as served:
            await until(lambda: len(served.host.led()) == 2, "the host to lead both")
            for schema in (first, placeholder):
                rows = await admin_execute(
                    fleet.url, f'SELECT count(*) AS n FROM "{schema}".cronoq_leader_history'
                )
                assert await fleet.stored_epoch(schema) == 1, schema
                assert rows[0]["n"] == 1, schema
    finally:
        await admin_execute(fleet.url, f'DROP SCHEMA IF EXISTS "{placeholder}" CASCADE')
