"""An application's session settings and resets never reach the store's transactions.

With ``PgStore.from_engine`` the store's transactions run on the application's pooled
sessions, whatever the application ``SET`` on them, and whatever it reset (``DISCARD ALL``
drops the prepared statements the driver and SQLAlchemy remember). The application's pool
here has one connection, so the store's next transaction runs on exactly the session the
application poisoned. What a store transaction runs under is read inside it, on the real
server: a probe statement runs in the store's own transaction (the commit's, on the driver
connection; a read's, on its SQLAlchemy connection; a migration's, in Alembic's run) before
the store's statements.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import Any

import asyncpg
import pytest
from alembic.runtime.environment import EnvironmentContext
from sqlalchemy import Connection, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from cronoq_store import _migrations as migrations
from cronoq_store import _queries as queries
from cronoq_store._config import MIGRATION_LOCK_TIMEOUT, PgStoreConfig
from cronoq_store._domain import (
    IntervalSchedule,
    Mutation,
    RecurringNext,
    RecurringRemove,
    RecurringSpec,
    RecurringUpsert,
    StatusChanged,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    task_id,
)
from cronoq_store._door import CommitConnection, CompiledStatement
from cronoq_store._errors import IdCollisionError, KeyTakenError, UnavailableError
from cronoq_store._store import PgStore
from cronoq_store._urls import async_url

from .pgbouncer import PgBouncer, store_connect_query, store_settings
from .pgharness import ServerUnderTest, admin_execute, asyncpg_dsn
from .support import PROCESS_BASE, RUNNING, SUCCEEDED, leadership_of
from .waits import bounded, until

SESSION_TIMEOUT = 2.0

#: What a store transaction runs under, read inside it.
PROBE = (
    "SELECT current_setting('synchronous_commit') AS synchronous_commit, "
    "current_setting('transaction_read_only') AS transaction_read_only, "
    "current_setting('transaction_isolation') AS transaction_isolation, "
    "current_setting('transaction_deferrable') AS transaction_deferrable, "
    "current_setting('statement_timeout') AS statement_timeout, "
    "current_setting('lock_timeout') AS lock_timeout, "
    "current_setting('idle_in_transaction_session_timeout') AS idle_timeout, "
    "current_setting('transaction_timeout', true) AS transaction_timeout, "
    "current_setting('session_replication_role') AS session_replication_role, "
    "current_setting('client_encoding') AS client_encoding, "
    "current_setting('search_path') AS search_path, "
    "current_user::text AS current_user, session_user::text AS session_user"
)

#: (what the application runs on its session, the probe's column, what the store needs).
POISONS = [
    ("SET synchronous_commit = off", "synchronous_commit", "on"),
    ("SET synchronous_commit = local", "synchronous_commit", "on"),
    ("SET default_transaction_read_only = on", "transaction_read_only", "off"),
    ("SET default_transaction_isolation = serializable", "transaction_isolation", "read committed"),
    (
        "SET default_transaction_isolation = 'repeatable read'",
        "transaction_isolation",
        "read committed",
    ),
    (
        "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE, "
        "READ ONLY, DEFERRABLE",
        "transaction_deferrable",
        "off",
    ),
    # The configured default (here the server's: none), as on the store's own pool.
    ("SET statement_timeout = '17s'", "statement_timeout", "0"),
    ("SET lock_timeout = '13s'", "lock_timeout", "0"),
    ("SET idle_in_transaction_session_timeout = '1h'", "idle_timeout", "2s"),
    ("SET session_replication_role = replica", "session_replication_role", "origin"),
    ("SET client_encoding = 'LATIN1'", "client_encoding", "UTF8"),
    ("SET ROLE {role}", "current_user", "{user}"),
    ("SET SESSION AUTHORIZATION {role}", "session_user", "{user}"),
]

#: Where a read needs another value than a commit: it takes no lock on the leader row, so
#: its idle limit is the store's own, not session_timeout (_session_statements.IDLE_LIMIT_MS).
READ_NEEDS = {"idle_timeout": "1min"}


@pytest.fixture
async def app_engine(pg_url: URL) -> AsyncIterator[AsyncEngine]:
    """An application's engine with one pooled session: the store's transactions get the
    session the application used last."""
    engine = create_async_engine(async_url(pg_url), pool_size=1, max_overflow=0)
    try:
        yield engine
        checked_out = engine.sync_engine.pool.checkedout()  # type: ignore[attr-defined]
        assert checked_out == 0, f"{checked_out} pool connection(s) left checked out"
    finally:
        await engine.dispose()


def config(schema: str) -> PgStoreConfig:
    return PgStoreConfig(
        schema=schema,
        lock_poll=0.1,
        keepalive=0.2,
        session_timeout=SESSION_TIMEOUT,
        commit_timeout=10.0,
        application_name=f"borrowed-{schema}",
    )


async def poison(engine: AsyncEngine, *statements: str) -> None:
    """The application's ``SET``s, left on its pooled session."""
    async with engine.connect() as conn:
        for statement in statements:
            await conn.exec_driver_sql(statement)
        await conn.commit()


