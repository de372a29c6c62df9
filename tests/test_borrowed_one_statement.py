"""Attacks on the one-statement commit on a borrowed session (``PgStore.from_engine``):
a batch of new tasks only, or of transitions only, runs its one fenced statement between
the opening that sets the store's settings and ``COMMIT``. Each answer is compared with
the store's own pool, and the application's session is read after each commit on a pool
that never resets it on return (a transaction left open would show)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from cronoq_store import ClusterReplacedError, FencedError, Mutation, PgStore, TaskStatus
from cronoq_store._commit_path import COPY_MIN_ROWS, fold
from cronoq_store._errors import IdCollisionError, KeyTakenError
from cronoq_store._migrations import upgrade
from cronoq_store._urls import async_url

from .pgharness import admin_execute, asyncpg_dsn
from .support import PROCESS_BASE, bump_epoch, changed_in, stored_ids, submitted_in
from .test_borrowed_sessions import PROBE, config
from .test_incarnation import swap
from .waits import PATIENCE, until

RUNNING, SUCCEEDED = TaskStatus.RUNNING, TaskStatus.SUCCEEDED


@pytest.fixture
async def raw_engine(pg_url: URL) -> AsyncIterator[AsyncEngine]:
    """An application's engine of one session that is never reset on return: whatever a
    store transaction leaves on it, the next checkout sees."""
    engine = create_async_engine(
        async_url(pg_url), pool_size=1, max_overflow=0, pool_reset_on_return=None
    )
    try:
        yield engine
        assert engine.sync_engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    finally:
        await engine.dispose()


async def app_session(engine: AsyncEngine) -> dict[str, Any]:
    """The application's session as the next checkout finds it: in a transaction or not
    (read on the driver before anything runs), and its settings."""
    async with engine.connect() as conn:
        raw = await conn.get_raw_connection()
        driver: Any = raw.driver_connection
        in_tx = driver.is_in_transaction()
        row = dict(await driver.fetchrow(PROBE))
        row["in_transaction"] = in_tx
        row["locks"] = await driver.fetchval(
            "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() "
            "AND locktype = 'relation' AND relation::regclass::text LIKE '%cronoq%'"
        )
        await conn.rollback()
        return row


async def open_kind(kind: str, pg_url: URL, engine: AsyncEngine, schema: str) -> PgStore:
    if kind == "own":
        return await PgStore.connect(pg_url, config(schema))
    return await PgStore.from_engine(engine, config(schema))


async def at_epoch_one(pg_url: URL, schema: str) -> None:
    await admin_execute(pg_url, f'UPDATE "{schema}".cronoq_leader SET epoch = 1')


async def rows_of(pg_url: URL, schema: str) -> list[tuple[Any, ...]]:
    rows = await admin_execute(
        pg_url, f'SELECT id, key, status, attempt FROM "{schema}".cronoq_tasks ORDER BY id'
    )
    return [tuple(r) for r in rows]


def path_batch(path: str) -> list[Mutation]:
    if path == "insert one":
        return [submitted_in(1, 10)]
    if path == "insert many":
        return [submitted_in(1, 11), submitted_in(1, 12)]
    return [changed_in(1, 0, RUNNING)]


@pytest.mark.parametrize("kind", ["own", "borrowed"])
@pytest.mark.parametrize("path", ["insert one", "insert many", "update"])
async def test_a_commit_after_another_took_the_epoch_writes_nothing_and_is_fenced(
    pg_url: URL, migrated: str, raw_engine: AsyncEngine, kind: str, path: str
) -> None:
    await at_epoch_one(pg_url, migrated)
    store = await open_kind(kind, pg_url, raw_engine, migrated)
    try:
        await store.commit(1, PROCESS_BASE, [submitted_in(1, 0)], [])
        before = await rows_of(pg_url, migrated)
        batch = path_batch(path)
        assert store._commits.writer.path(fold(batch, PROCESS_BASE, 0)) == path.split()[0]
        await bump_epoch(pg_url, migrated)
        with pytest.raises(FencedError) as caught:
            await store.commit(1, PROCESS_BASE, batch, [])
        assert not isinstance(caught.value, ClusterReplacedError)
        assert await rows_of(pg_url, migrated) == before
        with pytest.raises(FencedError):
            await store.commit(1, PROCESS_BASE, [submitted_in(1, 99)], [])
        assert await rows_of(pg_url, migrated) == before
    finally:
        await store.close()
    if kind == "borrowed":
        seen = await app_session(raw_engine)
        assert not seen["in_transaction"]
        assert seen["locks"] == 0


async def answers(store: PgStore) -> list[Any]:
    """Every refusal and repeat of the one-statement paths, each answer as raised."""
    out: list[Any] = []

    async def attempt(batch: list[Mutation]) -> None:
        try:
            await store.commit(1, PROCESS_BASE, batch, [])
            out.append("ok")
        except (IdCollisionError, KeyTakenError) as exc:
            out.append((type(exc).__name__, getattr(exc, "ids", None), getattr(exc, "keys", None)))

    first = submitted_in(1, 1, b"first", key="k")
    other = submitted_in(1, 2, b"other")
    await attempt([first, other])
    await attempt([first])  # the same submission again: a no-op
    await attempt([first, other])  # both again, as one insert of two
    # Another task with first's id (another payload): a collision, alone and in a batch.
    await attempt([submitted_in(1, 1, b"impostor")])
    await attempt([submitted_in(1, 3), submitted_in(1, 1, b"impostor")])
    # A live key another task holds: alone and with a new task.
    await attempt([submitted_in(1, 4, key="k")])
    await attempt([submitted_in(1, 5), submitted_in(1, 6, key="k")])
    # Both at once: the id wins.
    await attempt([submitted_in(1, 2, b"impostor", key="k")])
    # Sent again with its transition ahead of the stored row: the insert refuses, the
    # batch goes again with the transition in the update.
    await attempt([first, changed_in(1, 1, RUNNING)])
    # Transitions only: a no-op one and a real one.
    await attempt([changed_in(1, 1, RUNNING)])
    await attempt([changed_in(1, 1, SUCCEEDED)])
    # The key is released now: a new task takes it.
    await attempt([submitted_in(1, 7, key="k")])
    return out


async def test_refusals_and_repeats_answer_as_on_the_stores_own_pool(
    pg_url: URL, migrated: str, raw_engine: AsyncEngine
) -> None:
    await at_epoch_one(pg_url, migrated)
    seen: dict[str, tuple[list[Any], list[tuple[Any, ...]]]] = {}
    for kind in ("own", "borrowed"):
        await admin_execute(pg_url, f'DELETE FROM "{migrated}".cronoq_tasks')
        store = await open_kind(kind, pg_url, raw_engine, migrated)
        try:
            got = await answers(store)
        finally:
            await store.close()
        seen[kind] = (got, await rows_of(pg_url, migrated))
        if kind == "borrowed":
            app = await app_session(raw_engine)
            assert not app["in_transaction"]
            assert app["locks"] == 0
    assert seen["borrowed"] == seen["own"]
    got, rows = seen["own"]
    assert got[:3] == ["ok", "ok", "ok"]
    assert got[3][0] == "IdCollisionError"
    assert got[5][0] == "KeyTakenError"
    assert [r[2] for r in rows] == ["succeeded", "queued", "queued"]


async def test_the_applications_session_keeps_its_settings_and_no_transaction(
    pg_url: URL, migrated: str, raw_engine: AsyncEngine, intruder_role: str
) -> None:
    """After each one-statement commit, its refusals and a fenced one, the application's
    session is idle, holds no lock of ours, and runs under the settings it set."""
    await at_epoch_one(pg_url, migrated)
    store = await PgStore.from_engine(raw_engine, config(migrated))
    try:
        async with raw_engine.connect() as conn:
            for statement in (
                "SET search_path = pg_temp, public",
                "SET statement_timeout = '17s'",
                "SET lock_timeout = '13s'",
                "SET synchronous_commit = off",
                "SET default_transaction_isolation = serializable",
                f'SET ROLE "{intruder_role}"',
            ):
                await conn.exec_driver_sql(statement)
            await conn.commit()
        poisoned = await app_session(raw_engine)
        assert poisoned["current_user"] == intruder_role
        assert poisoned["statement_timeout"] == "17s"
        batches: list[tuple[list[Mutation], type[BaseException] | None]] = [
            ([submitted_in(1, 1, key="k")], None),
            ([submitted_in(1, 2), submitted_in(1, 3)], None),
            ([changed_in(1, 1, RUNNING)], None),
            ([submitted_in(1, 1, b"impostor")], IdCollisionError),
            ([submitted_in(1, 4, key="k")], KeyTakenError),
            ([submitted_in(1, 5), submitted_in(1, 6, key="k")], KeyTakenError),
            ([submitted_in(1, n) for n in range(10, 10 + COPY_MIN_ROWS)], None),
        ]
        for batch, error in batches:
            if error is None:
                await store.commit(1, PROCESS_BASE, batch, [])
            else:
                with pytest.raises(error):
                    await store.commit(1, PROCESS_BASE, batch, [])
            assert await app_session(raw_engine) == poisoned, batch
        await bump_epoch(pg_url, migrated)
        with pytest.raises(FencedError):
            await store.commit(1, PROCESS_BASE, [changed_in(1, 2, RUNNING)], [])
        assert await app_session(raw_engine) == poisoned
    finally:
        await store.close()
        async with raw_engine.connect() as conn:
            await conn.invalidate()
    assert len(await stored_ids(pg_url, migrated)) == 3 + COPY_MIN_ROWS


async def commit_waiting_on_row(
    pg_url: URL, schema: str, blocker: asyncpg.Connection, store: PgStore, id: int
) -> asyncio.Future[None]:
    """``blocker`` takes task ``id``'s row ``FOR UPDATE`` in a transaction it leaves open;
    then a commit moving that task to running, once its statement waits on the row."""
    await blocker.execute("BEGIN")
    await blocker.execute(f'SELECT 1 FROM "{schema}".cronoq_tasks WHERE id = $1 FOR UPDATE', id)
    blocker_pid = await blocker.fetchval("SELECT pg_backend_pid()")
    committing = asyncio.ensure_future(
        store.commit(1, PROCESS_BASE, [changed_in(1, 0, RUNNING)], [])
    )

    async def waiting() -> bool:
        rows = await admin_execute(
            pg_url,
            "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND pid <> $1 AND query LIKE '%cronoq_tasks%'",
            blocker_pid,
        )
        return bool(rows)

    await until(waiting, "the commit to wait on the row")
    return committing


async def test_a_commit_cancelled_while_its_statement_waits_leaves_nothing_open(
    pg_url: URL, migrated: str, raw_engine: AsyncEngine
) -> None:
    """The update waits on a row another session holds; the caller gives up (cancels).
    Whatever became of the write, the application's session is neither left in a
    transaction nor holding the leader row, and the next commits go through."""
    await at_epoch_one(pg_url, migrated)
    store = await PgStore.from_engine(raw_engine, config(migrated))
    try:
        await store.commit(1, PROCESS_BASE, [submitted_in(1, 0)], [])
        blocker = await asyncpg.connect(asyncpg_dsn(pg_url))
        try:
            committing = await commit_waiting_on_row(
                pg_url, migrated, blocker, store, submitted_in(1, 0).id
            )
            committing.cancel()
            outcome: BaseException | None = None
            try:
                await asyncio.wait_for(committing, PATIENCE)
            except BaseException as exc:
                outcome = exc
            # Taking the epoch must not wait behind a leader row share-locked by a
            # session nobody drives any more.
            await admin_execute(pg_url, "SET lock_timeout = '20s'")
            await blocker.execute("ROLLBACK")
        finally:
            await blocker.close()
        epoch_taken = await asyncio.wait_for(bump_epoch(pg_url, migrated), PATIENCE)
        assert epoch_taken == 2
        rows = await admin_execute(
            pg_url,
            "SELECT state, query FROM pg_stat_activity WHERE state LIKE 'idle in transaction%' "
            "AND datname = current_database()",
        )
        assert [dict(r) for r in rows] == []
        status = (await rows_of(pg_url, migrated))[0][2]
        if isinstance(outcome, asyncio.CancelledError):
            assert status in ("queued", "running")
        else:
            assert outcome is None, outcome
            assert status == "running"
        with pytest.raises(FencedError):
            await store.commit(1, PROCESS_BASE, [changed_in(1, 0, SUCCEEDED)], [])
    finally:
        await store.close()
    seen = await app_session(raw_engine)
    assert not seen["in_transaction"]
    assert seen["locks"] == 0


@pytest.mark.parametrize("path", ["insert one", "insert many", "update"])
async def test_a_schema_dropped_and_made_again_between_two_commits_refuses_the_second(
    pg_url: URL, engine: AsyncEngine, migrated: str, raw_engine: AsyncEngine, path: str
) -> None:
    await at_epoch_one(pg_url, migrated)
    store = await PgStore.from_engine(raw_engine, config(migrated))
    try:
        await store.commit(1, PROCESS_BASE, [submitted_in(1, 0)], [])
        # The statements are prepared on the application's session now: the second
        # commit meets them again, on a table of the same name and another OID.
        await store.commit(1, PROCESS_BASE, path_batch(path), [])
        incarnation = store.incarnation
        await admin_execute(pg_url, f'DROP SCHEMA "{migrated}" CASCADE')
        await upgrade(engine, migrated)
        await at_epoch_one(pg_url, migrated)
        agains: dict[str, list[Mutation]] = {
            "insert one": [submitted_in(1, 20)],
            "insert many": [submitted_in(1, 21), submitted_in(1, 22)],
            "update": [changed_in(1, 0, SUCCEEDED)],
        }
        again = agains[path]
        with pytest.raises(ClusterReplacedError) as refused:
            await store.commit(1, PROCESS_BASE, again, [])
        assert refused.value.incarnation == incarnation
        assert refused.value.found not in (None, incarnation)
        with pytest.raises(FencedError):
            await store.commit(1, PROCESS_BASE, [submitted_in(1, 999)], [])
        assert await stored_ids(pg_url, migrated) == []
    finally:
        await store.close()
    seen = await app_session(raw_engine)
    assert not seen["in_transaction"]


@pytest.fixture
async def other_schema(pg_url: URL) -> AsyncIterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    await admin_execute(pg_url, f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


@pytest.mark.parametrize("kind", ["own", "borrowed"])
async def test_schemas_swapped_while_the_statement_waits_write_into_no_other_cluster(
    pg_url: URL,
    engine: AsyncEngine,
    migrated: str,
    other_schema: str,
    raw_engine: AsyncEngine,
    kind: str,
) -> None:
    """The one statement resolves its tables once: swapped meanwhile, it still writes only
    into its own cluster (now under the other name) or refuses; never into the cluster
    now standing under its schema's name."""
    await upgrade(engine, other_schema)
    await at_epoch_one(pg_url, other_schema)
    await at_epoch_one(pg_url, migrated)
    store = await open_kind(kind, pg_url, raw_engine, migrated)
    try:
        stored = submitted_in(1, 0)
        await store.commit(1, PROCESS_BASE, [stored], [])
        # The same id in the other cluster, queued.
        await admin_execute(
            pg_url,
            f'INSERT INTO "{other_schema}".cronoq_tasks SELECT * FROM "{migrated}".cronoq_tasks',
        )
        blocker = await asyncpg.connect(asyncpg_dsn(pg_url))
        try:
            committing = await commit_waiting_on_row(pg_url, migrated, blocker, store, stored.id)
            await swap(pg_url, migrated, other_schema)
            await blocker.execute("ROLLBACK")
        finally:
            await blocker.close()
        with contextlib.suppress(ClusterReplacedError):
            await asyncio.wait_for(committing, PATIENCE)
        # Under the store's schema's name now: the other cluster, never written.
        rows = await admin_execute(
            pg_url, f'SELECT status FROM "{migrated}".cronoq_tasks WHERE id = $1', stored.id
        )
        assert rows[0][0] == "queued"
    finally:
        await store.close()
