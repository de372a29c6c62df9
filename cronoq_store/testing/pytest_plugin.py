"""pytest fixtures that give an application's tests a real PostgreSQL and a migrated schema.

An application enables the plugin in its ``conftest.py`` (it has no auto-loading entry
point, so installing cronoq-store changes no one's test run)::

    pytest_plugins = ["cronoq_store.testing.pytest_plugin"]

- ``cronoq_database_url`` (session): a ``postgresql://`` URL, password included, of the
  server for the whole run: ``$CRONOQ_TEST_DATABASE_URL`` if set (a CI service, say), else a
  throwaway :class:`~cronoq_store.testing.EmbeddedPostgres` started on first use and
  removed at the end (``pip install 'cronoq-store[testing]'``).
- ``cronoq_schema``: a cluster schema no other test uses, migrated to this build's head,
  dropped with everything in it after the test.
- ``cronoq_config``: ``PgStoreConfig(schema=cronoq_schema)``.
- ``cronoq_store``: a :class:`~cronoq_store.PgStore` open on that schema (opened with
  ``migrate=False``: the schema is already migrated), closed after the test. An async
  fixture: it needs pytest-asyncio, in either of its modes.

The async fixtures are function-scoped, so they run on the test's own event loop. Set
pytest-asyncio's fixture loop scope to match, in the application's pytest configuration,
or each run warns that it is unset::

    [pytest]
    asyncio_default_fixture_loop_scope = function

Schemas are made and dropped on a connection of their own in a worker thread, so the sync
fixtures work whether or not the test's event loop is running.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest
import pytest_asyncio
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool
from sqlalchemy.schema import DropSchema

from .._config import PgStoreConfig
from .._door import engine_arguments
from .._migrations import upgrade
from .._statements import SEARCH_PATH
from .._store import PgStore
from ._server import TEST_URL_ENV, EmbeddedPostgres

__all__ = ["cronoq_config", "cronoq_database_url", "cronoq_schema", "cronoq_store"]

_T = TypeVar("_T")


def _in_thread(make: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """Run a coroutine on an event loop of its own, whatever loop this thread runs."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


async def _migrate(url: str, schema: str) -> None:
    engine = _engine(url)
    try:
        await upgrade(engine, schema)
    finally:
        await engine.dispose()


async def _drop(url: str, schema: str) -> None:
    engine = _engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(DropSchema(schema, cascade=True, if_exists=True))
    finally:
        await engine.dispose()


def _engine(url: str) -> AsyncEngine:
    """An engine that dials ``url`` as the store does (a service, the ``PG*`` environment)."""
    dialled, arguments = engine_arguments(url)
    return create_async_engine(
        dialled,
        poolclass=NullPool,
        connect_args={**arguments, "server_settings": {"search_path": SEARCH_PATH}},
    )


@pytest.fixture(scope="session")
def cronoq_database_url() -> Iterator[str]:
    """The test server's URL: ``$CRONOQ_TEST_DATABASE_URL``, or a throwaway embedded server."""
    given = os.environ.get(TEST_URL_ENV)
    if given:
        yield given
        return
    with EmbeddedPostgres() as server:
        yield server.url().render_as_string(hide_password=False)


@pytest.fixture
def cronoq_schema(cronoq_database_url: str) -> Iterator[str]:
    """A fresh cluster schema at this build's head; dropped after the test."""
    schema = f"cronoq_test_{uuid.uuid4().hex[:12]}"
    try:
        _in_thread(lambda: _migrate(cronoq_database_url, schema))
        yield schema
    finally:
        _in_thread(lambda: _drop(cronoq_database_url, schema))


@pytest.fixture
def cronoq_config(cronoq_schema: str) -> PgStoreConfig:
    """The store's configuration for the test's schema, defaults otherwise."""
    return PgStoreConfig(schema=cronoq_schema)


@pytest_asyncio.fixture
async def cronoq_store(
    cronoq_database_url: str, cronoq_config: PgStoreConfig
) -> AsyncIterator[PgStore]:
    """A store open on the test's schema, on the test's event loop; closed afterwards."""
    store = await PgStore.connect(cronoq_database_url, cronoq_config, migrate=False)
    try:
        yield store
    finally:
        await store.close()
