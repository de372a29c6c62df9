"""How the store retries and waits, in one module: the pauses, the retry policy and its
loop, the one timeout.

:class:`Retry` is the policy of every retry (the group committer's commit, leader
acquisition) with its loop: what is retried is a transient ``StoreError``
(``is_transient``), the pauses are a :class:`Backoff`'s, capped exponential with jitter so
that instances that failed together do not retry together, and the loop stops by an
exception that the attempt or the policy raises. The committer uses
:data:`COMMIT_BACKOFF`, acquisition :func:`acquisition_backoff`. :func:`bounded` is the one
timeout around a wait on the database; :class:`TimeLimit` the same for a store's commits,
with one timer for all of them. Changing how the store retries or waits is a change
to this module only. (A task's own retries, ``domain.RetryPolicy``, are the scheduler's.)
"""

from __future__ import annotations

import asyncio
import random
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ._config import PgStoreConfig
from ._domain import check_seconds
from ._errors import StoreError

__all__ = [
    "COMMIT_BACKOFF",
    "MIN_PAUSE",
    "Backoff",
    "Retry",
    "TimeLimit",
    "acquisition_backoff",
    "bounded",
    "pause",
]

_T = TypeVar("_T")

#: Each pause's ceiling is the previous one times this, until ``cap``.
_GROWTH = 2.0
#: The shortest pause (seconds) between two attempts: below it a retry loop against a
#: server that refuses at once spins a core and floods the server's log.
MIN_PAUSE = 0.001


@dataclass(frozen=True, slots=True)
class Backoff:
    """Pauses between attempts, in float seconds: ``initial``, doubling, never over ``cap``.

    ``jitter`` is the share of each pause drawn at random: the pause before retry *n*
    (from 0) is uniform in ``[c * (1 - jitter), c]`` where ``c = min(cap, initial * 2**n)``.
    ``1.0`` is full jitter, ``0.0`` none. ``rng`` makes the draws reproducible (tests); by
    default they come from the :mod:`random` module's shared generator. No pause is shorter
    than :data:`MIN_PAUSE`: ``initial`` below it is refused, and a jittered draw below it is
    raised to it.
    """

    initial: float
    cap: float
    jitter: float = 1.0
    rng: random.Random | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("initial", "cap"):
            value = check_seconds(f"backoff {name}", getattr(self, name))
            if value < MIN_PAUSE:
                raise ValueError(
                    f"backoff {name} must be at least {MIN_PAUSE}s (a shorter pause is a busy "
                    f"loop), got {value!r}"
                )
        if self.cap < self.initial:
            raise ValueError(
                f"backoff cap ({self.cap}s) must be at least its initial delay ({self.initial}s)"
            )
        jitter = self.jitter
        if isinstance(jitter, bool) or not isinstance(jitter, (int, float)) or not 0 <= jitter <= 1:
            raise ValueError(f"backoff jitter must be a fraction from 0 to 1, got {jitter!r}")

    def delays(self) -> Iterator[float]:
        """The pauses of one run of consecutive failures, endless: take one per failure and
        start a new run once an attempt succeeds."""
        draw = self.rng.random if self.rng is not None else random.random
        ceiling = float(self.initial)
        while True:
            yield max(MIN_PAUSE, ceiling * (1.0 - self.jitter * draw()))
            ceiling = min(self.cap, ceiling * _GROWTH)


#: A batch's commit: retried at once after a blip, every 2 s at most through an outage
#: (commits are idempotent, and only the leader commits, so nothing herds).
COMMIT_BACKOFF = Backoff(initial=0.05, cap=2.0)


def acquisition_backoff(config: PgStoreConfig) -> Backoff:
    """Reaching the database while acquiring leadership: never longer than ``lock_poll``.

    A standby polls the lock every ``lock_poll`` while the database answers, so capping its
    reconnect pause there costs about what polling does, and keeps the takeover bound after
    an outage: once the server accepts connections again, a standby's next attempt starts
    within ``lock_poll`` of its last failed one, and it leads as soon as that attempt has
    connected (bounded by ``session_timeout``) and taken the lock, which nobody holds after
    a restart: within ``session_timeout + lock_poll`` of the server's return. Each pause is
    at least half its ceiling: through a long outage, at most two attempts per ``lock_poll``.
    """
    cap = max(config.lock_poll, MIN_PAUSE)
    return Backoff(initial=max(cap / 4, MIN_PAUSE), cap=cap, jitter=0.5)


