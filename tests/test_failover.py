"""Failover: of the PostgreSQL primary, and of a leader whose event loop is blocked.

**Primary failover**: a streaming standby is promoted and the store follows it.

Two store instances reach a primary and its standby through one multi-host URL that asks
for the writable host (``target_session_attrs=read-write``). The primary crashes
(``pg_ctl stop -m immediate``) while the leader commits; the standby is promoted. The
leader steps down (its lock session is gone), the other instance is elected on the new
primary with the next epoch, and recovery finds what the old leader acknowledged:

- with synchronous replication, all of it: a commit is acknowledged only once the standby
  has it;
- with asynchronous replication, only what the standby had received: a commit is
  acknowledged once the primary has it, so acknowledged work can be lost, and with it the
  epoch bump of a term the standby never saw, which is then issued a second time, task ids
  included.

**A blocked leader**: an instance blocks its event loop (``time.sleep``) for longer than
``session_timeout``; a standby takes over meanwhile, and the old leader's first commit
after waking is refused by the epoch check, with nothing written.

See docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import replace

import pytest
from sqlalchemy.engine import URL

from cronoq_store._committer import GroupCommitter
from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import (
    StatusChanged,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    TimeBase,
    task_id,
)
from cronoq_store._errors import FencedError, StoreError
from cronoq_store._statements import LOCK_NS_LEADER
from cronoq_store._store import PgStore

from .pgharness import admin_execute, without_instance
from .replication import (
    ReplicatedPostgres,
    multi_host_url,
    stores_on_a_replicated_pair,
)
from .support import PROCESS_BASE
from .waits import PATIENCE, bounded, until_value

pytestmark = pytest.mark.slow

SCHEMA = "failover"
LOCK_POLL, KEEPALIVE, SESSION_TIMEOUT = 0.1, 0.2, 1.0
RANK = {"queued": 0, "succeeded": 1}


def config(name: str) -> PgStoreConfig:
    return PgStoreConfig(
        schema=SCHEMA,
        lock_poll=LOCK_POLL,
        keepalive=KEEPALIVE,
        session_timeout=SESSION_TIMEOUT,
        commit_timeout=2.0,
        application_name=f"failover-{name}",
    )


class Driver:
    """A leader at work: submitters commit new tasks and finish older ones through a
    :class:`GroupCommitter`; ``acked`` maps each task to its last acknowledged state."""

    def __init__(self, store: PgStore, epoch: int) -> None:
        self.epoch = epoch
        self.committer = GroupCommitter(store, epoch, PROCESS_BASE)
        self.acked: dict[int, str] = {}
        self._numbers = itertools.count()
        self._submitters: list[asyncio.Task[None]] = []

    def start(self, submitters: int = 3) -> Driver:
        self._submitters = [asyncio.ensure_future(self._submit()) for _ in range(submitters)]
        return self

    async def _submit(self) -> None:
        mine: list[TaskId] = []
        while True:
            new = [task_id(self.epoch, next(self._numbers)) for _ in range(2)]
            batch: list[Submitted | StatusChanged] = [
                Submitted(i, i & 0xFFFF, PROCESS_BASE.engine_ns, TaskSpec(b"failover")) for i in new
            ]
            done = mine.pop(0) if len(mine) > 4 else None
            if done is not None:
                batch.append(StatusChanged(done, TaskStatus.SUCCEEDED, 1, time.monotonic_ns()))
            try:
                await self.committer.submit(batch)
            except StoreError:
                return  # fenced, or the committer closed: this leader is done
            for i in new:
                self.acked[i] = "queued"
            mine += new
            if done is not None:
                self.acked[done] = "succeeded"

    async def until(self, acked: int) -> None:
        await until_value(
            lambda: len(self.acked), lambda n: n >= acked, f"{acked} acknowledged tasks"
        )

    async def finished(self) -> None:
        """Wait for every submitter to give up on its own (fenced or closed)."""
        await bounded(
            asyncio.gather(*self._submitters), "the deposed leader's submitters to give up"
        )
        await self.committer.close(drain=False)

    async def stop(self) -> None:
        for task in self._submitters:
            task.cancel()
        await asyncio.wait(self._submitters)
        await self.committer.close()


async def stored_states(url: URL) -> dict[int, str]:
    rows = await admin_execute(url, f'SELECT id, status FROM "{SCHEMA}".cronoq_tasks')
    return {r[0]: r[1] for r in rows}


def not_kept(acked: dict[int, str], stored: dict[int, str]) -> list[int]:
    """Acknowledged tasks absent from ``stored``, or stored in an earlier state."""
    return sorted(
        i for i, state in acked.items() if i not in stored or RANK[stored[i]] < RANK[state]
    )


async def lock_holder(url: URL) -> list[str]:
    rows = await admin_execute(
        url,
        "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
        "WHERE l.locktype = 'advisory' AND l.granted AND l.classid::bigint = $1 "
        "AND l.objid::bigint = (SELECT $2::regnamespace::oid::bigint)",
        LOCK_NS_LEADER,
        SCHEMA,
    )
    return [without_instance(r[0]) for r in rows]


async def test_store_follows_a_promoted_synchronous_standby_and_keeps_every_ack(
    binaries: None,
) -> None:
    pair = ReplicatedPostgres(synchronous=True)
    stores: list[PgStore] = []
    try:
        await asyncio.to_thread(pair.start)
        await pair.streaming()
        url = multi_host_url(pair.primary, pair.standby)
        a = await PgStore.connect(url, config("a"))
        stores.append(a)
        b = await PgStore.connect(url, config("b"))
        stores.append(b)
        epoch = await a.acquire_leadership()
        election = asyncio.ensure_future(b.acquire_leadership())
        driver = Driver(a, epoch).start()
        await driver.until(300)

        # The primary crashes while commits are in flight.
        await asyncio.to_thread(pair.primary.stop, "immediate")
        await bounded(a.leadership_lost(), "the leader to step down after its primary crashed")
        assert not a.is_leader
        await driver.finished()
        assert not election.done(), "nothing writable to lead on before the promotion"

        await asyncio.to_thread(pair.promote)
        assert await bounded(election, "the standby's election on the promoted one") == epoch + 1
        new_primary = pair.standby.url()
        assert (await admin_execute(new_primary, "SELECT pg_is_in_recovery()"))[0][0] is False
        assert await lock_holder(new_primary) == ["failover-b leader"]

        recovered = await b.recover(TimeBase.now())
        ids = {t.id for t in recovered.tasks} | {t.id for t in recovered.terminal}
        assert set(driver.acked) <= ids
        assert not_kept(driver.acked, await stored_states(new_primary)) == []
        assert len(driver.acked) >= 300

        # The deposed leader writes nothing more.
        late = task_id(epoch, 10**6)
        with pytest.raises(FencedError):
            await a.commit(epoch, PROCESS_BASE, [Submitted(late, 0, 0, TaskSpec(b"late"))], [])
        assert late not in await stored_states(new_primary)
    finally:
        for store in stores:
            await store.close()
        await asyncio.to_thread(pair.destroy)


async def test_asynchronous_standby_loses_acks_it_had_not_received(
    binaries: None,
) -> None:
    async with stores_on_a_replicated_pair(config, synchronous=False) as (pair, replication, a, b):
        first_epoch = await a.acquire_leadership()
        replicated = Driver(a, first_epoch).start()
        await replicated.until(100)
        await replicated.stop()
        await pair.replayed()

        # The stream is held back (a slow or broken link): the primary keeps acknowledging
        # on its own. A new term starts there, and commits.
        replication.stall()
        await a.release_leadership()
        second_epoch = await a.acquire_leadership()
        assert second_epoch == first_epoch + 1
        unreplicated = Driver(a, second_epoch).start()
        await unreplicated.until(100)
        await unreplicated.stop()

        await asyncio.to_thread(pair.primary.stop, "immediate")
        await asyncio.to_thread(pair.promote)
        reissued = await bounded(b.acquire_leadership(), "b to lead on the promoted standby")
        recovered = await b.recover(TimeBase.now())
        stored = await stored_states(pair.standby.url())

        # What the standby had is all there; what it had not is gone, although acknowledged.
        assert not_kept(replicated.acked, stored) == []
        assert not_kept(unreplicated.acked, stored) == sorted(unreplicated.acked)
        # The new primary never saw the second term: its epoch is issued again, and the
        # ids that term handed out will be handed out again, to other tasks.
        assert reissued == second_epoch
        assert recovered.next_id <= min(unreplicated.acked)
        assert task_id(reissued, 0) in unreplicated.acked


async def test_a_promoted_standby_is_the_same_cluster_and_fences_no_healthy_store(
    binaries: None,
) -> None:
    """A physical replica is a copy of the cluster, its incarnation (the leader table's OID)
    included: every store opened before the failover leads and commits after it, the
    deposed leader too once it leads again; only the epoch moves."""
    async with stores_on_a_replicated_pair(config, synchronous=True) as (pair, _, a, b):
        assert a.incarnation == b.incarnation
        epoch = await a.acquire_leadership()
        first = Submitted(TaskId(task_id(epoch, 0)), 0, 0, TaskSpec(b"before"))
        await a.commit(epoch, PROCESS_BASE, [first], [])

        await asyncio.to_thread(pair.primary.stop, "fast")
        await bounded(a.leadership_lost(), "a to step down after its primary stopped")
        await asyncio.to_thread(pair.promote)
        new_primary = pair.standby.url()
        rows = await admin_execute(new_primary, f'SELECT tableoid FROM "{SCHEMA}".cronoq_leader')
        assert rows[0][0] == a.incarnation

        assert await bounded(b.acquire_leadership(), "b to lead on the promoted one") == epoch + 1
        assert [t.id for t in (await b.recover(PROCESS_BASE)).tasks] == [first.id]
        second = Submitted(TaskId(task_id(epoch + 1, 0)), 1, 0, TaskSpec(b"after"))
        await b.commit(epoch + 1, PROCESS_BASE, [second], [])
        health = await b.health()
        assert not health.cluster_replaced
        assert health.has_leader
        await b.release_leadership()

        assert await bounded(a.acquire_leadership(), "a to lead again") == epoch + 2
        third = Submitted(TaskId(task_id(epoch + 2, 0)), 2, 0, TaskSpec(b"again"))
        await a.commit(
            epoch + 2, PROCESS_BASE, [third, StatusChanged(first.id, TaskStatus.RUNNING, 1, 5)], []
        )
        assert sorted(await stored_states(new_primary)) == [first.id, second.id, third.id]


# --- a leader whose event loop is blocked ----------------------------------------------------


async def _blocked_leader(
    url: URL, config: PgStoreConfig, leading: threading.Event, taken_over: threading.Event
) -> tuple[int, FencedError | None]:
    """Lead, commit, then block this thread's event loop (no keeper, no ping, no reaction
    of any kind) until ``taken_over`` is set, and commit again the moment it wakes. Returns
    the epoch and the error of that commit."""
    store = await PgStore.connect(url, config)
    try:
        epoch = await store.acquire_leadership()
        await store.commit(
            epoch, PROCESS_BASE, [Submitted(task_id(epoch, 0), 0, 0, TaskSpec(b"a"))], []
        )
        leading.set()
        # The point: the loop is stuck, for as long as the takeover takes (bounded, so that a
        # takeover that never comes fails the test instead of hanging it).
        taken_over.wait(PATIENCE)
        try:
            await store.commit(
                epoch, PROCESS_BASE, [Submitted(task_id(epoch, 1), 1, 0, TaskSpec(b"b"))], []
            )
        except FencedError as exc:
            await bounded(store.leadership_lost(), "the fenced leader to step down")
            return epoch, exc
        return epoch, None
    finally:
        await store.close()


async def test_a_leader_blocked_past_session_timeout_is_replaced_and_fenced(
    pg_url: URL, migrated: str
) -> None:
    """The server sees nothing wrong with a blocked process (its kernel still answers TCP),
    so only a server-side limit can take the lock from it: the store's lock session asks
    the server to end it once idle for 1.5 x ``session_timeout`` (the leader pings every
    ``keepalive``, so a live leader is never idle that long). The leader stays blocked
    until the standby has taken over, however long the machine takes."""
    leading, taken_over = threading.Event(), threading.Event()
    leader = asyncio.ensure_future(
        asyncio.to_thread(
            asyncio.run,
            _blocked_leader(pg_url, replace(config("old"), schema=migrated), leading, taken_over),
        )
    )
    standby: PgStore | None = None
    try:
        assert await bounded(
            asyncio.to_thread(leading.wait, PATIENCE), "the first instance to lead"
        ), "the first instance did not lead"
        standby = await PgStore.connect(pg_url, replace(config("new"), schema=migrated))
        new_epoch = await bounded(
            standby.acquire_leadership(), "the standby to take over from the blocked leader"
        )
        assert not leader.done(), "the blocked leader woke before the takeover"
        taken_over.set()

        old_epoch, fenced = await bounded(leader, "the woken leader's commit")
        assert new_epoch == old_epoch + 1
        assert fenced is not None, "the old leader's first commit after waking was not fenced"
        assert "stored epoch" in str(fenced), "fenced by the epoch check in the database"
        rows = await admin_execute(pg_url, f'SELECT id FROM "{migrated}".cronoq_tasks')
        assert [r[0] for r in rows] == [task_id(old_epoch, 0)]
    finally:
        taken_over.set()
        if standby is not None:
            await standby.close()
        await asyncio.wait({leader}, timeout=PATIENCE)
