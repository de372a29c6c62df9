"""Group commit against a real server: batching, durability before acks, faults, shutdown.

Most tests make a commit slow on purpose by holding the leader row ``FOR UPDATE`` from an
admin session: the store's epoch check waits on it, so a batch stays in flight for exactly
as long as the test wants, and later submissions pile up behind it. The last tests use a
scripted fake store, for behaviour no server can be made to show on cue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Coroutine, Sequence, Sized
from typing import Any

import pytest
from sqlalchemy.engine import URL

from cronoq_store._commit_path import MAX_COMMIT_BYTES
from cronoq_store._committer import GroupCommitter
from cronoq_store._domain import Mutation, StatusChanged, TaskId, TaskStatus, TimeBase, task_id
from cronoq_store._errors import (
    CommitterClosedError,
    FencedError,
    IdCollisionError,
    KeyTakenError,
    StoreError,
    UnavailableError,
)
from cronoq_store._results import Tally
from cronoq_store._retry import MIN_PAUSE, Backoff
from cronoq_store.telemetry import DISABLED

from .pgharness import ServerUnderTest, admin_execute, terminate_backends
from .support import (
    PROCESS_BASE,
    CommitMeasuredByCommit,
    LeaderRowHold,
    app_name,
    bump_epoch,
    changed_in,
    open_store,
    stored_ids,
    submitted_in,
    waiting_on_lock,
)
from .waits import bounded, holds_for, until, until_value


async def grows_to(items: Sized, size: int, what: str) -> None:
    """Wait until ``items`` holds at least ``size`` elements (acks flowing again)."""
    await until_value(lambda: len(items), lambda n: n >= size, what)


def refusal_without_waiting(call: Coroutine[Any, Any, object]) -> BaseException:
    """What ``call`` raises before its first pause: a refusal "at once" waits for nothing,
    whatever the machine's speed."""
    try:
        call.send(None)
    except StopIteration:
        raise AssertionError("the call was accepted, not refused") from None
    except BaseException as exc:
        return exc
    call.close()
    raise AssertionError("the call waited instead of refusing at once")


# --- concurrency ----------------------------------------------------------------------------


async def test_concurrent_submitters_share_few_transactions(pg_url: URL, schema: str) -> None:
    submitters, per_submitter = 128, 8
    async with open_store(pg_url, schema) as store:
        epoch = await store.acquire_leadership()
        counter = itertools.count()
        acked: list[int] = []

        async def submitter(committer: GroupCommitter) -> None:
            for _ in range(per_submitter):
                n = next(counter)
                tid = task_id(epoch, n)
                batch: list[Mutation] = [
                    submitted_in(epoch, n),
                    changed_in(epoch, n, TaskStatus.RUNNING),
                ]
                outputs: list[tuple[TaskId, bytes]] = []
                if n % 2:
                    batch.append(
                        StatusChanged(tid, TaskStatus.SUCCEEDED, 1, PROCESS_BASE.engine_ns)
                    )
                    outputs.append((tid, b"out %d" % n))
                await committer.submit(batch, outputs)
                acked.append(n)

        async with GroupCommitter(store, epoch, PROCESS_BASE) as committer:
            await asyncio.gather(*(submitter(committer) for _ in range(submitters)))
            stats = committer.stats()

        total = submitters * per_submitter
        assert sorted(acked) == list(range(total))
        assert stats.submissions == stats.acknowledged == total
        assert stats.failed_submissions == 0
        assert stats.retries == 0
        assert stats.mutations == total * 2 + total // 2
        assert stats.commits <= total / 4, stats
        assert stats.mean_batch_submissions >= 4
        assert stats.pending_submissions == 0
        assert stats.pending_mutations == 0
        assert stats.latency_p50 is not None
        assert stats.latency_max is not None
        assert stats.latency_p99 is not None
        assert 0 < stats.latency_p50 <= stats.latency_p99 <= stats.latency_max

        rows = await admin_execute(
            pg_url, f'SELECT id, status, output FROM "{schema}".cronoq_tasks ORDER BY id'
        )
        assert [r["id"] for r in rows] == [task_id(epoch, n) for n in range(total)]
        for n, row in enumerate(rows):
            if n % 2:
                assert (row["status"], row["output"]) == ("succeeded", b"out %d" % n)
            else:
                assert (row["status"], row["output"]) == ("running", None)


