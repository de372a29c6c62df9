"""``PgHost.close`` racing the rest of the host's life in one process: a second close, a
close whose caller gives up, a lead slower than ``session_timeout`` to return, an enrolment
under way, a registration or a claim under way, a serve after it, an application still
using a borrowed engine. After each, what a user counts on once ``close`` returned: no
server session of the host left (its pool's or its host session's), no cluster owned by
its process in the control schema, the process marked left, and nothing asyncio reports
about a task left pending or an exception nobody retrieved."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store import StoreError
from cronoq_store._host.host import HostedStore, PgHost
from cronoq_store._urls import async_url

from ..pgharness import admin_execute, asyncpg_dsn
from ..waits import until, until_value
from .conftest import Fleet
from .hosts import STORE, commit_one, config, enrolled, serving_until_it_waits_on_a_lock

#: Seconds beyond what a close waits for by design (``handover_grace``, a statement under
#: way) that it may take on a loaded machine.
MARGIN = 5.0


async def host_sessions(fleet: Fleet, name: str) -> list[str]:
    """The server sessions of the host named ``name``: its pool's, named ``name``, and its
    host session, ``name leader <instance>``."""
    rows = await admin_execute(
        fleet.url,
        "SELECT application_name, state FROM pg_stat_activity "
        "WHERE application_name = $1 OR application_name LIKE $2",
        name,
        f"{name} leader %",
    )
    return [f"{r['application_name']} ({r['state']})" for r in rows]


async def no_session_left(fleet: Fleet, name: str) -> None:
    """Every server session of the host gone: the backend of a closed socket exits at once,
    a session left open stays."""
    await until_value(
        lambda: host_sessions(fleet, name), lambda found: found == [], f"{name}'s sessions gone"
    )


async def process_state(fleet: Fleet, process_id: int) -> str:
    rows = await admin_execute(
        fleet.url,
        f'SELECT state FROM "{fleet.control}".processes WHERE process_id = $1',
        process_id,
    )
    return str(rows[0]["state"])


async def left_the_group(fleet: Fleet, process_id: int) -> None:
    """The control schema as a closed process leaves it: nothing owned, marked left."""
    owned = [s for s, owner in (await fleet.owners()).items() if owner == process_id]
    assert owned == [], f"clusters still owned by closed process {process_id}: {owned}"
    assert await process_state(fleet, process_id) == "left"


@pytest.fixture
async def loop_reports() -> AsyncIterator[Callable[[], list[str]]]:
    """What asyncio reports through the loop's exception handler ("Task was destroyed but
    it is pending", "Future exception was never retrieved", ...), read after a collection."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: seen.append(context))

    def reports() -> list[str]:
        gc.collect()
        return [str(context.get("message")) for context in seen]

    yield reports
    loop.set_exception_handler(previous)


async def leading(host: PgHost, lead: Callable[[HostedStore], Awaitable[None]], n: int) -> Any:
    """``host`` serving with ``lead`` once it leads ``n`` clusters; the serving task."""
    task = asyncio.ensure_future(host.serve(lead))
    await until(lambda: len(host.led()) == n, f"the host to lead {n} clusters")
    return task


async def test_close_called_twice_at_once_returns_once_the_host_left(
    fleet: Fleet, loop_reports: Callable[[], list[str]]
) -> None:
    """Two closes at once (a signal handler's and an ``async with``'s): each returns once
    the clusters are handed over and the process left, never at once while the first is
    still handing over (its caller would exit with the clusters owned, the tasks pending)."""
    schemas = fleet.clusters(2)
    await enrolled(fleet, schemas)
    host = await PgHost.connect(fleet.url, config(fleet, "twice", handover_grace=5.0))

    async def lead(store: HostedStore) -> None:
        await store.leadership_lost()
        await asyncio.sleep(1.0)  # the application drains before returning

    serving = await leading(host, lead, 2)
    process_id = host.process_id
    assert process_id is not None
    first = asyncio.ensure_future(host.close())
    await asyncio.sleep(0)
    await host.close()
    await left_the_group(fleet, process_id)
    await asyncio.wait({first, serving})
    await no_session_left(fleet, "twice")
    assert loop_reports() == []


