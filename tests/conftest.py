"""Fixtures: one real PostgreSQL per session, a fresh schema and a clean engine per test.

Each test owns a schema of its own; isolation between schemas is a product feature, so the
suite relies on it instead of recreating databases. After every test, the engine must have
no connection checked out: a leak fails the test that caused it.

The fixtures many modules share are here too (a store on the test's schema, a role granted
nothing, Leadership instances); the plain values and helpers they share are in support.py.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from cronoq_store import PgStore, PgStoreConfig
from cronoq_store import _statements as st
from cronoq_store._leadership import Leadership
from cronoq_store._migrations import upgrade
from cronoq_store._urls import async_url

from .pgharness import EmbeddedServer, ServerUnderTest, admin_execute, start_test_server
from .replication import needs_binaries
from .support import LeadershipFactory, Role, create_role, drop_role, instance_config
from .waits import bounded


@pytest.fixture(scope="session")
def pg_server() -> Iterator[ServerUnderTest]:
    server = start_test_server()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def stoppable(pg_server: ServerUnderTest) -> Iterator[ServerUnderTest]:
    """The server, for tests that stop it; it is running again afterwards, whatever happens."""
    if not isinstance(pg_server, EmbeddedServer):
        pytest.skip("needs a server the suite can stop and start on the same port")
    try:
        yield pg_server
    finally:
        if not pg_server.server.running:
            pg_server.start()


@pytest.fixture
def binaries() -> None:
    """Skips a test that builds a server of its own (a primary and its standby, a server to
    upgrade) where no PostgreSQL binaries are found."""
    needs_binaries()


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts TCP connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


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


@pytest.fixture
async def intruder(pg_url: URL, schema: str) -> AsyncIterator[Role]:
    """A login role granted nothing but CONNECT on the database."""
    role = await create_role(pg_url, f"{schema}_intruder")
    try:
        yield role
    finally:
        await drop_role(pg_url, role.name)


@pytest.fixture
async def lock_key(engine: AsyncEngine, migrated: str) -> tuple[int, int]:
    async with engine.connect() as conn:
        oid = (await conn.execute(st.schema_oid, {"schema": migrated})).scalar_one()
    return (st.LOCK_NS_LEADER, oid)


@pytest.fixture
async def incarnation(pg_url: URL, migrated: str) -> int:
    """The test cluster's incarnation: its leader table's OID."""
    rows = await admin_execute(pg_url, f'SELECT tableoid FROM "{migrated}".cronoq_leader')
    return int(rows[0][0])


@pytest.fixture
async def make_leadership(
    pg_url: URL, migrated: str, lock_key: tuple[int, int], incarnation: int
) -> AsyncIterator[LeadershipFactory]:
    """Build Leadership instances on the test's schema; all are closed afterwards."""
    made: list[Leadership] = []

    def build(name: str = "a", url: URL | None = None, **settings: float) -> Leadership:
        leadership = Leadership(
            async_url(url or pg_url),
            migrated,
            lock_key,
            instance_config(migrated, name, **settings),
            incarnation=incarnation,
        )
        made.append(leadership)
        return leadership

    yield build
    for leadership in made:
        await bounded(leadership.close(), "close() of a leadership")


@pytest.fixture
async def store(
    request: pytest.FixtureRequest, engine: AsyncEngine, migrated: str, pg_url: URL
) -> AsyncIterator[PgStore]:
    """A store on the test's migrated schema, on an application's engine (every commit a
    transaction); a module that sets ``STORE_OPENINGS`` gets each test once per opening
    named there, ``"connect"`` being a store on its own pool (the one-statement paths)."""
    config = PgStoreConfig(schema=migrated)
    opening = getattr(request, "param", "from_engine")
    if opening == "connect":
        made = PgStore.connect(pg_url, config)
    else:
        made = PgStore.from_engine(engine, config)
    async with await made as s:
        yield s


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    openings = getattr(metafunc.module, "STORE_OPENINGS", None)
    if openings and "store" in metafunc.fixturenames:
        metafunc.parametrize("store", openings, indirect=True)


@pytest.fixture
async def intruder_role(pg_url: URL) -> AsyncIterator[str]:
    """A role with no rights on anything, for an application's ``SET ROLE``: a store
    acting as it could not even read."""
    name = f"r_{uuid.uuid4().hex[:12]}"
    await admin_execute(pg_url, f'CREATE ROLE "{name}" NOLOGIN')
    yield name
    await admin_execute(pg_url, f'DROP ROLE "{name}"')