# --- faults ---------------------------------------------------------------------------------


async def test_acknowledged_means_durable_across_database_crashes(
    pg_server: ServerUnderTest, pg_url: URL, schema: str
) -> None:
    """Two crashes mid-stream. Through the first the committer retries and carries on; at
    the second it gives up while the server is down, as a dying process would: whatever it
    acknowledged up to then must already be in the database, and whatever it abandons must
    be told so. An ack sent before the commit returned fails the final check."""
    if pg_server.kind == "external":
        pytest.skip("needs a server the suite can stop")
    async with open_store(pg_url, schema, commit_timeout=2.0) as store:
        epoch = await bump_epoch(pg_url, schema)
        counter = itertools.count()
        acked: set[int] = set()
        abandoned: list[CommitterClosedError] = []
        errors: list[BaseException] = []

        async def submitter(committer: GroupCommitter) -> None:
            while True:
                n = next(counter)
                try:
                    await committer.submit(
                        [submitted_in(epoch, n), changed_in(epoch, n, TaskStatus.RUNNING)]
                    )
                except CommitterClosedError as exc:
                    abandoned.append(exc)
                    return
                except StoreError as exc:  # a test failure: recorded, checked below
                    errors.append(exc)
                    return
                acked.add(task_id(epoch, n))

        committer = GroupCommitter(
            store, epoch, PROCESS_BASE, max_batch_mutations=200, backoff=Backoff(0.05, 0.2)
        )
        tasks = [asyncio.create_task(submitter(committer)) for _ in range(64)]
        try:
            await grows_to(acked, 300, "acks before the first crash")
            try:
                await asyncio.to_thread(pg_server.stop, "immediate")
                acked_at_crash = len(acked)
                await until(
                    lambda: committer.stats().retries >= 1, "a retry while the server is down"
                )
            finally:
                await asyncio.to_thread(pg_server.start)
            await grows_to(acked, acked_at_crash + 300, "acks after the restart")
            assert committer.stats().retries >= 1
            try:
                await asyncio.to_thread(pg_server.stop, "immediate")
                await bounded(committer.close(drain=False), "close() with the server down")
            finally:
                await asyncio.to_thread(pg_server.start)
            await bounded(asyncio.gather(*tasks), "every submitter to end")
        finally:
            for t in tasks:
                t.cancel()
            await committer.close(drain=False)

        stats = committer.stats()
        assert errors == []
        assert len(abandoned) == 64  # every submitter was told; none hangs
        assert stats.acknowledged == len(acked)
        assert stats.acknowledged + stats.failed_submissions == stats.submissions
        assert stats.failed_submissions >= 64
        missing = acked - set(await stored_ids(pg_url, schema))
        assert not missing, f"{len(missing)} acknowledged submissions are not in the database"


async def test_unavailable_is_retried_until_the_batch_commits(pg_url: URL, schema: str) -> None:
    name = app_name(schema)
    async with open_store(pg_url, schema, application_name=name) as store:
        epoch = await bump_epoch(pg_url, schema)
        counter = itertools.count()
        acked: set[int] = set()
        running_flag = True

        async def submitter(committer: GroupCommitter) -> None:
            while running_flag:
                n = next(counter)
                await committer.submit([submitted_in(epoch, n)])
                acked.add(task_id(epoch, n))

        committer = GroupCommitter(store, epoch, PROCESS_BASE, backoff=Backoff(0.01, 0.05))
        tasks = [asyncio.create_task(submitter(committer)) for _ in range(32)]
        try:
            await grows_to(acked, 100, "first acks")
            for _ in range(3):
                # Terminate the backend while its commit waits: the attempt fails for sure.
                async with LeaderRowHold(pg_url, schema):
                    await until(lambda: waiting_on_lock(pg_url, name), "a blocked commit")
                    assert await terminate_backends(pg_url, name) >= 1
                await grows_to(acked, len(acked) + 50, "acks after terminating")
        finally:
            running_flag = False
            results = await asyncio.gather(*tasks, return_exceptions=True)
            await committer.close()

        assert [r for r in results if r is not None] == []  # no submitter saw an error
        stats = committer.stats()
        assert stats.retries >= 3
        assert stats.failed_submissions == 0
        assert acked <= set(await stored_ids(pg_url, schema))


