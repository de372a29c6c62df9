"""A host process given more clusters than its event loop serves keeps its host session and
the clusters it can carry, instead of losing every one with the session and taking them all
back at once, for ever (cronoq_store/_host/pace.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import pytest

from cronoq_store import PgStoreConfig
from cronoq_store._host.host import HostedStore, PgHost
from cronoq_store._host.pace import OVERLOADED_STREAK, ClaimPace, Round

from ..waits import until, until_value
from .conftest import Fleet
from .hosts import config

#: How long each led cluster's lead yields between two holds of the event loop.
EVERY = 0.2
CLUSTERS = 40


class Load:
    """Leads that each hold the event loop ``hold`` seconds every ``EVERY``: the work a
    cluster brings. A sleep, not CPU: the loop is held as long on a loaded machine."""

    def __init__(self, hold: float) -> None:
        self.hold = hold

    def _work(self) -> None:
        time.sleep(self.hold)

    async def lead(self, store: HostedStore) -> None:
        lost = asyncio.ensure_future(store.leadership_lost())
        while not lost.done():
            self._work()
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
        serving = asyncio.ensure_future(host.serve(load.lead))
        deadline = time.monotonic() + 12
        while time.monotonic() < deadline:
            if host.process_id is not None:
                registrations.add(host.process_id)
            await asyncio.sleep(0.05)
        led = len(host.led())
    finally:
        load.hold = 0.0  # closing is not under test: it need not wait on the load
        await host.close()
        await asyncio.wait({serving})
    assert len(registrations) == 1, f"the host session was lost: ids {sorted(registrations)}"
    # It carries some (a loop iteration of a quarter of session_timeout is ten clusters)
    # and said why it took no more.
    assert 1 <= led < CLUSTERS
    late = [r for r in caplog.records if "event loop runs late" in r.getMessage()]
    assert late


async def test_a_host_whose_loop_stays_late_hands_clusters_over(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    """Clusters claimed while the loop kept up, then each costing more (their commits grew):
    the host hands some over before its session could be lost with all of them."""
    caplog.set_level(logging.INFO, "cronoq_store")
    quick = PgStoreConfig(lock_poll=0.1, keepalive=0.3, session_timeout=1.0, commit_timeout=10.0)
    host = await PgHost.connect(fleet.url, replace(config(fleet, "shed"), store=quick))
    load = Load(0.0)

    try:
        await host.enroll(fleet.clusters(8))
        serving = asyncio.ensure_future(host.serve(load.lead))
        await until(lambda: len(host.led()) == 8, "the host leading its eight clusters")
        # Eight clusters now hold each loop iteration for half of session_timeout.
        load.hold = 0.06
        shed = await until_value(lambda: handed_over(caplog), bool, "clusters handed over")
    finally:
        load.hold = 0.0
        await host.close()
        await asyncio.wait({serving})
    assert shed[0].__dict__["clusters"] == 1  # an eighth of eight
    assert shed[0].__dict__["late_seconds"] >= 0.25  # a quarter of session_timeout


def handed_over(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "stays late; handing clusters over" in r.getMessage()]


def test_the_claim_window_doubles_while_claims_keep_up_and_closes_when_the_loop_lags() -> None:
    pace = ClaimPace(session_timeout=10.0, smallest=16, largest=1024)
    # Rounds that claim nothing (a process waiting out join_settle) do not open it.
    assert [pace.look().claims for _ in range(3)] == [16, 16, 16]
    assert [pace.claiming(recovering=0) for _ in range(4)] == [16, 32, 64, 128]
    # Recoveries still waiting are claims already made.
    assert pace.claiming(recovering=200) == 56
    pace.woke(1.0)  # a tenth of session_timeout
    assert pace.look() == Round(0, False, 1.0)
    # Once caught up, it starts from the smallest window again.
    assert pace.look().claims == 16
    assert [pace.claiming(recovering=0) for _ in range(2)] == [16, 32]
    pace.restart()
    assert pace.claiming(recovering=0) == 16


def test_only_a_lasting_lag_hands_clusters_over() -> None:
    pace = ClaimPace(session_timeout=10.0, smallest=16, largest=1024)
    pace.woke(3.0)
    assert pace.look() == Round(0, False, 3.0)
    pace.woke(0.5)
    pace.woke(1.0)
    assert pace.look() == Round(0, False, 1.0)  # late, not a quarter of session_timeout
    for _ in range(OVERLOADED_STREAK - 1):
        pace.woke(2.5)
        assert not pace.look().shed
    pace.woke(2.5)
    assert pace.look() == Round(0, True, 2.5)
    pace.woke(2.6)
    assert pace.look().shed  # each round that stays as late sheds more
    assert pace.look() == Round(16, False, 0.0)  # no wake-up was late: the streak ends
    pace.woke(2.5)
    assert not pace.look().shed


async def test_a_claim_stops_between_batches_once_the_loop_lags() -> None:
    pace = ClaimPace(session_timeout=1.0, smallest=16, largest=1024)
    assert not await pace.lagging()
    hog = asyncio.get_running_loop().call_soon(time.sleep, 0.2)
    assert await pace.lagging()
    assert pace.look().claims == 0
    hog.cancel()
