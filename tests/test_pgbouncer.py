"""The store behind a real PgBouncer 1.18 in ``pool_mode = transaction``, and the settings
of the store's own pool sessions.

PgBouncer hands each transaction (and each statement outside one) to whichever of its
server connections is free: a named prepared statement made on one is unknown on the next,
or collides with another client's of the same name, and it refuses every startup parameter
it does not track. The pool here has two server connections for up to eight client
connections, so clients really share backends. The leader lock session goes direct
(``lock_url``). The store's PgBouncer database entry sets the store's ``search_path`` and
idle limit on each server connection (``connect_query``), as docs/reliability.md asks.

Skipped, naming the package, where PgBouncer is not installed.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store._commit_path import COPY_MIN_ROWS
from cronoq_store._committer import GroupCommitter
from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import (
    IntervalSchedule,
    Mutation,
    RecurringSpec,
    RecurringUpsert,
    TaskId,
    TaskSpec,
    TaskStatus,
    task_id,
)
from cronoq_store._errors import FencedError, StoreError
from cronoq_store._retry import Backoff
from cronoq_store._statements import SEARCH_PATH
from cronoq_store._store import PgStore
from cronoq_store._urls import async_url

from .pgbouncer import PgBouncer, store_connect_query, store_settings
from .pgharness import ServerUnderTest, admin_execute, asyncpg_dsn
from .support import PROCESS_BASE, changed_in, submitted_in
from .waits import bounded, holds_for, until_value

#: The store's default: the idle limits it scales (PgBouncer's ``idle_transaction_timeout``,
#: the server's ``idle_in_transaction_session_timeout``) end a migration whose transaction
#: idles between statements while Python works, which on a busy machine can take seconds.
#: No test here waits for a limit to pass.
SESSION_TIMEOUT = 10.0
#: What the store's PgBouncer database entry runs on each server connection it opens.
STORE_ENTRY = store_connect_query(SESSION_TIMEOUT)
PGBOUNCER_SETTINGS = store_settings(SESSION_TIMEOUT)


@pytest.fixture
def bouncer(pg_server: ServerUnderTest) -> Iterator[PgBouncer]:
    if pg_server.url.password is None:
        pytest.skip("PgBouncer here needs a server URL with a password")
    with PgBouncer(
        pg_server.url, pool_size=2, connect_query=STORE_ENTRY, settings=PGBOUNCER_SETTINGS
    ) as running:
        yield running


def behind(schema: str, name: str = "pgb", **settings: Any) -> PgStoreConfig:
    return PgStoreConfig(
        schema=schema,
        prepared_statements=False,
        lock_poll=0.1,
        keepalive=0.2,
        session_timeout=SESSION_TIMEOUT,
        application_name=f"{name}-{schema}",
        **settings,
    )


@asynccontextmanager
async def store_behind(
    bouncer: PgBouncer, direct: URL, config: PgStoreConfig, *, shared: bool = False
) -> AsyncIterator[PgStore]:
    """A store whose pool goes through ``bouncer`` and whose lock session goes direct: its
    own pool (``connect``), or an application's engine set up as docs/reliability.md says."""
    if not shared:
        store = await PgStore.connect(bouncer.url(), config, lock_url=direct)
        try:
            yield store
        finally:
            await store.close()
        return
    engine = create_async_engine(
        async_url(bouncer.url()),
        pool_size=8,
        connect_args={"statement_cache_size": 0, "prepared_statement_cache_size": 0},
    )
    try:
        store = await PgStore.from_engine(engine, config, lock_url=direct)
        try:
            yield store
        finally:
            await store.close()
    finally:
        await engine.dispose()


async def stored(url: URL, schema: str) -> dict[int, tuple[str, bytes | None]]:
    rows = await admin_execute(url, f'SELECT id, status, output FROM "{schema}".cronoq_tasks')
    return {r["id"]: (r["status"], r["output"]) for r in rows}


async def schema_exists(url: URL, schema: str) -> bool:
    rows = await admin_execute(url, "SELECT 1 FROM pg_namespace WHERE nspname = $1", schema)
    return bool(rows)


# --- what the default settings meet -----------------------------------------------------