async def test_backpressure_holds_submitters_while_the_queue_is_full(
    pg_url: URL, schema: str
) -> None:
    name = app_name(schema)
    async with open_store(pg_url, schema, application_name=name) as store:
        epoch = await bump_epoch(pg_url, schema)
        committer = GroupCommitter(
            store, epoch, PROCESS_BASE, max_batch_mutations=4, max_pending_mutations=10
        )
        async with LeaderRowHold(pg_url, schema) as hold:
            tasks = [
                asyncio.create_task(committer.submit([submitted_in(epoch, n)])) for n in range(30)
            ]
            await until(lambda: waiting_on_lock(pg_url, name), "a slow commit")
            await until(lambda: committer.stats().submissions == 10, "ten submissions accepted")

            def held_back() -> bool:
                stats = committer.stats()
                return (
                    stats.submissions == stats.pending_submissions == stats.pending_mutations == 10
                    and not any(t.done() for t in tasks)
                )

            await holds_for(held_back, "the full queue holding the other twenty back", 0.2)
            await hold.release()
            await bounded(asyncio.gather(*tasks), "every submitter once the row is free")
        await committer.close()

        stats = committer.stats()
        assert stats.acknowledged == 30
        assert stats.commits >= 30 / 4  # the cap held
        assert set(await stored_ids(pg_url, schema)) == {task_id(epoch, n) for n in range(30)}


async def test_fenced_fails_everything_pending_and_closes(pg_url: URL, schema: str) -> None:
    name = app_name(schema)
    async with open_store(pg_url, schema, application_name=name) as store:
        epoch = await bump_epoch(pg_url, schema)
        committer = GroupCommitter(store, epoch, PROCESS_BASE, max_batch_mutations=5)
        await asyncio.gather(*(committer.submit([submitted_in(epoch, n)]) for n in range(10)))
        before = set(await stored_ids(pg_url, schema))
        assert before == {task_id(epoch, n) for n in range(10)}

        async with LeaderRowHold(pg_url, schema) as hold:
            tasks = [
                asyncio.create_task(committer.submit([submitted_in(epoch, n)]))
                for n in range(10, 30)
            ]
            await until(lambda: waiting_on_lock(pg_url, name), "in flight")
            assert committer.stats().pending_submissions == 20  # one batch in flight, 3 queued
            # A takeover: the new leader bumps the epoch while the old one's commit waits.
            await hold.execute(f'UPDATE "{schema}".cronoq_leader SET epoch = epoch + 1')
            await hold.release(commit=True)
            results = await bounded(
                asyncio.gather(*tasks, return_exceptions=True), "every submitter to be fenced"
            )

        assert all(isinstance(r, FencedError) for r in results), results
        assert committer.fenced
        assert committer.closed
        refusal = refusal_without_waiting(committer.submit([submitted_in(epoch, 99)]))
        assert isinstance(refusal, FencedError), refusal
        await committer.close()
        stats = committer.stats()
        assert stats.failed_submissions == 20
        assert stats.acknowledged == 10
        assert set(await stored_ids(pg_url, schema)) == before


