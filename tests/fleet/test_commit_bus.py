"""The host's commit bus on a real server: several clusters' commits in one transaction,
each answered as it would be alone.

Each test's host has one lane (``max_connections=3``). A commit to a plug cluster whose
leader row the test holds keeps the lane busy while the commits under test queue behind
it, so that they go together when the plug is released. Each cluster is fenced on its own:
a fence moved or an id refused is that commit's answer alone, and the others land in one
transaction (their rows share an ``xmin``). A session lost in the middle of a group fails
every commit of it, having written nothing. One cluster's schema name needs quoting, and
its batches take the transaction path, closed by a check rendered with its name.

A group of commits that only insert a few tasks is staged: their epochs checked first by
statements the session keeps prepared, their tasks copied into its staging table, then
each cluster's insert. The statements a session keeps are tested on a session of the
test's own; random splits of commits into groups end as the same commits one at a time.
"""

from __future__ import annotations

import asyncio
import gc
import random
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import pytest
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import URL

from cronoq_store import (
    FencedError,
    IdCollisionError,
    TaskSpec,
    TaskStatus,
    UnavailableError,
)
from cronoq_store._commit_path import BatchWriter, GroupMember, Outcome, Written, fold, write_group
from cronoq_store._domain import Mutation, StatusChanged, Submitted, TimeBase, task_id
from cronoq_store._door import CommitConnection, CompiledStatement, executing, translate_error
from cronoq_store._host.host import HostedStore

from ..pgharness import admin_execute, asyncpg_dsn
from ..support import LeaderRowHold, bump_epoch
from ..waits import until
from .conftest import Fleet
from .hosts import Served, commit_one, config, serving

#: Every commit's time base: a batch sent again is the same tasks.
BASE = TimeBase.now()


def task(store: HostedStore, n: int, payload: bytes = b"bus") -> Submitted:
    assert store.epoch is not None
    return Submitted(task_id(store.epoch, n), n, BASE.engine_ns, TaskSpec(payload))


def moved(store: HostedStore, n: int) -> StatusChanged:
    assert store.epoch is not None
    return StatusChanged(task_id(store.epoch, n), TaskStatus.RUNNING, 1, BASE.engine_ns)


async def commit(store: HostedStore, batch: Sequence[Mutation]) -> None:
    assert store.epoch is not None
    await store.commit(store.epoch, BASE, batch, [])


async def xmins(fleet: Fleet, schema: str) -> dict[int, str]:
    """Each stored task's id and the transaction that wrote it."""
    rows = await admin_execute(
        fleet.url, f'SELECT id, xmin::text AS x FROM "{schema}".cronoq_tasks'
    )
    return {int(r["id"]): str(r["x"]) for r in rows}


async def statuses(fleet: Fleet, schema: str) -> dict[int, str]:
    rows = await admin_execute(fleet.url, f'SELECT id, status FROM "{schema}".cronoq_tasks')
    return {int(r["id"]): str(r["status"]) for r in rows}


@asynccontextmanager
async def hosting(fleet: Fleet, schemas: list[str]) -> AsyncIterator[Served]:
    async with serving(fleet.url, config(fleet, "bus"), schemas) as served:
        await until(lambda: len(served.host.led()) == len(schemas), "the host to lead all")
        yield served


@asynccontextmanager
async def plugged(fleet: Fleet, store: HostedStore) -> AsyncIterator[None]:
    """The lane busy with a commit to ``store``, waiting on its leader row, for the block;
    the commits started inside queue behind it and go together once it returns."""
    hold = LeaderRowHold(fleet.url, store.config.schema)
    await hold.lock()
    plug = asyncio.ensure_future(commit_one(store, 1))
    try:
        await hold.waited_on(plug, "the plug's commit to wait for its leader row")
        yield
    finally:
        await hold.release()
        await plug


def started(*commits: tuple[HostedStore, Sequence[Mutation]]) -> list[asyncio.Task[None]]:
    """The commits as tasks. Each reaches the bus's queue in its first step (no I/O comes
    before it): one pass of the loop, the ``sleep(0)`` that follows."""
    return [asyncio.ensure_future(commit(store, batch)) for store, batch in commits]


