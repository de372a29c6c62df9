"""Both routings reach the primary, and follow it when Patroni moves it.

asyncpg (0.32) takes a multi-host URL (SQLAlchemy's ``?host=h:p&host=h:p`` form) and
``target_session_attrs`` (``any``, ``primary``, ``standby``, ``prefer-standby``,
``read-write``, ``read-only``): it tries the hosts in order and keeps the first that
qualifies, so a standby, or a demoted primary, is skipped at connect time.
"""

from __future__ import annotations

import pytest

from cronoq_store import (
    PgStore,
    PgStoreConfig,
    StoreError,
    Submitted,
    TaskSpec,
    TimeBase,
    task_id,
)

from ..pgharness import admin_execute
from .stack import HaStack

pytestmark = pytest.mark.slow


async def _stored(stack: HaStack, node: str, task: int) -> bool:
    rows = await admin_execute(
        stack.node_url(node), 'SELECT count(*) FROM "routing".cronoq_tasks WHERE id = $1', task
    )
    return bool(rows[0][0] == 1)


async def test_multi_host_url_and_haproxy_reach_the_primary_follow_a_switchover_never_a_standby(
    stack: HaStack,
) -> None:
    before = await stack.wait_primary()
    config = PgStoreConfig(schema="routing", lock_poll=0.2, keepalive=0.5, session_timeout=3)
    committed: list[int] = []
    for url in (stack.multi_host_url(), stack.haproxy_url()):
        async with await PgStore.connect(url, config) as store:
            epoch = await store.acquire_leadership()
            base = TimeBase.now()
            await store.recover(base)
            new_id = task_id(epoch, 0)
            spec = TaskSpec(b"routed", key=f"k{epoch}")
            await store.commit(epoch, base, [Submitted(new_id, 1, 0, spec)], [])
            committed.append(new_id)
            await store.release_leadership()
        # The commit landed on the primary (with synchronous replication, on its standby too).
        assert await _stored(stack, before, committed[-1])
    # The first node in the multi-host URL is a standby after the switchover: asyncpg must
    # skip it, and HAProxy must route elsewhere.
    old, new = await stack.switchover()
    assert old == before
    assert new != old
    await stack.wait_healthy()
    for url in (stack.multi_host_url(), stack.haproxy_url()):
        async with await PgStore.connect(url, config) as store:
            await store.acquire_leadership()
            recovered = await store.recover(TimeBase.now())
            assert sorted(t.id for t in recovered.tasks) == committed
            rows = await admin_execute(
                stack.node_url(new), 'SELECT epoch FROM "routing".cronoq_leader'
            )
            assert rows[0][0] == store.epoch  # the epoch bump landed on the new primary
            await store.release_leadership()
    # A URL that reaches a standby opens no store (its migration cannot write there):
    # target_session_attrs=read-write, or HAProxy's check, is what keeps the store off one.
    standby = next(n.name for n in stack.nodes if n.name != new)
    url = stack.node_url(standby)
    with pytest.raises(StoreError, match=r"read-only|recovery"):
        async with await PgStore.connect(url, PgStoreConfig(schema="routing")):
            pass