async def test_a_failing_submission_is_isolated_from_its_batch(pg_url: URL, schema: str) -> None:
    name = app_name(schema)
    async with open_store(pg_url, schema, application_name=name) as store:
        epoch = await bump_epoch(pg_url, schema)
        committer = GroupCommitter(store, epoch, PROCESS_BASE)
        async with LeaderRowHold(pg_url, schema) as hold:
            first = asyncio.create_task(committer.submit([submitted_in(epoch, 0)]))
            await until(lambda: waiting_on_lock(pg_url, name), "in flight")
            # These ten queue up behind it and form the next batch; 4 and 7 share a live key.
            batch = [
                asyncio.create_task(
                    committer.submit(
                        [submitted_in(epoch, n, key="dup" if n in (4, 7) else f"k{n}")]
                    )
                )
                for n in range(1, 11)
            ]
            await until_value(
                lambda: committer.stats().pending_submissions,
                lambda n: n == 11,
                "the ten queued behind the one in flight",
            )
            await hold.release()
            await bounded(first, "the first submission once the row is free")
            results = await bounded(
                asyncio.gather(*batch, return_exceptions=True), "the batch of ten"
            )
        await committer.close()

        failures = {n: r for n, r in zip(range(1, 11), results, strict=True) if r is not None}
        assert list(failures) == [7], results  # the later holder of the key, alone
        error = failures[7]
        assert isinstance(error, StoreError)
        assert not isinstance(error, (UnavailableError, FencedError, CommitterClosedError))
        stats = committer.stats()
        assert stats.splits >= 1
        assert stats.failed_submissions == 1
        assert stats.acknowledged == 10
        expected = {task_id(epoch, n) for n in range(11) if n != 7}
        assert set(await stored_ids(pg_url, schema)) == expected


async def test_cancelled_submitters_queued_are_dropped_in_flight_still_commit(
    pg_url: URL, schema: str
) -> None:
    name = app_name(schema)
    async with open_store(pg_url, schema, application_name=name) as store:
        epoch = await bump_epoch(pg_url, schema)
        committer = GroupCommitter(store, epoch, PROCESS_BASE, max_batches_in_flight=1)
        async with LeaderRowHold(pg_url, schema) as hold:
            in_flight = asyncio.create_task(committer.submit([submitted_in(epoch, 1)]))
            await until(lambda: waiting_on_lock(pg_url, name), "in flight")
            queued = asyncio.create_task(committer.submit([submitted_in(epoch, 2)]))
            kept = asyncio.create_task(committer.submit([submitted_in(epoch, 3)]))
            await until(
                lambda: committer.stats().pending_submissions == 3, "two submissions queued"
            )
            in_flight.cancel()
            queued.cancel()
            await until_value(  # the queued one leaves; the one in flight stays in flight
                lambda: committer.stats().pending_submissions,
                lambda n: n == 2,
                "the cancelled queued submission to leave the queue",
            )
            await hold.release()
            await bounded(kept, "the kept submission once the row is free")
        await committer.close()

        assert in_flight.cancelled()
        assert queued.cancelled()
        stats = committer.stats()
        assert stats.dropped == 1
        assert stats.acknowledged == 2
        assert set(await stored_ids(pg_url, schema)) == {task_id(epoch, 1), task_id(epoch, 3)}


# --- shutdown -------------------------------------------------------------------------------


async def test_close_with_drain_commits_everything_pending(pg_url: URL, schema: str) -> None:
    name = app_name(schema)
    async with open_store(pg_url, schema, application_name=name) as store:
        epoch = await bump_epoch(pg_url, schema)
        committer = GroupCommitter(
            store, epoch, PROCESS_BASE, max_batch_mutations=5, max_batches_in_flight=1
        )
        async with LeaderRowHold(pg_url, schema) as hold:
            tasks = [
                asyncio.create_task(committer.submit([submitted_in(epoch, n)])) for n in range(20)
            ]
            await until(lambda: waiting_on_lock(pg_url, name), "in flight")
            closing = asyncio.create_task(committer.close(drain=True))
            await holds_for(
                lambda: not closing.done(), "a draining close() waiting for the batch held", 0.05
            )
            with pytest.raises(CommitterClosedError):
                await committer.submit([submitted_in(epoch, 99)])
            await hold.release()
            await bounded(closing, "the draining close() once the row is free")

        assert all(t.done() for t in tasks)
        assert [t.result() for t in tasks] == [None] * 20
        assert committer.stats().acknowledged == 20
        assert set(await stored_ids(pg_url, schema)) == {task_id(epoch, n) for n in range(20)}


