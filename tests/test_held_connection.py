"""The connection a store holds for its commits through its term
(``CommitPath(hold=True)``): reused by one commit at a time, never when in doubt, returned
at step-down, fencing and close; and what holding it must not change about the store's
pool, leadership terms and failures."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy.engine import URL

from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import TaskId
from cronoq_store._errors import (
    FencedError,
    IdCollisionError,
    KeyTakenError,
    StoreError,
    UnavailableError,
)
from cronoq_store._store import PgStore

from .pgharness import ServerUnderTest, admin_execute, restart, terminate_backend
from .support import START_BASE, LeaderRowHold, changed, lock_holders, stored_ids, submitted
from .waits import bounded, holds_for, until, until_value


@pytest.fixture
def name(migrated: str) -> str:
    return f"cronoq-held-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def leader(
    request: pytest.FixtureRequest, pg_url: URL, migrated: str, name: str
) -> AsyncIterator[tuple[PgStore, int]]:
    # Only the test that cuts a commit short wants a short bound; the others' commits wait
    # on the leader row as long as a loaded machine takes to line them up (over 1 s seen).
    short = request.node.name.startswith("test_a_commit_cut_short")
    config = PgStoreConfig(
        schema=migrated,
        max_connections=3,
        application_name=name,
        commit_timeout=1.0 if short else 30.0,
    )
    store = await PgStore.connect(pg_url, config)
    try:
        yield store, await store.acquire_leadership()
    finally:
        await store.close()


def checked_out(store: PgStore) -> int:
    return int(store.engine.pool.checkedout())  # type: ignore[attr-defined]


async def writers(pg_url: URL, name: str) -> set[int]:
    """Backends of the store's pool that ran an insert (its lock session runs none)."""
    rows = await admin_execute(
        pg_url,
        "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND query LIKE $2",
        name,
        "%INSERT INTO%cronoq_tasks%",
    )
    return {r["pid"] for r in rows}


async def test_one_connection_is_held_for_the_term_and_returned_at_step_down(
    pg_url: URL, migrated: str, name: str, leader: tuple[PgStore, int]
) -> None:
    store, epoch = leader
    for n in range(1, 6):
        await store.commit(epoch, START_BASE, [submitted(n)], [])
        assert checked_out(store) == 1  # kept between commits, not returned
    assert len(await writers(pg_url, name)) == 1
    await store.release_leadership()
    assert checked_out(store) == 0
    assert await stored_ids(pg_url, migrated) == [1, 2, 3, 4, 5]


async def test_a_held_connection_the_server_closed_is_replaced_before_the_commit(
    pg_url: URL, migrated: str, name: str, leader: tuple[PgStore, int]
) -> None:
    store, epoch = leader
    await store.commit(epoch, START_BASE, [submitted(1)], [])
    [pid] = await writers(pg_url, name)
    held = store._commits.connections.held
    assert held is not None
    assert await terminate_backend(pg_url, pid)
    await until(
        lambda: held.driver_connection.is_closed(),  # type: ignore[union-attr]
        "the event loop to read the held connection's closed socket",
    )
    await store.commit(epoch, START_BASE, [submitted(2)], [])  # no error: a new connection
    assert pid not in await writers(pg_url, name)
    assert checked_out(store) == 1
    assert await stored_ids(pg_url, migrated) == [1, 2]


async def test_a_commit_cut_short_gives_up_the_held_connection(
    pg_url: URL, migrated: str, name: str, leader: tuple[PgStore, int]
) -> None:
    store, epoch = leader
    await store.commit(epoch, START_BASE, [submitted(1)], [])
    [pid] = await writers(pg_url, name)
    async with LeaderRowHold(pg_url, migrated):
        with pytest.raises(UnavailableError, match="commit_timeout"):
            await store.commit(epoch, START_BASE, [submitted(2)], [])
    # The interrupted connection was closed, not kept: its backend is gone.
    assert checked_out(store) == 0
    await store.commit(epoch, START_BASE, [submitted(2)], [])
    assert pid not in await writers(pg_url, name)
    assert checked_out(store) == 1
    assert await stored_ids(pg_url, migrated) == [1, 2]


