"""The retry policy: each pause within its bounds, growing to the cap, reproducible; its
loop retries what is transient and stops by exception; the one timeout and pause."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import sys
import time
from collections.abc import Awaitable
from typing import Any

import pytest

from cronoq_store._committer import GroupCommitter
from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import TimeBase
from cronoq_store._errors import StoreError, UnavailableError
from cronoq_store._retry import (
    COMMIT_BACKOFF,
    MIN_PAUSE,
    Backoff,
    Retry,
    TimeLimit,
    acquisition_backoff,
    bounded,
    pause,
)
from cronoq_store.testing import InMemoryStore

from .waits import until


def first(backoff: Backoff, n: int) -> list[float]:
    return list(itertools.islice(backoff.delays(), n))


def test_without_jitter_pauses_double_from_initial_up_to_the_cap() -> None:
    assert first(Backoff(initial=0.1, cap=1.0, jitter=0.0), 7) == pytest.approx(
        [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    )


@pytest.mark.parametrize("jitter", [1.0, 0.5, 0.1])
def test_each_pause_lies_within_its_jittered_ceiling(jitter: float) -> None:
    backoff = Backoff(initial=0.05, cap=2.0, jitter=jitter, rng=random.Random(12))
    ceilings = [min(2.0, 0.05 * 2**n) for n in range(12)]
    for _ in range(200):
        for delay, ceiling in zip(backoff.delays(), ceilings, strict=False):
            assert ceiling * (1 - jitter) <= delay <= ceiling


def test_pauses_grow_with_failures_and_the_cap_holds_forever() -> None:
    backoff = Backoff(initial=0.01, cap=0.5, rng=random.Random(3))
    runs = [first(backoff, 2000) for _ in range(100)]
    means = [sum(run[n] for run in runs) / len(runs) for n in range(7)]
    # Full jitter: the mean pause is half its ceiling, which doubles until the cap.
    assert means == sorted(means)
    assert means[6] > 10 * means[0]
    assert max(max(run) for run in runs) <= 0.5
    # Deep into a run the ceiling is the cap, not an overflowed power of two.
    assert max(run[-1] for run in runs) > 0.25


def test_an_injected_generator_makes_the_pauses_reproducible() -> None:
    def sample(seed: int) -> list[float]:
        return first(Backoff(initial=0.05, cap=2.0, rng=random.Random(seed)), 10)

    assert sample(5) == sample(5)
    assert sample(5) != sample(6)


def test_each_run_of_failures_starts_again_from_initial() -> None:
    backoff = Backoff(initial=0.2, cap=3.0, jitter=0.0)
    failing = backoff.delays()
    assert [next(failing) for _ in range(4)] == pytest.approx([0.2, 0.4, 0.8, 1.6])
    assert next(backoff.delays()) == pytest.approx(0.2)


def test_the_committer_retries_a_blip_at_once_and_an_outage_every_two_seconds() -> None:
    pauses = first(COMMIT_BACKOFF, 40)
    assert pauses[0] <= 0.05
    assert max(pauses) <= 2.0


@pytest.mark.parametrize("lock_poll", [0.05, 0.5, 4.0])
def test_acquisition_never_pauses_longer_than_lock_poll(lock_poll: float) -> None:
    """The bound after an outage: a standby's next attempt comes within lock_poll."""
    config = PgStoreConfig(lock_poll=lock_poll, session_timeout=10.0, keepalive=1.0)
    backoff = acquisition_backoff(config)
    for _ in range(50):
        pauses = first(backoff, 30)
        assert max(pauses) <= lock_poll
        # Once at the cap, never faster than twice per lock_poll.
        assert min(pauses[2:]) >= lock_poll / 2


class _Topmost(random.Random):
    """Draws the largest value ``random()`` can return: full jitter then takes all the pause."""

    def random(self) -> float:
        return 1.0 - 2.0**-53


@pytest.mark.parametrize("jitter", [1.0, 0.999])
def test_no_pause_is_shorter_than_the_floor_whatever_the_draw(jitter: float) -> None:
    """Full jitter may draw a pause of almost nothing: a hot loop, unless raised to the floor."""
    backoff = Backoff(initial=MIN_PAUSE, cap=MIN_PAUSE * 4, jitter=jitter, rng=_Topmost())
    assert min(first(backoff, 20)) == MIN_PAUSE