async def test_a_fenced_member_fails_alone_and_the_others_land_in_one_transaction(
    fleet: Fleet,
) -> None:
    a, b, c, plug = fleet.clusters(4)
    quoted = f"{fleet.prefix}_Quoted"
    async with hosting(fleet, [a, b, c, plug, quoted]) as served:
        stores = served.host.led()
        for schema in (b, quoted):
            await commit(stores[schema], [task(stores[schema], 2)])
        # Updates and inserts: the transaction path, the epoch read FOR SHARE and the
        # closing check rendered with the schema's name (quoted for one).
        batches: dict[str, list[Mutation]] = {
            a: [task(stores[a], 3)],
            c: [task(stores[c], 3)],
            b: [moved(stores[b], 2), task(stores[b], 3)],
            quoted: [moved(stores[quoted], 2), task(stores[quoted], 3)],
        }
        ids = {s: [task(stores[s], 2).id, task(stores[s], 3).id] for s in (a, b, quoted)}
        async with plugged(fleet, stores[plug]):
            commits = started(*((stores[s], batches[s]) for s in (a, b, c, quoted)))
            await asyncio.sleep(0)
            # Takeovers of b (whose commit updates and inserts) and of c (whose commit
            # only inserts, staged) while their commits wait.
            await bump_epoch(fleet.url, b)
            await bump_epoch(fleet.url, c)
        done = await asyncio.gather(*commits, return_exceptions=True)
        assert done[0] is None, done
        assert done[3] is None, done
        assert isinstance(done[1], FencedError)
        assert isinstance(done[2], FencedError)
        assert await statuses(fleet, c) == {}
        assert not stores[b].is_leader
        assert not stores[c].is_leader
        assert stores[a].is_leader
        assert stores[quoted].is_leader
        assert await statuses(fleet, b) == {ids[b][0]: "queued"}
        assert await statuses(fleet, quoted) == {
            ids[quoted][0]: "running",
            ids[quoted][1]: "queued",
        }
        landed_a = await xmins(fleet, a)
        landed_q = await xmins(fleet, quoted)
        assert landed_a[ids[a][1]] == landed_q[ids[quoted][1]]  # one transaction


async def test_a_refused_member_gets_its_own_error_and_the_others_land(fleet: Fleet) -> None:
    a, b, c, plug = fleet.clusters(4)
    async with hosting(fleet, [a, b, c, plug]) as served:
        stores = served.host.led()
        await commit(stores[b], [task(stores[b], 2, b"first")])
        async with plugged(fleet, stores[plug]):
            commits = started(
                (stores[a], [task(stores[a], 2)]),
                (stores[b], [task(stores[b], 2, b"another task under the same id")]),
                (stores[c], [task(stores[c], 2)]),
            )
            await asyncio.sleep(0)
        done = await asyncio.gather(*commits, return_exceptions=True)
        assert done[0] is None, done
        assert done[2] is None, done
        assert isinstance(done[1], IdCollisionError)
        assert all(store.is_leader for store in stores.values())
        landed_a = await xmins(fleet, a)
        landed_c = await xmins(fleet, c)
        assert len(landed_a) == len(landed_c) == 1
        assert set(landed_a.values()) == set(landed_c.values())  # one transaction


async def test_a_session_lost_mid_group_fails_every_member_and_a_retry_lands_each_once(
    fleet: Fleet,
) -> None:
    a, b, c, plug = fleet.clusters(4)
    async with hosting(fleet, [a, b, c, plug]) as served:
        stores = served.host.led()
        batches: dict[str, list[Mutation]] = {s: [task(stores[s], 2)] for s in (a, b, c)}
        held = LeaderRowHold(fleet.url, c)
        await held.lock()
        try:
            async with plugged(fleet, stores[plug]):
                commits = started(*((stores[s], batches[s]) for s in (a, b, c)))
                await asyncio.sleep(0)
            # The group holds a's and b's epochs and waits for c's leader row: its session
            # ends.
            group = asyncio.ensure_future(asyncio.gather(*commits, return_exceptions=True))
            await held.waited_on(group, "the group to wait for c's leader row")
            await admin_execute(
                fleet.url,
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE $1 = ANY(pg_blocking_pids(pid))",
                held.pid,
            )
            done = await group
        finally:
            await held.release()
        assert all(isinstance(d, UnavailableError) for d in done), done
        assert all(store.is_leader for store in stores.values())
        for s in (a, b, c):
            assert await xmins(fleet, s) == {}  # the group wrote nothing that committed
        for s in (a, b, c):
            await commit(stores[s], batches[s])
            await commit(stores[s], batches[s])  # once more: idempotent
            assert list(await xmins(fleet, s)) == [task(stores[s], 2).id]


