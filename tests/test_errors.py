"""Every failure class, produced for real through the asyncpg dialect, and how it is mapped.

Each scenario asserts the shape it really produced (SQLSTATE or exception type) before the
mapping, so a scenario that silently stopped producing its error fails instead of passing.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import asyncpg
import pytest
from sqlalchemy import BigInteger, bindparam, select, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

import cronoq_store
from cronoq_store._door import CONNECTION_CLASSES, translate_error, translated
from cronoq_store._errors import (
    FencedError,
    KeyTakenError,
    StoreError,
    UnavailableError,
)
from cronoq_store._urls import async_url

from .pgharness import ServerUnderTest, admin_execute, terminate_backend
from .waits import bounded, until

#: Put into every statement and parameter below: none of it may reach a message.
SECRET_SQL = "/* sql-text-marker */"
SECRET_PARAM = "param-value-marker"

#: A query that outlasts any wait for it: what a test does to it (a stop, a kill, a cancel,
#: a timeout) ends it, else the test's bound fails.
LONG_SLEEP = 600


@pytest.fixture
def password(pg_url: URL) -> str:
    assert pg_url.password, "the suite's server uses password authentication over TCP"
    return str(pg_url.password)


@pytest.fixture
async def table(engine: AsyncEngine, schema: str) -> str:
    """A two-row table ``"<schema>".t(id, v)``, for transactions to fight over."""
    async with engine.begin() as conn:
        await conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        await conn.execute(text(f'CREATE TABLE "{schema}".t (id int PRIMARY KEY, v text)'))
        await conn.execute(text(f"INSERT INTO \"{schema}\".t VALUES (1, 'a'), (2, 'b')"))
    return f'"{schema}".t'


def sqlstate(exc: BaseException) -> str | None:
    return getattr(getattr(exc, "orig", None), "sqlstate", None)


def causes(exc: BaseException) -> Iterator[BaseException]:
    current: BaseException | None = exc
    while current is not None:
        yield current
        current = getattr(current, "orig", None) or current.__cause__


async def reraise(exc: BaseException) -> None:
    raise exc


async def failure(action: Awaitable[Any]) -> tuple[StoreError, BaseException]:
    """Run ``action``; return its failure translated, as the store raises it, and the original."""
    try:
        await action
    except Exception as exc:
        try:
            raise translate_error(exc, "testing") from exc
        except StoreError as error:
            return error, exc
    pytest.fail("the scenario produced no error")


def assert_clean(error: StoreError, original: BaseException, password: str) -> None:
    assert error.__cause__ is original
    for secret in (password, SECRET_SQL, SECRET_PARAM):
        assert secret not in str(error)
        assert secret not in repr(error)
    assert str(error).startswith("testing failed: ")
    assert "\n" not in str(error)


def assert_unavailable(
    error: StoreError, original: BaseException, password: str, *, reconnect: bool = False
) -> None:
    assert isinstance(error, UnavailableError), f"not transient: {error}"
    assert error.is_transient
    assert error.reconnect is reconnect
    assert_clean(error, original, password)


def assert_permanent(error: StoreError, original: BaseException, password: str) -> None:
    assert type(error) is StoreError, f"transient: {error}"
    assert not error.is_transient
    assert_clean(error, original, password)


async def query(conn: AsyncConnection, sql: str, **params: Any) -> Any:
    result = await conn.execute(text(f"{SECRET_SQL} {sql}"), params)
    return result.all() if result.returns_rows else None


async def backend_pid(conn: AsyncConnection) -> int:
    return int((await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one())


async def sleeping(pg_url: URL, pid: int) -> None:
    """Return once backend ``pid`` runs its ``pg_sleep``: what a test then does to the query
    happens during it, however long the query took to reach the server."""

    async def running() -> bool:
        rows = await admin_execute(
            pg_url,
            "SELECT 1 FROM pg_stat_activity"
            " WHERE pid = $1 AND state = 'active' AND query LIKE '%pg_sleep%'",
            pid,
        )
        return bool(rows)

    await until(running, f"backend {pid} running its pg_sleep")


async def during(pg_url: URL, pid: int, action: Callable[[], Awaitable[Any]]) -> Any:
    await sleeping(pg_url, pid)
    return await action()


# --- connection loss ------------------------------------------------------------------------


async def test_server_stop_during_a_query(
    engine: AsyncEngine, pg_url: URL, stoppable: ServerUnderTest, password: str
) -> None:
    async with engine.connect() as conn:
        pid = await backend_pid(conn)  # connected before the stop
        stop = asyncio.ensure_future(during(pg_url, pid, lambda: asyncio.to_thread(stoppable.stop)))
        error, original = await bounded(
            failure(query(conn, f"SELECT pg_sleep({LONG_SLEEP})")), "the query cut by the stop"
        )
        await stop
        assert sqlstate(original) == "08003"  # 57P01 admin shutdown as its cause
        codes = {getattr(e, "sqlstate", None) for e in causes(original)} - {None}
        assert "57P01" in codes
        # The store discards a connection that failed so (never back to the pool).
        assert all(str(code).startswith(CONNECTION_CLASSES) for code in codes), codes
        assert_unavailable(error, original, password)
        await conn.rollback()


async def test_server_down_and_back_with_idle_pooled_connection(
    pg_url: URL, stoppable: ServerUnderTest, password: str
) -> None:
    engine = create_async_engine(async_url(pg_url))  # no pre-ping: the dead one is handed out
    try:
        async with engine.connect() as conn:
            await query(conn, "SELECT 1")
        assert engine.pool.checkedin() == 1  # type: ignore[attr-defined]
        await asyncio.to_thread(stoppable.stop, "immediate")

        async def use() -> None:
            async with engine.connect() as conn:
                await query(conn, "SELECT :p", p=SECRET_PARAM)

        # The pooled connection is dead: "connection is closed" with no SQLSTATE.
        error, original = await failure(use())
        assert isinstance(original, DBAPIError)
        assert original.connection_invalidated
        assert_unavailable(error, original, password)

        # While the server is down, new connections are refused: a raw OSError.
        error, original = await failure(use())
        assert isinstance(original, OSError)
        assert_unavailable(error, original, password)

        await asyncio.to_thread(stoppable.start)
        await use()  # and the pool recovers by itself
    finally:
        await engine.dispose()


async def test_backend_terminated_during_a_query_and_while_idle(
    engine: AsyncEngine, pg_url: URL, password: str
) -> None:
    async with engine.connect() as conn:
        pid = await backend_pid(conn)
        kill = asyncio.ensure_future(during(pg_url, pid, lambda: terminate_backend(pg_url, pid)))
        error, original = await bounded(
            failure(query(conn, f"SELECT pg_sleep({LONG_SLEEP})")), "the query cut by the kill"
        )
        assert await kill
        assert sqlstate(original) == "08003"
        assert_unavailable(error, original, password)
        await conn.rollback()

    async with engine.connect() as conn:
        pid = await backend_pid(conn)
        await conn.commit()
        driver = (await conn.get_raw_connection()).driver_connection
        assert isinstance(driver, asyncpg.Connection)
        assert await terminate_backend(pg_url, pid)
        await until(driver.is_closed, "the client seeing its idle backend gone")
        error, original = await failure(query(conn, "SELECT 1"))
        assert sqlstate(original) is None
        assert "closed" in str(original.__cause__)
        assert_unavailable(error, original, password)
        await conn.rollback()


async def test_refused_connection(pg_url: URL, password: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    engine = create_async_engine(async_url(pg_url.set(port=closed_port)))
    try:
        error, original = await failure(engine.connect().start())
        assert isinstance(original, ConnectionRefusedError)
        assert_unavailable(error, original, password)
    finally:
        await engine.dispose()


async def test_wrong_password_is_permanent_and_not_shown(pg_url: URL, password: str) -> None:
    wrong = f"{password}-wrong"
    engine = create_async_engine(async_url(pg_url.set(password=wrong)))
    try:
        error, original = await failure(engine.connect().start())
        assert sqlstate(original) == "28P01"
        assert_permanent(error, original, password)
        assert wrong not in str(error)
    finally:
        await engine.dispose()


# --- contention -----------------------------------------------------------------------------


async def test_serialization_failure(engine: AsyncEngine, table: str, password: str) -> None:
    async with engine.connect() as first, engine.connect() as second:
        await first.execution_options(isolation_level="REPEATABLE READ")
        await query(first, f"SELECT v FROM {table} WHERE id = 1")  # snapshot taken
        await query(second, f"UPDATE {table} SET v = 'second' WHERE id = 1")
        await second.commit()
        error, original = await failure(
            query(first, f"UPDATE {table} SET v = :p WHERE id = 1", p=SECRET_PARAM)
        )
        assert sqlstate(original) == "40001"
        assert_unavailable(error, original, password)
        await first.rollback()


async def test_deadlock(engine: AsyncEngine, table: str, password: str) -> None:
    async with engine.connect() as first, engine.connect() as second:
        for conn in (first, second):
            await query(conn, "SET deadlock_timeout = '50ms'")
        await query(first, f"UPDATE {table} SET v = 'x' WHERE id = 1")
        await query(second, f"UPDATE {table} SET v = 'x' WHERE id = 2")
        results = await asyncio.gather(
            query(first, f"UPDATE {table} SET v = 'y' WHERE id = 2"),
            # Either order closes the cycle: whichever waits second sees it.
            query(second, f"UPDATE {table} SET v = 'y' WHERE id = 1"),
            return_exceptions=True,
        )
        victims = [r for r in results if isinstance(r, BaseException)]
        assert len(victims) == 1
        error, original = await failure(reraise(victims[0]))
        assert sqlstate(original) == "40P01"
        assert_unavailable(error, original, password)
        await first.rollback()
        await second.rollback()


async def test_lock_timeout(engine: AsyncEngine, table: str, password: str) -> None:
    async with engine.connect() as holder, engine.connect() as waiter:
        await query(holder, f"SELECT * FROM {table} WHERE id = 1 FOR UPDATE")
        await query(waiter, "SET lock_timeout = '100ms'")
        error, original = await failure(
            query(waiter, f"SELECT * FROM {table} WHERE id = 1 FOR UPDATE")
        )
        assert sqlstate(original) == "55P03"
        assert_unavailable(error, original, password)
        await waiter.rollback()
        await holder.rollback()


async def test_statement_timeout(engine: AsyncEngine, password: str) -> None:
    async with engine.connect() as conn:
        await query(conn, "SET statement_timeout = '100ms'")
        error, original = await failure(query(conn, "SELECT pg_sleep(5)"))
        assert sqlstate(original) == "57014"
        assert_unavailable(error, original, password)
        # Discarded, not rolled back: nothing of the test's own runs under its 100 ms limit.
        await conn.invalidate()


async def test_pool_exhaustion(pg_url: URL, password: str) -> None:
    engine = create_async_engine(async_url(pg_url), pool_size=1, max_overflow=0, pool_timeout=0.2)
    try:
        async with engine.connect() as held:
            await query(held, "SELECT 1")
            error, original = await failure(engine.connect().start())
        assert type(original).__module__ == "sqlalchemy.exc"
        assert type(original).__name__ == "TimeoutError"
        assert_unavailable(error, original, password)
    finally:
        await engine.dispose()


async def test_read_only_transaction_asks_for_reconnect(
    engine: AsyncEngine, table: str, password: str
) -> None:
    async with engine.connect() as conn:
        await query(conn, "SET TRANSACTION READ ONLY")
        error, original = await failure(
            query(conn, f"INSERT INTO {table} VALUES (3, :p)", p=SECRET_PARAM)
        )
        assert sqlstate(original) == "25006"
        assert_unavailable(error, original, password, reconnect=True)
        await conn.rollback()


# --- timeouts and cancellation --------------------------------------------------------------


async def test_asyncio_timeout_during_a_query(
    engine: AsyncEngine, pg_url: URL, password: str
) -> None:
    async with engine.connect() as conn:
        pid = await backend_pid(conn)

        running = asyncio.ensure_future(query(conn, f"SELECT pg_sleep({LONG_SLEEP})"))
        try:
            await sleeping(pg_url, pid)
        finally:
            # A timeout of 0 expires at once: the wait times out during the running query.
            error, original = await failure(asyncio.wait_for(running, 0))
        assert isinstance(original, asyncio.TimeoutError)
        assert_unavailable(error, original, password)
        assert conn.invalidated  # the connection was closed under the query
        await conn.rollback()
        assert await query(conn, "SELECT 1") == [(1,)]  # and reconnects


async def test_server_side_cancel(engine: AsyncEngine, pg_url: URL, password: str) -> None:
    async with engine.connect() as conn:
        pid = await backend_pid(conn)
        cancel = asyncio.ensure_future(
            during(pg_url, pid, lambda: admin_execute(pg_url, "SELECT pg_cancel_backend($1)", pid))
        )
        error, original = await bounded(
            failure(query(conn, f"SELECT pg_sleep({LONG_SLEEP})")), "the query cut by the cancel"
        )
        await cancel
        assert sqlstate(original) == "57014"
        assert_unavailable(error, original, password)
        await conn.rollback()


async def test_task_cancellation_propagates_untranslated(engine: AsyncEngine, pg_url: URL) -> None:
    pids: list[int] = []

    async def work() -> None:
        async with engine.begin() as conn:
            pids.append(await backend_pid(conn))
            await query(conn, f"SELECT pg_sleep({LONG_SLEEP})")

    task = asyncio.ensure_future(work())
    await until(lambda: bool(pids) or task.done(), "the task's connection")
    await sleeping(pg_url, pids[0])
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    async with engine.connect() as conn:  # the pool is fine afterwards
        assert await query(conn, "SELECT 1") == [(1,)]


# --- permanent errors -----------------------------------------------------------------------


async def test_unique_violation(engine: AsyncEngine, table: str, password: str) -> None:
    async with engine.connect() as conn:
        error, original = await failure(
            query(conn, f"INSERT INTO {table} VALUES (1, :p)", p=SECRET_PARAM)
        )
        assert sqlstate(original) == "23505"
        assert_permanent(error, original, password)
        await conn.rollback()


async def test_syntax_error(engine: AsyncEngine, password: str) -> None:
    async with engine.connect() as conn:
        error, original = await failure(query(conn, "SELEC 1"))
        assert sqlstate(original) == "42601"
        assert_permanent(error, original, password)
        await conn.rollback()


@pytest.mark.parametrize(
    ("sql", "code"),
    [
        ("EXECUTE cronoq_missing", "26000"),
        ("PREPARE p AS SELECT 1; PREPARE p AS SELECT 1", "42P05"),
    ],
)
async def test_a_prepared_statement_missing_or_taken_names_the_settings_that_avoid_it(
    engine: AsyncEngine, password: str, sql: str, code: str
) -> None:
    """What a transaction-pooling PgBouncer produces, made directly: permanent, and saying
    which settings to change."""
    async with engine.connect() as conn:
        driver: Any = (await conn.get_raw_connection()).driver_connection
        error, original = await failure(driver.execute(f"{SECRET_SQL} {sql}"))
        assert getattr(original, "sqlstate", None) == code
        assert_permanent(error, original, password)
        assert "PgStoreConfig(prepared_statements=False)" in str(error)
        assert '"prepared_statement_cache_size": 0' in str(error)
        await conn.rollback()


async def test_nul_in_a_text_parameter(engine: AsyncEngine, table: str, password: str) -> None:
    async with engine.connect() as conn:
        error, original = await failure(
            query(conn, f"INSERT INTO {table} VALUES (3, :p)", p=f"{SECRET_PARAM}\x00")
        )
        assert sqlstate(original) == "22021"
        assert_permanent(error, original, password)
        await conn.rollback()


async def test_bad_argument_does_not_show_the_value(engine: AsyncEngine, password: str) -> None:
    statement = select(bindparam("n", type_=BigInteger))
    async with engine.connect() as conn:
        error, original = await failure(conn.execute(statement, {"n": SECRET_PARAM}))
        assert SECRET_PARAM in str(original)  # the driver quotes it...
        assert_permanent(error, original, password)  # ...the store does not
        assert "query argument $1" in str(error)
        await conn.rollback()


async def test_driver_misuse_is_a_bug_not_an_outage(engine: AsyncEngine, password: str) -> None:
    """asyncpg's InterfaceError also means misuse; only a closed connection is transient."""
    async with engine.connect() as conn:
        error, original = await failure(query(conn, "SELECT $1::text"))
        assert type(original).__name__ == "InterfaceError"
        assert "expects 1 argument" in str(original)
        assert_permanent(error, original, password)
        await conn.rollback()