async def test_concurrent_commits_use_the_pool_beside_the_held_connection(
    pg_url: URL, migrated: str, name: str, leader: tuple[PgStore, int]
) -> None:
    store, epoch = leader
    await store.commit(epoch, START_BASE, [submitted(1)], [])
    async with LeaderRowHold(pg_url, migrated):
        commits = [
            asyncio.ensure_future(store.commit(epoch, START_BASE, [submitted(n)], []))
            for n in (2, 3, 4)
        ]
        # All three wait on the leader row, each on its own connection.
        await until_value(
            lambda: checked_out(store), lambda n: n == 3, "three commits waiting on the row"
        )
    await asyncio.gather(*commits)
    assert checked_out(store) == 1
    assert len(await writers(pg_url, name)) == 3
    assert await stored_ids(pg_url, migrated) == [1, 2, 3, 4]


async def test_a_fenced_commit_returns_the_held_connection(
    pg_url: URL, migrated: str, leader: tuple[PgStore, int]
) -> None:
    store, epoch = leader
    await store.commit(epoch, START_BASE, [submitted(1)], [])
    await admin_execute(pg_url, f'UPDATE "{migrated}".cronoq_leader SET epoch = epoch + 1')
    with pytest.raises(FencedError):
        await store.commit(epoch, START_BASE, [submitted(2)], [])
    assert checked_out(store) == 0
    assert await stored_ids(pg_url, migrated) == [1]


async def test_a_held_connection_to_a_demoted_primary_is_not_reused(
    pg_url: URL, migrated: str, leader: tuple[PgStore, int]
) -> None:
    store, epoch = leader
    await store.commit(epoch, START_BASE, [submitted(1)], [])
    # The held session now behaves like one on a demoted primary: the commit fails, the
    # store disposes the pool, and the next commit must not run on that session again.
    held = store._commits.connections.held
    assert held is not None
    driver: Any = held.driver_connection
    await driver.execute("SET SESSION default_transaction_read_only = on")
    with pytest.raises(UnavailableError) as caught:
        await store.commit(epoch, START_BASE, [submitted(2)], [])
    assert caught.value.reconnect
    await store.commit(epoch, START_BASE, [submitted(2)], [])
    assert store._commits.connections.held is not held
    assert await stored_ids(pg_url, migrated) == [1, 2]


async def test_a_store_with_one_connection_holds_none(
    pg_url: URL, migrated: str, name: str
) -> None:
    # Reads, pings and the committer's checks need a connection between commits.
    config = PgStoreConfig(schema=migrated, max_connections=1, application_name=name)
    async with await PgStore.connect(pg_url, config) as store:
        epoch = await store.acquire_leadership()
        await store.commit(epoch, START_BASE, [submitted(1, arrival=0)], [])
        assert checked_out(store) == 0
        assert await store.get_task(TaskId(1)) is not None


# --- what the held connection must not change: the pool, terms, failures --------------


async def backends(pg_url: URL, name: str) -> set[int]:
    rows = await admin_execute(
        pg_url, "SELECT pid FROM pg_stat_activity WHERE application_name = $1", name
    )
    return {r["pid"] for r in rows}


async def gone(pg_url: URL, name: str, pid: int) -> bool:
    """Whether the server session ``pid`` has ended (the server ends it asynchronously)."""
    return pid not in await backends(pg_url, name)


@pytest.fixture
async def leader_row(pg_url: URL, migrated: str) -> AsyncIterator[LeaderRowHold]:
    """The leader row, held from outside the store once a test calls ``lock()``."""
    hold = LeaderRowHold(pg_url, migrated)
    try:
        yield hold
    finally:
        await hold.release()