class Retry:
    """A retry policy and its loop: :meth:`run` awaits an attempt until one succeeds, and
    stops only by an exception, raised by the attempt or by the policy.

    - What is retried: :meth:`classify` maps a failure to the store's error (``None``: not
      the store's, raised as it is); a transient one is retried, any other raised (``from``
      the failure when it is a translation of it).
    - The pauses: the ``backoff``'s, one run of them per policy object, so make one for
      each operation to retry.
    - When to stop: after each transient failure :meth:`next_pause` gives the pause to take
      or raises (a stuck batch, an abort); :meth:`wait` takes it or raises (closed while
      pausing). The stop's exception names the last error as its cause.

    Each caller subclasses it with its own classification, accounting and stop: the
    group committer's commit (``_committer.CommitRetry``), leader acquisition
    (``_leadership``).
    """

    __slots__ = ("_delays",)

    def __init__(self, backoff: Backoff) -> None:
        self._delays = backoff.delays()

    def classify(self, exc: Exception) -> StoreError | None:
        """The store's error that ``exc`` is or translates to; ``None`` for any other."""
        return exc if isinstance(exc, StoreError) else None

    async def next_pause(self, error: StoreError, failures: int) -> float:
        """The pause before the next attempt, ``failures`` transient failures in a row
        having ended with ``error``; raise to stop instead."""
        return next(self._delays)

    async def wait(self, seconds: float, error: StoreError) -> None:
        """Pause ``seconds`` before the next attempt; raise to stop instead."""
        await asyncio.sleep(seconds)

    async def run(self, attempt: Callable[[], Awaitable[_T]]) -> _T:
        """``await attempt()`` until it succeeds, or until the policy stops the loop."""
        failures = 0
        while True:
            try:
                return await attempt()
            except Exception as exc:
                error = self.classify(exc)
                if error is None or (error is exc and not error.is_transient):
                    raise
                if not error.is_transient:
                    raise error from exc
                if error is not exc:
                    error.__cause__ = exc  # a translation names what it translates
            failures += 1
            await self.wait(await self.next_pause(error, failures), error)


# ``asyncio.wait_for`` before Python 3.12 loses a cancellation that arrives as its awaitable
# finishes (it returns that result or raises that error instead): a retry loop around it
# then keeps retrying in a task its caller has cancelled and is waiting for (a cancelled
# ``acquire_leadership`` whose connect is refused in the same loop turn would retry for
# ever). :func:`bounded` never loses one.


async def bounded(
    work: Awaitable[_T],
    seconds: float,
    *,
    discard: Callable[[_T], Awaitable[object]] | None = None,
    abort: Callable[[], object] | None = None,
    grace: float = 0.0,
    silent: str = "no answer",
) -> _T:
    """``await work`` for at most ``seconds`` (``asyncio.TimeoutError`` after, saying
    ``silent``); a cancellation of the caller stops ``work`` and is raised, whatever
    ``work`` did: the store's one timeout.

    ``work`` is stopped by cancelling it, or, with ``abort``, by calling ``abort`` (a lock
    session drops its socket, where a cancel would send a request into the same silence)
    and cancelling only if ``work`` has not ended ``grace`` seconds later. ``discard`` frees
    what ``work`` made when nobody gets it: a result that arrived in the same loop turn as
    the caller's cancellation, or as the timeout's (a connection opened just then would
    otherwise stay open, and checked out, for good). With neither, no task is made (a
    commit's few event-loop turns, on Python 3.11 and later).
    """
    if discard is None and abort is None and sys.version_info >= (3, 11):
        try:
            async with asyncio.timeout(seconds) as scope:
                return await work
        except TimeoutError:
            if scope.expired():
                raise TimeoutError(f"{silent} within {seconds:g} s") from None
            raise
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except BaseException:
        await _abandon(task, discard, abort, grace)
        raise
    if not done:
        await _abandon(task, discard, abort, grace)
        raise asyncio.TimeoutError(f"{silent} within {seconds:g} s")
    return task.result()