async def test_a_claim_of_a_member_lands_after_its_whole_group(fleet: Fleet) -> None:
    """The group holds a's epoch share-locked while it waits for b's leader row: a
    takeover of a waits for the whole group, which lands before it, both commits at once."""
    a, b, plug = fleet.clusters(3)
    async with hosting(fleet, [a, b, plug]) as served:
        stores = served.host.led()
        first = task(stores[a], 2)
        held = LeaderRowHold(fleet.url, b)
        await held.lock()
        try:
            async with plugged(fleet, stores[plug]):
                commits = started((stores[a], [first]), (stores[b], [task(stores[b], 2)]))
                await asyncio.sleep(0)
            group = asyncio.ensure_future(asyncio.gather(*commits, return_exceptions=True))
            await held.waited_on(group, "the group to wait for b's leader row")
            claim = asyncio.ensure_future(bump_epoch(fleet.url, a))

            async def claim_waits() -> bool:
                rows = await admin_execute(
                    fleet.url,
                    "SELECT count(*) AS n FROM pg_stat_activity "
                    "WHERE wait_event_type = 'Lock' AND starts_with(query, $1)",
                    f'UPDATE "{a}".cronoq_leader',
                )
                return bool(rows[0]["n"])

            await until(claim_waits, "the takeover of a to wait for the group")
            assert not claim.done()
        finally:
            await held.release()
        assert await group == [None, None]  # landed, before the takeover
        await claim
        landed_a, landed_b = await xmins(fleet, a), await xmins(fleet, b)
        assert list(landed_a) == [first.id]
        assert set(landed_a.values()) == set(landed_b.values())  # one transaction


def _select(n: int) -> CompiledStatement:
    """A statement of its own text, with one integer parameter."""
    return CompiledStatement(f"SELECT {n} + $1::INTEGER", ("x",), {})


async def _held(conn: asyncpg.Connection) -> set[str]:
    """The bus's statements the session holds (not the driver's own)."""
    rows = await conn.fetch(
        "SELECT name FROM pg_prepared_statements WHERE starts_with(name, 'cronoq_bus_')"
    )
    return {str(r["name"]) for r in rows}


async def test_a_session_keeps_the_bus_statements_it_was_last_asked_for(pg_url: URL) -> None:
    driver = await asyncpg.connect(asyncpg_dsn(pg_url))
    try:
        conn = CommitConnection(driver)
        setup = "CREATE TEMPORARY TABLE IF NOT EXISTS pg_temp.bus_test (x integer)"
        first = await conn.named([_select(1), _select(2)], setup, keep=3)
        assert first is not None
        assert await _held(driver) == set(first)
        assert await driver.fetchval("SELECT count(*) FROM pg_temp.bus_test") == 0
        again = await conn.named([_select(3), _select(1)], setup, keep=3)
        assert again is not None
        assert again[1] == first[0]  # kept, not prepared again
        # The least recently used (2) makes room for 4.
        fourth = await conn.named([_select(4)], setup, keep=3)
        assert fourth is not None
        assert await _held(driver) == {first[0], again[0], fourth[0]}
        assert await conn.named([_select(n) for n in range(1, 5)], setup, keep=3) is None
        status = await driver.execute(executing(fourth[0], _select(4), {"x": 2}))
        assert status == "SELECT 1"
        with pytest.raises(TypeError):
            executing(fourth[0], _select(4), {"x": "2); DROP TABLE x; --"})
        # A message that fails half-way: what the session holds is what it keeps.
        broken = CompiledStatement("SELECT * FROM pg_temp.no_such_table", (), {})
        with pytest.raises(asyncpg.UndefinedTableError):
            await conn.named([_select(5), broken], setup, keep=3)
        kept = await conn.named([_select(5), _select(4)], setup, keep=3)
        assert kept is not None
        assert len(await _held(driver)) <= 3
        assert set(kept) <= await _held(driver)
        assert kept[1] == fourth[0]
    finally:
        await driver.close()


async def test_a_session_that_refuses_the_staging_table_is_not_asked_again(pg_url: URL) -> None:
    driver = await asyncpg.connect(asyncpg_dsn(pg_url))
    try:
        conn = CommitConnection(driver)
        refused = "CREATE TEMPORARY TABLE pg_temp.bus_test (x no_such_type)"
        assert await conn.named([_select(1)], refused, keep=3) is None
        fine = "CREATE TEMPORARY TABLE IF NOT EXISTS pg_temp.bus_test (x integer)"
        assert await conn.named([_select(1)], fine, keep=3) is None
        assert await _held(driver) == set()
    finally:
        await driver.close()


