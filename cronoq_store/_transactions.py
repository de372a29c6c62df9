"""A store transaction on a pooled session for reads and look-ups: on the store's own
sessions SQLAlchemy's ``BEGIN``; on borrowed ones (an application's engine, a
transaction-pooling PgBouncer) the message that sets the store's settings for that
transaction alone. The commits' connections are :mod:`cronoq_store._held_connection`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

__all__ = ["transaction"]


@asynccontextmanager
async def transaction(
    db: AsyncEngine, borrowed_opening: str | None
) -> AsyncIterator[AsyncConnection]:
    """A pooled connection in a transaction, with the cluster's schema applied, under
    the store's settings. A failure inside is raised as it is, never replaced by the
    rollback's on a connection that is gone.

    On a borrowed session the store opens the transaction itself, with the message that
    sets them for it alone (``borrowed_opening``, the writer's
    :attr:`~cronoq_store._writer.BatchWriter.borrowed_opening`: no more round trips than
    SQLAlchemy's ``BEGIN``), and the driver adapter sends no ``BEGIN`` of its own
    meanwhile (its DBAPI ``autocommit``; SQLAlchemy's isolation-level option would
    leave the application's session reset to another level). A connection left in
    doubt (a failed rollback, a cancellation) is discarded.
    """
    if borrowed_opening is None:
        failure: BaseException | None = None
        try:
            async with db.begin() as conn:
                try:
                    yield conn
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
    async with db.connect() as conn:
        pooled = await conn.get_raw_connection()
        adapter: Any = pooled.dbapi_connection
        driver: Any = pooled.driver_connection
        adapter.autocommit = True
        try:
            await driver.execute(borrowed_opening)
            yield conn
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
