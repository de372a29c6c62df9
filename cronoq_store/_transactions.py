"""A store transaction on a pooled session for reads, recovery, pruning and migrations: on
the store's own sessions SQLAlchemy's ``BEGIN``, or the store's opening message, which sets
the store's settings for that transaction alone (on a borrowed session: an application's
engine, a transaction-pooling PgBouncer). The commits' connections are
:mod:`cronoq_store._held_connection`'s.

Both run the work again, once, on the same connection, when its session had lost the
driver's prepared statements (:func:`~cronoq_store._driver.forget_lost_statements`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from sqlalchemy import ClauseElement
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ._driver import forget_lost_statements

__all__ = ["opening", "run"]

_T = TypeVar("_T")


def opening(statements: Sequence[ClauseElement], dialect: Dialect) -> str:
    """``statements`` (``BEGIN`` first, none with parameters) as one simple-protocol message
    for :func:`run`: no more round trips than SQLAlchemy's ``BEGIN``."""
    compiled = [statement.compile(dialect=dialect) for statement in statements]
    if any(c.params for c in compiled):
        raise ValueError("an opening takes no parameters")
    return "; ".join(c.string for c in compiled)


async def run(
    db: AsyncEngine, opening: str | None, work: Callable[[AsyncConnection], Awaitable[_T]]
) -> _T:
    """``work`` on a pooled connection in a transaction, with the cluster's schema applied
    (``db``'s execution options); it commits when ``work`` returns. ``opening``: the message
    that opens the transaction with the store's settings (:func:`opening`), or ``None`` for
    SQLAlchemy's ``BEGIN`` (the session's own settings are the store's).

    If the session had lost prepared statements the driver or SQLAlchemy made on it (an
    application's ``DISCARD ALL`` between two checkouts), their caches are emptied and
    ``work`` runs again on the same connection (another of the pool may have lost them
    too). That is safe: the statement the server did not find failed the transaction, so
    nothing ``work`` wrote stayed. A second loss in a row is raised.
    """
    async with db.connect() as conn:
        try:
            return await _attempt(conn, opening, work)
        except Exception as exc:
            if conn.invalidated or not await _forgot(conn, exc):
                raise
        try:
            return await _attempt(conn, opening, work)
        except Exception as exc:
            if not conn.invalidated:
                await _forgot(conn, exc)
            raise


async def _forgot(conn: AsyncConnection, exc: BaseException) -> bool:
    """Whether ``exc`` was a lost prepared statement on ``conn``, now forgotten, with the
    failed transaction ended for SQLAlchemy too."""
    if not await forget_lost_statements(exc, await conn.get_raw_connection()):
        return False
    await conn.rollback()
    return True


async def _attempt(
    conn: AsyncConnection, opening: str | None, work: Callable[[AsyncConnection], Awaitable[_T]]
) -> _T:
    async with _transaction(conn, opening):
        return await work(conn)


@asynccontextmanager
async def _transaction(conn: AsyncConnection, opening: str | None) -> AsyncIterator[None]:
    """A transaction on ``conn``, under the store's settings. A failure inside is raised as
    it is, never replaced by the rollback's on a connection that is gone.

    With ``opening`` the store opens the transaction itself (on a borrowed session: the
    message that sets the store's settings for it alone, the writer's
    :attr:`~cronoq_store._writer.BatchWriter.borrowed_opening`), and the driver adapter
    sends no ``BEGIN`` of its own meanwhile (its DBAPI ``autocommit``; SQLAlchemy's
    isolation-level option would leave the application's session reset to another level).
    A connection left in doubt (a failed rollback, a cancellation) is discarded.
    """
    if opening is None:
        failure: BaseException | None = None
        try:
            async with conn.begin():
                try:
                    yield
                except BaseException as exc:
                    failure = exc
                    raise
        except BaseException as exc:
            if failure is None or exc is failure:
                raise
            # The rollback failed too, on a connection that is gone (a crash): the
            # first failure is what explains it.
            raise failure from None
        return
    pooled = await conn.get_raw_connection()
    adapter: Any = pooled.dbapi_connection
    driver: Any = pooled.driver_connection
    adapter.autocommit = True
    try:
        await driver.execute(opening)
        yield
        await driver.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(Exception):
            await driver.execute("ROLLBACK")
        if driver.is_closed() or driver.is_in_transaction():
            driver.terminate()
            await conn.invalidate()
        raise
    finally:
        adapter.autocommit = False