async def discard_session(engine: AsyncEngine) -> None:
    """Close the application's pooled session rather than reset it: a reset would run
    under whatever the test left set there, a statement timeout of a millisecond included,
    and the pool opens a clean session for whoever comes next."""
    async with engine.connect() as conn:
        await conn.invalidate()


async def session_values(engine: AsyncEngine) -> dict[str, Any]:
    """What the application's session runs under, outside the store's transactions."""
    async with engine.connect() as conn:
        return dict((await conn.execute(text(PROBE))).mappings().one())


def probing_commits(store: PgStore) -> list[dict[str, Any]]:
    """Probe every commit's transaction, before its inserts, or before its one statement
    (a batch of one kind of write, in the transaction a borrowed session opens for it)."""
    seen: list[dict[str, Any]] = []
    writer = store._commits.writer
    writers = writer._writers
    insert = writers["insert_rows"]
    write_one = writer._write_one

    async def probe(conn: CommitConnection) -> None:
        seen.append(dict(await conn.fetchrow(CompiledStatement(PROBE, (), {}), {})))

    async def probed(conn: CommitConnection, batch: Any, copy: bool, fenced: Any) -> None:
        await probe(conn)
        await insert(conn, batch, copy, fenced)

    async def probed_one(conn: CommitConnection, fence: Any, batch: Any, path: str) -> Any:
        await probe(conn)
        return await write_one(conn, fence, batch, path)

    writers["insert_rows"] = probed
    writer._write_one = probed_one  # type: ignore[method-assign]
    return seen