async def open_leader(
    pg_url: URL, migrated: str, name: str, max_connections: int, timeout: float = 30.0
) -> tuple[PgStore, int]:
    """A leader whose commits, prunes and pool checkouts wait up to ``timeout``: what a test
    holds up is still waiting when the test looks, however slow the machine, and a wait
    that should not happen at all fails the test after it."""
    config = PgStoreConfig(
        schema=migrated,
        max_connections=max_connections,
        application_name=name,
        commit_timeout=timeout,
    )
    store = await PgStore.connect(pg_url, config)
    return store, await store.acquire_leadership()


# --- the pool: the held connection takes a slot from reads ----------------------------------


@pytest.mark.parametrize("connections", [2, 3])
async def test_an_idle_leader_with_two_connections_still_serves_a_read_beside_another(
    pg_url: URL, migrated: str, name: str, leader_row: LeaderRowHold, connections: int
) -> None:
    """Were the writer to hold one of two connections for the whole term, idle between
    commits, a read waiting on a lock (a prune behind a commit) would take the other, and
    health() would wait for a connection until the prune gave up: so a writer holds a
    connection only from max_connections=3 on. Told by order, not by a clock: health
    answers while the prune still waits."""
    store, epoch = await open_leader(pg_url, migrated, name, max_connections=connections)
    await store.commit(epoch, START_BASE, [submitted(1)], [])
    await leader_row.lock()
    prune = asyncio.ensure_future(store.prune(0))
    try:
        await leader_row.waited_on(prune, "the prune to wait on the leader row")
        health = await bounded(store.health(), "health beside the waiting prune")
        assert health.is_leader
        assert not prune.done(), "health answered only once the prune gave its connection up"
    finally:
        await leader_row.release()
        assert await bounded(prune, "the prune once the row is free") == 0
        await store.close()


# --- leadership terms ----------------------------------------------------------------------


async def test_a_standby_waiting_for_leadership_holds_no_writer_connection(
    pg_url: URL, migrated: str, name: str
) -> None:
    # A leader that lost its lock (its lock session killed) and goes back to
    # acquire_leadership() without committing gives the previous term's held connection
    # back: it holds none while it waits as a standby, and takes none into its next term
    # (a refused commit, a fencing, release_leadership and close are not the only ways back).
    store, epoch = await open_leader(pg_url, migrated, name, max_connections=3)
    other = await PgStore.connect(
        pg_url, PgStoreConfig(schema=migrated, application_name=f"{name}-other")
    )
    try:
        await store.commit(epoch, START_BASE, [submitted(1)], [])
        assert checked_out(store) == 1
        [(pid, _)] = await lock_holders(pg_url, store.leader_lock)
        assert await terminate_backend(pg_url, pid)
        await bounded(store.leadership_lost(), "the step-down after the lock session ended")
        await bounded(other.acquire_leadership(), "the other's takeover")
        waiting = asyncio.ensure_future(store.acquire_leadership())
        await holds_for(lambda: not waiting.done(), "the standby waiting", 0.5)
        # A standby's pool is all for reads: the last term's held connection is given back.
        await until(lambda: checked_out(store) == 0, "the waiting standby to hold no connection")
        assert not waiting.done()
        await other.release_leadership()
        new_epoch = await bounded(waiting, "the standby's takeover after the release")
        await store.commit(new_epoch, START_BASE, [submitted(2)], [])
        assert await stored_ids(pg_url, migrated) == [1, 2]
    finally:
        await other.close()
        await store.close()


# --- what held ------------------------------------------------------------------------------


