"""Leader election against a real server: lock, epochs, step-down, takeover, retries."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import time

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from cronoq_store import EPOCH_MAX, PgStore
from cronoq_store import _statements as st
from cronoq_store._config import PgStoreConfig
from cronoq_store._door import translate_error
from cronoq_store._errors import StoreError
from cronoq_store._leadership import Leadership
from cronoq_store._urls import async_url

from .pgharness import (
    ServerUnderTest,
    admin_execute,
    asyncpg_dsn,
    terminate_backends,
)
from .support import (
    KEEPALIVE,
    LOCK_POLL,
    SESSION_TIMEOUT,
    LeadershipFactory,
    ha_config,
    instance_config,
    lead,
    leader_app,
    leadership_of,
    lock_holders,
    unused_port,
)
from .tcpproxy import TcpProxy
from .waits import bounded, holds_for, until

#: Step-down must come within session_timeout of the session failing; this is the slack.
STEP_DOWN_BOUND = SESSION_TIMEOUT + 2 * KEEPALIVE
#: How long a takeover past a stalled transaction may take before the test says the stalled
#: session held it up: ten idle limits of that session (one second each).
STALLED_WITHIN = 10.0


async def test_lock_shows_in_pg_locks_on_the_leader_session(
    make_leadership: LeadershipFactory, pg_url: URL, migrated: str, lock_key: tuple[int, int]
) -> None:
    a = make_leadership("a")
    await lead(a)
    holders = await lock_holders(pg_url, lock_key)
    assert [app for _, app in holders] == [leader_app(migrated, "a")]

    await a.release()

    async def released() -> bool:
        return await lock_holders(pg_url, lock_key) == []

    await until(released, "the server to end the released lock session")


async def test_step_down_when_lock_session_is_terminated(
    make_leadership: LeadershipFactory, pg_url: URL, migrated: str, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = make_leadership("a"), make_leadership("b")
    assert await lead(a) == 1
    standby = asyncio.ensure_future(b.acquire())
    caplog.set_level(logging.INFO, logger="cronoq_store")

    started = time.monotonic()
    assert await terminate_backends(pg_url, leader_app(migrated, "a")) == 1
    await asyncio.wait_for(a.wait_lost(), STEP_DOWN_BOUND)
    assert time.monotonic() - started < STEP_DOWN_BOUND
    assert (a.is_leader, a.epoch) == (False, None)
    assert await bounded(standby, "the standby's takeover") == 2

    lost = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage() for r in lost] == ["leader lock session lost; stepping down"]
    assert getattr(lost[0], "epoch", None) == 1


async def test_step_down_when_lock_session_goes_silent(
    make_leadership: LeadershipFactory, pg_url: URL, lock_key: tuple[int, int], migrated: str
) -> None:
    # A longer ping interval tells "silent for session_timeout" from "a ping unanswered for
    # session_timeout", which would step down up to one interval later.
    keepalive = 0.4
    loop = asyncio.get_running_loop()
    async with TcpProxy.to(pg_url) as proxy:
        a = make_leadership("a", proxy.url(pg_url), keepalive=keepalive)
        b = make_leadership("b")
        assert await lead(a) == 1
        standby = asyncio.ensure_future(b.acquire())
        await asyncio.sleep(2.5 * keepalive)

        proxy.stall()
        stalled = loop.time()
        await asyncio.wait_for(a.wait_lost(), SESSION_TIMEOUT + 2 * keepalive)
        assert loop.time() - stalled < SESSION_TIMEOUT + 2 * keepalive
        assert not a.is_leader
        # Measured from the last answer that came through, the step-down is on time: neither
        # early (nothing failed, nothing closed) nor a ping interval late.
        silent_for = loop.time() - proxy.last_delivery
        assert SESSION_TIMEOUT - 0.05 <= silent_for < SESSION_TIMEOUT + keepalive / 2

        # The server still sees a live socket (the proxy's): the lock stays held until the
        # server's TCP keepalive gives up on the client, which the cut stands in for. The
        # old leader stepped down before the lock could move.
        assert not standby.done()
        assert [app for _, app in await lock_holders(pg_url, lock_key)] == [
            leader_app(migrated, "a")
        ]
        proxy.cut()
        assert await bounded(standby, "the standby's takeover after the cut") == 2


async def test_server_frees_the_lock_of_a_stalled_leader_without_help(
    make_leadership: LeadershipFactory, pg_url: URL
) -> None:
    """Behind a stalled path the server's TCP keepalives are answered (here by the proxy's
    kernel), so only the session's idle_session_timeout ends it and frees the lock."""
    loop = asyncio.get_running_loop()
    async with TcpProxy.to(pg_url) as proxy:
        a = make_leadership("a", proxy.url(pg_url))
        b = make_leadership("b")
        assert await lead(a) == 1
        standby = asyncio.ensure_future(b.acquire())
        await asyncio.sleep(3 * KEEPALIVE)
        proxy.stall()
        stalled = loop.time()
        await bounded(a.wait_lost(), "the old leader to step down")
        # No cut: the server must end the silent session by itself (or never does: the bound
        # is how long the test takes to say so).
        taking_over = bounded(standby, "the server to free the stalled leader's lock")
        assert await taking_over == 2
        took_over = loop.time() - stalled
        assert took_over >= SESSION_TIMEOUT, "the lock moved before the old leader stepped down"