def test_store_errors_pass_through() -> None:
    fenced = FencedError("fenced")
    assert translate_error(fenced, "committing") is fenced


async def through_the_door(exc: BaseException, *, asynchronous: bool) -> BaseException:
    """What leaves ``translated`` (as ``async with`` or as ``with``) when ``exc`` is raised
    inside; a caller's ``ValueError`` passes."""
    try:
        if asynchronous:
            async with translated("committing", passing=(ValueError,)):
                raise exc
        else:
            with translated("committing", passing=(ValueError,)):
                raise exc
    except BaseException as left:
        return left
    raise AssertionError("nothing left the door")


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async-with", "with"])
async def test_the_door_translates_failures_and_nothing_else(asynchronous: bool) -> None:
    lost = OSError("connection reset")
    error = await through_the_door(lost, asynchronous=asynchronous)
    assert isinstance(error, UnavailableError)
    assert error.__cause__ is lost
    assert str(error) == "committing failed: OSError: connection reset"
    # The caller's own errors, the store's, a cancellation and an interrupt leave as they are.
    for untouched in (
        ValueError("the caller's"),
        FencedError("fenced"),
        asyncio.CancelledError(),
        KeyboardInterrupt(),
    ):
        left = await through_the_door(untouched, asynchronous=asynchronous)
        assert left is untouched
        assert left.__cause__ is None


