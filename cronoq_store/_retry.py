"""The one retry policy: capped exponential backoff with jitter, for every retry loop.

Transient failures (``UnavailableError``) are retried after a pause that doubles from
``initial`` up to ``cap``, with part of it drawn at random so that instances that failed
together do not retry together. The group committer retries a failed batch with
:data:`COMMIT_BACKOFF`; leader acquisition retries reaching the database with
:func:`acquisition_backoff`. Changing how the store waits between attempts is a change to
this module only. (A task's own retries, ``domain.RetryPolicy``, are the scheduler's.)
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from ._config import PgStoreConfig as PgStoreConfig
from ._domain import check_seconds as check_seconds

__all__ = [
    "COMMIT_BACKOFF",
    "MIN_PAUSE",
    "Backoff",
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


# ``asyncio.wait_for`` before Python 3.12 loses a cancellation that arrives as its awaitable
# finishes (it returns that result or raises that error instead): a retry loop around it
# then keeps retrying in a task its caller has cancelled and is waiting for. Seen here: a
# cancelled ``acquire_leadership`` retried forever when a refused connect and the cancel
# came together. These two never lose one.


async def bounded(
    work: Awaitable[_T],
    seconds: float,
    *,
    discard: Callable[[_T], Awaitable[object]] | None = None,
) -> _T:
    """``await work`` for at most ``seconds`` (``asyncio.TimeoutError`` after); a
    cancellation of the caller cancels ``work`` and is raised, whatever ``work`` did.

    ``discard`` frees what ``work`` made when nobody gets it: a result that arrived in the
    same loop turn as the caller's cancellation, or as the timeout's (a connection opened
    just then would otherwise stay open, and checked out, for good).
    """
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except BaseException:
        await _abandon(task, discard)
        raise
    if not done:
        await _abandon(task, discard)
        raise asyncio.TimeoutError(f"no answer within {seconds:g} s")
    return task.result()


async def _abandon(
    task: asyncio.Future[_T], discard: Callable[[_T], Awaitable[object]] | None
) -> None:
    """Cancel ``task``, whose result nobody will get, and discard the result it had anyway."""
    if not task.done():
        task.cancel()
        await asyncio.wait({task})
    if discard is not None and not task.cancelled() and task.exception() is None:
        await discard(task.result())


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