async def test_standby_whose_session_goes_silent_reconnects(
    make_leadership: LeadershipFactory, pg_url: URL, caplog: pytest.LogCaptureFixture
) -> None:
    async with TcpProxy.to(pg_url) as proxy:
        a, b = make_leadership("a"), make_leadership("b", proxy.url(pg_url))
        await lead(a)
        standby = asyncio.ensure_future(b.acquire())
        await asyncio.sleep(4 * LOCK_POLL)
        caplog.set_level(logging.WARNING, logger="cronoq_store")
        proxy.stall()
        # Polls unanswered for session_timeout count as an outage: reconnect and retry.
        await until(
            lambda: any("retrying" in r.getMessage() for r in caplog.records),
            "the stalled standby to log a retry",
        )
        assert not standby.done()
        proxy.forward()
        await a.release()
        assert await bounded(standby, "the standby's takeover after the release") == 2


async def test_slow_but_answering_session_keeps_leadership(
    make_leadership: LeadershipFactory, pg_url: URL
) -> None:
    async with TcpProxy.to(pg_url) as proxy:
        a = make_leadership("a", proxy.url(pg_url))
        await lead(a)
        # Round trips of 0.5 s: slower than keepalive but well within session_timeout.
        proxy.delay(0.25)
        await asyncio.sleep(3 * SESSION_TIMEOUT)
        assert a.is_leader
        proxy.forward()


async def test_epoch_wraps_at_32767(
    make_leadership: LeadershipFactory, pg_url: URL, migrated: str
) -> None:
    await admin_execute(pg_url, f'UPDATE "{migrated}".cronoq_leader SET epoch = 32766')
    a = make_leadership()
    assert await lead(a) == EPOCH_MAX
    await a.release()
    assert await lead(a) == 1
    rows = await admin_execute(pg_url, f'SELECT epoch FROM "{migrated}".cronoq_leader')
    assert [r[0] for r in rows] == [1]


async def test_reacquire_after_loss_takes_a_new_epoch(
    make_leadership: LeadershipFactory, pg_url: URL, migrated: str, lock_key: tuple[int, int]
) -> None:
    a = make_leadership("a")
    assert await lead(a) == 1
    first = await lock_holders(pg_url, lock_key)
    await terminate_backends(pg_url, leader_app(migrated, "a"))
    await bounded(a.wait_lost(), "the old leader to step down")

    assert await lead(a) == 2
    assert a.epoch == 2
    second = await lock_holders(pg_url, lock_key)
    assert len(second) == 1
    assert second[0][0] != first[0][0], "a new term runs on a new session"
    # Acquiring while leading starts a new term too.
    assert await lead(a) == 3


async def test_mark_lost_steps_down_and_frees_the_lock(
    make_leadership: LeadershipFactory, pg_url: URL, lock_key: tuple[int, int]
) -> None:
    a, b = make_leadership("a"), make_leadership("b")
    await lead(a)
    standby = asyncio.ensure_future(b.acquire())
    a.mark_lost()
    assert (a.is_leader, a.epoch) == (False, None)
    await bounded(a.wait_lost(), "wait_lost() after mark_lost()")
    # The keeper closes the session at its next wake-up, which releases the lock.
    assert await bounded(standby, "the standby's takeover after mark_lost()") == 2
    assert len(await lock_holders(pg_url, lock_key)) == 1