async def test_close_without_drain_fails_pending_and_drops_nothing_silently(
    pg_url: URL, schema: str
) -> None:
    name = app_name(schema)
    async with open_store(pg_url, schema, application_name=name) as store:
        epoch = await bump_epoch(pg_url, schema)
        committer = GroupCommitter(
            store, epoch, PROCESS_BASE, max_batch_mutations=5, max_batches_in_flight=1
        )
        async with LeaderRowHold(pg_url, schema) as hold:
            tasks = [
                asyncio.create_task(committer.submit([submitted_in(epoch, n)])) for n in range(20)
            ]
            await until(lambda: waiting_on_lock(pg_url, name), "in flight")
            closing = asyncio.create_task(committer.close(drain=False))
            # Queued submissions fail at once; the attempt in flight may still finish.
            done = await until_value(
                lambda: sum(t.done() for t in tasks),
                lambda n: n >= 15,
                "the fifteen queued submissions to fail",
            )
            assert done == 15
            await hold.release()
            await bounded(closing, "close() once the row is free")

        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        acked = {n for n, r in enumerate(outcomes) if r is None}
        closed = {n for n, r in enumerate(outcomes) if isinstance(r, CommitterClosedError)}
        assert acked == set(range(5))  # the batch in flight committed
        assert closed == set(range(5, 20))
        assert "not committed" in str(outcomes[19])
        stats = committer.stats()
        assert stats.acknowledged + stats.failed_submissions == stats.submissions == 20
        assert stats.pending_submissions == 0
        assert set(await stored_ids(pg_url, schema)) == {task_id(epoch, n) for n in acked}


# --- semantics a server cannot be made to show on cue: a scripted store ---------------------


class ScriptedStore(CommitMeasuredByCommit):
    """Records every commit; fails each attempt with the next scripted error, if any. While
    failures are scripted, the database does not answer a ping either (an outage)."""

    max_commit_bytes = MAX_COMMIT_BYTES
    telemetry = DISABLED

    def __init__(self, failures: Sequence[BaseException] = (), forever: bool = False) -> None:
        self.failures = list(failures)
        self.forever = forever
        self.attempts: list[list[Mutation]] = []
        self.attempted_at: list[float] = []
        self.commits: list[list[Mutation]] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def commit(
        self,
        epoch: int,
        base: TimeBase,
        batch: Sequence[Mutation],
        outputs: Sequence[tuple[TaskId, bytes]],
    ) -> None:
        self.attempts.append(list(batch))
        self.attempted_at.append(time.monotonic())
        await self.gate.wait()
        if self.forever:
            raise self.failures[0]
        if self.failures:
            raise self.failures.pop(0)
        self.commits.append(list(batch))

    async def ping(self) -> None:
        if self.forever or self.failures:
            raise UnavailableError("the scripted outage goes on")


async def test_batches_keep_submission_order_and_respect_the_cap() -> None:
    store = ScriptedStore()
    store.gate.clear()
    committer = GroupCommitter(store, 1, PROCESS_BASE, max_batch_mutations=10)
    sizes = [3, 4, 5, 25, 1, 9, 2, 2, 2, 2, 2]
    counter = itertools.count()
    subs = [[submitted_in(1, next(counter)) for _ in range(size)] for size in sizes]
    tasks = [asyncio.create_task(committer.submit(s)) for s in subs]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    store.gate.set()
    await asyncio.gather(*tasks)
    await committer.close()

    assert [m for c in store.commits for m in c] == [m for s in subs for m in s]
    assert [len(c) for c in store.commits] == [7, 5, 25, 10, 10]
    assert committer.stats().commits == 5
    assert committer.stats().mean_batch_submissions == pytest.approx(11 / 5)