async def test_the_default_settings_are_refused_with_the_setting_named(
    bouncer: PgBouncer, pg_url: URL, schema: str
) -> None:
    """PgBouncer refuses the store's session settings at connection start: the store says
    which setting to change, as a permanent error, before it creates anything."""
    with pytest.raises(StoreError, match=r"PgStoreConfig\(prepared_statements=False\)") as info:
        await PgStore.connect(bouncer.url(), PgStoreConfig(schema=schema), lock_url=pg_url)
    assert not info.value.is_transient
    assert "unsupported startup parameter" in str(info.value)
    assert bouncer.server_url.password is not None
    assert bouncer.server_url.password not in str(info.value)
    assert not await schema_exists(pg_url, schema)


async def test_named_prepared_statements_break_behind_pgbouncer(
    bouncer: PgBouncer, pg_url: URL, schema: str
) -> None:
    """What ``prepared_statements=False`` avoids: an application engine with asyncpg's and
    SQLAlchemy's statement caches on (their defaults), shared by a store left at the
    default. Clients sharing server connections find their named statements missing
    (26000) or taken by another client (42P05): commits and reads fail."""
    engine = create_async_engine(async_url(bouncer.url()), pool_size=8, max_overflow=0)
    failures: list[BaseException] = []
    try:
        try:
            store = await PgStore.from_engine(engine, PgStoreConfig(schema=schema), lock_url=pg_url)
        except StoreError as exc:
            failures.append(exc)
        else:
            try:
                epoch = await store.acquire_leadership()
                # Each client connection reuses its statement names from the second round
                # on, on whichever server connection PgBouncer gives that transaction.
                for round in range(5):
                    ids = range(16 * round, 16 * (round + 1))
                    results = await asyncio.gather(
                        *(
                            store.commit(epoch, PROCESS_BASE, [submitted_in(epoch, n)], [])
                            for n in ids
                        ),
                        *(store.get_task(task_id(epoch, n)) for n in ids),
                        return_exceptions=True,
                    )
                    failures += [r for r in results if isinstance(r, BaseException)]
                    if failures:
                        break
            finally:
                await store.close()
    finally:
        await engine.dispose()
    assert failures, "named prepared statements worked behind a transaction-pooling PgBouncer"
    assert all(isinstance(f, StoreError) for f in failures), failures
    codes = {_sqlstate(f) for f in failures}
    assert codes <= {"26000", "42P05"}, failures
    assert any("prepared statement" in str(f) for f in failures), failures
    # Each says what to change, and is not retried: the same settings fail again.
    for failure in failures:
        assert "PgStoreConfig(prepared_statements=False)" in str(failure), failure
        assert '"statement_cache_size": 0' in str(failure), failure
        assert isinstance(failure, StoreError)
        assert not failure.is_transient, failure


def _sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE somewhere in ``exc``'s chain of causes."""
    seen: BaseException | None = exc
    while seen is not None:
        for holder in (seen, getattr(seen, "orig", None)):
            code = getattr(holder, "sqlstate", None)
            if isinstance(code, str):
                return code
        seen = seen.__cause__
    return None


async def test_pooled_sessions_without_the_stores_search_path_are_refused(
    pg_server: ServerUnderTest, pg_url: URL, schema: str
) -> None:
    """Without prepared statements the store cannot set ``search_path`` per session, so a
    PgBouncer entry that does not set it is refused, naming the fix, before anything is
    created."""
    if pg_url.password is None:
        pytest.skip("PgBouncer here needs a server URL with a password")
    with PgBouncer(pg_url) as plain, pytest.raises(StoreError, match="connect_query") as info:
        await PgStore.connect(plain.url(), behind(schema), lock_url=pg_url)
    assert "search_path" in str(info.value)
    assert not await schema_exists(pg_url, schema)


@pytest.mark.parametrize("shared", [False, True], ids=["connect", "from_engine"])
async def test_without_prepared_statements_a_direct_lock_url_is_required(
    bouncer: PgBouncer, pg_url: URL, schema: str, shared: bool
) -> None:
    """The leader lock would otherwise be taken through PgBouncer, on a server connection
    other clients' transactions use and that outlives this store's hold on it."""
    engine = create_async_engine(async_url(bouncer.url()))
    try:
        opening = (
            PgStore.from_engine(engine, behind(schema))
            if shared
            else PgStore.connect(bouncer.url(), behind(schema))
        )
        with pytest.raises(ValueError, match="needs lock_url="):
            await opening
    finally:
        await engine.dispose()
    assert not await schema_exists(pg_url, schema)


