"""One Alembic run at a time in this process, whatever loop or thread starts it.

Alembic keeps the running migration in module globals (the ``alembic.context`` and
``alembic.op`` proxies), and the greenlets of concurrent ``run_sync`` calls interleave at
every I/O: two runs at once share them (``KeyError: 'script'``, one schema's DDL on another's
connection). The database's advisory lock serializes runs of one schema across processes;
this lock serializes every run inside one process.

It is a ``threading.Lock`` (runs can start on several loops in several threads), never
waited on in a way that blocks a loop that may hold it: a coroutine, or sync code inside a
SQLAlchemy greenlet, polls it and yields to its loop meanwhile; only a thread that runs no
loop (or whose loop is already blocked by the caller's sync code) waits on it outright, and
one whose own loop holds the lock is refused instead of deadlocking.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from alembic.runtime.environment import EnvironmentContext
from sqlalchemy.util.concurrency import await_, in_greenlet

from .errors import MigrationError

__all__ = ["HELD", "held", "held_async", "resolve"]

#: ``Config.attributes`` key set by a caller that already holds the lock for this run.
HELD = "cronoq_store.migration_lock_held"
#: How often a waiting coroutine tries the lock again.
_POLL = 0.01

_lock = threading.Lock()
#: The loop whose coroutine holds the lock, if one does.
_owner: asyncio.AbstractEventLoop | None = None


async def _acquire() -> None:
    global _owner
    # Polled: an asyncio primitive cannot be woken by a holder on another loop or thread.
    while not _lock.acquire(blocking=False):  # noqa: ASYNC110
        await asyncio.sleep(_POLL)
    _owner = asyncio.get_running_loop()


def _release() -> None:
    global _owner
    _owner = None
    _lock.release()


@asynccontextmanager
async def held_async() -> AsyncIterator[None]:
    """Hold the lock in a coroutine; waiting yields to the loop (its holder may be on it)."""
    await _acquire()
    try:
        yield
    finally:
        _release()


@contextmanager
def held(environment: EnvironmentContext) -> Iterator[None]:
    """Hold the lock for the run of ``environment``, unless its caller already does.

    On leaving, the run's own proxies are installed again: a run that started meanwhile
    replaced them before it queued here, and Alembic removes them when this run ends.
    """
    if environment.config.attributes.get(HELD):
        try:
            yield
        finally:
            environment._install_proxy()
        return
    if in_greenlet():
        await_(_acquire())
    else:
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None and _owner is loop:
            raise MigrationError(
                "a migration is running on this event loop, and Alembic was called "
                "synchronously on the same loop, which blocks it: await "
                "cronoq_store.migrations.upgrade() (or use AsyncConnection.run_sync) instead"
            )
        _lock.acquire()
    try:
        yield
    finally:
        environment._install_proxy()
        _release()


def resolve(context: Any) -> EnvironmentContext:
    """The ``EnvironmentContext`` of this run itself, not the module proxy another run can
    replace (``env.py`` passes ``alembic.context``, a module that proxies the current run)."""
    proxy = getattr(context, "_proxy", None)
    if isinstance(proxy, EnvironmentContext):
        return proxy
    assert isinstance(context, EnvironmentContext), "run by Alembic's EnvironmentContext"
    return context
