"""Opening and closing stores: URL forms, schema names, secrets, shared engines."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from sqlalchemy import event, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import Submitted, TaskId, TaskSpec
from cronoq_store._errors import StoreError, UnavailableError
from cronoq_store._store import PgStore, Store, StoreQueries

from .pgharness import ServerUnderTest, admin_execute, without_instance
from .support import PROCESS_BASE, unused_port


def plain(url: URL) -> str:
    return url.render_as_string(hide_password=False)


async def round_trip(store: PgStore) -> None:
    """A commit and a read through the store's pool, in its schema."""
    await store.commit(0, PROCESS_BASE, [Submitted(TaskId(1), 1, 0, TaskSpec(b"x"))], [])
    task = await store.get_task(TaskId(1))
    assert task is not None
    assert task.pool == "default"


@pytest.mark.parametrize(
    "form",
    ["postgresql-url-object", "postgresql-string", "postgres-string", "asyncpg-string"],
)
async def test_connect_accepts_postgresql_and_asyncpg_urls(
    pg_url: URL, schema: str, form: str
) -> None:
    forms: dict[str, URL | str] = {
        "postgresql-url-object": pg_url,
        "postgresql-string": plain(pg_url),
        "postgres-string": plain(pg_url).replace("postgresql://", "postgres://", 1),
        "asyncpg-string": plain(pg_url.set(drivername="postgresql+asyncpg")),
    }
    url = forms[form]
    async with await PgStore.connect(url, PgStoreConfig(schema=schema)) as store:
        assert isinstance(store, Store)
        assert isinstance(store, StoreQueries)
        await round_trip(store)
        assert store.leader_lock[0] == 0x63726F71


async def test_connect_over_a_unix_socket(pg_server: ServerUnderTest, schema: str) -> None:
    if pg_server.kind != "embedded":
        pytest.skip(f"only the embedded server exposes its socket directory ({pg_server.kind})")
    server: Any = pg_server.server  # type: ignore[attr-defined]
    url = server.socket_url()
    assert "host" in url.query
    assert url.host is None
    async with await PgStore.connect(plain(url), PgStoreConfig(schema=schema)) as store:
        await round_trip(store)


async def test_owned_pool_is_sized_named_and_disposed(pg_url: URL, schema: str) -> None:
    name = f"cronoq-test-{schema}"
    config = PgStoreConfig(schema=schema, max_connections=3, application_name=name)
    store = await PgStore.connect(pg_url, config)
    pool: Any = store.engine.pool
    assert (pool.size(), pool._max_overflow) == (3, 0)
    await round_trip(store)
    sessions = await admin_execute(
        pg_url, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", name
    )
    assert sessions[0][0] >= 1
    await store.close()
    await store.close()  # idempotent
    with pytest.raises(StoreError, match="closed"):
        await store.get_task(TaskId(1))
    sessions = await admin_execute(
        pg_url, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", name
    )
    assert sessions[0][0] == 0


async def test_invalid_schema_name_is_refused_before_any_sql(engine: AsyncEngine) -> None:
    with pytest.raises(ValueError, match="invalid schema name"):
        PgStoreConfig(schema='x"; DROP TABLE users; --')
    # A config that slipped past validation is still refused, before a statement runs.
    config = PgStoreConfig()
    object.__setattr__(config, "schema", 'x"; DROP TABLE users; --')
    statements: list[str] = []

    def record(*args: Any) -> None:
        statements.append(args[2])

    event.listen(engine.sync_engine, "before_cursor_execute", record)
    try:
        with pytest.raises(ValueError, match="invalid schema name"):
            await PgStore.from_engine(engine, config)
        refused = URL.create("postgresql", "u", "pw", "127.0.0.1", unused_port(), "db")
        with pytest.raises(ValueError, match="invalid schema name"):
            await PgStore.connect(refused, config)
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", record)
    assert statements == []


async def test_an_engine_on_another_driver_is_refused_before_any_sql(
    pg_url: URL, schema: str
) -> None:
    # The commit path runs on asyncpg connections: a psycopg engine could connect and
    # migrate, then fail every commit.
    engine = create_async_engine(pg_url.set(drivername="postgresql+psycopg"))
    try:
        with pytest.raises(ValueError, match=r"asyncpg driver.*postgresql\+psycopg"):
            await PgStore.from_engine(engine, PgStoreConfig(schema=schema))
        assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    finally:
        await engine.dispose()
    [[exists]] = await admin_execute(
        pg_url, "SELECT count(*) FROM pg_namespace WHERE nspname = $1", schema
    )
    assert exists == 0


async def test_unsupported_url_is_refused_without_its_password() -> None:
    with pytest.raises(ValueError, match="unsupported database URL") as caught:
        await PgStore.connect("mysql://user:hunter2@localhost/db")
    assert "hunter2" not in str(caught.value)