async def test_acquisition_retries_while_the_server_is_down(
    make_leadership: LeadershipFactory,
    pg_server: ServerUnderTest,
    pg_url: URL,
    caplog: pytest.LogCaptureFixture,
) -> None:
    if pg_server.kind != "embedded":
        pytest.skip("needs a server the suite can stop and start on the same port")
    a = make_leadership()
    caplog.set_level(logging.INFO, logger="cronoq_store")
    pg_server.stop()
    try:
        attempt = asyncio.ensure_future(a.acquire())
        await holds_for(lambda: not attempt.done(), "acquire() pending with no server", 1.0)
    finally:
        await asyncio.to_thread(pg_server.start)
    assert await bounded(attempt, "the leadership once the server is back") == 1
    assert a.is_leader

    retries = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert retries, "each failed attempt is logged"
    assert all("retrying" in r.getMessage() for r in retries)
    assert getattr(retries[0], "url", "").startswith("postgresql+asyncpg://")
    password = pg_url.password
    assert password
    for record in caplog.records:
        assert str(password) not in str(record.__dict__)


@pytest.mark.slow
async def test_after_an_outage_a_standby_leads_within_lock_poll_of_the_servers_return(
    make_leadership: LeadershipFactory, pg_server: ServerUnderTest, caplog: pytest.LogCaptureFixture
) -> None:
    """A standby never pauses longer than ``lock_poll`` between attempts to reach the
    database, so a long outage cannot push the election past ``session_timeout + lock_poll``
    of the server's return (a doubling backoff would be at seconds by then)."""
    if pg_server.kind != "embedded":
        pytest.skip("needs a server the suite can stop and start on the same port")
    outage = 60 * LOCK_POLL
    loop = asyncio.get_running_loop()
    a, b = make_leadership("a"), make_leadership("b")
    assert await lead(a) == 1
    standby = asyncio.ensure_future(b.acquire())
    await asyncio.sleep(4 * LOCK_POLL)
    caplog.set_level(logging.WARNING, logger="cronoq_store")
    await asyncio.to_thread(pg_server.stop, "fast")
    try:
        await bounded(a.wait_lost(), "the old leader to step down")
        await asyncio.sleep(outage)
        assert not standby.done()
    finally:
        await asyncio.to_thread(pg_server.start)
    back = loop.time()  # pg_ctl's return: the server accepted a poll interval earlier
    assert await bounded(standby, "the standby's election after the outage") == 2
    elected = loop.time() - back
    # The bound, with slack for two busy cores. Measured: the standby usually leads before
    # pg_ctl returns; a doubling backoff capped at 5 s came 3.3 s after it.
    assert elected < SESSION_TIMEOUT + LOCK_POLL + 0.5, elected

    pauses = [
        float(getattr(r, "retry_in"))  # noqa: B009 (an `extra` field of the record)
        for r in caplog.records
        if "acquire leadership" in r.getMessage()
    ]
    assert len(pauses) >= outage / LOCK_POLL / 2, "a standby keeps trying through the outage"
    assert max(pauses) <= LOCK_POLL


