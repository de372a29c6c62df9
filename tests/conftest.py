"""Fixtures: one real PostgreSQL per session, a fresh schema and a clean engine per test.

Each test owns a schema of its own; isolation between schemas is a product feature, so the
suite relies on it instead of recreating databases. After every test, the engine must have
no connection checked out: a leak fails the test that caused it.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from cronoq_store._migrations import upgrade
from cronoq_store._urls import async_url

from .pgharness import ServerUnderTest, admin_execute, start_test_server


@pytest.fixture(scope="session")
def pg_server() -> Iterator[ServerUnderTest]:
    server = start_test_server()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def pg_url(pg_server: ServerUnderTest) -> URL:
    """The server's ``postgresql://`` URL, password included."""
    return pg_server.url


@pytest.fixture
async def schema(pg_url: URL) -> AsyncIterator[str]:
    """A schema name no other test uses; dropped with everything in it afterwards."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    await admin_execute(pg_url, f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


@pytest.fixture
async def engine(pg_url: URL) -> AsyncIterator[AsyncEngine]:
    eng = create_async_engine(async_url(pg_url), pool_pre_ping=True)
    try:
        yield eng
        checked_out = eng.pool.checkedout()  # type: ignore[attr-defined]
        assert checked_out == 0, f"{checked_out} pool connection(s) left checked out"
    finally:
        await eng.dispose()


@pytest.fixture
async def migrated(engine: AsyncEngine, schema: str) -> str:
    """``schema``, migrated to head."""
    await upgrade(engine, schema)
    return schema