async def test_a_close_whose_caller_gives_up_still_closes_the_host(
    fleet: Fleet, loop_reports: Callable[[], list[str]]
) -> None:
    """A close whose caller stops waiting (``wait_for`` on shutdown) still hands every
    cluster over and closes the pool: nothing else would, and a later close found nothing
    left to wait for."""
    schemas = fleet.clusters(2)
    await enrolled(fleet, schemas)
    host = await PgHost.connect(fleet.url, config(fleet, "impatient", handover_grace=1.5))

    async def lead(store: HostedStore) -> None:
        await store.leadership_lost()
        await asyncio.sleep(1.0)

    serving = await leading(host, lead, 2)
    process_id = host.process_id
    assert process_id is not None
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(host.close(), 0.2)
    await asyncio.wait({serving})
    await no_session_left(fleet, "impatient")
    await left_the_group(fleet, process_id)
    assert loop_reports() == []


async def test_a_lead_slower_than_session_timeout_to_return_is_handed_over_at_close(
    fleet: Fleet, caplog: pytest.LogCaptureFixture, loop_reports: Callable[[], list[str]]
) -> None:
    """A close waits up to ``handover_grace`` for the leads to return (the defaults give it
    as long as ``session_timeout``); a lead that takes it all, ignoring its cancellation
    besides, must not cost the host session: its clusters are then released and the process
    leaves, where a session timed out would leave them owned by a dead process."""
    caplog.set_level(logging.INFO, "cronoq_store")
    grace = STORE.session_timeout + 1.5
    schemas = fleet.clusters(2)
    await enrolled(fleet, schemas)
    host = await PgHost.connect(fleet.url, config(fleet, "stubborn", handover_grace=grace))
    unstick = asyncio.Event()

    async def lead(store: HostedStore) -> None:
        await store.leadership_lost()
        while not unstick.is_set():
            # A cleanup that outlives its cancellation.
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(unstick.wait(), 1)

    serving = await leading(host, lead, 2)
    process_id = host.process_id
    assert process_id is not None
    started = time.monotonic()
    try:
        await host.close()
        took = time.monotonic() - started
        assert took < grace + MARGIN, f"close took {took:.1f} s (handover_grace {grace} s)"
        await left_the_group(fleet, process_id)
        lost = [r.getMessage() for r in caplog.records if "session lost" in r.getMessage()]
        assert lost == []
        await no_session_left(fleet, "stubborn")
    finally:
        unstick.set()
        await asyncio.wait({serving})
    assert loop_reports() == []


async def test_an_enrolment_under_way_when_the_host_closes_leaves_no_session(
    fleet: Fleet, loop_reports: Callable[[], list[str]]
) -> None:
    """Enrolling a list while the host closes: the enrolment ends (done, or refused as
    closed) and no session of the pool stays open. A connection taken after the pool was
    disposed would come from a new pool that nothing closes."""
    schemas = fleet.clusters(6)
    host = await PgHost.connect(fleet.url, config(fleet, "enrolling"))
    enrolling = asyncio.ensure_future(host.enroll(schemas))

    async def migrated() -> int:
        rows = await admin_execute(
            fleet.url,
            "SELECT count(*) AS n FROM pg_namespace WHERE nspname LIKE $1",
            f"{fleet.prefix}%",
        )
        return int(rows[0]["n"])

    await until_value(migrated, lambda n: n >= 2, "the enrolment to be under way")
    await host.close()
    await asyncio.wait({enrolling})
    failure = enrolling.exception()
    assert failure is None or isinstance(failure, StoreError), repr(failure)
    await no_session_left(fleet, "enrolling")
    assert loop_reports() == []


async def test_a_close_during_registration_leaves_nothing(
    fleet: Fleet, loop_reports: Callable[[], list[str]]
) -> None:
    """A close while ``serve`` registers the process (its row's insert waits on a lock
    here), before the host session is there: once the registration ends, the process leaves
    and its session closes; the close returns within the registration's bound."""
    schemas = fleet.clusters(1)
    await enrolled(fleet, schemas)
    host = await PgHost.connect(fleet.url, config(fleet, "registering"))
    blocker = await asyncpg.connect(asyncpg_dsn(fleet.url))
    try:
        await blocker.execute("BEGIN")
        await blocker.execute(f'LOCK TABLE "{fleet.control}".processes IN EXCLUSIVE MODE')

        serving = await serving_until_it_waits_on_a_lock(
            fleet, host, "registering", "the registration to wait for the processes table"
        )
        assert host.process_id is None
        started = time.monotonic()
        closing = asyncio.ensure_future(host.close())
        await asyncio.sleep(0.2)
        await blocker.execute("ROLLBACK")
        await asyncio.wait({closing, serving})
        took = time.monotonic() - started
        assert closing.exception() is None
        assert took < STORE.session_timeout + MARGIN, f"close took {took:.1f} s"
    finally:
        await blocker.close()
    await no_session_left(fleet, "registering")
    assert await fleet.owners() == {schemas[0]: None}
    rows = await admin_execute(
        fleet.url, f"SELECT state FROM \"{fleet.control}\".processes WHERE state <> 'left'"
    )
    assert [dict(r) for r in rows] == []
    assert loop_reports() == []