# --- what works with prepared_statements=False --------------------------------------------


@pytest.mark.parametrize("shared", [False, True], ids=["connect", "from_engine"])
async def test_commits_recovery_and_queries_behind_pgbouncer(
    bouncer: PgBouncer, pg_url: URL, schema: str, shared: bool
) -> None:
    """Every commit shape (one-statement submissions and transitions, a transaction with
    outputs and a schedule, a batch of new tasks by COPY), many at once so that clients share
    server connections; then recovery, look-ups and pruning, all through PgBouncer."""
    async with store_behind(bouncer, pg_url, behind(schema), shared=shared) as store:
        epoch = await store.acquire_leadership()
        await asyncio.gather(
            *(
                store.commit(epoch, PROCESS_BASE, [submitted_in(epoch, n, key=f"k{n}")], [])
                for n in range(40)
            )
        )
        await asyncio.gather(
            *(
                store.commit(epoch, PROCESS_BASE, [changed_in(epoch, n, TaskStatus.RUNNING)], [])
                for n in range(40)
            )
        )
        schedule = RecurringSpec("hourly", IntervalSchedule(timedelta(hours=1)), TaskSpec(b"tpl"))
        await asyncio.gather(
            *(
                store.commit(
                    epoch,
                    PROCESS_BASE,
                    [changed_in(epoch, n, TaskStatus.SUCCEEDED)],
                    [(TaskId(task_id(epoch, n)), b"out %d" % n)],
                )
                for n in range(20)
            ),
            store.commit(epoch, PROCESS_BASE, [RecurringUpsert(schedule)], []),
        )
        large: list[Mutation] = [submitted_in(epoch, n) for n in range(1000, 1000 + COPY_MIN_ROWS)]
        await asyncio.gather(
            store.commit(epoch, PROCESS_BASE, large, []),
            *(
                store.commit(epoch, PROCESS_BASE, [submitted_in(epoch, n)], [])
                for n in range(40, 60)
            ),
        )

        rows = await stored(pg_url, schema)
        assert len(rows) == 60 + COPY_MIN_ROWS
        for n in range(20):
            assert rows[task_id(epoch, n)] == ("succeeded", b"out %d" % n)
        for n in range(20, 40):
            assert rows[task_id(epoch, n)] == ("running", None)

        recovered = await store.recover(PROCESS_BASE)
        assert {t.id for t in recovered.tasks} == {task_id(epoch, n) for n in range(20, 60)} | {
            task_id(epoch, n) for n in range(1000, 1000 + COPY_MIN_ROWS)
        }
        assert {t.id for t in recovered.terminal} == {task_id(epoch, n) for n in range(20)}
        assert [r.spec.name for r in recovered.recurring] == ["hourly"]
        assert recovered.next_id == task_id(epoch, 1000 + COPY_MIN_ROWS)

        by_key = await store.get_task("k3")
        assert by_key is not None
        assert (by_key.id, by_key.status) == (task_id(epoch, 3), TaskStatus.SUCCEEDED)
        page = await store.list_finished(statuses=[TaskStatus.SUCCEEDED], limit=100)
        assert [r.id for r in page] == [task_id(epoch, n) for n in range(20)]
        assert await store.load_output(TaskId(task_id(epoch, 7))) == b"out 7"
        assert await store.prune(0) == 20
        assert len(await stored(pg_url, schema)) == 40 + COPY_MIN_ROWS


