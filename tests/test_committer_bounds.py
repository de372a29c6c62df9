"""Batches that can never commit: bounded by bytes, refused when too large, and split when
they keep failing while the database answers, on a real server.

The 1 GiB message limit of PostgreSQL is not allocated here: the committer's and the
store's byte bounds are parameters, lowered to a few hundred KiB. A batch that fails
"transiently" every time is made on the server: a trigger that ends its own session, or
sleeps past a statement timeout, whenever a poisoned payload is inserted.

Admission too: the bound on rows accepted and not yet settled, first come first served,
under submitters that cancel.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store._commit_path import MAX_COMMIT_BYTES, batch_size
from cronoq_store._committer import GroupCommitter
from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import Mutation, TaskId, TimeBase, task_id
from cronoq_store._errors import (
    BatchTooLargeError,
    StoreError,
    UnavailableError,
)
from cronoq_store._retry import Backoff
from cronoq_store._store import PgStore
from cronoq_store._urls import async_url
from cronoq_store.telemetry import DISABLED, Telemetry

from .pgharness import ServerUnderTest, admin_execute
from .support import (
    PROCESS_BASE,
    CommitMeasuredByCommit,
    bump_epoch,
    open_store,
    stored_ids,
    submitted,
    submitted_in,
)
from .waits import until

POISON = b"poison"


class Recording(CommitMeasuredByCommit):
    """The real store, with the size of every batch it was asked to commit recorded."""

    def __init__(self, store: PgStore) -> None:
        self.store = store
        self.sizes: list[int] = []

    @property
    def max_commit_bytes(self) -> int:
        return self.store.max_commit_bytes

    @property
    def telemetry(self) -> Telemetry:
        return self.store.telemetry

    async def ping(self) -> None:
        await self.store.ping()

    async def commit(
        self,
        epoch: int,
        base: TimeBase,
        batch: Sequence[Mutation],
        outputs: Sequence[tuple[TaskId, bytes]],
    ) -> None:
        self.sizes.append(batch_size(batch, outputs))
        await self.store.commit(epoch, base, batch, outputs)


async def test_concurrent_large_submissions_are_batched_under_the_byte_bound(
    pg_url: URL, schema: str
) -> None:
    """17 submissions of 256 KiB each, all at once, under a 1 MiB bound: each batch stays
    under it (today they merge into one batch 17 times the size of each)."""
    bound = 2**20
    async with open_store(pg_url, schema) as store:
        epoch = await store.acquire_leadership()
        recording = Recording(store)
        subs = [[submitted_in(epoch, n, bytes(256 * 1024))] for n in range(17)]
        async with GroupCommitter(
            recording, epoch, PROCESS_BASE, max_batch_bytes=bound
        ) as committer:
            await asyncio.wait_for(asyncio.gather(*(committer.submit(s) for s in subs)), 60)
        assert set(await stored_ids(pg_url, schema)) == {s[0].id for s in subs}
        assert max(recording.sizes) <= bound
        assert committer.stats().commits == len(recording.sizes) >= 5


async def test_a_batch_too_large_for_the_server_is_refused_before_it_is_sent(
    pg_url: URL, schema: str
) -> None:
    async with open_store(pg_url, schema) as store:
        epoch = await store.acquire_leadership()
        store.max_commit_bytes = 2**20
        big = submitted_in(epoch, 1, bytes(2**20))
        with pytest.raises(BatchTooLargeError, match="over the 1048576 bytes") as refused:
            await store.commit(epoch, PROCESS_BASE, [big], [])
        assert not refused.value.is_transient
        # Outputs count too: a task's output of 1 MiB cannot ride on a 1 MiB commit.
        small = submitted_in(epoch, 2)
        with pytest.raises(BatchTooLargeError):
            await store.commit(epoch, PROCESS_BASE, [small], [(small.id, bytes(2**20))])
        assert await stored_ids(pg_url, schema) == []


async def test_a_store_limit_lowered_at_run_time_bounds_the_next_batches(
    pg_url: URL, schema: str
) -> None:
    """The committer sizes each batch by the store's ``max_commit_bytes`` as it is then: a
    limit lowered under a running committer (with its own bound far above) gets no batch
    refused by the store and bisected."""
    async with open_store(pg_url, schema) as store:
        epoch = await store.acquire_leadership()
        recording = Recording(store)
        async with GroupCommitter(recording, epoch, PROCESS_BASE) as committer:
            await committer.submit([submitted_in(epoch, 0)])  # running, at the default limit
            store.max_commit_bytes = 2**20
            subs = [[submitted_in(epoch, n, bytes(200 * 1024))] for n in range(1, 18)]
            await asyncio.wait_for(asyncio.gather(*(committer.submit(s) for s in subs)), 60)
        stats = committer.stats()
        assert (stats.splits, stats.failed_submissions) == (0, 0)
        assert max(recording.sizes) <= 2**20
        assert set(await stored_ids(pg_url, schema)) == {task_id(epoch, n) for n in range(18)}


async def test_a_submission_too_large_to_commit_fails_at_once_and_alone(
    pg_url: URL, schema: str
) -> None:
    async with open_store(pg_url, schema) as store:
        epoch = await store.acquire_leadership()
        store.max_commit_bytes = 2**20
        subs = [[submitted_in(epoch, n)] for n in range(10)]
        subs[4] = [submitted_in(epoch, 4, bytes(2**20))]
        committer = GroupCommitter(store, epoch, PROCESS_BASE, max_batch_bytes=2**19)
        async with committer:
            outcomes = await asyncio.wait_for(
                asyncio.gather(*(committer.submit(s) for s in subs), return_exceptions=True), 30
            )
        assert isinstance(outcomes[4], BatchTooLargeError)
        assert [o for i, o in enumerate(outcomes) if i != 4] == [None] * 9
        stats = committer.stats()
        assert (stats.retries, stats.failed_submissions) == (0, 1)  # failed at its only try
        expected = {s[0].id for i, s in enumerate(subs) if i != 4}
        assert set(await stored_ids(pg_url, schema)) == expected


async def plant_poison(url: URL, schema: str, action: str) -> None:
    """A trigger that runs ``action`` whenever a task with the poisoned payload is inserted."""
    await admin_execute(
        url,
        f'CREATE FUNCTION "{schema}".poison() RETURNS trigger LANGUAGE plpgsql AS '
        f"$$ BEGIN {action}; RETURN NEW; END $$",
    )
    await admin_execute(
        url,
        f'CREATE TRIGGER poison BEFORE INSERT ON "{schema}".cronoq_tasks FOR EACH ROW '
        f"WHEN (NEW.payload = '\\x{POISON.hex()}'::bytea) "
        f'EXECUTE FUNCTION "{schema}".poison()',
    )


@pytest.mark.parametrize(
    ("failure", "action", "message"),
    [
        (
            "the server closes the connection",
            "PERFORM pg_terminate_backend(pg_backend_pid())",
            "connection",
        ),
        ("a statement timeout", "PERFORM pg_sleep(30)", "statement timeout"),
    ],
)
async def test_a_batch_that_keeps_failing_while_the_database_answers_is_split(
    pg_url: URL, schema: str, failure: str, action: str, message: str
) -> None:
    """Every attempt of a batch holding the poisoned submission fails transiently, and
    small commits succeed meanwhile: the batch is split until the poisoned submission
    fails alone with that error, and the others commit (today: retried forever)."""
    engine = create_async_engine(
        async_url(pg_url),
        connect_args={"server_settings": {"statement_timeout": "300"}},
    )
    try:
        store = await PgStore.from_engine(engine, PgStoreConfig(schema=schema))
        try:
            epoch = await store.acquire_leadership()
            # Planted mid-term: the trust check at the next acquisition would refuse it.
            await plant_poison(pg_url, schema, action)
            subs = [[submitted_in(epoch, n)] for n in range(8)]
            subs[5] = [submitted_in(epoch, 5, POISON)]
            committer = GroupCommitter(store, epoch, PROCESS_BASE, backoff=Backoff(0.01, 0.05))
            async with committer:
                outcomes = await asyncio.wait_for(
                    asyncio.gather(*(committer.submit(s) for s in subs), return_exceptions=True),
                    60,
                )
        finally:
            await store.close()
    finally:
        await engine.dispose()

    poisoned = outcomes[5]
    assert isinstance(poisoned, UnavailableError), poisoned
    assert message in str(poisoned)
    assert [o for i, o in enumerate(outcomes) if i != 5] == [None] * 7
    stats = committer.stats()
    assert stats.stuck_batches >= 2  # the first batch, and the poisoned submission alone
    assert stats.splits >= 3  # 8 submissions down to one
    assert stats.failed_submissions == 1
    expected = {s[0].id for i, s in enumerate(subs) if i != 5}
    assert set(await stored_ids(pg_url, schema)) == expected


async def test_an_outage_is_retried_for_as_long_as_it_lasts(
    pg_server: ServerUnderTest, pg_url: URL, schema: str
) -> None:
    """The server is down for a while: pings go unanswered, so no batch is taken for
    stuck, nothing fails, and everything commits once the server is back."""
    if pg_server.kind == "external":
        pytest.skip("needs a server the suite can stop")
    async with open_store(pg_url, schema, commit_timeout=2.0) as store:
        # The epoch without a lock session: the restart would end that session, and its
        # keeper, if it pinged before the batches landed, would step down (fencing them).
        epoch = await bump_epoch(pg_url, schema)
        committer = GroupCommitter(
            store, epoch, PROCESS_BASE, stuck_after=1, backoff=Backoff(0.01, 0.1)
        )
        async with committer:
            await committer.submit([submitted_in(epoch, 0)])
            await asyncio.to_thread(pg_server.stop, "immediate")
            try:
                pending = [
                    asyncio.create_task(committer.submit([submitted_in(epoch, n)]))
                    for n in range(1, 21)
                ]
                await until(lambda: committer.stats().unanswered_pings >= 3, "unanswered pings")
            finally:
                await asyncio.to_thread(pg_server.start)
            outcomes = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 60)
        assert outcomes == [None] * 20
        stats = committer.stats()
        assert stats.failed_submissions == stats.stuck_batches == 0
        assert stats.retries >= 3
    assert set(await stored_ids(pg_url, schema)) == {task_id(epoch, n) for n in range(21)}


async def test_a_batch_is_retried_as_long_as_the_database_does_not_answer() -> None:
    """A batch is split only once the database answers pings while it fails: a ping that
    fails means an outage, retried through."""

    class Failing(CommitMeasuredByCommit):
        attempts = 0
        max_commit_bytes = MAX_COMMIT_BYTES
        telemetry = DISABLED

        async def ping(self) -> None:
            raise UnavailableError("connection refused")

        async def commit(
            self,
            epoch: int,
            base: TimeBase,
            batch: Sequence[Mutation],
            outputs: Sequence[tuple[TaskId, bytes]],
        ) -> None:
            self.attempts += 1
            raise UnavailableError("connection refused")

    store = Failing()
    committer = GroupCommitter(store, 1, PROCESS_BASE, stuck_after=1, backoff=Backoff(0.01, 0.01))
    task = asyncio.create_task(committer.submit([submitted_in(1, 1)]))
    await until(lambda: store.attempts >= 20, "20 attempts")
    assert not task.done()
    assert committer.stats().stuck_batches == 0
    assert committer.stats().unanswered_pings >= 19
    await committer.close(drain=False)
    with pytest.raises(StoreError):
        await task


# --- admission: the bound on pending rows, under cancellation ---------------------------


class _SlowStore(CommitMeasuredByCommit):
    """Commits after a random short pause; records what committed, in order."""

    max_commit_bytes = MAX_COMMIT_BYTES
    telemetry = DISABLED

    def __init__(self, rng: Any) -> None:
        self.rng = rng
        self.committed: list[int] = []

    async def commit(self, epoch: int, base: Any, batch: Any, outputs: Any) -> None:
        await asyncio.sleep(self.rng.random() * 0.002)
        self.committed.extend(m.id for m in batch)

    async def ping(self) -> None:
        pass


@pytest.mark.parametrize("in_flight", [1, 3])
async def test_admission_under_cancellation_keeps_counters_order_and_bounds(in_flight: int) -> None:
    """With one batch in flight, submitters keep their order; with several, batches that
    share no task commute, so only the bounds and the counters are checked."""
    import random

    from cronoq_store._committer import GroupCommitter

    rng = random.Random(7)
    store = _SlowStore(rng)
    limit = 10
    committer = GroupCommitter(
        store,
        1,
        PROCESS_BASE,
        max_pending_mutations=limit,
        max_batch_mutations=4,
        max_batches_in_flight=in_flight,
    )
    admitted: list[int] = []
    over: list[int] = []

    async def one(n: int, size: int) -> None:
        batch = [submitted(n * 100 + i) for i in range(size)]
        await committer.submit(batch)

    tasks = []
    for n in range(1, 400):
        size = rng.randint(1, 6)
        tasks.append(asyncio.ensure_future(one(n, size)))
        if rng.random() < 0.3:
            await asyncio.sleep(0)
        if rng.random() < 0.15:
            rng.choice(tasks).cancel()
        weight = committer._admission.rows
        if committer._admission.pending > 1 and weight > limit:
            over.append(weight)
        admitted.append(n)
    await asyncio.gather(*tasks, return_exceptions=True)
    await committer.close()
    s = committer.stats()
    assert over == []
    assert (s.pending_submissions, s.pending_mutations) == (0, 0)
    assert s.submissions == s.acknowledged + s.failed_submissions + s.dropped
    assert s.mutations == len(store.committed)
    assert len(set(store.committed)) == len(store.committed)
    if in_flight == 1:
        # Submitters keep their order: the tasks committed in submission order.
        assert store.committed == sorted(store.committed)
