"""A connect that succeeds in the same loop turn as a cancellation is closed, not leaked.

The leader's lock session is opened under a bound (``retry.bounded``). When the caller is
cancelled just as the connect completes, nobody receives the connection: it must go back
(and, once the store closes, away), not stay checked out of the lock pool with its server
session open for good. The cancellation here is real: the lock pool's checkout, the last
step of a successful connect, cancels the acquiring task.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.engine import URL

from cronoq_store._config import PgStoreConfig
from cronoq_store._store import PgStore

from .pgharness import WITHOUT_INSTANCE, admin_execute
from .support import leadership_of
from .waits import bounded, until_value


async def no_sessions_named(url: URL, name: str) -> None:
    """No server session is named ``name`` (a lock session's name without its instance id),
    once a closed one had the moment it takes to end."""
    await until_value(
        lambda: admin_execute(
            url, f"SELECT pid FROM pg_stat_activity WHERE {WITHOUT_INSTANCE} = $1", name
        ),
        lambda rows: not rows,
        f"no session named {name!r} left open",
    )


async def test_a_lock_session_connected_as_the_acquisition_is_cancelled_is_not_leaked(
    pg_url: URL, migrated: str
) -> None:
    config = PgStoreConfig(
        schema=migrated, lock_poll=0.05, keepalive=0.2, application_name=f"cancel-{migrated}"
    )
    store = await PgStore.connect(pg_url, config)
    lock_pool: Any = leadership_of(store)._engine.sync_engine.pool  # the lock session's own
    try:
        acquiring = asyncio.ensure_future(store.acquire_leadership())

        def cancel_the_acquisition(*_: object) -> None:
            acquiring.cancel()

        event.listen(lock_pool, "checkout", cancel_the_acquisition)
        with pytest.raises(asyncio.CancelledError):
            await acquiring
        event.remove(lock_pool, "checkout", cancel_the_acquisition)
        assert not store.is_leader
        # No lock session was left open (the store's lock pool keeps none idle).
        await no_sessions_named(pg_url, f"cancel-{migrated} leader")
        # The store still leads on a later attempt, on that connection or another.
        assert await bounded(store.acquire_leadership(), "a later acquisition") >= 1
    finally:
        await store.close()
    await no_sessions_named(pg_url, f"cancel-{migrated} leader")
