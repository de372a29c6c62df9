"""A host process given more clusters than its event loop serves keeps its host session and
the clusters it can carry, instead of losing every one with the session and taking them all
back at once, for ever; its claims follow what it gained and what it still recovers
(cronoq_store/_host/pace.py)."""

from __future__ import annotations

import asyncio
import logging
import time

import asyncpg
import pytest

from cronoq_store import TimeBase
from cronoq_store._host.host import HostedStore, PgHost
from cronoq_store._host.pace import ClaimPace
from cronoq_store._host.session import HostSession
from cronoq_store._statements import LOCK_NS_LEADER

from ..pgharness import asyncpg_dsn
from ..waits import holds_for, until
from .conftest import Fleet
from .hosts import config, enrolled, serving

#: How long each led cluster's lead yields between two holds of the event loop.
EVERY = 0.2
CLUSTERS = 40


class Load:
    """Leads that each hold the event loop ``hold`` seconds every ``EVERY``: the work a
    cluster brings. A sleep, not CPU: the loop is held as long on a loaded machine."""

    def __init__(self, hold: float) -> None:
        self.hold = hold

    async def lead(self, store: HostedStore) -> None:
        lost = asyncio.ensure_future(store.leadership_lost())
        while not lost.done():
            hold_the_loop(self.hold)
            await asyncio.wait({lost}, timeout=EVERY)


async def test_a_host_given_more_than_its_loop_serves_keeps_its_session_and_a_share(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "cronoq_store")
    host = await PgHost.connect(fleet.url, config(fleet, "overload"))
    registrations: set[int] = set()
    # Forty such clusters hold a loop iteration for two seconds, the host session's whole
    # bound (session_timeout); ten, half a second.
    load = Load(0.05)
    try:
        await host.enroll(fleet.clusters(CLUSTERS))
        serving_task = asyncio.ensure_future(host.serve(load.lead))
        deadline = time.monotonic() + 12
        while time.monotonic() < deadline:
            if host.process_id is not None:
                registrations.add(host.process_id)
            await asyncio.sleep(0.05)
        led = len(host.led())
    finally:
        load.hold = 0.0  # closing is not under test: it need not wait on the load
        await host.close()
        await asyncio.wait({serving_task})
    assert len(registrations) == 1, f"the host session was lost: ids {sorted(registrations)}"
    # It carries some (its first window, 16, holds each iteration 0.8 s) and said why it
    # took no more.
    assert 1 <= led < CLUSTERS
    late = [r for r in caplog.records if "event loop runs late" in r.getMessage()]
    assert late


async def test_rounds_that_gain_nothing_do_not_open_the_claim_window(fleet: Fleet) -> None:
    """Clusters chosen round after round and not won (a standalone leader holds each lock):
    once they can be had, the first round that gains takes one window, not all."""
    schemas = fleet.clusters(24)
    await enrolled(fleet, schemas)
    squatter = await asyncpg.connect(asyncpg_dsn(fleet.url))
    gains: list[int] = []
    try:
        for schema in schemas:
            await squatter.execute(
                "SELECT pg_advisory_lock($1, to_regnamespace(quote_ident($2))::int)",
                LOCK_NS_LEADER,
                schema,
            )
        async with serving(fleet.url, config(fleet, "inflate")) as served:
            host = served.host
            real = host._claim

            async def spy(session: HostSession, schemas: list[str]) -> int:
                gained = await real(session, schemas)
                gains.append(gained)
                return gained

            host._claim = spy  # type: ignore[method-assign]
            await until(lambda: len(gains) >= 8, "eight rounds that gained nothing")
            assert not host.led()
            await squatter.execute("SELECT pg_advisory_unlock_all()")
            await until(lambda: len(host.led()) == len(schemas), "every cluster led")
    finally:
        await squatter.close()
    first = next(g for g in gains if g)
    assert first == 16, f"gains per round: {gains}"


async def test_claims_follow_the_recoveries(fleet: Fleet) -> None:
    """Every recovery stuck behind an operator's lock: the process claims two windows'
    worth (16, then 16 more while those recover), then waits for recoveries to end."""
    schemas = fleet.clusters(40)
    await enrolled(fleet, schemas)
    blocker = await asyncpg.connect(asyncpg_dsn(fleet.url))
    ended: list[str] = []

    async def lead(store: HostedStore) -> None:
        try:
            await store.recover(TimeBase.now())
        finally:
            ended.append(store.config.schema)
        await store.leadership_lost()

    host = await PgHost.connect(fleet.url, config(fleet, "recovering"))
    serving_task: asyncio.Future[None] | None = None
    try:
        await blocker.execute("BEGIN")
        for schema in schemas:
            await blocker.execute(f'LOCK TABLE "{schema}".cronoq_tasks IN ACCESS EXCLUSIVE MODE')
        serving_task = asyncio.ensure_future(host.serve(lead))
        await until(lambda: len(host.led()) >= 32, "two windows claimed")
        # Recoveries wait for the lock up to commit_timeout (10 s): none ends meanwhile.
        await holds_for(
            lambda: len(host.led()) == 32 and not ended,
            "no more claims while 32 recoveries wait",
            duration=3,
        )
    finally:
        await blocker.execute("ROLLBACK")
        await blocker.close()
        await host.close()
        if serving_task is not None:
            await asyncio.wait({serving_task})


def test_the_next_round_claims_twice_what_the_last_gained_less_what_still_recovers() -> None:
    pace = ClaimPace(session_timeout=10.0, smallest=16, largest=1024)
    assert pace.allowance(recovering=0) == 16
    pace.gained(16)
    assert pace.allowance(recovering=0) == 32
    pace.gained(600)
    assert pace.allowance(recovering=0) == 1024
    assert pace.allowance(recovering=1000) == 24  # recoveries waiting are claims made
    pace.gained(3)  # few to be had: the next round starts small again
    assert pace.allowance(recovering=0) == 16
    pace.gained(0)
    assert pace.allowance(recovering=20) == 0
    pace.gained(40)
    pace.restart()
    assert pace.allowance(recovering=0) == 16


def test_a_late_loop_claims_nothing_until_it_catches_up(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "cronoq_store")
    pace = ClaimPace(session_timeout=10.0, smallest=16, largest=1024)
    pace.gained(100)
    pace.woke(0.5)
    assert pace.allowance(recovering=0) == 200  # late, not a tenth of session_timeout
    pace.woke(0.2)
    pace.woke(1.0)
    assert pace.allowance(recovering=0) == 0
    assert pace.allowance(recovering=0) == 16  # caught up: from the smallest window
    said = [r.getMessage() for r in caplog.records]
    assert [m for m in said if "runs late" in m]
    assert [m for m in said if "caught up" in m]


async def test_a_claim_stops_between_batches_once_the_loop_lags() -> None:
    pace = ClaimPace(session_timeout=1.0, smallest=16, largest=1024)
    assert not await pace.lagging()
    asyncio.get_running_loop().call_soon(hold_the_loop, 0.2)
    assert await pace.lagging()
    assert pace.allowance(recovering=0) == 0


def hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)