async def test_a_commit_on_the_held_connection_cancelled_mid_flight_gives_it_up(
    pg_url: URL, migrated: str, name: str, leader_row: LeaderRowHold
) -> None:
    store, epoch = await open_leader(pg_url, migrated, name, max_connections=3)
    try:
        await store.commit(epoch, START_BASE, [submitted(1)], [])
        await leader_row.lock()
        [pid] = await writers(pg_url, name)
        commit = asyncio.ensure_future(store.commit(epoch, START_BASE, [submitted(2)], []))
        await leader_row.waited_on(commit, "the commit to wait on the leader row")
        commit.cancel()
        with pytest.raises(asyncio.CancelledError):
            await commit
        assert checked_out(store) == 0
        await leader_row.release()
        await until(
            lambda: gone(pg_url, name, pid), "the server to end the cancelled commit's session"
        )
        await store.commit(epoch, START_BASE, [submitted(2)], [])
        assert checked_out(store) == 1
        assert await stored_ids(pg_url, migrated) == [1, 2]
    finally:
        await store.close()


async def test_the_held_session_terminated_during_a_commit(
    pg_url: URL, migrated: str, name: str, leader_row: LeaderRowHold
) -> None:
    store, epoch = await open_leader(pg_url, migrated, name, max_connections=3)
    try:
        await store.commit(epoch, START_BASE, [submitted(1)], [])
        await leader_row.lock()
        [pid] = await writers(pg_url, name)
        commit = asyncio.ensure_future(store.commit(epoch, START_BASE, [submitted(2)], []))
        await leader_row.waited_on(commit, "the commit to wait on the leader row")
        assert await terminate_backend(pg_url, pid)
        with pytest.raises(UnavailableError):
            await commit
        assert checked_out(store) == 0
        await leader_row.release()
        await store.commit(epoch, START_BASE, [submitted(2)], [])
        assert await stored_ids(pg_url, migrated) == [1, 2]
    finally:
        await store.close()


async def test_the_held_session_ended_by_idle_session_timeout(
    pg_url: URL, migrated: str, name: str
) -> None:
    store, epoch = await open_leader(pg_url, migrated, name, max_connections=3)
    try:
        await store.commit(epoch, START_BASE, [submitted(1)], [])
        held = store._commits.connections.held
        assert held is not None
        await held.driver_connection.execute("SET idle_session_timeout = '100ms'")  # type: ignore[union-attr]
        await until(
            lambda: held.driver_connection.is_closed(),  # type: ignore[union-attr]
            "the server to end the idle held session, and the event loop to read it",
        )
        await store.commit(epoch, START_BASE, [submitted(2)], [])
        assert await stored_ids(pg_url, migrated) == [1, 2]
    finally:
        await store.close()


async def test_close_while_a_commit_runs_on_the_held_connection_leaves_no_session(
    pg_url: URL, migrated: str, name: str, leader_row: LeaderRowHold
) -> None:
    store, epoch = await open_leader(pg_url, migrated, name, max_connections=3)
    await store.commit(epoch, START_BASE, [submitted(1)], [])
    await leader_row.lock()
    commit = asyncio.ensure_future(store.commit(epoch, START_BASE, [submitted(2)], []))
    await leader_row.waited_on(commit, "the commit to wait on the leader row")
    closing = asyncio.ensure_future(store.close())
    await asyncio.sleep(0.3)
    await leader_row.release()
    # The commit in flight lands after close() disposed the pool: its connection must not
    # go back to the disposed pool, whose server session would then stay open (even after
    # a garbage collection).
    await bounded(asyncio.gather(commit, closing), "the commit and close() once the row is free")
    left: set[int] = await until_value(
        lambda: backends(pg_url, name), lambda pids: not pids, "the store's sessions to end"
    )
    assert left == set()
    with pytest.raises(StoreError):
        await store.commit(epoch, START_BASE, [submitted(3)], [])


async def test_a_deposed_leader_cannot_write_through_its_held_connection(
    pg_url: URL, migrated: str, name: str
) -> None:
    store, epoch = await open_leader(pg_url, migrated, name, max_connections=3)
    other = await PgStore.connect(
        pg_url, PgStoreConfig(schema=migrated, application_name=f"{name}-other")
    )
    try:
        await store.commit(epoch, START_BASE, [submitted(1)], [])
        [(pid, _)] = await lock_holders(pg_url, store.leader_lock)
        assert await terminate_backend(pg_url, pid)
        await bounded(other.acquire_leadership(), "the other's takeover")
        # Whether or not the keeper noticed yet, the held connection must not write.
        with pytest.raises(FencedError):
            await store.commit(epoch, START_BASE, [submitted(2)], [])
        assert checked_out(store) == 0
        assert await stored_ids(pg_url, migrated) == [1]
    finally:
        await other.close()
        await store.close()