async def test_retries_back_off_with_jitter_and_close_abandons_them_clearly() -> None:
    store = ScriptedStore([UnavailableError("connection refused")], forever=True)
    committer = GroupCommitter(store, 1, PROCESS_BASE, backoff=Backoff(0.01, 0.04))
    task = asyncio.create_task(committer.submit([submitted_in(1, 1)]))
    await until_value(lambda: len(store.attempts), lambda n: n >= 9, "nine attempts")
    at = store.attempted_at
    # Delays are drawn from [MIN_PAUSE, min(0.04, 0.01 * 2**n)]: the retries keep coming,
    # each after a pause (a machine's slowness only lengthens them).
    assert all(b - a >= MIN_PAUSE * 0.9 for a, b in itertools.pairwise(at)), at
    await until(
        lambda: committer.stats().retries == len(store.attempts), "each attempt counted a retry"
    )
    assert not task.done()
    await bounded(committer.close(drain=True, timeout=0.2), "a drain that gives up after 0.2 s")
    with pytest.raises(CommitterClosedError, match="may or may not have been committed") as err:
        await task
    assert isinstance(err.value.__cause__, UnavailableError)
    with pytest.raises(CommitterClosedError):
        await committer.submit([submitted_in(1, 2)])


async def test_retries_pause_as_the_backoff_says_and_each_batch_starts_afresh(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="cronoq_store")
    outage = [UnavailableError("connection refused")] * 5
    store = ScriptedStore(outage)
    committer = GroupCommitter(store, 1, PROCESS_BASE, backoff=Backoff(0.04, 0.16, jitter=0.0))
    async with committer:
        await committer.submit([submitted_in(1, 1)])
        store.failures += outage[:2]
        await committer.submit([submitted_in(1, 2)])
    at = store.attempted_at
    gaps = [b - a for a, b in itertools.pairwise(at)]
    # Five failures of the first batch: 0.04, 0.08, then the cap; its sixth attempt commits.
    # The second batch fails twice and pauses from the initial delay again, not at the cap.
    expected = [0.04, 0.08, 0.16, 0.16, 0.16, None, 0.04, 0.08]
    chosen = [getattr(r, "delay") for r in caplog.records if hasattr(r, "delay")]  # noqa: B009
    assert chosen == [p for p in expected if p is not None]
    # Each pause chosen is taken (a busy machine only lengthens it).
    assert len(gaps) == len(expected)
    for gap, pause in zip(gaps, expected, strict=True):
        if pause is not None:
            assert gap >= pause - MIN_PAUSE, gaps
    assert committer.stats().retries == 7


async def test_a_single_submission_larger_than_the_bounds_goes_alone() -> None:
    store = ScriptedStore()
    committer = GroupCommitter(
        store, 1, PROCESS_BASE, max_batch_mutations=3, max_pending_mutations=4
    )
    big = [submitted_in(1, n) for n in range(10)]
    async with committer:
        await committer.submit(big)
        await committer.submit([])  # a barrier: an empty submission is still committed
    assert store.commits == [big, []]


async def test_close_refuses_submitters_still_waiting_for_room() -> None:
    store = ScriptedStore()
    store.gate.clear()  # the first batch stays in flight
    committer = GroupCommitter(
        store, 1, PROCESS_BASE, max_batch_mutations=2, max_pending_mutations=2
    )
    accepted = [asyncio.create_task(committer.submit([submitted_in(1, n)])) for n in range(2)]
    waiting = asyncio.create_task(committer.submit([submitted_in(1, 2)]))
    await until(lambda: len(store.attempts) == 1, "the first batch in flight")
    assert committer.stats().submissions == 2
    assert not waiting.done()
    closing = asyncio.create_task(committer.close(drain=True))
    with pytest.raises(CommitterClosedError, match="closed"):
        # Refused while the drain still waits for the batch in flight: never accepted.
        await bounded(waiting, "the refusal of the submitter waiting for room")
    assert not closing.done()
    store.gate.set()
    await bounded(closing, "the drain once the batch commits")
    assert [t.result() for t in accepted] == [None, None]
    assert [len(c) for c in store.commits] == [2]


