"""Only a fence of the current epoch ends the current term.

A commit stamped with an earlier term's epoch can reach the server after this instance
began a new term: a ``PgStore.commit`` call, or a ``GroupCommitter`` of the earlier term,
already past the store's own checks and on its way (here: dialling the pool's connection,
held back until the new term began). The server fences it, and nothing of it is written;
the new term goes on leading and committing, and no standby takes over. (The contract
suite covers a late commit that arrives once the new term began, for every store.)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg
import pytest
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from cronoq_store import (
    FencedError,
    GroupCommitter,
    PgStore,
    PgStoreConfig,
    task_id,
)
from cronoq_store._urls import async_url

from .pgharness import asyncpg_dsn
from .support import PROCESS_BASE, stored_ids, submitted_in
from .waits import PATIENCE


@dataclass
class Dialling:
    """An application's engine whose new connections wait for ``gate`` (a slow network);
    ``entered`` is set when one starts dialling."""

    engine: AsyncEngine
    gate: asyncio.Event
    entered: asyncio.Event

    async def hold_back(self) -> None:
        """From now on, the next connection the pool makes waits for :attr:`gate`: the
        pool's connections are closed, and the gate shut."""
        await self.engine.dispose()
        self.gate.clear()
        self.entered.clear()


@pytest.fixture
async def dialling(pg_url: URL) -> AsyncIterator[Dialling]:
    gate, entered = asyncio.Event(), asyncio.Event()
    gate.set()
    dsn = asyncpg_dsn(pg_url)

    async def creator() -> asyncpg.Connection:
        entered.set()
        await gate.wait()
        return await asyncpg.connect(dsn)

    engine = create_async_engine(async_url(pg_url), async_creator=creator)
    try:
        yield Dialling(engine, gate, entered)
    finally:
        gate.set()
        await engine.dispose()


async def open_store(dialling: Dialling, pg_url: URL, schema: str, name: str) -> PgStore:
    """A store on the dialling engine; its lock session dials the server itself."""
    config = PgStoreConfig(schema=schema, application_name=name, lock_poll=0.05)
    return await PgStore.from_engine(dialling.engine, config, lock_url=pg_url)


async def test_a_commit_of_the_earlier_term_reaching_the_server_late_leaves_the_term_going(
    pg_url: URL, migrated: str, dialling: Dialling
) -> None:
    async with (
        await open_store(dialling, pg_url, migrated, f"late-a-{migrated}") as a,
        await open_store(dialling, pg_url, migrated, f"late-b-{migrated}") as b,
    ):
        earlier = await a.acquire_leadership()
        await dialling.hold_back()
        late = asyncio.ensure_future(
            a.commit(earlier, PROCESS_BASE, [submitted_in(earlier, 0)], [])
        )
        await asyncio.wait_for(dialling.entered.wait(), PATIENCE)  # past the store's checks

        await a.release_leadership()
        current = await a.acquire_leadership()
        standby = asyncio.ensure_future(b.acquire_leadership())
        lost = asyncio.ensure_future(a.leadership_lost())
        dialling.gate.set()
        with pytest.raises(FencedError, match=f"stored epoch is {current}"):
            await asyncio.wait_for(late, PATIENCE)

        assert (a.is_leader, a.epoch) == (True, current)
        await a.commit(current, PROCESS_BASE, [submitted_in(current, 0)], [])
        assert await stored_ids(pg_url, migrated) == [task_id(current, 0)]
        assert not lost.done()
        assert not standby.done()
        lost.cancel()
        standby.cancel()


async def test_a_group_committer_of_the_earlier_term_is_fenced_alone(
    pg_url: URL, migrated: str, dialling: Dialling
) -> None:
    """The earlier term's committer is fenced (it must never write again) and fails its
    submitters; the store's current term, and its own committer, go on."""
    async with (
        await open_store(dialling, pg_url, migrated, f"lategc-a-{migrated}") as a,
        await open_store(dialling, pg_url, migrated, f"lategc-b-{migrated}") as b,
    ):
        earlier = await a.acquire_leadership()
        old = GroupCommitter(a, earlier, PROCESS_BASE)
        await dialling.hold_back()
        pending = asyncio.ensure_future(old.submit([submitted_in(earlier, 0)]))
        await asyncio.wait_for(dialling.entered.wait(), PATIENCE)  # its batch is in flight

        await a.release_leadership()
        current = await a.acquire_leadership()
        standby = asyncio.ensure_future(b.acquire_leadership())
        dialling.gate.set()
        with pytest.raises(FencedError):
            await asyncio.wait_for(pending, PATIENCE)
        assert old.fenced
        await old.close()

        assert (a.is_leader, a.epoch) == (True, current)
        async with GroupCommitter(a, current, PROCESS_BASE) as new:
            await asyncio.wait_for(new.submit([submitted_in(current, 0)]), PATIENCE)
        assert await stored_ids(pg_url, migrated) == [task_id(current, 0)]
        assert a.is_leader
        assert not standby.done()
        standby.cancel()