async def test_concurrent_commits_with_three_connections(
    pg_url: URL, migrated: str, name: str
) -> None:
    store, epoch = await open_leader(pg_url, migrated, name, max_connections=3)
    try:
        await asyncio.gather(
            *(store.commit(epoch, START_BASE, [submitted(n)], []) for n in range(1, 9))
        )
        assert checked_out(store) == 1
        assert await store.get_task(submitted(1).id) is not None
        assert await stored_ids(pg_url, migrated) == list(range(1, 9))
    finally:
        await store.close()


async def test_the_server_restarted_under_a_held_connection(
    pg_server: ServerUnderTest, pg_url: URL, migrated: str, name: str
) -> None:
    store, epoch = await open_leader(pg_url, migrated, name, max_connections=3)
    try:
        await store.commit(epoch, START_BASE, [submitted(1)], [])
        held = store._commits.connections.held
        await asyncio.to_thread(restart, pg_server, "immediate")
        await bounded(store.leadership_lost(), "the step-down after the restart")
        with pytest.raises(FencedError):
            await store.commit(epoch, START_BASE, [submitted(2)], [])
        epoch = await bounded(store.acquire_leadership(), "the leadership after the restart")
        await store.commit(epoch, START_BASE, [submitted(2)], [])
        assert store._commits.connections.held is not held
        assert checked_out(store) == 1
        assert await stored_ids(pg_url, migrated) == [1, 2]
    finally:
        await store.close()


async def test_refused_batches_leave_the_held_connection_idle_and_in_use(
    pg_url: URL, migrated: str, name: str
) -> None:
    # A server's refusal (a live key, an id of another task) in a transaction path must
    # leave the held session out of any transaction, and it goes on serving commits.
    from cronoq_store._domain import TaskStatus

    store, epoch = await open_leader(pg_url, migrated, name, max_connections=3)
    try:
        await store.commit(epoch, START_BASE, [submitted(1, key="k")], [])
        held = store._commits.connections.held
        [pid] = await writers(pg_url, name)
        with pytest.raises(KeyTakenError):
            await store.commit(
                epoch, START_BASE, [changed(1, TaskStatus.RUNNING), submitted(2, key="k")], []
            )
        with pytest.raises(IdCollisionError):
            await store.commit(epoch, START_BASE, [submitted(1, payload=b"other")], [])
        rows = await admin_execute(pg_url, "SELECT state FROM pg_stat_activity WHERE pid = $1", pid)
        assert [r["state"] for r in rows] == ["idle"]
        assert store._commits.connections.held is held
        await store.commit(
            epoch, START_BASE, [changed(1, TaskStatus.SUCCEEDED), submitted(2, key="k")], []
        )
        assert await stored_ids(pg_url, migrated) == [1, 2]
    finally:
        await store.close()


async def test_a_held_connection_of_a_disposed_pool_is_closed_at_step_down(
    pg_url: URL, migrated: str, name: str
) -> None:
    # The pool is disposed while the writer holds a connection (as _translated does for a
    # demoted primary, after a read or ping): release_leadership() closes the held
    # connection instead of returning it to the disposed pool, where its session would
    # stay open.
    store, epoch = await open_leader(pg_url, migrated, name, max_connections=3)
    try:
        await store.commit(epoch, START_BASE, [submitted(1)], [])
        [pid] = await writers(pg_url, name)
        await store.engine.dispose()
        await store.release_leadership()
        await until(lambda: gone(pg_url, name, pid), "the server to end the released session")
    finally:
        await store.close()