def probing_reads(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Probe every ``get_task``'s transaction, before its look-up."""
    seen: list[dict[str, Any]] = []
    get_task: Callable[[AsyncConnection, Any], Awaitable[Any]] = queries.get_task

    async def probed(conn: AsyncConnection, params: Any) -> Any:
        seen.append(dict((await conn.execute(text(PROBE))).mappings().one()))
        return await get_task(conn, params)

    monkeypatch.setattr(queries, "get_task", probed)
    return seen


def batch(epoch: int, n: int, key: str | None = None) -> list[Mutation]:
    """A submission and a transition: a transaction with inserts on every path."""
    return [
        Submitted(task_id(epoch, n), n, PROCESS_BASE.engine_ns, TaskSpec(b"p", key=key)),
        StatusChanged(task_id(epoch, n), TaskStatus.RUNNING, 1, PROCESS_BASE.engine_ns),
    ]


@pytest.mark.parametrize(("statement", "column", "needed"), POISONS, ids=[p[0] for p in POISONS])
async def test_a_store_transaction_runs_under_its_own_settings_on_a_poisoned_session(
    app_engine: AsyncEngine,
    migrated: str,
    pg_url: URL,
    intruder_role: str,
    monkeypatch: pytest.MonkeyPatch,
    statement: str,
    column: str,
    needed: str,
) -> None:
    user = pg_url.username
    statement, needed = statement.format(role=intruder_role), needed.format(user=user)
    store = await PgStore.from_engine(app_engine, config(migrated))
    try:
        epoch = await store.acquire_leadership()
        pool = app_engine.sync_engine.pool
        before = await session_values(app_engine)
        await poison(app_engine, statement)
        poisoned = await session_values(app_engine)
        assert poisoned != before  # the application's SET took
        commits, reads = probing_commits(store), probing_reads(monkeypatch)
        await store.commit(epoch, PROCESS_BASE, batch(epoch, 1), [])
        found = await store.get_task(task_id(epoch, 1))
        assert found is not None
        assert found.status is TaskStatus.RUNNING
        assert await store.prune(0) == 0
        assert [c[column] for c in commits] == [needed]
        assert [r[column] for r in reads] == [READ_NEEDS.get(column, needed)]
        # For its transaction alone: the application's session keeps its own settings.
        assert await session_values(app_engine) == poisoned
        assert app_engine.sync_engine.pool is pool  # never disposed
    finally:
        await store.close()
        await poison(app_engine, "RESET SESSION AUTHORIZATION", "RESET ALL")


async def test_every_setting_at_once_and_every_store_transaction(
    app_engine: AsyncEngine, migrated: str, pg_url: URL, intruder_role: str
) -> None:
    """All the poisons together, on commits (every write path), reads, recovery and prune;
    the search path puts first a schema anyone can write, holding an exact-match ``=`` for
    text (the one the store's own opening compares settings with)."""
    evil = f"{migrated}_evil"
    for statement in (
        f"CREATE SCHEMA {evil}",
        f"CREATE TABLE {evil}.calls (who text)",
        f"GRANT ALL ON SCHEMA {evil} TO PUBLIC",
        f"GRANT ALL ON {evil}.calls TO PUBLIC",
        f"CREATE FUNCTION {evil}.eq(a text, b text) RETURNS boolean LANGUAGE sql AS "
        f"$$ INSERT INTO {evil}.calls VALUES (current_user) "
        "RETURNING a OPERATOR(pg_catalog.=) b $$",
        f"CREATE OPERATOR {evil}.= (LEFTARG = text, RIGHTARG = text, FUNCTION = {evil}.eq)",
    ):
        await admin_execute(pg_url, statement)
    store = await PgStore.from_engine(app_engine, config(migrated))
    try:
        epoch = await store.acquire_leadership()
        pool = app_engine.sync_engine.pool
        await reset(
            app_engine,
            *(p[0].format(role=intruder_role) for p in POISONS if "ROLE" not in p[0]),
            f"SET search_path = {evil}, pg_catalog",
            f'SET ROLE "{intruder_role}"',
            # Last, outside a transaction: no statement of the test's own runs under it.
            "SET statement_timeout = 1",
        )
        commits = probing_commits(store)
        # One task, many, by COPY; then transitions alone; a key outside LATIN1.
        await store.commit(epoch, PROCESS_BASE, batch(epoch, 1, key="k-\N{EURO SIGN}-\u6771"), [])
        many = [
            Submitted(task_id(epoch, n), n, PROCESS_BASE.engine_ns, TaskSpec(b"p"))
            for n in range(2, 50)
        ]
        await store.commit(epoch, PROCESS_BASE, many, [])
        finish = [
            StatusChanged(task_id(epoch, n), TaskStatus.SUCCEEDED, 1, 1) for n in range(2, 50)
        ]
        await store.commit(epoch, PROCESS_BASE, finish, [(task_id(epoch, 2), b"out")])
        assert len(commits) == 2
        assert all(c["current_user"] == pg_url.username for c in commits)
        found = await store.get_task("k-\N{EURO SIGN}-\u6771")
        assert found is not None
        assert found.id == task_id(epoch, 1)
        assert await store.load_output(task_id(epoch, 2)) == b"out"
        recovered = await store.recover(PROCESS_BASE)
        assert [t.id for t in recovered.tasks] == [task_id(epoch, 1)]
        assert (await store.health()).is_leader
        assert await store.prune(0) == 48
        assert app_engine.sync_engine.pool is pool
    finally:
        await store.close()
        await discard_session(app_engine)
    rows = await admin_execute(pg_url, f'SELECT key FROM "{migrated}".cronoq_tasks')
    assert [r["key"] for r in rows] == ["k-\N{EURO SIGN}-\u6771"]
    calls = await admin_execute(pg_url, f"SELECT count(*) AS n FROM {evil}.calls")
    await admin_execute(pg_url, f"DROP SCHEMA {evil} CASCADE")
    assert calls[0]["n"] == 0


async def _read_only_error(engine: AsyncEngine) -> asyncpg.ReadOnlySQLTransactionError:
    """A real 25006 from the server (a read-only transaction that writes)."""
    async with engine.connect() as conn:
        driver: Any = (await conn.get_raw_connection()).driver_connection
        try:
            await driver.execute("BEGIN READ ONLY; CREATE TEMPORARY TABLE t (x int); COMMIT")
        except asyncpg.ReadOnlySQLTransactionError as exc:
            await driver.execute("ROLLBACK")
            error: asyncpg.ReadOnlySQLTransactionError = exc
            return error
    raise AssertionError("the server took a write in a read-only transaction")


async def test_a_read_only_error_alone_never_disposes_an_applications_pool(
    app_engine: AsyncEngine, migrated: str
) -> None:
    """The server is a primary: a read-only error there comes from session state, which is
    no failover. The store's error stays transient; the application's pool stays."""
    store = await PgStore.from_engine(app_engine, config(migrated))
    try:
        pool = app_engine.sync_engine.pool
        error = await _read_only_error(app_engine)
        with pytest.raises(UnavailableError):
            async with store._translated("committing a batch"):
                raise error
        assert app_engine.sync_engine.pool is pool
    finally:
        await store.close()


# --- migrating on a borrowed session ----------------------------------------------------


def probing_migrations(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Probe every migration's transaction, just before its revisions run and just after."""
    seen: list[dict[str, Any]] = []
    run_revisions = migrations._run_revisions

    def probed(context: EnvironmentContext, schema: str, conn: Connection, wait: Any) -> None:
        seen.append(dict(conn.execute(text(PROBE)).mappings().one()))
        run_revisions(context, schema, conn, wait)
        seen.append(dict(conn.execute(text(PROBE)).mappings().one()))

    monkeypatch.setattr(migrations, "_run_revisions", probed)
    return seen


async def tables_of(pg_url: URL, schema: str) -> list[str]:
    rows = await admin_execute(
        pg_url,
        "SELECT tablename FROM pg_catalog.pg_tables WHERE schemaname = $1 ORDER BY 1",
        schema,
    )
    return [r["tablename"] for r in rows]


@pytest.mark.parametrize(("statement", "column", "needed"), POISONS, ids=[p[0] for p in POISONS])
async def test_from_engine_migrates_under_the_stores_own_settings_on_a_poisoned_session(
    app_engine: AsyncEngine,
    schema: str,
    pg_url: URL,
    intruder_role: str,
    monkeypatch: pytest.MonkeyPatch,
    statement: str,
    column: str,
    needed: str,
) -> None:
    """``from_engine`` creates the cluster in a transaction opened as every other store
    transaction on a borrowed session: a read-only session is no failover (a retry on a
    pool of one would meet it for ever), a role left set would own the tables, an
    asynchronous commit could lose the migration. The application's session keeps its
    values."""
    user = pg_url.username
    statement, needed = statement.format(role=intruder_role), needed.format(user=user)
    seen = probing_migrations(monkeypatch)
    try:
        await poison(app_engine, statement)
        poisoned = await session_values(app_engine)
        store = await PgStore.from_engine(app_engine, config(schema))
        await store.close()
        before, after = [s[column] for s in seen]
        assert before == READ_NEEDS.get(column, needed)
        if column == "lock_timeout":
            # Once the revisions locked the cluster's tables, the migration's lock waits are
            # bounded by what remains of its own bound (_door.lock_tables), never by
            # the application's.
            assert after.endswith("ms")
            assert 0 < int(after.removesuffix("ms")) <= MIGRATION_LOCK_TIMEOUT * 1000
        else:
            assert after == before
        assert await session_values(app_engine) == poisoned
    finally:
        await poison(app_engine, "RESET SESSION AUTHORIZATION", "RESET ALL")
    assert "cronoq_tasks" in await tables_of(pg_url, schema)
    owners = await admin_execute(
        pg_url, "SELECT DISTINCT tableowner FROM pg_catalog.pg_tables WHERE schemaname = $1", schema
    )
    assert [r["tableowner"] for r in owners] == [user]


async def test_from_engine_migrates_on_a_session_whose_transactions_may_idle_a_millisecond(
    app_engine: AsyncEngine, schema: str, pg_url: URL
) -> None:
    """The server would end the session between two of the migration's statements: the
    store's transaction sets its own idle limit first."""
    # Outside a transaction, which would sit idle before its own COMMIT.
    await reset(app_engine, "SET idle_in_transaction_session_timeout = 1")
    store = await PgStore.from_engine(app_engine, config(schema))
    await store.close()
    assert "cronoq_tasks" in await tables_of(pg_url, schema)
    async with app_engine.connect() as conn:  # outside a transaction: never idle in one
        driver: Any = (await conn.get_raw_connection()).driver_connection
        assert await driver.fetchval("SHOW idle_in_transaction_session_timeout") == "1ms"


async def test_from_engine_migrates_on_a_session_that_waits_a_millisecond_for_a_lock(
    app_engine: AsyncEngine, migrated: str, pg_url: URL
) -> None:
    """Another session holds a table the migration reads: the migration waits for it
    (the store's lock_timeout, none here), not the millisecond the application set."""
    await poison(app_engine, "SET lock_timeout = 1")
    holder = await asyncpg.connect(asyncpg_dsn(pg_url))
    try:
        await holder.execute(
            f'BEGIN; LOCK TABLE "{migrated}".cronoq_alembic_version IN ACCESS EXCLUSIVE MODE'
        )
        opening = asyncio.ensure_future(PgStore.from_engine(app_engine, config(migrated)))
        waiting = (
            "SELECT count(*) FROM pg_catalog.pg_locks WHERE NOT granted "
            f"AND relation = '\"{migrated}\".cronoq_alembic_version'::regclass"
        )
        await until(
            lambda: opening.done() or holder.fetchval(waiting),
            "the opening's migration to wait for the table held",
        )
        await holder.execute("COMMIT")
        store = await opening
        await store.close()
    finally:
        await holder.close()
    assert (await session_values(app_engine))["lock_timeout"] == "1ms"


# --- through a transaction-pooling PgBouncer ---------------------------------------------


@pytest.fixture
def bouncer(pg_server: ServerUnderTest) -> AsyncIterator[PgBouncer] | Any:
    if pg_server.url.password is None:
        pytest.skip("PgBouncer here needs a server URL with a password")
    with PgBouncer(
        pg_server.url,
        pool_size=1,
        connect_query=store_connect_query(SESSION_TIMEOUT),
        settings=store_settings(SESSION_TIMEOUT),
    ) as running:
        yield running


@pytest.mark.parametrize("shared", [False, True], ids=["connect", "from_engine"])
async def test_settings_another_client_left_on_a_pgbouncer_server_connection_never_reach_the_store(
    bouncer: PgBouncer, pg_url: URL, migrated: str, shared: bool
) -> None:
    """In transaction pooling a session-level ``SET`` stays on the server connection for
    its next client, whichever it is: one server connection, so the store gets it."""
    settings = dataclasses.replace(config(migrated), prepared_statements=False)
    no_cache = {"statement_cache_size": 0, "prepared_statement_cache_size": 0}
    engine = create_async_engine(async_url(bouncer.url()), pool_size=2, connect_args=no_cache)
    try:
        if shared:
            store = await PgStore.from_engine(engine, settings, lock_url=pg_url)
        else:
            store = await PgStore.connect(bouncer.url(), settings, lock_url=pg_url)
        try:
            epoch = await store.acquire_leadership()
            other = await asyncpg.connect(
                bouncer.url().set(drivername="postgresql").render_as_string(hide_password=False),
                statement_cache_size=0,
            )
            try:
                await other.execute(
                    "BEGIN; SET synchronous_commit = off; "
                    "SET default_transaction_read_only = on; SET lock_timeout = '13s'; COMMIT"
                )
            finally:
                await other.close()
            pool = store.engine.sync_engine.pool
            commits = probing_commits(store)
            await store.commit(epoch, PROCESS_BASE, batch(epoch, 1), [])
            assert await store.prune(0) == 0
            assert [
                (c["synchronous_commit"], c["transaction_read_only"], c["lock_timeout"])
                for c in commits
            ] == [("on", "off", "0")]
            assert store.engine.sync_engine.pool is pool
            assert (await store.get_task(TaskId(task_id(epoch, 1)))) is not None
        finally:
            await store.close()
    finally:
        await engine.dispose()


async def test_an_applications_connect_settings_reach_neither_the_lock_session_nor_a_commit(
    pg_url: URL, migrated: str
) -> None:
    """Settings in the engine's connect arguments are the sessions' reset values, so
    ``TO DEFAULT`` alone would keep them: the store still commits durably and read-write,
    and its lock session (made the way the engine connects) bumps the epoch the same way.
    A timeout there is the engine's configuration, as on the store's own pool: kept."""
    engine = create_async_engine(
        async_url(pg_url),
        pool_size=1,
        max_overflow=0,
        connect_args={
            "server_settings": {
                "synchronous_commit": "off",
                "default_transaction_read_only": "on",
                # The engine's configuration, as the store's own pool has it: kept.
                "statement_timeout": "17s",
            }
        },
    )
    try:
        store = await PgStore.from_engine(engine, config(migrated), migrate=False)
        try:
            epoch = await bounded(store.acquire_leadership(), "the leadership of an idle cluster")
            lock_session: Any = leadership_of(store)._session
            assert lock_session is not None
            assert await lock_session.setting("synchronous_commit", 5.0) == "on"
            assert await lock_session.setting("default_transaction_read_only", 5.0) == "off"
            commits = probing_commits(store)
            await store.commit(epoch, PROCESS_BASE, batch(epoch, 1), [])
            assert [
                (c["synchronous_commit"], c["transaction_read_only"], c["statement_timeout"])
                for c in commits
            ] == [("on", "off", "17s")]
            assert await store.prune(0) == 0
        finally:
            await store.close()
    finally:
        await engine.dispose()


async def test_a_function_on_the_applications_path_neither_fails_a_ping_nor_disposes_its_pool(
    app_engine: AsyncEngine, migrated: str
) -> None:
    """The recovery check runs on the application's session outside a store transaction:
    a ``pg_is_in_recovery`` in a schema the application put before ``pg_catalog`` (one
    another role can write) must not answer it, nor make a primary look like a standby
    and dispose the application's pool."""
    shadow = f"shadow_{uuid.uuid4().hex[:8]}"
    async with app_engine.begin() as conn:
        await conn.exec_driver_sql(f'CREATE SCHEMA "{shadow}"')
        await conn.exec_driver_sql(
            f'CREATE FUNCTION "{shadow}".pg_is_in_recovery() RETURNS boolean '
            "LANGUAGE sql AS 'SELECT true'"
        )
    store = await PgStore.from_engine(app_engine, config(migrated))
    try:
        pool = app_engine.sync_engine.pool
        await poison(app_engine, f'SET search_path = "{shadow}", pg_catalog')
        await store.ping()
        assert await store._demoted() is False
        assert app_engine.sync_engine.pool is pool
    finally:
        await store.close()
        async with app_engine.begin() as conn:
            await conn.exec_driver_sql(f'DROP SCHEMA "{shadow}" CASCADE')


# --- sessions the application resets ---------------------------------------------------------

EVERY_MINUTE = IntervalSchedule(timedelta(minutes=1))
#: The rows each round of :func:`every_path` leaves: tasks 1, 2, 4, 5 and 40 copied ones.
ROWS_PER_ROUND = 44
#: The epoch a new cluster stores. A store that never led commits under it (the epoch check
#: still fences it), with no lock session whose keeper a long migration on a loaded machine
#: could starve: these tests are about the pooled sessions.
NO_LEADER = 0


async def reset(engine: AsyncEngine, *statements: str) -> None:
    """What the application runs on its pooled session between the store's transactions,
    outside any transaction (``DISCARD`` refuses to run in one), by the simple protocol."""
    async with engine.connect() as conn:
        driver: Any = (await conn.get_raw_connection()).driver_connection
        for statement in statements:
            await driver.execute(statement)


async def prepared_statements(engine: AsyncEngine) -> dict[str, str]:
    """The statements prepared on the application's session, name by text (this query's
    own left out)."""
    async with engine.connect() as conn:
        driver: Any = (await conn.get_raw_connection()).driver_connection
        # A text of its own each time: never a statement of the driver's cache, which the
        # application's reset may have emptied on the server.
        rows = await driver.fetch(
            f"SELECT name, statement FROM pg_prepared_statements -- {uuid.uuid4()}"
        )
    return {
        r["statement"]: r["name"] for r in rows if "pg_prepared_statements" not in r["statement"]
    }


async def every_path(
    store: PgStore, epoch: int, round: int, engine: AsyncEngine | None, *, migrate: bool = False
) -> None:
    """Every statement the store runs on a pooled session, each with the outcome it must
    have: commits on every write path (one statement, a transaction, COPY, an id
    collision, a held key, a batch sent again), look-ups, a page, an output, recovery,
    health, a ping, a prune, and opening a store on ``engine`` (checking the revision, and
    migrating if ``migrate``). A migration runs DDL, after which SQLAlchemy prepares every
    statement again: a reset right after it would meet no stale statement. Each round uses
    ids of its own; it leaves :data:`ROWS_PER_ROUND` task rows."""

    def id(n: int) -> TaskId:
        return TaskId(100 * round + n)

    key, held, now = f"key-{round}", f"held-{round}", PROCESS_BASE.engine_ns
    await store.commit(
        epoch,
        PROCESS_BASE,
        [Submitted(id(1), 1, now, TaskSpec(b"p", key=key)), StatusChanged(id(1), RUNNING, 1, now)],
        [],
    )
    await store.commit(
        epoch,
        PROCESS_BASE,
        [
            StatusChanged(id(1), SUCCEEDED, 1, now),
            RecurringUpsert(RecurringSpec(f"s{round}", EVERY_MINUTE, TaskSpec(b"t"))),
            RecurringNext(f"s{round}", next=now, last=id(1)),
            RecurringRemove(f"s{round - 1}"),
        ],
        [(id(1), b"out")],
    )
    await store.commit(
        epoch, PROCESS_BASE, [Submitted(id(n), n, now, TaskSpec(b"p")) for n in range(10, 50)], []
    )
    await store.commit(
        epoch, PROCESS_BASE, [Submitted(id(n), n, now, TaskSpec(b"p")) for n in (4, 5)], []
    )
    await store.commit(epoch, PROCESS_BASE, [StatusChanged(id(10), RUNNING, 1, now)], [])
    sent = Submitted(id(2), 2, now, TaskSpec(b"p", key=held))
    await store.commit(epoch, PROCESS_BASE, [sent], [])
    # Sent again with its next transition: its insert finds it stored, so the batch is
    # written again with the transition first.
    await store.commit(epoch, PROCESS_BASE, [sent, StatusChanged(id(2), RUNNING, 1, now)], [])
    with pytest.raises(IdCollisionError):
        await store.commit(epoch, PROCESS_BASE, [Submitted(id(2), 2, now, TaskSpec(b"other"))], [])
    with pytest.raises(KeyTakenError):
        await store.commit(
            epoch, PROCESS_BASE, [Submitted(id(3), 3, now, TaskSpec(b"p", key=held))], []
        )

    found = await store.get_task(id(1))
    assert found is not None
    assert found.status is SUCCEEDED
    by_key = await store.get_task(key)
    assert by_key is not None
    assert by_key.id == id(1)
    assert [t.id for t in await store.list_finished(after=id(0), limit=10)] == [id(1)]
    assert await store.load_output(id(1)) == b"out"
    recovered = await store.recover(PROCESS_BASE)
    live = {t.id: t.attempt for t in recovered.tasks}
    assert {n: live.get(id(n)) for n in (2, 3, 4, 10, 11)} == {2: 1, 3: None, 4: 0, 10: 1, 11: 0}
    assert f"s{round}" in [r.spec.name for r in recovered.recurring]
    assert f"s{round - 1}" not in [r.spec.name for r in recovered.recurring]
    health = await store.health()
    assert (health.is_leader, health.stored_epoch) == (False, epoch)
    await store.ping()
    assert await store.prune(3600) == 0
    if engine is not None:
        for migrating in (False, True) if migrate else (False,):
            await (await PgStore.from_engine(engine, store.config, migrate=migrating)).close()


async def stored_rows(pg_url: URL, schema: str) -> list[tuple[str, int, int]]:
    """(status, attempt, rows) of the cluster's tasks: nothing lost, nothing doubled."""
    rows = await admin_execute(
        pg_url,
        f'SELECT status, attempt, count(*) AS n FROM "{schema}".cronoq_tasks '
        "GROUP BY status, attempt ORDER BY status, attempt",
    )
    return [(r["status"], r["attempt"], r["n"]) for r in rows]


def rows_of(rounds: int) -> list[tuple[str, int, int]]:
    """What :func:`stored_rows` reads after ``rounds`` rounds of :func:`every_path`."""
    return [("queued", 0, 41 * rounds), ("running", 1, 2 * rounds), ("succeeded", 1, rounds)]


@pytest.mark.parametrize(
    "caches",
    [{}, {"prepared_statement_cache_size": 0}],
    ids=["asyncpg-and-sqlalchemy-caches", "asyncpg-cache-only"],
)
@pytest.mark.parametrize("statement", ["DISCARD ALL", "DEALLOCATE ALL"])
async def test_a_session_that_lost_its_prepared_statements_still_serves_every_path(
    pg_url: URL, migrated: str, statement: str, caches: dict[str, int]
) -> None:
    """The application resets its one pooled session: the statements asyncpg and
    SQLAlchemy remember are gone from the server. Every path of the store makes them
    again, and writes each batch once."""
    engine = create_async_engine(
        async_url(pg_url), pool_size=1, max_overflow=0, connect_args=caches
    )
    try:
        store = await PgStore.from_engine(engine, config(migrated))
        try:
            epoch = NO_LEADER
            await every_path(store, epoch, 0, engine, migrate=True)
            await every_path(store, epoch, 1, engine)
            assert await prepared_statements(engine) != {}
            await reset(engine, statement)
            assert await prepared_statements(engine) == {}
            await every_path(store, epoch, 2, engine, migrate=True)
        finally:
            await store.close()
        assert engine.sync_engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    finally:
        await engine.dispose()
    assert await stored_rows(pg_url, migrated) == rows_of(3)


async def test_each_prepared_statement_lost_alone_is_made_again(
    app_engine: AsyncEngine, migrated: str, pg_url: URL
) -> None:
    """``DEALLOCATE`` of one statement at a time, each of those the store made on the
    session: whichever statement meets the loss (a commit's, recovery's cursor, a look-up's,
    the migration's...), the store makes it again and the path's outcome is the same."""
    store = await PgStore.from_engine(app_engine, config(migrated))
    try:
        epoch = NO_LEADER
        await every_path(store, epoch, 0, app_engine, migrate=True)
        await every_path(store, epoch, 1, app_engine)
        texts = list(await prepared_statements(app_engine))
        rounds, lost = 2, 0
        for text in texts:
            # Made again under another name: by the round after the store found one lost
            # (which empties the session's caches); never, if nothing runs it again
            # (SQLAlchemy's checks of a new connection).
            name = (await prepared_statements(app_engine)).get(text)
            if name is None:
                await every_path(store, epoch, rounds, app_engine)
                rounds += 1
                name = (await prepared_statements(app_engine)).get(text)
            if name is not None:
                await reset(app_engine, f'DEALLOCATE "{name}"')
                await every_path(store, epoch, rounds, app_engine)
                rounds, lost = rounds + 1, lost + 1
        assert lost > 30, texts
    finally:
        await store.close()
    assert await stored_rows(pg_url, migrated) == rows_of(rounds)


async def test_a_session_of_the_stores_own_pool_reset_through_its_engine(
    pg_url: URL, migrated: str
) -> None:
    """``store.engine`` is public: an application that runs ``DISCARD ALL`` through it
    resets the store's own sessions, where commits take the one-statement paths."""
    one = dataclasses.replace(config(migrated), max_connections=1)
    store = await PgStore.connect(pg_url, one)
    try:
        epoch = NO_LEADER
        assert store._commits.writer.borrowed_opening is None  # the one-statement paths
        await every_path(store, epoch, 0, None)
        await reset(store.engine, "DISCARD ALL")
        await every_path(store, epoch, 1, None)
    finally:
        await store.close()
    assert await stored_rows(pg_url, migrated) == rows_of(2)


@pytest.fixture
async def evil_path(pg_url: URL, migrated: str) -> AsyncIterator[str]:
    """A schema anyone can write, holding an exact-match ``=`` for text that records who
    called it: a session whose ``search_path`` puts it first must never run it."""
    evil = f"{migrated}_evil"
    for statement in (
        f"CREATE SCHEMA {evil}",
        f"CREATE TABLE {evil}.calls (who text)",
        f"GRANT ALL ON SCHEMA {evil} TO PUBLIC",
        f"GRANT ALL ON {evil}.calls TO PUBLIC",
        f"CREATE FUNCTION {evil}.eq(a text, b text) RETURNS boolean LANGUAGE sql AS "
        f"$$ INSERT INTO {evil}.calls VALUES (current_user) "
        "RETURNING a OPERATOR(pg_catalog.=) b $$",
        f"CREATE OPERATOR {evil}.= (LEFTARG = text, RIGHTARG = text, FUNCTION = {evil}.eq)",
    ):
        await admin_execute(pg_url, statement)
    yield evil
    calls = await admin_execute(pg_url, f"SELECT count(*) AS n FROM {evil}.calls")
    await admin_execute(pg_url, f"DROP SCHEMA {evil} CASCADE")
    assert calls[0]["n"] == 0


#: Resets and settings an application may leave on its session, in the order the test
#: below runs them: each stays in effect for the rounds after it, until ``DISCARD ALL``.
OTHER_RESETS = [
    "DISCARD PLANS",
    "DISCARD TEMP",
    "DISCARD SEQUENCES",
    "RESET ALL",
    "SET search_path = {evil}, pg_catalog",
    'SET ROLE "{role}"',
    'SET SESSION AUTHORIZATION "{role}"',
    "DISCARD ALL",
]


async def test_every_reset_an_application_may_run_leaves_every_path_working(
    app_engine: AsyncEngine, migrated: str, pg_url: URL, intruder_role: str, evil_path: str
) -> None:
    """The application's own temporary objects and prepared statements on the session,
    then each reset in turn: every path of the store works after each, the open included
    (its revision check and schema look-up run as the pool's role, not a role left set)."""
    store = await PgStore.from_engine(app_engine, config(migrated))
    try:
        epoch = NO_LEADER
        await reset(
            app_engine,
            "CREATE TEMPORARY TABLE cronoq_tasks (id bigint)",
            "CREATE TEMPORARY SEQUENCE app_sequence",
            "SELECT nextval('app_sequence')",
            "PREPARE app_statement AS SELECT 1",
        )
        await every_path(store, epoch, 0, app_engine)
        for round, statement in enumerate(OTHER_RESETS, start=1):
            await reset(app_engine, statement.format(evil=evil_path, role=intruder_role))
            await every_path(store, epoch, round, app_engine, migrate=True)
    finally:
        await store.close()
        await reset(app_engine, "RESET SESSION AUTHORIZATION", "RESET ALL")
    assert await stored_rows(pg_url, migrated) == rows_of(len(OTHER_RESETS) + 1)


async def test_a_session_reset_behind_a_session_pooling_pgbouncer_is_still_recovered(
    pg_server: ServerUnderTest, pg_url: URL, migrated: str
) -> None:
    """Behind a proxy that keeps each client on one server session (PgBouncer's session
    pooling), the backend is not the one the connection's startup named, and a reset is
    still a reset: the server session under the connection never changes."""
    if pg_server.url.password is None:
        pytest.skip("PgBouncer here needs a server URL with a password")
    with PgBouncer(pg_server.url, pool_size=1, settings={"pool_mode": "session"}) as bouncer:
        engine = create_async_engine(async_url(bouncer.url()), pool_size=1, max_overflow=0)
        try:
            store = await PgStore.from_engine(engine, config(migrated), lock_url=pg_url)
            try:
                epoch = NO_LEADER
                await every_path(store, epoch, 0, engine, migrate=True)
                await every_path(store, epoch, 1, engine)
                for round in (2, 3):  # the second loss on the connection too
                    await reset(engine, "DISCARD ALL")
                    await every_path(store, epoch, round, engine)
            finally:
                await store.close()
        finally:
            await engine.dispose()
    assert await stored_rows(pg_url, migrated) == rows_of(4)
