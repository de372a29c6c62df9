"""The held connection's life: the pooled connection a commit runs on, checked out, kept
between commits for the writer, and given up when in doubt.

SQLAlchemy does not see what runs on the driver connection under a pooled one
(:mod:`cronoq_store._driver`), so this module decides what the pool would: a connection
left in doubt is invalidated instead of returned, and one of a disposed pool (a demoted
primary) is closed instead of kept. A session that lost the driver's prepared statements
(an application's ``DISCARD ALL`` on a shared pool) has its caches emptied and the commit
runs again on it, once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import Pool, PoolProxiedConnection
from sqlalchemy.util import greenlet_spawn

from ._driver import forget_lost_statements, leaves_connection_sound

__all__ = ["HeldConnection"]

_T = TypeVar("_T")


class HeldConnection:
    """The commits' connections from ``engine``'s pool.

    ``hold``: keep one pooled connection checked out between commits (the writer's, for the
    term) instead of a checkout and a return per commit, which cost a greenlet switch each
    and the pool's bookkeeping. One commit at a time uses it; a concurrent one checks out
    another as before. It is given up, never reused, when in doubt (as any connection of a
    failed commit), when the server closed it, or when the pool it came from was disposed
    (a demoted primary); and returned by :meth:`release` (``PgStore`` calls it at close,
    ``release_leadership``, fencing, the first commit refused after a lost term, and
    ``acquire_leadership``: a standby holds none, a new term takes a fresh one).
    """

    def __init__(self, engine: AsyncEngine, *, hold: bool = False) -> None:
        self._engine = engine
        self._hold = hold
        self._held: PoolProxiedConnection | None = None
        self._held_from: Pool | None = None  # the pool it came from
        self._held_busy = False
        self._releases = 0  # a connection checked out before a release is not held

    @property
    def held(self) -> PoolProxiedConnection | None:
        """The connection kept between commits, if any."""
        return self._held

    async def release(self) -> None:
        """Return the held connection to the pool (a commit using it returns it when done);
        a later commit holds one again."""
        held, busy = self._held, self._held_busy
        self._held, self._held_busy = None, False
        self._releases += 1
        if held is not None and not busy:
            if self._held_from is not self._engine.sync_engine.pool:
                # Its pool was disposed (a demoted primary): it would stay open there.
                _driver(held).terminate()
                held.invalidate()
            await greenlet_spawn(held.close)

    async def _checkout(self) -> PoolProxiedConnection:
        """The held connection if it is free and sound, else one from the pool."""
        held = self._held
        if held is None or self._held_busy:
            return await self._engine.raw_connection()
        if self._held_from is self._engine.sync_engine.pool and not _driver(held).is_closed():
            self._held_busy = True
            return held
        # What the pool's checkout check would refuse, or a connection of a pool disposed
        # since (a demoted primary): discarded, never reused.
        self._held = None
        _driver(held).terminate()
        held.invalidate()
        await greenlet_spawn(held.close)
        return await self._engine.raw_connection()

    async def run(self, work: Callable[[Any], Awaitable[_T]]) -> _T:
        """``work`` on a pooled connection's asyncpg connection (the commit path's
        ``BatchWriter``), and once more on the same one if its session had lost prepared
        statements the driver made on it (:func:`~cronoq_store._driver.forget_lost_statements`).

        Running the commit again is safe: the statement the server did not find failed the
        transaction it was in, or was the transaction, so the attempt wrote nothing; and
        commits are idempotent besides (a batch that landed changes nothing the second
        time). A second loss in a row is raised: the statements were just made anew, so
        something else than a reset shares the session (a transaction pooler).
        """
        async with self._driver_connection() as pooled:
            try:
                return await work(_driver(pooled))
            except Exception as exc:
                if not await forget_lost_statements(exc, pooled):
                    raise
            try:
                return await work(_driver(pooled))
            except Exception as exc:
                # Left with no stale statement either way.
                await forget_lost_statements(exc, pooled)
                raise

    @asynccontextmanager
    async def _driver_connection(self) -> AsyncIterator[PoolProxiedConnection]:
        """A pooled connection whose asyncpg connection the commit path uses.

        SQLAlchemy does not see what runs on it, so a connection that may be left in doubt
        (closed, still in a transaction, or interrupted by a timeout or a driver error) is
        invalidated here instead of going back to the pool. A server's error leaves it
        usable: asyncpg rolled the transaction back. With ``hold``, a sound connection is
        kept as the held one when none is (and none was released meanwhile).
        """
        pool, releases = self._engine.sync_engine.pool, self._releases
        pooled = await self._checkout()
        driver = _driver(pooled)
        sound = False
        try:
            yield pooled
            sound = True
        except BaseException as exc:
            if leaves_connection_sound(exc, driver):
                sound = True
            else:
                if pooled is self._held:
                    self._held, self._held_busy = None, False
                # Close the socket first: a graceful close waits for the operation in
                # progress and fails ("another operation is in progress") after a timeout
                # or cancellation, which would mask the error being raised.
                driver.terminate()
                pooled.invalidate()
            raise
        finally:
            if pooled is self._held:
                self._held_busy = False
            elif sound and self._hold and self._held is None and self._releases == releases:
                self._held, self._held_from = pooled, pool
            else:
                if sound and pool is not self._engine.sync_engine.pool:
                    # Its pool was disposed meanwhile (close(), a demoted primary): returned
                    # there, it would stay open, never handed out nor closed.
                    driver.terminate()
                    pooled.invalidate()
                # Back to the pool (or, invalidated, discarded). Inside a greenlet, because
                # the pool's reset-on-return may call the driver; it has nothing to roll back.
                await greenlet_spawn(pooled.close)


def _driver(pooled: PoolProxiedConnection) -> Any:
    """The asyncpg connection under a pooled one."""
    return pooled.driver_connection