async def test_password_appears_in_no_repr_and_no_error(
    pg_url: URL, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    password = pg_url.password
    assert password
    async with await PgStore.connect(pg_url, PgStoreConfig(schema=schema)) as store:
        assert "***" in repr(store)
        assert str(password) not in repr(store)
        assert str(password) not in str(store)

    wrong = "not-the-password-3141"
    caplog.set_level(logging.DEBUG, logger="cronoq_store")
    with pytest.raises(StoreError) as auth:
        await PgStore.connect(pg_url.set(password=wrong), PgStoreConfig(schema=schema))
    refused = pg_url.set(port=unused_port())
    with pytest.raises(UnavailableError) as down:
        await PgStore.connect(refused, PgStoreConfig(schema=schema))
    for caught in (auth, down):
        rendered = "".join(
            str(e) + repr(e) for e in (caught.value, caught.value.__cause__) if e is not None
        )
        assert wrong not in rendered
        assert str(password) not in rendered
    assert "password authentication failed" in str(auth.value)
    logged = caplog.text
    assert wrong not in logged
    assert str(password) not in logged


async def test_from_engine_shares_the_pool_and_close_leaves_it_open(
    engine: AsyncEngine, schema: str
) -> None:
    pool: Any = engine.pool
    store = await PgStore.from_engine(engine, PgStoreConfig(schema=schema))
    assert store.engine is engine
    await round_trip(store)
    assert pool.checkedin() >= 1  # the store used this pool
    await store.close()
    assert pool.checkedin() >= 1
    assert engine.pool is pool
    async with engine.connect() as conn:  # the application carries on
        assert (await conn.execute(text("SELECT 1"))).scalar() == 1
    await store.migrate()  # idempotent, and still possible on the shared engine


async def test_from_engine_never_holds_the_lock_on_the_applications_pool(
    engine: AsyncEngine, schema: str, pg_url: URL
) -> None:
    """The leader lock lives on a dedicated session, not on any of the app pool's backends."""
    store = await PgStore.from_engine(
        engine, PgStoreConfig(schema=schema, application_name=f"app-{schema}")
    )
    try:
        await round_trip(store)  # the store's own statements ran on the shared pool
        await store.acquire_leadership()
        # Check out several pool connections at once, note their backends, return them all.
        conns = [await engine.connect() for _ in range(3)]
        pool_pids = {(await c.execute(text("SELECT pg_backend_pid()"))).scalar() for c in conns}
        for conn in conns:
            await conn.close()
        k1, k2 = store.leader_lock
        holders = await admin_execute(
            pg_url,
            "SELECT l.pid, a.application_name FROM pg_locks l "
            "JOIN pg_stat_activity a USING (pid) WHERE l.locktype = 'advisory' AND l.granted "
            "AND l.classid = $1 AND l.objid = ($2::bigint & 4294967295)::oid "
            "AND l.objsubid = 2",
            k1,
            k2,
        )
        assert len(holders) == 1
        pid, application = holders[0]
        assert pid not in pool_pids
        assert without_instance(application) == f"app-{schema} leader"
        await store.release_leadership()
        assert (
            await admin_execute(
                pg_url,
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND classid = $1 "
                "AND objid = ($2::bigint & 4294967295)::oid",
                k1,
                k2,
            )
            == []
        )
    finally:
        await store.close()


async def test_mixed_case_schema_names_are_kept_apart(pg_url: URL) -> None:
    """``Prod`` and ``prod`` are two schemas, two clusters, two leader locks."""
    names = ["Cronoq_Mixed", "cronoq_mixed"]
    try:
        async with (
            await PgStore.connect(pg_url, PgStoreConfig(schema=names[0])) as upper,
            await PgStore.connect(pg_url, PgStoreConfig(schema=names[1])) as lower,
        ):
            await round_trip(upper)
            assert await lower.get_task(TaskId(1)) is None
            oids = await admin_execute(
                pg_url,
                "SELECT nspname, oid::int FROM pg_namespace WHERE nspname = ANY($1::text[])",
                names,
            )
            by_name = {r[0]: r[1] for r in oids}
            assert upper.leader_lock[1] == by_name[names[0]]
            assert lower.leader_lock[1] == by_name[names[1]]
    finally:
        for name in names:
            await admin_execute(pg_url, f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


async def test_a_database_not_encoded_in_utf8_is_refused_before_anything_is_created(
    pg_url: URL,
) -> None:
    """In LATIN1, a key such as '日本' would fail its whole batch: refused at open instead."""
    name = "cronoq_latin1"
    await admin_execute(pg_url, f"DROP DATABASE IF EXISTS {name}")
    await admin_execute(
        pg_url,
        f"CREATE DATABASE {name} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0",
    )
    latin1 = pg_url.set(database=name)
    try:
        with pytest.raises(StoreError, match="encoded in LATIN1: cronoq-store needs a UTF8"):
            await PgStore.connect(latin1, PgStoreConfig(schema="cluster"))
        rows = await admin_execute(
            latin1, "SELECT count(*) AS n FROM pg_namespace WHERE nspname = 'cluster'"
        )
        assert rows[0]["n"] == 0
    finally:
        await admin_execute(pg_url, f"DROP DATABASE IF EXISTS {name}")
