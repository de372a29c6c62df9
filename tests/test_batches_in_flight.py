"""Several batches in flight: they commit at once on separate connections, yet end in the
rows of the same history committed one submission at a time, in the order submitted.

A commit is held in flight by an admin transaction that holds the leader row
``FOR UPDATE`` (every commit's share lock waits on it), so the test sees which batches were
sent (``pg_stat_activity``). The property test draws concurrent submitters whose histories
resubmit tasks, hand keys over and send a task's transitions before the previous one was
acknowledged, with any number of batches in flight, and compares the rows and each
submission's outcome with a serial replay in another schema.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import TaskId, TaskSpec, TaskStatus, TimeBase
from cronoq_store._errors import FencedError, StoreError
from cronoq_store._group_commit import GroupCommitter
from cronoq_store._migrations import upgrade
from cronoq_store._mutations import Mutation, StatusChanged, Submitted
from cronoq_store._store import PgStore

from .pgharness import admin_execute
from .test_group_commit import LeaderRowHold, app_name, wait_until

BASE = TimeBase.now()
_ids = itertools.count(1)
_clock = itertools.count(1)


def new(key: str | None = None) -> Submitted:
    id = next(_ids)
    return Submitted(TaskId(id), id, 1, TaskSpec(b"p%d" % id, key=key))


def moved(task: Submitted, status: TaskStatus, attempt: int = 1) -> StatusChanged:
    return StatusChanged(task.id, status, attempt, next(_clock), f"{status.value} {attempt}")


async def sent(url: URL, name: str) -> int:
    """How many commits of ``name``'s sessions wait on the held leader row."""
    rows = await admin_execute(
        url,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 "
        "AND wait_event_type = 'Lock'",
        name,
    )
    return int(rows[0][0])


@pytest.fixture
async def store(pg_url: URL, migrated: str) -> AsyncIterator[PgStore]:
    config = PgStoreConfig(schema=migrated, application_name=app_name(migrated))
    async with await PgStore.connect(pg_url, config) as s:
        yield s


async def rows(url: URL, schema: str, ids: set[int] | None = None) -> list[tuple[Any, ...]]:
    found = await admin_execute(
        url,
        f"SELECT id, status, attempt, terminal, key, message, output "
        f'FROM "{schema}".cronoq_tasks ORDER BY id',
    )
    return [tuple(r) for r in found if ids is None or r[0] in ids]


async def test_independent_batches_are_in_flight_at_once(
    store: PgStore, migrated: str, pg_url: URL
) -> None:
    name = app_name(migrated)
    committer = GroupCommitter(store, 0, BASE, max_batch_mutations=1, max_batches_in_flight=3)
    async with LeaderRowHold(pg_url, migrated) as hold:
        tasks = [new() for _ in range(5)]
        waiting = [asyncio.ensure_future(committer.submit([t])) for t in tasks]
        await wait_until(lambda: _sent_is(pg_url, name, 3), what="three batches in flight")
        await asyncio.sleep(0.1)
        assert await sent(pg_url, name) == 3  # the bound: the other two wait for a slot
        await hold.release()
        await asyncio.wait_for(asyncio.gather(*waiting), 10)
    await committer.close()
    assert [r[0] for r in await rows(pg_url, migrated)] == [t.id for t in tasks]


async def _sent_is(url: URL, name: str, count: int) -> bool:
    return await sent(url, name) == count