class TimeLimit:
    """:func:`bounded` for each of many short awaits, ``seconds`` each (a store's commits),
    kept by one timer for all of them.

    ``asyncio.timeout``, under :func:`bounded`, makes a timer handle for each await and
    cancels it after: 4.3 us per await on this project's machines, against a bare await's
    2.1 (``asyncio.sleep(0)``), and a commit of one task costs the client about 100 us.
    Here an await costs a dictionary entry; the one timer is set for the earliest limit
    running (every later await's ends later: the seconds are the same), and when it fires,
    it cancels what outlived its limit and is set for the next. An await cut short raises
    ``TimeoutError``; a cancellation of the caller is raised as it is, as with
    ``asyncio.timeout`` (``Task.uncancel`` tells them apart: before Python 3.11, and for
    an await inside another of the same task, :func:`bounded` runs instead).
    """

    __slots__ = ("_expired", "_running", "_timer", "_timer_loop", "seconds")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._running: dict[asyncio.Task[Any], float] = {}  # each await's task: its limit
        self._expired: set[asyncio.Task[Any]] = set()  # cancelled by the timer
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None

    async def run(self, work: Awaitable[_T]) -> _T:
        """``await work`` for at most :attr:`seconds` (``TimeoutError`` after)."""
        task = asyncio.current_task()
        if task is None or task in self._running or sys.version_info < (3, 11):
            return await bounded(work, self.seconds)
        loop = asyncio.get_running_loop()
        limit = loop.time() + self.seconds
        if self._timer_loop is not loop:
            self._move_to(loop)
        self._running[task] = limit
        if self._timer is None:
            self._timer = loop.call_at(limit, self._expire, loop)
        cancelling = task.cancelling()
        try:
            return await work
        except asyncio.CancelledError:
            if task in self._expired:
                self._expired.discard(task)
                if task.uncancel() <= cancelling:
                    raise TimeoutError(f"no answer within {self.seconds:g} s") from None
            raise
        finally:
            # Popped, not deleted: a task of a closed loop (:meth:`_move_to`) may end late,
            # when the garbage collector closes its coroutine.
            self._running.pop(task, None)
            if task in self._expired:
                # Cut short, yet the work ended otherwise (it ignored the cancellation, or
                # finished in the same loop turn): the cancellation was ours, not news.
                self._expired.discard(task)
                task.uncancel()

    def _move_to(self, loop: asyncio.AbstractEventLoop) -> None:
        """The first await on ``loop``: the timer is set there from now on, and the awaits
        of a loop that closed while they ran are forgotten. Their tasks never ended, and
        never will (cancelling one raises ``Event loop is closed``, in the timer, which
        would then cancel nothing more); kept, they would keep that loop's connections."""
        self._timer, self._timer_loop = None, loop
        for task in [t for t in self._running if t.get_loop().is_closed()]:
            del self._running[task]
            self._expired.discard(task)

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        """The timer: cancel each await past its limit; set the timer for the next limit."""
        if self._timer_loop is not loop:
            return  # a timer of a loop this limit has left (:meth:`_move_to`)
        self._timer = None
        now, earliest = loop.time(), None
        for task, limit in self._running.items():
            if task.get_loop() is not loop:
                continue  # another loop's, which ended while it ran
            if limit > now:
                earliest = limit if earliest is None else min(earliest, limit)
            elif task not in self._expired:
                self._expired.add(task)
                task.cancel()
        if earliest is not None:
            self._timer = loop.call_at(earliest, self._expire, loop)


async def _abandon(
    task: asyncio.Future[_T],
    discard: Callable[[_T], Awaitable[object]] | None,
    abort: Callable[[], object] | None,
    grace: float,
) -> None:
    """Stop ``task``, whose result nobody will get, and discard the result it had anyway;
    its error, the consequence of the stop, is not news.

    A caller cancelled meanwhile (while ``task`` is given its grace, stops, or its result
    is discarded) is not kept waiting, and loses nothing: ``task`` is cancelled at once
    and what it still makes is discarded when it ends (:func:`_discard_late`)."""
    cancelled = False
    try:
        if not task.done() and abort is not None:
            abort()
            await asyncio.wait({task}, timeout=grace)
        if not task.done():
            task.cancel()
            cancelled = True
            await asyncio.wait({task})
    except asyncio.CancelledError:
        if not cancelled:  # once: a second cancel would cut short the work's own cleanup
            task.cancel()
        task.add_done_callback(lambda done: _discard_late(done, discard))
        raise
    if task.cancelled() or task.exception() is not None:
        return
    if discard is not None:
        # Shielded: a caller cancelled now does not cut the discarding short.
        await asyncio.shield(_keep(discard(task.result())))


#: Discards that outlive the call that started them (:func:`_abandon`), kept referenced
#: until they end: the event loop holds only weak references to its tasks.
_LATE: set[asyncio.Future[object]] = set()


def _keep(work: Awaitable[object]) -> asyncio.Future[object]:
    """``work`` as a task kept in :data:`_LATE` until it ends; its error, if any, taken
    (a discard that fails leaves nothing more to free, and is no caller's news)."""
    late = asyncio.ensure_future(work)
    _LATE.add(late)

    def ended(done: asyncio.Future[object]) -> None:
        _LATE.discard(done)
        if not done.cancelled():
            done.exception()

    late.add_done_callback(ended)
    return late


def _discard_late(
    task: asyncio.Future[_T], discard: Callable[[_T], Awaitable[object]] | None
) -> None:
    """``task``'s result discarded once it ended, its error taken (the stop caused it)."""
    if task.cancelled() or task.exception() is not None:
        return
    if discard is not None:
        _keep(discard(task.result()))


async def pause(seconds: float, until: asyncio.Event) -> bool:
    """Sleep ``seconds`` or until ``until`` is set; whether it was set."""
    if until.is_set():
        return True
    waiter = asyncio.ensure_future(until.wait())
    try:
        await asyncio.wait({waiter}, timeout=seconds)
    finally:
        if not waiter.done():
            waiter.cancel()
    return until.is_set()