def test_stats_are_nearest_rank_percentiles_over_the_latest_window() -> None:
    tally = Tally(latency_window=100)
    assert tally.snapshot(0, 0).latency_p50 is None
    for n in range(1, 151, 3):  # the first 50 fall out of the window
        tally.acknowledge(mutations=6, latencies=[float(n), float(n + 1), float(n + 2)])
    tally.commit(submissions=100)
    tally.commit(submissions=50)
    stats = tally.snapshot(pending_submissions=3, pending_mutations=7)
    assert (stats.latency_p50, stats.latency_p99, stats.latency_max) == (100.0, 149.0, 150.0)
    assert (stats.acknowledged, stats.mutations, stats.commits) == (150, 300, 2)
    assert (stats.mean_batch_mutations, stats.mean_batch_submissions) == (150.0, 75.0)
    assert (stats.pending_submissions, stats.pending_mutations) == (3, 7)


async def test_through_the_committer_an_id_collision_still_wins_over_taken_keys(
    pg_url: URL, schema: str
) -> None:
    """On the leader's held connection, each half the committer bisects answers as a batch
    of its own does: the submission with both an id collision and a taken key (its key row
    first) gets ``IdCollisionError``, the one with a taken key only ``KeyTakenError``."""
    async with open_store(pg_url, schema) as store:
        epoch = await store.acquire_leadership()
        await store.commit(
            epoch, PROCESS_BASE, [submitted_in(epoch, 1, key="k1"), submitted_in(epoch, 2)], []
        )
        other = submitted_in(epoch, 2, b"other")
        both: list[Mutation] = [submitted_in(epoch, 3, key="k1"), other]
        keys: list[Mutation] = [submitted_in(epoch, 4, key="k1"), submitted_in(epoch, 6, key="k2")]
        fine: list[Mutation] = [submitted_in(epoch, 5, key="k2")]
        async with GroupCommitter(store, epoch, PROCESS_BASE) as committer:
            outcomes = await bounded(
                asyncio.gather(
                    *(committer.submit(s) for s in (both, keys, fine)), return_exceptions=True
                ),
                "the three submissions",
            )
        collision, taken, ok = outcomes
        assert isinstance(collision, IdCollisionError)
        assert collision.ids == [task_id(epoch, 2)]
        assert isinstance(taken, KeyTakenError)
        assert taken.keys == ["k1"]
        assert ok is None
        assert set(await stored_ids(pg_url, schema)) == {task_id(epoch, n) for n in (1, 2, 5)}


async def test_a_refusal_of_the_callers_own_is_logged_at_debug_a_bug_at_warning(
    pg_url: URL, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A taken key or an id of another task is the submitter's answer, not the store's
    trouble: the log says it at debug level, alone or bisected out of a batch. A failure
    that is no answer to the caller (here a store that raises a bare ``StoreError``) stays
    a warning."""
    async with open_store(pg_url, schema) as store:
        epoch = await store.acquire_leadership()
        await store.commit(epoch, PROCESS_BASE, [submitted_in(epoch, 1, key="k1")], [])
        other = submitted_in(epoch, 1, b"other")
        with caplog.at_level(logging.DEBUG, logger="cronoq_store"):
            async with GroupCommitter(store, epoch, PROCESS_BASE) as committer:
                with pytest.raises(KeyTakenError):
                    await committer.submit([submitted_in(epoch, 2, key="k1")])
                with pytest.raises(IdCollisionError):
                    await committer.submit([other])
                outcomes = await bounded(
                    asyncio.gather(
                        *(committer.submit([submitted_in(epoch, n, key="k1")]) for n in (3, 4)),
                        return_exceptions=True,
                    ),
                    "the two submissions of a taken key",
                )
        assert [type(o) for o in outcomes] == [KeyTakenError, KeyTakenError]
    records = [r for r in caplog.records if r.name == "cronoq_store"]
    refusals = [r for r in records if "failed to commit" in r.getMessage()]
    assert len(refusals) >= 4, [r.getMessage() for r in records]
    assert [r for r in records if r.levelno >= logging.WARNING] == []

    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="cronoq_store"):
        async with GroupCommitter(ScriptedStore([StoreError("bug")]), 1, PROCESS_BASE) as committer:
            with pytest.raises(StoreError, match="bug"):
                await committer.submit([submitted_in(1, 1)])
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == ["a submission failed to commit"]