async def test_a_close_during_a_claim_hands_over_what_it_claimed(
    fleet: Fleet, loop_reports: Callable[[], list[str]]
) -> None:
    """A close while a claim waits for a leader table a session holds: the claim ends
    within its bound, and whatever it gained is handed over before the close returns."""
    schemas = fleet.clusters(3)
    await enrolled(fleet, schemas)
    host = await PgHost.connect(fleet.url, config(fleet, "claiming"))
    blocker = await asyncpg.connect(asyncpg_dsn(fleet.url))
    try:
        await blocker.execute("BEGIN")
        await blocker.execute(f'SELECT epoch FROM "{schemas[1]}".cronoq_leader FOR SHARE')

        serving = await serving_until_it_waits_on_a_lock(
            fleet, host, "claiming", "a claim to wait for the held leader table"
        )
        process_id = host.process_id
        assert process_id is not None
        started = time.monotonic()
        await host.close()
        took = time.monotonic() - started
        assert took < STORE.session_timeout + MARGIN, f"close took {took:.1f} s"
        await left_the_group(fleet, process_id)
        await asyncio.wait({serving})
    finally:
        await blocker.close()
    await no_session_left(fleet, "claiming")
    assert loop_reports() == []


async def test_serve_and_enroll_after_close_are_refused_and_open_nothing(fleet: Fleet) -> None:
    """After a close, ``serve`` and ``enroll`` raise instead of opening a pool anew."""
    host = await PgHost.connect(fleet.url, config(fleet, "reopened"))
    await host.close()

    async def lead(store: HostedStore) -> None:
        await store.leadership_lost()

    with pytest.raises(StoreError, match="closed"):
        await host.serve(lead)
    with pytest.raises(StoreError, match="closed"):
        await host.enroll(fleet.clusters(1))
    await host.close()
    await no_session_left(fleet, "reopened")


async def test_a_host_on_a_borrowed_engine_closes_while_the_application_uses_it(
    fleet: Fleet, loop_reports: Callable[[], list[str]]
) -> None:
    """A host on the application's engine closes while the application keeps querying on
    it: the host session closes, the clusters are handed over, and the engine goes on,
    with none of its connections left checked out by the host."""
    schemas = fleet.clusters(2)
    await enrolled(fleet, schemas)
    app = create_async_engine(
        async_url(fleet.url),
        pool_size=4,
        max_overflow=0,
        connect_args={"server_settings": {"application_name": "borrowing app"}},
    )
    stop = asyncio.Event()
    queries = 0

    async def use() -> None:
        nonlocal queries
        while not stop.is_set():
            async with app.connect() as conn:
                await conn.execute(text("SELECT pg_sleep(0.01)"))
            queries += 1

    users = [asyncio.ensure_future(use()) for _ in range(2)]
    try:
        host = await PgHost.from_engine(app, config(fleet, "borrowing", handover_grace=2.0))

        async def lead(store: HostedStore) -> None:
            await commit_one(store, 1)
            await store.leadership_lost()
            await asyncio.sleep(0.5)

        serving = await leading(host, lead, 2)
        process_id = host.process_id
        assert process_id is not None
        await host.close()
        await asyncio.wait({serving})
        await left_the_group(fleet, process_id)
        await no_session_left(fleet, "borrowing")
        before = queries
        await until(lambda: queries > before + 5, "the application to go on querying")
    finally:
        stop.set()
        await asyncio.gather(*users)
        assert app.sync_engine.pool.checkedout() == 0  # type: ignore[attr-defined]
        await app.dispose()
    assert loop_reports() == []