def _outcome(outcome: object) -> object:
    """What a member's answer says, comparable across clusters: the fence held (or not),
    the ids or keys it names, or the error's type."""
    if isinstance(outcome, Written):
        return ("written", outcome.colliding, outcome.taken)
    return type(outcome).__name__


async def _rows(conn: asyncpg.Connection, schema: str) -> list[tuple[object, ...]]:
    rows = await conn.fetch(
        f'SELECT id, seq, payload, status, attempt, updated_unix_ns FROM "{schema}".cronoq_tasks '
        "ORDER BY id"
    )
    return [tuple(r) for r in rows]


async def test_random_splits_into_groups_end_as_one_commit_at_a_time(fleet: Fleet) -> None:
    """Commits of three clusters (new tasks, the same sent again, transitions, another task
    under a stored id) written in groups split at random, against the same commits of three
    other clusters written one at a time: the same answers, the same rows."""
    grouped, alone = fleet.clusters(3), fleet.clusters(6)[3:]
    async with hosting(fleet, grouped + alone) as served:
        stores = served.host.led()
        dialect = postgresql.asyncpg.dialect()  # type: ignore[no-untyped-call]
        writers = {s: BatchWriter(dialect, s) for s in grouped + alone}
        driver = await asyncpg.connect(asyncpg_dsn(fleet.url))
        try:
            conn = CommitConnection(driver)
            for seed in range(6):
                rng = random.Random(seed)
                commits: list[tuple[int, list[Mutation]]] = []
                submitted: list[list[list[Submitted]]] = [[], [], []]
                for n in range(rng.randint(4, 12)):
                    k = rng.randrange(3)
                    epoch = stores[grouped[k]].epoch
                    assert epoch is not None
                    base_n = 1000 * seed + 10 * n
                    kind = rng.choice(["new", "new", "again", "moved", "other"])
                    earlier = submitted[k]
                    batch: list[Mutation]
                    if kind == "again" and earlier:
                        batch = list(rng.choice(earlier))
                    elif kind == "moved" and earlier:
                        first = rng.choice(earlier)[0]
                        batch = [StatusChanged(first.id, TaskStatus.RUNNING, 1, BASE.engine_ns)]
                    elif kind == "other" and earlier:
                        first = rng.choice(earlier)[0]
                        batch = [Submitted(first.id, 9, BASE.engine_ns, TaskSpec(b"other"))]
                    else:
                        new = [
                            Submitted(task_id(epoch, base_n + i), i, BASE.engine_ns, TaskSpec(b"x"))
                            for i in range(rng.randint(1, 3))
                        ]
                        submitted[k].append(new)
                        batch = list(new)
                    commits.append((k, batch))
                groups: list[list[int]] = [[]]
                for i, (k, _) in enumerate(commits):
                    # A group holds commits that commute: one per cluster (the committer's
                    # footprint keeps a cluster's overlapping commits apart).
                    if any(commits[j][0] == k for j in groups[-1]) or rng.random() < 0.3:
                        groups.append([])
                    groups[-1].append(i)

                def member(schema: str, batch: list[Mutation]) -> GroupMember:
                    store = stores[schema]
                    assert store.epoch is not None
                    folded = fold(batch, BASE, BASE.engine_ns)
                    return GroupMember(writers[schema], store.epoch, store.incarnation, folded)

                together: list[object] = [None] * len(commits)
                for group in groups:
                    members = [member(grouped[commits[i][0]], commits[i][1]) for i in group]
                    outcomes: list[Outcome] = [None] * len(members)
                    await write_group(conn, members, outcomes, prepared=64)
                    for i, outcome in zip(group, outcomes, strict=True):
                        together[i] = _outcome(outcome)
                one_by_one: list[object] = []
                for k, batch in commits:
                    m = member(alone[k], batch)
                    try:
                        written = await m.writer.write(conn, m.epoch, m.incarnation, m.batch)
                    except Exception as exc:
                        one_by_one.append(_outcome(exc))
                    else:
                        one_by_one.append(_outcome(written))
                assert together == one_by_one, (seed, commits, groups)
                for k in range(3):
                    assert await _rows(driver, grouped[k]) == await _rows(driver, alone[k]), seed
            assert await _held(driver)  # the groups went staged
        finally:
            await driver.close()