@pytest.mark.parametrize("shared", [False, True], ids=["connect", "from_engine"])
async def test_a_search_path_another_client_left_on_a_server_connection_never_reaches_a_commit(
    bouncer: PgBouncer, pg_url: URL, schema: str, shared: bool
) -> None:
    """In transaction pooling a session-level ``SET search_path`` stays on the server
    connection for its next client. Another client of the store's entry leaves one that
    puts a schema anyone can write first, holding an exact-match ``=`` for integers (the
    epoch check's): none of the store's commits or reads may run that operator."""
    evil = f"{schema}_evil"
    for statement in (
        f"CREATE SCHEMA {evil}",
        f"CREATE TABLE {evil}.calls (who text)",
        f"GRANT ALL ON SCHEMA {evil} TO PUBLIC",
        f"GRANT ALL ON {evil}.calls TO PUBLIC",
        f"CREATE FUNCTION {evil}.eq(a integer, b integer) RETURNS boolean LANGUAGE sql AS "
        f"$$ INSERT INTO {evil}.calls VALUES (current_user) "
        "RETURNING a OPERATOR(pg_catalog.=) b $$",
        f"CREATE OPERATOR {evil}.= (LEFTARG = integer, RIGHTARG = integer, FUNCTION = {evil}.eq)",
    ):
        await admin_execute(pg_url, statement)
    async with store_behind(bouncer, pg_url, behind(schema), shared=shared) as store:
        epoch = await store.acquire_leadership()
        # The other client: both server connections of the pool get its search_path.
        others = [
            await asyncpg.connect(asyncpg_dsn(bouncer.url()), statement_cache_size=0)
            for _ in range(2)
        ]
        try:
            transactions = [other.transaction() for other in others]
            for transaction in transactions:
                await transaction.start()
            for other in others:
                await other.execute(f"SET search_path = {evil}, pg_catalog")
            for transaction in transactions:
                await transaction.commit()
        finally:
            for other in others:
                await other.close()
        for n in range(4):
            await store.commit(epoch, PROCESS_BASE, [submitted_in(epoch, n)], [])
        await store.commit(epoch, PROCESS_BASE, [changed_in(epoch, 0, TaskStatus.RUNNING)], [])
        big = [submitted_in(epoch, 100 + n) for n in range(COPY_MIN_ROWS)]
        await store.commit(epoch, PROCESS_BASE, big, [])
        assert (await store.get_task(task_id(epoch, 0))) is not None
        recovered = await store.recover(PROCESS_BASE)
        assert len(recovered.tasks) == 4 + COPY_MIN_ROWS
    calls = await admin_execute(pg_url, f"SELECT count(*) AS n FROM {evil}.calls")
    assert calls[0]["n"] == 0


async def test_group_commit_behind_pgbouncer(bouncer: PgBouncer, pg_url: URL, schema: str) -> None:
    async with store_behind(bouncer, pg_url, behind(schema)) as store:
        epoch = await store.acquire_leadership()
        counter = itertools.count()
        acked: set[int] = set()

        async def submitter(committer: GroupCommitter) -> None:
            for _ in range(10):
                n = next(counter)
                await committer.submit(
                    [submitted_in(epoch, n), changed_in(epoch, n, TaskStatus.RUNNING)]
                )
                acked.add(task_id(epoch, n))

        async with GroupCommitter(store, epoch, PROCESS_BASE) as committer:
            await asyncio.gather(*(submitter(committer) for _ in range(64)))
            stats = committer.stats()
    assert stats.failed_submissions == 0
    assert stats.commits < len(acked)
    rows = await stored(pg_url, schema)
    assert len(acked) == 640
    assert {i: rows[i][0] for i in acked} == dict.fromkeys(acked, "running")


async def test_a_takeover_behind_pgbouncer_fences_the_deposed_leader(
    bouncer: PgBouncer, pg_url: URL, schema: str
) -> None:
    """Two stores pooled through PgBouncer, lock sessions direct. The leader's lock session
    is terminated; the standby takes over with the next epoch, recovers what the old leader
    committed, and the old leader's next commit is fenced with nothing written."""
    async with (
        store_behind(bouncer, pg_url, behind(schema, "a")) as old,
        store_behind(bouncer, pg_url, behind(schema, "b")) as new,
    ):
        old_epoch = await old.acquire_leadership()
        await old.commit(old_epoch, PROCESS_BASE, [submitted_in(old_epoch, 0)], [])
        standby = asyncio.ensure_future(new.acquire_leadership())
        await holds_for(
            lambda: not standby.done(), "the standby waiting while the leader holds the lock", 0.3
        )

        rows = await admin_execute(
            pg_url,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE starts_with(application_name, $1)",
            f"a-{schema} leader ",
        )
        assert [r[0] for r in rows] == [True]
        new_epoch = await bounded(standby, "the standby to take over")
        assert new_epoch == old_epoch + 1
        recovered = await new.recover(PROCESS_BASE)
        assert [t.id for t in recovered.tasks] == [task_id(old_epoch, 0)]

        with pytest.raises(FencedError):
            await old.commit(old_epoch, PROCESS_BASE, [submitted_in(old_epoch, 1)], [])
        await new.commit(new_epoch, PROCESS_BASE, [submitted_in(new_epoch, 0)], [])
    assert set(await stored(pg_url, schema)) == {task_id(old_epoch, 0), task_id(new_epoch, 0)}


