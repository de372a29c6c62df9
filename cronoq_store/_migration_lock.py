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

Alembic installs its ``context`` proxy when a command starts, before ``env.py`` can take
the lock: callers therefore take it first (:func:`held_async` in
``migrations.upgrade``, :func:`held_for` in ``migrations.run_command``), and ``env.py``
refuses a run whose proxy another thread's raw ``alembic.command`` call replaced
(:func:`resolve`) rather than run the other command's migration.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import alembic.context
from alembic.config import Config
from alembic.runtime.environment import EnvironmentContext
from alembic.script import ScriptDirectory
from sqlalchemy.util.concurrency import await_, in_greenlet

from ._errors import MigrationError

__all__ = ["HELD", "held", "held_async", "held_for", "resolve"]

#: ``Config.attributes`` key set by a caller that already holds the lock for this run.
HELD = "cronoq_store.migration_lock_held"
#: How often a waiting coroutine tries the lock again.
_POLL = 0.01
#: A coroutine still waiting says so this often (seconds).
_REPORT_INTERVAL = 30.0

logger = logging.getLogger("cronoq_store")

_lock = threading.Lock()
#: The loop whose coroutine holds the lock, if one does.
_owner: asyncio.AbstractEventLoop | None = None


async def _acquire() -> None:
    global _owner
    loop = asyncio.get_running_loop()
    started = said = loop.time()
    # Polled: an asyncio primitive cannot be woken by a holder on another loop or thread.
    while not _lock.acquire(blocking=False):
        await asyncio.sleep(_POLL)
        if loop.time() - said >= _REPORT_INTERVAL:
            said = loop.time()
            # Each run's own waits are bounded and said: this one is only their sum.
            logger.warning(
                "a migration has waited %.0f s for another Alembic run in this process "
                "(runs take turns: Alembic keeps the running command in module globals)",
                said - started,
            )
    _owner = loop


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


def _acquire_here() -> None:
    """Take the lock from sync code: polled inside a greenlet, refused on the loop that holds
    it (waiting would block the very loop that must release it), else waited on outright."""
    if in_greenlet():
        await_(_acquire())
        return
    try:
        loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    if loop is not None and _owner is loop:
        raise MigrationError(
            "a migration is running on this event loop, and Alembic was called "
            "synchronously on the same loop, which blocks it: await "
            "cronoq_store.upgrade() (or use AsyncConnection.run_sync) instead"
        )
    _lock.acquire()


@contextmanager
def held_for(config: Config) -> Iterator[None]:
    """Hold the lock around a whole Alembic command for ``config``, from before Alembic
    installs its module proxies until after it removes them: no other run can replace them."""
    if config.attributes.get(HELD):
        yield
        return
    _acquire_here()
    config.attributes[HELD] = True
    try:
        yield
    finally:
        del config.attributes[HELD]
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
    _acquire_here()
    try:
        yield
    finally:
        environment._install_proxy()
        _release()


def resolve(context: Any) -> EnvironmentContext:
    """The ``EnvironmentContext`` of this run itself (``env.py`` passes ``alembic.context``,
    a module that proxies whichever run installed itself last).

    Alembic installs that proxy when it enters the run, before ``env.py`` can take the lock:
    an Alembic command started meanwhile in another thread, not through
    :func:`held_for`, can have replaced or removed it. Such a run is refused, never run with
    the other command's context: its ``script`` is not the ``ScriptDirectory`` whose
    ``run_env()`` is running ``env.py`` here (Alembic makes a new one for every command).
    """
    proxy = context if isinstance(context, EnvironmentContext) else getattr(context, "_proxy", None)
    running = _running_script()
    if not isinstance(proxy, EnvironmentContext) or (
        running is not None and proxy.script is not running
    ):
        # Alembic removes "this run's" proxies as the error leaves (a KeyError if another
        # run removed them already): let there be some to remove.
        if not isinstance(proxy, EnvironmentContext) and running is not None:
            proxy = EnvironmentContext(Config(), running)
        if isinstance(proxy, EnvironmentContext):
            proxy._install_proxy()
        raise MigrationError(
            "another Alembic command started in this process while this one was starting, "
            "and Alembic keeps the running command in module globals: refusing to run the "
            "other command's migration in place of this one's. Run concurrent Alembic commands "
            "through cronoq_store.run_command(command.upgrade, config, ...) "
            "(or await cronoq_store.upgrade()): they then take turns"
        )
    if proxy.__dict__.get("_remove_proxy") is None:
        proxy._remove_proxy = lambda: _remove_own_proxy(proxy)  # type: ignore[method-assign]
    return proxy


def _remove_own_proxy(environment: EnvironmentContext) -> None:
    """What Alembic runs as ``environment`` ends: remove its proxies if they are still its
    own; those another run installed meanwhile are that run's to remove (removing twice is
    a ``KeyError`` in Alembic)."""
    if getattr(alembic.context, "_proxy", None) is environment:
        EnvironmentContext._remove_proxy(environment)


def _running_script() -> ScriptDirectory | None:
    """The ``ScriptDirectory`` whose ``run_env()`` is on this thread's (or greenlet's) stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is ScriptDirectory.run_env.__code__:
            script = frame.f_locals.get("self")
            return script if isinstance(script, ScriptDirectory) else None
        frame = frame.f_back  # type: ignore[assignment]
    return None