@pytest.mark.parametrize(
    "second",
    [
        "a transition of the task",
        "an output of the task",
        "a task given the key the first releases",
        "a task finished while the first gives out a key",
    ],
)
async def test_a_batch_waits_for_the_batch_in_flight_it_must_follow(
    store: PgStore, serial_store: PgStore, migrated: str, pg_url: URL, second: str
) -> None:
    """The second batch is not sent while the first is in flight (an independent third one
    is); once the first lands, the second lands on its rows, as if committed after it."""
    name = app_name(migrated)
    holder = new("k")
    task = new("k2" if second.endswith("gives out a key") else None)
    first: list[Mutation] = [task]
    outputs: list[tuple[TaskId, bytes]] = []
    if second == "a transition of the task":
        follower: list[Mutation] = [moved(task, TaskStatus.RUNNING)]
    elif second == "an output of the task":
        follower, outputs = [moved(task, TaskStatus.SUCCEEDED)], [(task.id, b"out")]
    elif second == "a task given the key the first releases":
        first, follower = [moved(holder, TaskStatus.SUCCEEDED)], [new("k")]
    else:
        follower = [moved(holder, TaskStatus.FAILED)]
    independent = new()
    await store.commit(0, BASE, [holder], [])
    committer = GroupCommitter(store, 0, BASE, max_batches_in_flight=4)
    async with LeaderRowHold(pg_url, migrated) as hold:
        one = asyncio.ensure_future(committer.submit(first))
        await wait_until(lambda: _sent_is(pg_url, name, 1), what="the first batch in flight")
        two = asyncio.ensure_future(committer.submit(follower, outputs))
        await asyncio.sleep(0.2)
        assert not two.done()
        assert await sent(pg_url, name) == 1
        await hold.release()
        await asyncio.wait_for(asyncio.gather(one, two), 10)
        await committer.submit([independent])
    await committer.close()
    replay: list[tuple[list[Mutation], list[tuple[TaskId, bytes]]]] = [
        ([holder], []),
        (first, []),
        (follower, outputs),
        ([independent], []),
    ]
    for mutations, extra in replay:
        await serial_store.commit(0, BASE, mutations, extra)
    if second == "an output of the task":
        assert await store.load_output(task.id) == b"out"
    assert await rows(pg_url, migrated) == await rows(pg_url, serial_store.config.schema)


async def test_a_takeover_fences_every_batch_in_flight_and_queued(
    store: PgStore, migrated: str, pg_url: URL
) -> None:
    """Three batches wait in flight on the leader row; a takeover bumps the epoch there:
    every pending submission fails with FencedError and nothing of any batch lands."""
    name = app_name(migrated)
    committer = GroupCommitter(store, 0, BASE, max_batch_mutations=1, max_batches_in_flight=3)
    async with LeaderRowHold(pg_url, migrated) as hold:
        waiting = [asyncio.ensure_future(committer.submit([new()])) for _ in range(6)]
        await wait_until(lambda: _sent_is(pg_url, name, 3), what="three batches in flight")
        await hold.execute(f'UPDATE "{migrated}".cronoq_leader SET epoch = epoch + 1')
        await hold.release(commit=True)
        outcomes = await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), 10)
    await committer.close()
    assert all(isinstance(o, FencedError) for o in outcomes), outcomes
    assert committer.fenced
    assert await rows(pg_url, migrated) == []


# --- the property: any number of batches in flight, the rows of a serial history ----------


@dataclass
class Submitter:
    """A scheduler's submitter: its tasks, the keys it holds, what it sent."""

    number: int
    live: list[tuple[Submitted, int]] = field(default_factory=list)  # task, attempt
    finished: list[Submitted] = field(default_factory=list)
    free_keys: list[str] = field(default_factory=list)

    def step(self, action: str, pick: int) -> list[Mutation]:
        """The submission ``action`` makes, valid whatever was acknowledged so far."""
        if action == "handover" and any(t.spec.key for t, _ in self.live):
            keyed = [(i, t) for i, (t, _) in enumerate(self.live) if t.spec.key]
            i, old = keyed[pick % len(keyed)]
            del self.live[i]
            self.finished.append(old)
            task = new(old.spec.key)
            self.live.append((task, 1))
            return [moved(old, TaskStatus.SUCCEEDED), task]
        if action == "advance" and self.live:
            i = pick % len(self.live)
            task, attempt = self.live[i]
            status = [TaskStatus.RUNNING, TaskStatus.RETRYING, TaskStatus.FAILED][pick % 3]
            if status is TaskStatus.RETRYING:
                self.live[i] = (task, attempt + 1)
            elif status.is_terminal:
                del self.live[i]
                self.finished.append(task)
                if task.spec.key is not None:
                    self.free_keys.append(task.spec.key)
            return [moved(task, status, attempt)]
        if action == "resubmit" and (self.live or self.finished):
            known = [t for t, _ in self.live] + self.finished
            return [known[pick % len(known)]]
        key = None
        if action == "keyed":
            key = self.free_keys.pop() if self.free_keys else f"s{self.number}-k{pick}-{next(_ids)}"
        task = new(key)
        self.live.append((task, 1))
        return [task]