@pytest.mark.parametrize("mode", ["term", "kill"])
async def test_a_pgbouncer_restart_under_group_commit_loses_no_ack(
    bouncer: PgBouncer, pg_url: URL, schema: str, mode: str
) -> None:
    """PgBouncer stops (SIGTERM: it closes every connection; SIGKILL: a crash) while 32
    submitters commit, and comes back: commits in flight fail as unavailable and are
    retried, submitters see no error, commits resume, and every acknowledged submission is
    in the database."""
    async with store_behind(bouncer, pg_url, behind(schema)) as store:
        epoch = await store.acquire_leadership()
        counter = itertools.count()
        acked: set[int] = set()
        going = True

        async def submitter(committer: GroupCommitter) -> None:
            while going:
                n = next(counter)
                await committer.submit([submitted_in(epoch, n)])
                acked.add(task_id(epoch, n))

        async def grows_by(count: int, what: str) -> None:
            target = len(acked) + count
            await until_value(lambda: len(acked), lambda n: n >= target, f"{target} acks: {what}")

        committer = GroupCommitter(
            store, epoch, PROCESS_BASE, backoff=Backoff(initial=0.02, cap=0.2)
        )
        tasks = [asyncio.create_task(submitter(committer)) for _ in range(32)]
        try:
            await grows_by(200, "acks before the restart")
            await asyncio.to_thread(bouncer.stop, "kill" if mode == "kill" else "term")
            # Down until a commit has met the outage, however long that takes here.
            await until_value(
                lambda: committer.stats().retries,
                lambda n: n >= 1,
                "a commit to fail while PgBouncer is down, and be retried",
            )
            await asyncio.to_thread(bouncer.start)
            await grows_by(200, "acks after the restart")
        finally:
            going = False
            results = await asyncio.gather(*tasks, return_exceptions=True)
            await committer.close()
        stats = committer.stats()
    assert [r for r in results if r is not None] == []
    assert stats.retries >= 1
    assert stats.failed_submissions == 0
    missing = acked - set(await stored(pg_url, schema))
    assert not missing, f"{len(missing)} acknowledged submissions are not in the database"


# --- the store's own pool sessions --------------------------------------------------------


async def test_pool_sessions_end_when_their_client_vanishes(pg_url: URL, schema: str) -> None:
    """A pooled session of ``connect()`` has TCP keepalives and ``tcp_user_timeout`` scaled
    to ``session_timeout``, like the lock session, and the store's idle-in-transaction limit:
    a client cut off inside a commit cannot hold the leader row for hours."""
    config = PgStoreConfig(schema=schema, session_timeout=7.0, keepalive=1.0, lock_poll=0.5)
    async with await PgStore.connect(pg_url, config) as store, store.engine.connect() as conn:
        rows = (
            await conn.execute(
                text(
                    "SELECT name, setting FROM pg_catalog.pg_settings WHERE name IN "
                    "('tcp_keepalives_idle', 'tcp_keepalives_interval', "
                    "'tcp_keepalives_count', 'tcp_user_timeout', "
                    "'idle_in_transaction_session_timeout', 'search_path')"
                )
            )
        ).all()
    assert dict(rows) == {
        "tcp_keepalives_idle": "7",
        "tcp_keepalives_interval": "1",
        "tcp_keepalives_count": "3",
        "tcp_user_timeout": "7000",
        "idle_in_transaction_session_timeout": "7000",
        "search_path": SEARCH_PATH,
    }