async def test_lock_never_rides_on_an_app_pool_connection(
    make_leadership: LeadershipFactory, pg_url: URL, migrated: str, lock_key: tuple[int, int]
) -> None:
    app_name = f"app-{migrated}"
    app = create_async_engine(
        async_url(pg_url), connect_args={"server_settings": {"application_name": app_name}}
    )
    try:
        # Use several pool connections, return them, and lead from the same server URL.
        async def backend_pid() -> int:
            async with app.connect() as conn:
                await asyncio.sleep(0.05)
                return int((await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one())

        app_pids = set(await asyncio.gather(*(backend_pid() for _ in range(3))))
        assert app.pool.checkedout() == 0  # type: ignore[attr-defined]
        a = make_leadership("a")
        await lead(a)
        async with app.connect() as conn:
            await conn.execute(text("SELECT 1"))

        rows = await admin_execute(
            pg_url, "SELECT pid FROM pg_stat_activity WHERE application_name = $1", app_name
        )
        app_pids |= {r[0] for r in rows}
        holders = await lock_holders(pg_url, lock_key)
        assert [app for _, app in holders] == [leader_app(migrated, "a")]
        assert holders[0][0] not in app_pids
    finally:
        await app.dispose()
    assert a.is_leader
    assert len(await lock_holders(pg_url, lock_key)) == 1


async def test_unmigrated_schema_is_an_error_not_a_retry(
    pg_url: URL, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="cronoq_store")
    await admin_execute(pg_url, f'CREATE SCHEMA "{schema}"')
    rows = await admin_execute(pg_url, "SELECT $1::regnamespace::oid::bigint", schema)
    a = Leadership(
        async_url(pg_url),
        schema,
        (st.LOCK_NS_LEADER, rows[0][0]),
        instance_config(schema, "a"),
        incarnation=0,  # no leader table: no cluster
    )
    try:
        with pytest.raises(StoreError) as info:
            await bounded(a.acquire(), "acquire() on an unmigrated schema")
        assert not info.value.is_transient
        assert info.value.__cause__ is not None
        assert not a.is_leader
        assert caplog.records == []
    finally:
        await a.close()


async def test_close_stops_a_pending_acquisition(make_leadership: LeadershipFactory) -> None:
    a, b = make_leadership("a"), make_leadership("b")
    await lead(a)
    standby = asyncio.ensure_future(b.acquire())
    await asyncio.sleep(4 * LOCK_POLL)
    await bounded(b.close(), "close() of a store acquiring")
    with pytest.raises(StoreError, match="closed"):
        await standby
    assert a.is_leader
    with pytest.raises(StoreError, match="closed"):
        await lead(b)


async def test_release_right_after_acquire_frees_the_lock(pg_url: URL, migrated: str) -> None:
    config = ha_config(migrated)
    async with (
        await PgStore.connect(pg_url, config) as first,
        await PgStore.connect(pg_url, config) as second,
    ):
        for expected in (1, 3, 5):
            assert await first.acquire_leadership() == expected
            await first.release_leadership()
            gc.collect()  # a leaked session would be reclaimed here, with a warning (an error)
            taking = bounded(second.acquire_leadership(), "the lock released by the first")
            assert await taking == expected + 1
            await second.release_leadership()


async def test_a_session_stalled_mid_transaction_cannot_hold_up_a_takeover(
    pg_url: URL, migrated: str
) -> None:
    # As a leader frozen between two statements of a commit: its pooled session holds the
    # leader row lock, which the next epoch bump needs.
    stalled_config = PgStoreConfig(
        schema=migrated, lock_poll=0.05, keepalive=0.2, session_timeout=1.0
    )
    async with await PgStore.connect(pg_url, stalled_config) as stalled:
        conn = await stalled.engine.connect()
        try:
            await conn.begin()
            await conn.execute(text(f'SELECT epoch FROM "{migrated}".cronoq_leader FOR UPDATE'))
            idle_since = time.monotonic()
            async with await PgStore.connect(pg_url, PgStoreConfig(schema=migrated)) as standby:
                # Held for ever, the row lock would keep the standby waiting: the bound is
                # how long the test takes to say so.
                await bounded(
                    standby.acquire_leadership(),
                    "the takeover past a session stalled holding the leader row",
                    STALLED_WITHIN,
                )
                led = time.monotonic()
            # The server ended the idle transaction after session_timeout (counted from the
            # stalled session's last statement), not before.
            assert led - idle_since > 0.9, led - idle_since
            with pytest.raises(DBAPIError) as caught:
                await conn.execute(text("SELECT 1"))
            assert translate_error(caught.value, "using the stalled session").is_transient
        finally:
            await conn.close()


# --- the lock session connects the way the application's engine does -----------------------


def app_engine(kind: str, pg_url: URL, app_name: str) -> AsyncEngine:
    """An application's engine whose URL alone does not reach the server as it should."""
    right = async_url(pg_url)
    if kind == "async_creator":
        # The URL's port is wrong; only the creator knows the server.
        dsn = asyncpg_dsn(pg_url)
        return create_async_engine(
            right.set(port=unused_port()),
            async_creator=lambda: asyncpg.connect(
                dsn, server_settings={"application_name": app_name}
            ),
        )
    # work_mem: a setting the lock session does not set for itself.
    settings = {"application_name": app_name, "work_mem": "4321kB"}
    if kind == "connect_args_password":
        # The password travels in connect_args, not in the URL.
        return create_async_engine(
            right.set(password="not-the-password"),
            connect_args={"password": pg_url.password, "server_settings": settings},
        )
    assert kind == "connect_args_settings"
    return create_async_engine(right, connect_args={"server_settings": settings})


async def lock_session_setting(store: PgStore, name: str) -> str:
    """A setting as the lock session itself sees it (the keeper pings only every 2 s)."""
    session = leadership_of(store)._session
    assert session is not None
    return await session.setting(name, 5.0)


@pytest.mark.parametrize(
    "kind", ["async_creator", "connect_args_password", "connect_args_settings"]
)
async def test_from_engine_lock_session_connects_like_the_engine(
    pg_url: URL, migrated: str, kind: str
) -> None:
    app_name = f"app-{migrated}"
    engine = app_engine(kind, pg_url, app_name)
    cfg = PgStoreConfig(
        schema=migrated,
        lock_poll=LOCK_POLL,
        keepalive=2.0,
        session_timeout=4.0,
        application_name=app_name,
    )
    try:
        async with await PgStore.from_engine(engine, cfg) as store:
            epoch = await bounded(store.acquire_leadership(), "the leadership via the engine")
            assert epoch >= 1
            assert store.is_leader
            conns = [await engine.connect() for _ in range(3)]
            pool_pids = {
                (await c.execute(text("SELECT pg_backend_pid()"))).scalar_one() for c in conns
            }
            for conn in conns:
                await conn.close()
            holders = await lock_holders(pg_url, store.leader_lock)
            assert len(holders) == 1
            pid, application = holders[0]
            assert pid not in pool_pids  # a separate backend, not one of the app's
            assert application == f"{app_name} leader"
            assert await lock_session_setting(store, "search_path") == "pg_catalog, pg_temp"
            assert await lock_session_setting(store, "tcp_keepalives_idle") == "4"
            assert await lock_session_setting(store, "idle_session_timeout") == "6s"
            if kind != "async_creator":
                # The engine's own server settings came along.
                assert await lock_session_setting(store, "work_mem") == "4321kB"
            assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
        assert await lock_holders(pg_url, store.leader_lock) == []
    finally:
        await engine.dispose()


async def test_a_creator_that_cannot_connect_is_logged_not_a_silent_hang(
    pg_url: URL,
    migrated: str,
    lock_key: tuple[int, int],
    incarnation: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A port bound here and never listened on refuses every connection, and stays ours.
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dsn = asyncpg_dsn(pg_url.set(host="127.0.0.1", port=closed.getsockname()[1]))
    engine = create_async_engine(async_url(pg_url), async_creator=lambda: asyncpg.connect(dsn))
    caplog.set_level(logging.WARNING, logger="cronoq_store")
    leadership = Leadership(
        engine.url,
        migrated,
        lock_key,
        instance_config(migrated, "a"),
        incarnation=incarnation,
        pool=engine.sync_engine.pool.recreate(),
    )
    attempt = asyncio.ensure_future(leadership.acquire())
    try:
        await until(
            lambda: any("acquire leadership" in r.getMessage() for r in caplog.records),
            "a warning that acquire_leadership retries",
        )
        assert not attempt.done()
    finally:
        attempt.cancel()
        await asyncio.gather(attempt, return_exceptions=True)
        await leadership.close()
        await engine.dispose()
        closed.close()
    warnings = [r for r in caplog.records if "acquire leadership" in r.getMessage()]
    assert warnings, "acquire_leadership retried without saying why"
    assert warnings[0].via == "the engine's connection creator"  # type: ignore[attr-defined]
    assert "ConnectionRefusedError" in warnings[0].error  # type: ignore[attr-defined]
    assert str(pg_url.password) not in warnings[0].url  # type: ignore[attr-defined]