def test_a_driver_protocol_out_of_step_is_transient() -> None:
    # What asyncpg raises when a pooled connection that a shutdown or a terminated backend
    # reached is used before its socket is seen closed (the torture test meets it; the race
    # cannot be staged on demand, so the driver's own exception is given here).
    broken = asyncpg.InternalClientError(
        "cannot switch to state 12; another operation (2) is in progress"
    )
    error = translate_error(broken, "committing a batch")
    assert isinstance(error, UnavailableError)
    # Misuse stays a bug: the same words from InterfaceError mean a shared connection.
    busy = asyncpg.InterfaceError("cannot perform operation: another operation is in progress")
    assert not translate_error(busy, "committing a batch").is_transient


def test_every_public_error_has_its_home_in_errors_and_derives_from_store_error() -> None:
    """One root (callers catch ``StoreError``) and one module that defines them all; a
    usage error, refused before anything connects, is a ``ValueError`` as a bad setting is."""
    errors = [
        value
        for value in (getattr(cronoq_store, name) for name in cronoq_store.__all__)
        if isinstance(value, type) and issubclass(value, BaseException)
    ]
    assert {e.__name__ for e in errors} >= {"StoreError", "CommitterClosedError"}
    for error in errors:
        usage = error is cronoq_store.UnsupportedParameterError and issubclass(error, ValueError)
        assert issubclass(error, StoreError) or usage, error
        assert error.__module__ == "cronoq_store._errors", error


def test_key_taken_keeps_every_key_and_names_a_bounded_few() -> None:
    keys = ["k" * 3000] + [f"key{n}" for n in range(7)]
    error = KeyTakenError(keys)
    assert error.keys == keys
    message = str(error)
    assert message.startswith("committing a batch failed: keys 'kkk")
    assert "'key3' and 3 more held by another live task or given twice" in message
    assert len(message) < 400
