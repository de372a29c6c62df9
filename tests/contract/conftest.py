"""The ``cluster`` fixture: every contract test runs once per store implementation.

``PgStore`` runs on the suite's real server in a fresh migrated schema (the server starts
only if a ``pg`` test runs); ``InMemoryStore`` on a fresh ``InMemoryDatabase``. A test
marked ``needs(Capability.X)`` is generated only for the stores that declare ``X``: the
in-memory store's gaps are named by the tests it does not get, never skipped.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from .support import Capability, Cluster, MemoryCluster, PgCluster

CLUSTERS: dict[str, type[Cluster]] = {c.name: c for c in (PgCluster, MemoryCluster)}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "needs(capability): run only against the stores that declare it"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cluster" not in metafunc.fixturenames:
        return
    needed: set[Capability] = set()
    for marker in metafunc.definition.iter_markers("needs"):
        needed.update(marker.args)
    names = [name for name, c in CLUSTERS.items() if needed <= c.capabilities]
    metafunc.parametrize("backend", names, indirect=True)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> tuple[URL, AsyncEngine, str] | None:
    """For ``pg``, the server, an engine and a migrated schema; for ``memory``, nothing."""
    if request.param != PgCluster.name:
        return None
    schema: str = request.getfixturevalue("migrated")
    pg_url: URL = request.getfixturevalue("pg_url")
    engine: AsyncEngine = request.getfixturevalue("engine")
    return pg_url, engine, schema


@pytest.fixture
async def cluster(
    backend: tuple[URL, AsyncEngine, str] | None,
) -> AsyncIterator[Cluster]:
    made: Cluster = MemoryCluster() if backend is None else PgCluster(*backend)
    try:
        yield made
    finally:
        await made.close()