@pytest.mark.parametrize("lock_poll", [1e-300, 1e-6, 0.002])
def test_a_tiny_lock_poll_still_pauses_at_least_the_floor(lock_poll: float) -> None:
    config = PgStoreConfig(lock_poll=lock_poll, session_timeout=10.0, keepalive=1.0)
    backoff = acquisition_backoff(config)
    assert min(min(first(backoff, 30)) for _ in range(50)) >= MIN_PAUSE


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"initial": 1e-300, "cap": 1e-300}, r"initial must be at least 0.001s"),
        ({"initial": 0.0009, "cap": 1.0}, r"initial must be at least 0.001s"),
        ({"initial": 0.0, "cap": 1.0}, "initial must be a positive number"),
        ({"initial": 0.1, "cap": float("inf")}, "cap must be a positive number"),
        ({"initial": True, "cap": 1.0}, "initial must be a number of seconds"),
        ({"initial": 2.0, "cap": 1.0}, r"cap \(1.0s\) must be at least its initial"),
        ({"initial": 0.1, "cap": 1.0, "jitter": 1.5}, "jitter must be a fraction"),
        ({"initial": 0.1, "cap": 1.0, "jitter": -0.1}, "jitter must be a fraction"),
    ],
)
def test_a_bad_policy_is_refused_when_built(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Backoff(**settings)


def test_a_committer_refuses_a_backoff_that_is_not_a_policy() -> None:
    """``backoff=2.0`` (a number of seconds, not a policy) fails when built, not at the
    first retry of a batch."""
    with pytest.raises(ValueError, match=r"backoff must be a retry\.Backoff"):
        GroupCommitter(InMemoryStore(), 1, TimeBase.now(), backoff=2.0)  # type: ignore[arg-type]


async def test_a_cancellation_that_arrives_as_the_work_fails_is_never_lost() -> None:
    """A connect that fails (a refused port) in the same loop turn as the caller's
    cancellation ends in the cancellation: ``asyncio.wait_for`` before 3.12 raises the
    connect's error there, which the retry loop would take as transient and retry forever;
    ``bounded`` raises the cancellation."""
    loop = asyncio.get_running_loop()
    work: asyncio.Future[int] = loop.create_future()
    waiter = asyncio.ensure_future(bounded(work, 5))
    await asyncio.sleep(0)  # waiting on work now
    work.set_exception(ConnectionRefusedError("refused"))
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter


async def test_a_caller_cancelled_during_the_grace_still_stops_the_work() -> None:
    """A lock session's statement timed out: its socket was aborted, and the statement gets
    a grace to end. The caller cancelled meanwhile (a store closing) is answered at once,
    and the statement that ignored the abort is cancelled, not left running unowned."""
    ended = asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.sleep(3600)  # a statement the abort did not end
        finally:
            ended.set()

    caller = asyncio.ensure_future(bounded(work(), 0.01, abort=lambda: None, grace=60))
    await asyncio.sleep(0.2)  # timed out; now in the grace
    assert not caller.done()
    assert not ended.is_set()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await until(ended.is_set, "the abandoned work to be stopped", within=10)


async def test_what_the_work_made_is_discarded_when_the_caller_is_cancelled_as_it_stops() -> None:
    """A connect that timed out was cancelled, but completes its handshake anyway (the
    cancel came too late); the caller, cancelled while waiting for it to stop, is answered
    at once, and the connection it made is still closed, not left checked out."""
    finish = asyncio.Event()
    discarded: list[str] = []

    async def connect() -> str:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await finish.wait()  # the handshake ends regardless
        return "connection"

    async def close(connection: str) -> None:
        await asyncio.sleep(0.01)
        discarded.append(connection)

    caller = asyncio.ensure_future(bounded(connect(), 0.01, discard=close))
    await asyncio.sleep(0.2)  # timed out; the connect was cancelled and is awaited
    assert not caller.done()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    finish.set()
    await until(lambda: discarded == ["connection"], "the late connection to be closed")


async def test_a_discard_under_way_is_not_cut_short_by_the_callers_cancellation() -> None:
    closing = asyncio.Event()
    closed: list[str] = []

    async def close(connection: str) -> None:
        closing.set()
        await asyncio.sleep(0.1)
        closed.append(connection)

    async def connect() -> str:
        with contextlib.suppress(asyncio.CancelledError):  # completes anyway
            await asyncio.sleep(60)
        return "connection"

    caller = asyncio.ensure_future(bounded(connect(), 0.01, discard=close))
    await closing.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await until(lambda: closed == ["connection"], "the discard to finish")


async def test_a_pause_woken_as_it_is_cancelled_raises_the_cancellation() -> None:
    event = asyncio.Event()
    sleeper = asyncio.ensure_future(pause(5, event))
    await asyncio.sleep(0)
    event.set()
    sleeper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sleeper
    assert await pause(5, event)  # set: returns at once
    assert not await pause(0.01, asyncio.Event())


# --- the retry policy and its loop --------------------------------------------------------------

_FAST = Backoff(initial=0.001, cap=0.001)


class _Told(Retry):
    """A policy that maps every failure to ``error`` (``None``: not the store's), records
    each run of failures it is told of, and stops while pausing when ``stop`` is set."""

    def __init__(self, error: StoreError | None, *, stop: bool = False) -> None:
        super().__init__(_FAST)
        self.error = error
        self.stop = stop
        self.failures: list[int] = []

    def classify(self, exc: Exception) -> StoreError | None:
        return self.error

    async def next_pause(self, error: StoreError, failures: int) -> float:
        self.failures.append(failures)
        return await super().next_pause(error, failures)

    async def wait(self, seconds: float, error: StoreError) -> None:
        if self.stop:
            raise RuntimeError(f"stopped after {error}") from error
        await super().wait(seconds, error)


async def test_retry_retries_transient_errors_until_the_attempt_succeeds() -> None:
    calls = 0

    async def attempt() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise OSError("refused")
        return "done"

    policy = _Told(UnavailableError("refused"))
    assert await policy.run(attempt) == "done"
    assert policy.failures == [1, 2]


async def _refused() -> None:
    raise OSError("refused")


@pytest.mark.parametrize(
    ("error", "stop", "raised", "cause"),
    [
        (None, False, OSError, None),  # not the store's: raised as it is
        (StoreError("permanent"), False, StoreError, OSError),
        (UnavailableError("down"), True, RuntimeError, UnavailableError),
    ],
    ids=["not-ours", "not-transient", "stopped"],
)
async def test_retry_raises_what_it_does_not_retry_and_stops_when_the_policy_raises(
    error: StoreError | None, stop: bool, raised: type[Exception], cause: Any
) -> None:
    with pytest.raises(raised) as caught:
        await _Told(error, stop=stop).run(_refused)
    if cause is None:
        assert caught.value.__cause__ is None
    else:
        assert isinstance(caught.value.__cause__, cause)
    if stop:  # the stop names the last error, which names the failure it translates
        assert caught.value.__cause__ is not None
        assert isinstance(caught.value.__cause__.__cause__, OSError)


# --- TimeLimit: one timer for a store's commits ---------------------------------------------


async def _within(seconds: float, work: Awaitable[object]) -> None:
    """``work`` under the caller's own timeout, in the caller's task where Python can."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            await work
    else:
        await asyncio.wait_for(work, seconds)


def _cancel_requests() -> int:
    """Cancellation requests pending on the running task (counted from Python 3.11; before,
    ``TimeLimit`` runs ``bounded``, whose work is a task of its own)."""
    task = asyncio.current_task()
    assert task is not None
    if sys.version_info >= (3, 11):
        return task.cancelling()
    return 0


async def _never(cancelled: list[str]) -> int:
    """Work that never ends by itself; records its cancellation."""
    try:
        await asyncio.get_running_loop().create_future()
    except asyncio.CancelledError:
        cancelled.append("cancelled")
        raise
    raise AssertionError("unreachable")


async def test_an_await_past_its_limit_is_cancelled_and_raises_timeout() -> None:
    limit = TimeLimit(0.5)
    cancelled: list[str] = []
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"within 0\.5 s"):
        await limit.run(_never(cancelled))
    assert time.monotonic() - started >= 0.5
    assert cancelled == ["cancelled"]
    # The task is not left cancelling: the timer's cancellation was the limit's own.
    assert _cancel_requests() == 0
    # And the limit goes on for the next await.
    assert await limit.run(asyncio.sleep(0, result=7)) == 7
    with pytest.raises(TimeoutError):
        await limit.run(_never(cancelled))


async def test_each_await_is_cut_at_its_own_limit_not_at_an_earlier_ones() -> None:
    """The one timer is set for the earliest limit: an await that began later is not cut
    with it, and finishes when it is done, within its own limit."""
    limit = TimeLimit(2.0)
    first_cut = asyncio.Event()

    async def first() -> None:
        try:
            await limit.run(_never([]))
        finally:
            first_cut.set()

    async def second() -> str:
        await first_cut.wait()
        return "done"

    early = asyncio.ensure_future(first())
    await asyncio.sleep(1.0)  # the second's limit ends a second after the first's
    late = asyncio.ensure_future(limit.run(second()))
    with pytest.raises(TimeoutError):
        await early
    assert await late == "done"
    # Many at once: every one past its limit is cut, each task only once.
    outcomes = await asyncio.gather(
        *(limit.run(_never([])) for _ in range(20)), return_exceptions=True
    )
    assert [type(o) for o in outcomes] == [TimeoutError] * 20


async def test_a_callers_cancellation_is_raised_as_a_cancellation_not_a_timeout() -> None:
    limit = TimeLimit(30.0)
    cancelled: list[str] = []
    waiter = asyncio.ensure_future(limit.run(_never(cancelled)))
    await until(lambda: bool(limit._running), "the await to begin")
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert cancelled == ["cancelled"]
    assert not limit._running
    # A caller's shorter timeout around it is the caller's: its TimeoutError, its task
    # left with no cancellation pending.
    with pytest.raises(TimeoutError):
        await _within(0.2, limit.run(_never(cancelled)))
    assert _cancel_requests() == 0


async def test_work_that_ends_despite_the_cut_gives_its_result_and_leaves_no_cancel() -> None:
    """Work that swallows the cancellation and returns (as a connection's close might):
    its result stands, and its task is not left cancelling, so the next await is not
    cancelled by a request nobody made."""
    limit = TimeLimit(0.3)

    async def stubborn() -> str:
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            return "finished anyway"
        raise AssertionError("unreachable")

    assert await limit.run(stubborn()) == "finished anyway"
    assert _cancel_requests() == 0
    await asyncio.sleep(0.05)  # no cancellation arrives at the next await


async def test_an_await_inside_another_of_the_same_task_is_still_limited() -> None:
    limit = TimeLimit(0.5)
    with pytest.raises(TimeoutError):
        await limit.run(limit.run(_never([])))
    assert not limit._running


def test_a_limit_keeps_working_on_the_next_event_loop() -> None:
    """A timer set on a loop that closed before it fired is not waited for on the next."""
    limit = TimeLimit(0.5)

    async def quick() -> int:
        return await limit.run(asyncio.sleep(0, result=1))

    assert asyncio.run(quick()) == 1  # its timer was set on that loop, and never fired

    async def slow() -> None:
        await limit.run(_never([]))

    with pytest.raises(TimeoutError, match=r"within 0\.5 s"):
        asyncio.run(asyncio.wait_for(slow(), timeout=30))


def test_an_await_left_on_a_closed_loop_does_not_stop_the_limit_on_the_next() -> None:
    """A loop closed while an await under the limit was still running (its task never
    ended, so it never left the limit): on the next loop the limit still cuts each await
    at its own time, and keeps nothing of the closed loop's."""
    limit = TimeLimit(0.5)
    old = asyncio.new_event_loop()
    try:
        left = old.create_task(limit.run(_never([])))
        old.run_until_complete(asyncio.sleep(0.05))  # it waits, under the limit
        assert not left.done()
    finally:
        old.close()
    # It can never end now: the limit must let go of it (then it is destroyed pending, as
    # any task of a closed loop is; that is no news here).
    left._log_destroy_pending = False  # type: ignore[attr-defined]
    del left

    async def slow() -> None:
        await limit.run(_never([]))

    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"within 0\.5 s"):
        asyncio.run(asyncio.wait_for(slow(), timeout=20))
    assert time.monotonic() - started < 15  # cut by the limit, not by the caller's 20 s
    assert not limit._running
    assert not limit._expired