async def test_a_session_that_loses_the_bus_statements_writes_each_commit_alone(
    fleet: Fleet,
) -> None:
    """A transaction-pooling proxy hands a group to a server session that lacks what the bus
    prepared: the group is written one statement each, and the session never staged on
    again (each staged try would fail)."""
    schemas = fleet.clusters(2)
    async with hosting(fleet, schemas) as served:
        stores = served.host.led()
        dialect = postgresql.asyncpg.dialect()  # type: ignore[no-untyped-call]
        writers = {s: BatchWriter(dialect, s) for s in schemas}
        driver = await asyncpg.connect(asyncpg_dsn(fleet.url))
        try:
            conn = CommitConnection(driver)

            async def group(n: int) -> list[Outcome]:
                members = []
                for s in schemas:
                    store = stores[s]
                    assert store.epoch is not None
                    batch = fold([task(store, n)], BASE, BASE.engine_ns)
                    members.append(GroupMember(writers[s], store.epoch, store.incarnation, batch))
                outcomes: list[Outcome] = [None] * len(members)
                await write_group(conn, members, outcomes, prepared=64)
                return outcomes

            assert all(isinstance(o, Written) for o in await group(2))
            held = await _held(driver)
            assert held  # staged
            for name in held:  # the bus's alone: the driver keeps its own
                await driver.execute(f"DEALLOCATE {name}")
            assert all(isinstance(o, Written) for o in await group(3))
            assert all(isinstance(o, Written) for o in await group(4))
            assert await _held(driver) == set()  # not prepared again
            for s in schemas:
                assert len(await xmins(fleet, s)) == 3
        finally:
            await driver.close()


def _end_with_the_loop_blocked(url: URL, pid: int) -> None:
    """End backend ``pid`` and wait until it is gone, from another thread, this one (and so
    its event loop) blocked meanwhile: the server ends a session while the loop runs late,
    which then finds the server's last words and the closed socket at once."""

    async def end() -> None:
        await admin_execute(url, "SELECT pg_catalog.pg_terminate_backend($1)", pid)
        await until(lambda: _gone(url, pid), f"backend {pid} to exit", every=0.01)

    thread = threading.Thread(target=lambda: asyncio.run(end()))
    thread.start()
    thread.join()


async def _gone(url: URL, pid: int) -> bool:
    rows = await admin_execute(url, "SELECT 1 FROM pg_catalog.pg_stat_activity WHERE pid = $1", pid)
    return not rows


async def _copy(conn: CommitConnection, method: str, n: int) -> None:
    """Task ``n`` into the session's table ``copied``, by one of a commit's COPYs."""
    if method == "copy_into":
        await conn.copy_into("copied", [(n,)], ["n"], "pg_temp")
    else:
        await conn.stage("copied", [(n,)], ["n"])


@pytest.mark.parametrize("method", ["copy_into", "stage"])
async def test_a_copy_on_a_session_ended_while_the_loop_ran_late_leaves_no_future_behind(
    pg_url: URL, method: str
) -> None:
    """A host lost its session with its loop seconds late, and asyncio logged "Future
    exception was never retrieved ... ConnectionDoesNotExistError": the server had ended a
    lane's session idle in its transaction (``idle_in_transaction_session_timeout``), and
    the commit's COPY (the bus's staging, a store's insert) met a driver out of step with
    it. asyncpg then raises having made the COPY's waiter, which the connection's loss
    fails with nobody to see it. Whenever the loop reads the session's end, the COPY fails
    as a lost session (retried), and leaves nothing for asyncio to report."""
    loop = asyncio.get_running_loop()
    gc.collect()  # what earlier tests left is not this test's to report
    reports: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reports.append(context))
    try:
        # The COPY starts 0 to 3 loop turns after the loop is back: before the driver read
        # the server's error, between the error and the closed socket, and after both.
        for turns in range(4):
            driver = await asyncpg.connect(asyncpg_dsn(pg_url))
            try:
                conn = CommitConnection(driver)
                await driver.execute("CREATE TEMPORARY TABLE copied (n bigint)")
                await _copy(conn, method, 1)  # asyncpg caches the COPY's statement
                await driver.execute("BEGIN")
                _end_with_the_loop_blocked(pg_url, driver.get_server_pid())
                for _ in range(turns):
                    await asyncio.sleep(0)
                failure: Exception | None = None
                try:
                    await _copy(conn, method, 2)
                except Exception as exc:
                    failure = translate_error(exc, "committing a batch")
                assert isinstance(failure, UnavailableError), (turns, failure)
                del failure
                await until(driver.is_closed, "the driver to see its session gone")
            finally:
                driver.terminate()  # as the commit path drops a connection in doubt
        for _ in range(3):
            await asyncio.sleep(0)
        gc.collect()
    finally:
        loop.set_exception_handler(previous)
    assert [(r["message"], repr(r.get("exception"))) for r in reports] == []