class Jittered:
    """A store whose commits each start after the next of ``delays`` (cycled)."""

    def __init__(self, store: PgStore, delays: list[float]) -> None:
        self._store = store
        self._delays = itertools.cycle(delays)

    async def commit(
        self,
        epoch: int,
        base: TimeBase,
        batch: Sequence[Mutation],
        outputs: Sequence[tuple[TaskId, bytes]],
    ) -> None:
        await asyncio.sleep(next(self._delays))
        await self._store.commit(epoch, base, batch, outputs)


ACTIONS = ("new", "keyed", "advance", "handover", "resubmit")
history_of = st.lists(
    st.lists(
        st.tuples(st.sampled_from(ACTIONS), st.integers(0, 11), st.booleans()),
        min_size=1,
        max_size=10,
    ),
    min_size=1,
    max_size=6,
)


@pytest.fixture
async def serial_store(engine: AsyncEngine, migrated: str, pg_url: URL) -> AsyncIterator[PgStore]:
    schema = f"{migrated}_serial"
    await upgrade(engine, schema)
    try:
        async with await PgStore.from_engine(engine, PgStoreConfig(schema=schema)) as s:
            yield s
    finally:
        await admin_execute(pg_url, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    histories=history_of,
    in_flight=st.integers(1, 6),
    batch=st.integers(1, 6),
    delays=st.lists(st.sampled_from([0.0, 0.0, 0.001, 0.004]), min_size=1, max_size=8),
)
async def test_any_batches_in_flight_end_in_the_rows_of_the_serial_history(
    store: PgStore,
    serial_store: PgStore,
    migrated: str,
    pg_url: URL,
    histories: list[list[tuple[str, int, bool]]],
    in_flight: int,
    batch: int,
    delays: list[float],
) -> None:
    """Concurrent submitters send their histories through one committer (``in_flight``
    batches at once, up to ``batch`` rows each); a submitter awaits a submission's
    acknowledgement only where the draw says so, else it sends the next one at once. The
    same submissions, committed one at a time in the order the committer accepted them,
    give the same rows and the same outcome for every submission. Each commit starts after
    the next of ``delays``, so that batches in flight overtake one another."""
    order: list[list[Mutation]] = []
    outcomes: dict[int, str | None] = {}
    committer = GroupCommitter(
        Jittered(store, delays), 0, BASE, max_batches_in_flight=in_flight, max_batch_mutations=batch
    )

    async def send(mutations: list[Mutation]) -> None:
        index = len(order)
        order.append(mutations)  # accepted in this order: submit enqueues before it awaits
        try:
            await committer.submit(mutations)
            outcomes[index] = None
        except StoreError as exc:
            outcomes[index] = type(exc).__name__

    async def submitter(number: int, steps: list[tuple[str, int, bool]]) -> None:
        me = Submitter(number)
        unacked: list[asyncio.Future[None]] = []
        for action, pick, wait in steps:
            pending = asyncio.ensure_future(send(me.step(action, pick)))
            await asyncio.sleep(0)  # the submission is accepted before the next step
            if wait:
                await pending
            else:
                unacked.append(pending)
        await asyncio.gather(*unacked)

    await asyncio.gather(*(submitter(n, steps) for n, steps in enumerate(histories)))
    await committer.close()

    serial: dict[int, str | None] = {}
    for index, mutations in enumerate(order):
        try:
            await serial_store.commit(0, BASE, mutations, [])
            serial[index] = None
        except StoreError as exc:
            serial[index] = type(exc).__name__
    ids: set[int] = {m.id for mutations in order for m in mutations if isinstance(m, Submitted)}
    assert outcomes == serial
    assert await rows(pg_url, migrated, ids) == await rows(pg_url, serial_store.config.schema, ids)
