"""Both routings reach the primary, and follow it when Patroni moves it.

asyncpg (0.32) takes a multi-host URL (SQLAlchemy's ``?host=h:p&host=h:p`` form) and
``target_session_attrs`` (``any``, ``primary``, ``standby``, ``prefer-standby``,
``read-write``, ``read-only``): it tries the hosts in order and keeps the first that
qualifies, so a standby, or a demoted primary, is skipped at connect time.
"""

from __future__ import annotations

import asyncio

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
from ..waits import bounded, until_value
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


async def test_a_leader_on_a_node_that_patroni_demotes_steps_down_and_never_leads_a_standby(
    two_node_stack: HaStack,
) -> None:
    """A store whose URL names one node (no routing) meets the demotion itself: its lock
    session ends, it steps down, and every later attempt meets ``25006`` on the standby
    (the epoch bump's transaction cannot lock or write there) until the node is primary
    again."""
    stack = two_node_stack
    first = await stack.wait_primary()
    config = PgStoreConfig(
        schema="demoted", lock_poll=0.2, keepalive=0.5, session_timeout=3, application_name="pin"
    )
    async with await PgStore.connect(stack.node_url(first), config) as store:
        epoch = await store.acquire_leadership()
        holder = (await store.health()).holder
        assert holder is not None
        name = holder.application_name  # "pin leader <instance id>": the server logs it
        await stack.switchover()
        await bounded(store.leadership_lost(), "the store to step down from the demoted node")
        assert not store.is_leader
        attempt = asyncio.ensure_future(store.acquire_leadership())
        try:
            # The bump's transaction first locks the leader table, which a standby refuses.
            refused = await until_value(
                lambda: stack.server_log_lines(
                    f"{name}: ERROR:  cannot execute LOCK TABLE during recovery",
                    f"{name}: ERROR:  cannot execute UPDATE in a read-only",
                ),
                bool,
                "the store's attempt to bump the epoch on the standby to be refused",
                every=0.2,
            )
            if attempt.done():
                raise AssertionError(f"the attempt to lead on a standby ended: {attempt!r}")
        finally:
            attempt.cancel()
            await asyncio.gather(attempt, return_exceptions=True)
        assert all(line.startswith(f"{first}:") for line in refused)
        # Once Patroni moves the primary back, the same store leads again, with a new epoch.
        await stack.switchover()
        assert await stack.wait_primary() == first
        again = await bounded(store.acquire_leadership(), "the store to lead on the primary again")
        assert again == epoch + 1
        await store.release_leadership()
